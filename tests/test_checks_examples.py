"""Every script in examples/mistakes/ makes exactly the mistake it is named after, and
clean.py none: each runs under torchrun (2 ranks, gloo, CPU) with the checks wired in
by tests/checks_shim.py, and the collector-side merge of both ranks' reports must name
exactly that one finding."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jobs import ROOT
from traceml_agent.checks import (
    Finding,
    compare_checksums,
    compare_devices,
    facts_from_wire,
    merge_findings,
)

MISTAKES = ROOT / "examples" / "mistakes"
SHIM = ROOT / "tests" / "checks_shim.py"
WORLD = 2
CUDA_ONLY = {"same-device"}
# Where a mistake is not on every rank: rank 0 alone loaded the checkpoint; rank 0 does
# read shard 0, as its sampler says, rank 1 reads shard 0 too.
RANKS = {"params-differ-across-ranks": (1,), "sampler-shard-mismatch": (1,)}

CASES = sorted(p.stem for p in MISTAKES.glob("*.py") if not p.stem.startswith("_"))


def collect(out_dir) -> list[Finding]:
    """What the collector will do: merge the ranks' findings and compare their facts."""
    reports = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert [r["error"] for r in reports] == [None] * WORLD
    findings = [Finding.from_wire(f) for r in reports for f in r["findings"]]
    facts = {r["rank"]: facts_from_wire(r["facts"]) for r in reports}
    cross = [compare_checksums({r: f["param_checksum"] for r, f in facts.items()}),
             compare_devices({r["rank"]: (r["host"], facts[r["rank"]]["device"])
                              for r in reports})]
    return merge_findings(findings + [c for c in cross if c], world_size=WORLD)


@pytest.mark.e2e
@pytest.mark.parametrize("name", [c for c in CASES if c not in CUDA_ONLY])
def test_example_makes_exactly_its_mistake(tmp_path, name):
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(WORLD), str(SHIM), str(tmp_path), str(MISTAKES / f"{name}.py")],
        capture_output=True, text=True, timeout=180, cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, "\n".join(line for line in proc.stderr.splitlines()
                                           if "Warning" not in line)[-6000:]
    merged = collect(tmp_path)
    assert [f.id for f in merged] == ([] if name == "clean" else [name])
    for f in merged:
        assert f.ranks == RANKS.get(name, (0, 1))
        print(f"{f.id} [{f.severity}] ranks {f.ranks}: {f.evidence}")


def test_every_finding_id_has_an_example():
    from traceml_agent.checks import CHECKS

    assert set(CASES) == set(CHECKS) | {"clean"}
