"""The GPU suite itself, checked on every machine (not marked `gpu`): its job scripts
compile, and where there is no GPU, `python -m pytest -m gpu` collects every GPU test and
skips each one with the reason, saying so even under -q."""

from __future__ import annotations

import py_compile
import re
import subprocess
import sys

import pytest

from gpu_jobs import JOBS, ROOT, missing_gpu


@pytest.mark.parametrize("script", sorted(p.name for p in JOBS.glob("*.py")))
def test_job_script_compiles(script, tmp_path):
    py_compile.compile(str(JOBS / script), cfile=str(tmp_path / "x.pyc"), doraise=True)


def test_gpu_suite_is_collected_and_skipped_with_the_reason_without_a_gpu():
    reason = missing_gpu()
    if reason is None:
        pytest.skip("a GPU is here: `python -m pytest -m gpu` runs the suite for real")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p",
                           "no:cacheprovider", "tests/gpu"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-2000:]
    skipped = re.search(r"(\d+) skipped", out)
    assert skipped is not None and "passed" not in out and "failed" not in out, out[-3000:]
    count = int(skipped.group(1))
    assert count >= 12, out[-3000:]  # every GPU case, parametrised ones included
    assert f"GPU suite: {count} test(s) skipped: {reason}" in out, out[-3000:]
    # -rs gives the reason for all of them (pytest folds identical skips into one line).
    folded = re.findall(r"SKIPPED \[(\d+)\] \S+: (.*)", out)
    assert sum(int(n) for n, why in folded if why == reason) == count, out[-3000:]
