"""The GPU suite itself, checked on every machine (not marked `gpu`): its job scripts
compile, and where there is no GPU, `python -m pytest -m gpu` collects every GPU test and
skips each one with the reason, saying so even under -q."""

from __future__ import annotations

import os
import py_compile
import re
import subprocess
import sys

import pytest

from gpu_jobs import EVIDENCE_ORDER, JOBS, ROOT, missing_gpu


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


# --- a bare GPU box: the product's runtime wheels and pytest, nothing else (issue 40) ---

# The test extra (pyproject.toml) beyond pytest: none of it may be needed to collect the
# GPU suite. Its pytest plugins are absent there too (PYTEST_DISABLE_PLUGIN_AUTOLOAD).
TEST_EXTRA = ("hypothesis", "prometheus_client", "jsonschema", "textual_serve",
              "pytest_asyncio", "xdist", "importlinter", "mypy", "lightning",
              "transformers", "accelerate", "pytest_textual_snapshot", "syrupy", "py_spy")
BLOCKER = f'''import sys
BLOCKED = {TEST_EXTRA!r}
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError("not on a bare GPU box: " + name)
        return None
sys.meta_path.insert(0, Blocker())
'''


def bare_box_pytest(tmp_path, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("where", [(), ("tests/gpu",)], ids=["documented", "folder"])
def test_the_gpu_suite_collects_with_only_the_runtime_dependencies(tmp_path, where):
    proc = bare_box_pytest(tmp_path, "--collect-only", "-q", "-m", "gpu", *where)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "error" not in out.lower(), out[-3000:]
    n = len(EVIDENCE_ORDER)  # every GPU test is in it (the test below)
    assert re.search(rf"\b{n}/\d+ tests collected", out) or f" {n} tests collected" in out, out
    if missing_gpu() is not None:  # and runs them: skipped, each with its reason
        proc = bare_box_pytest(tmp_path, "-q", "-rs", "-m", "gpu", *where)
        assert proc.returncode == 0 and f"{n} skipped" in proc.stdout, proc.stdout[-3000:]
        assert f"GPU suite: {n} test(s) skipped: {missing_gpu()}" in proc.stdout


def test_every_gpu_test_is_in_the_evidence_order_and_lives_in_tests_gpu():
    names = {name for name, _, _ in EVIDENCE_ORDER}
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m",
                           "gpu", "-p", "no:cacheprovider", "tests/gpu"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    ids = {line.split("tests/gpu/", 1)[1] for line in proc.stdout.splitlines()
           if line.startswith("tests/gpu/")}
    assert ids == names, (ids ^ names)
    stray = [p for p in (ROOT / "tests").rglob("test_*.py")
             if "gpu" not in p.relative_to(ROOT / "tests").parts[:1]
             and re.search(r"mark\.gpu\b", p.read_text())]
    assert stray == []  # `-m gpu` collects tests/gpu only (tests/conftest.py)


def test_a_budget_runs_the_most_telling_tests_first_and_names_the_rest(tmp_path):
    proc = bare_box_pytest(tmp_path, "--collect-only", "-q", "-m", "gpu",
                           "--gpu-budget-s", "100", "tests/gpu")
    collected = [line.split("tests/gpu/", 1)[1] for line in proc.stdout.splitlines()
                 if line.startswith("tests/gpu/")]
    assert collected == [EVIDENCE_ORDER[0][0], EVIDENCE_ORDER[1][0]], proc.stdout[-2000:]
    left = len(EVIDENCE_ORDER) - 2
    assert f"GPU suite: {left} test(s) left out by --gpu-budget-s 100: " in proc.stdout
