"""End to end: the `traceml run` contract (CLI.md): flag orders, exit codes, run folder."""

from __future__ import annotations

import json

import pytest

from jobs import EXAMPLES, Finished, live_ranks_steps, run_job, traceml, validate_schema, wait_for

pytestmark = pytest.mark.e2e


def test_failing_rank_sets_exit_code_and_is_named(tmp_path):
    job = run_job(tmp_path, "ddp_toy.py", nproc=2, name="fail",
                  script_args=("--fail-rank", "1", "--fail-at-step", "12", "--steps", "200"))
    assert job.returncode == 3, job.stderr[-3000:]
    doc = job.summary
    validate_schema(doc)
    assert doc["run"]["exit_code"] == 3
    assert doc["run"]["failed_rank"] == 1
    assert doc["ranks"][1]["exit_code"] == 3
    # The rank's own output is kept in the run folder.
    logs = "".join(p.read_text(errors="replace") for p in (job.run_dir / "logs").rglob("*.log"))
    assert "simulated failure at step 12" in logs


@pytest.fixture(scope="module")
def options_after(tmp_path_factory) -> Finished:
    """A finished run, its options after the script: two tests read it (one job)."""
    out = tmp_path_factory.mktemp("after") / "runs"
    proc = traceml("run", "--headless", "--out", str(out), "--run-name", "before",
                   str(EXAMPLES / "ddp_toy.py"), "--nproc-per-node=2", "--",
                   "--steps", "20")
    return Finished(proc.returncode, proc.stdout, proc.stderr, out / "before")


def test_options_after_the_script_and_script_args_after_dashes(options_after):
    assert options_after.returncode == 0, options_after.stderr[-3000:]
    doc = json.loads((options_after.run_dir / "final_summary.json").read_text())
    validate_schema(doc)
    assert doc["run"]["world_size"] == 2
    assert [r["steps"] for r in doc["ranks"]] == [20, 20]
    assert doc["run"]["command"][:2] == ["traceml", "run"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "no_such_script.py", "--headless"], "script not found"),
        (["run", "examples/ddp_toy.py", "--nproc-per-node", "zero"], "whole number"),
        (["run", "examples/ddp_toy.py", "--steps", "5"], "go after --"),
        (["compare", "nope.json", "nope2.json"], "no such file"),
    ],
)
def test_user_mistakes_get_one_clear_line(tmp_path, args, message):
    proc = traceml(*args, cwd=EXAMPLES.parent, timeout=60)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_reusing_a_run_name_does_not_overwrite_the_record(options_after):
    first = options_after  # a finished run named "before" in its --out
    assert first.returncode == 0
    before = (first.run_dir / "final_summary.json").read_text()
    again = run_job(first.run_dir.parents[1], "ddp_toy.py", nproc=1, name="before",
                    script_args=("--steps", "10"))
    assert again.returncode == 2
    assert "already holds a run" in again.stderr
    assert (first.run_dir / "final_summary.json").read_text() == before


def _start_long_job(tmp_path, name):
    import os
    import subprocess
    import sys

    out = tmp_path / "runs"
    proc = subprocess.Popen(
        [sys.executable, "-m", "traceml_tui", "run", str(EXAMPLES / "ddp_toy.py"),
         "--nproc-per-node", "2", "--headless", "--out", str(out), "--run-name", name, "--",
         "--steps", "1000000"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    run_dir = out / name
    # Every rank past 20 steps (the run's step count is the furthest rank's).
    wait_for(lambda: min(live_ranks_steps(run_dir) or [0]) >= 20, timeout=120)
    return proc, run_dir


@pytest.mark.parametrize(("sig", "code"), [("SIGINT", 130), ("SIGTERM", 143)])
def test_interrupted_run_still_writes_the_summary(tmp_path, sig, code):
    import signal
    import time

    proc, run_dir = _start_long_job(tmp_path, sig.lower())
    t0 = time.monotonic()
    proc.send_signal(getattr(signal, sig))
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == code, output[-3000:]
    assert time.monotonic() - t0 < 20  # "within a few seconds", with room for a slow CI box
    doc = json.loads((run_dir / "final_summary.json").read_text())
    validate_schema(doc)
    assert doc["run"]["exit_code"] == code
    assert all(r["steps"] >= 20 for r in doc["ranks"])


def test_collector_killed_midrun_leaves_an_incomplete_summary(tmp_path):
    import os
    import signal

    proc, run_dir = _start_long_job(tmp_path, "killed")
    collector_pid = json.loads((run_dir / "collector.json").read_text())["pid"]
    os.kill(collector_pid, signal.SIGKILL)
    wait_for(lambda: (run_dir / "collector.log").exists(), timeout=5)
    proc.send_signal(signal.SIGINT)  # training went on; now the user stops it
    output, _ = proc.communicate(timeout=90)
    assert proc.returncode == 130, output[-3000:]
    doc = json.loads((run_dir / "final_summary.json").read_text())
    validate_schema(doc)
    assert doc["complete"] is False
    assert "INCOMPLETE" in output
    assert doc["run"]["exit_code"] == 130
    assert all(r["steps"] >= 20 for r in doc["ranks"])
