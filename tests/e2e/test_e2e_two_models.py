"""End to end (issue 40, item 5): a real `traceml run` job (gloo, CPU, 2 ranks) that
trains one DDP model, drops it and its optimizer, and trains another of another class
(examples/faults/two_models.py). Every step of both models is counted in the summary,
and each rank checks, with the agent attached, that the first model was freed."""

from __future__ import annotations

import pytest

from jobs import run_job, validate_schema

pytestmark = [pytest.mark.e2e]

JOB = "faults/two_models.py"


def test_the_second_models_steps_are_counted_and_the_first_is_freed(tmp_path):
    job = run_job(tmp_path, JOB, nproc=2, name="two",
                  script_args=("--steps", "30", "30", "--check-freed"))
    assert job.returncode == 0, job.stderr[-3000:]
    assert "was not freed" not in job.stderr
    doc = job.summary
    validate_schema(doc)
    assert doc["run"]["steps"] == 60, doc["run"]
    assert sorted((r["rank"], r["steps"]) for r in doc["ranks"]) == [(0, 60), (1, 60)]
    assert "2 rank(s), 60 steps" in job.stdout


def test_an_idle_first_optimizer_still_alive_yields_to_the_second(tmp_path):
    """The first optimizer kept alive but idle: the second takes over after a few steps
    (hooks.RELEARN_OTHER_STEPS; those first few merge into one)."""
    from traceml_agent.hooks import RELEARN_OTHER_STEPS

    job = run_job(tmp_path, JOB, nproc=2, name="kept",
                  script_args=("--steps", "30", "30", "--keep-first"))
    assert job.returncode == 0, job.stderr[-3000:]
    steps = 60 - (RELEARN_OTHER_STEPS - 1)
    assert job.summary["run"]["steps"] == steps, job.summary["run"]
    assert f"2 rank(s), {steps} steps" in job.stdout
