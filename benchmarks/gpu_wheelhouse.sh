#!/usr/bin/env bash
# Build the wheelhouse the GPU suite needs on a GPU box that has torch (a CUDA build) but
# no package index: traceml-tui itself, its runtime dependencies except torch, pytest,
# and jsonschema (the suite validates final_summary.json against the schema). Carry the
# folder over, then on the GPU box (docs/gpu-validation.md):
#
#   pip install --no-index --find-links WHEELHOUSE traceml-tui pytest jsonschema
#   python -m pytest -m gpu tests/gpu -v -s --gpu-budget-s 540
#
# Usage: benchmarks/gpu_wheelhouse.sh [OUT_DIR]        (default: ./wheelhouse)
# For a GPU box whose Python or platform differs from this machine's, set
#   TARGET_PYTHON=3.11 TARGET_PLATFORM=manylinux2014_x86_64
# and binary wheels for that target are downloaded (pip download --only-binary).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${1:-wheelhouse}
PY=${PYTHON:-python}
mkdir -p "$OUT"

# The runtime dependencies, read from pyproject.toml: one list, never a second copy here.
mapfile -t DEPS < <("$PY" - "$ROOT/pyproject.toml" <<'PYEOF'
import re, sys, tomllib
deps = tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]
for d in deps:
    if re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0].lower() != "torch":  # the box has its own
        print(d)
PYEOF
)
DEPS+=("pytest>=8" "jsonschema>=4")

TARGET=()
if [[ -n "${TARGET_PYTHON:-}${TARGET_PLATFORM:-}" ]]; then
    TARGET=(--only-binary=:all:)
    [[ -n "${TARGET_PYTHON:-}" ]] && TARGET+=(--python-version "$TARGET_PYTHON")
    [[ -n "${TARGET_PLATFORM:-}" ]] && TARGET+=(--platform "$TARGET_PLATFORM")
fi

# traceml-tui itself (pure Python: one wheel for any target), without its dependencies
# (torch would pull a multi-GB build).
"$PY" -m pip wheel --no-deps --wheel-dir "$OUT" "$ROOT"
"$PY" -m pip download --dest "$OUT" "${TARGET[@]}" "${DEPS[@]}"
echo "wheelhouse: $(find "$OUT" -maxdepth 1 -name '*.whl' | wc -l) wheels in $OUT" \
     "($(du -sh "$OUT" | cut -f1)); torch is not among them: the GPU box brings its own"
