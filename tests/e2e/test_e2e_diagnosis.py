"""End to end: real `traceml run` jobs (torchrun, gloo, 3 ranks on CPU) with one problem
injected each, asserting the diagnosis a user would read in final_summary.json."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import pytest

from jobs import Finished, run_job, validate_schema

pytestmark = pytest.mark.e2e
HAS_SCHEDSTAT = os.path.exists(f"/proc/self/task/{threading.get_native_id()}/schedstat")

# scenario, expected label, expected rank, expected phase
CASES = [
    ("input", "INPUT STRAGGLER", 1, "dataloader"),
    ("optimizer", "COMPUTE STRAGGLER", 1, "optimizer"),
    ("batch", "COMPUTE STRAGGLER", 1, None),  # forward or backward: both grow with the batch
    ("input-all", "INPUT-BOUND", None, "dataloader"),
    ("stall", "WAIT-HEAVY", None, "wait"),
    # Rank 1 shares its core with two busy processes (larger batches: CPU-bound steps):
    # a straggler, said to be its CPU's (test_a_straggler_on_an_oversubscribed_core...).
    ("contended", "COMPUTE STRAGGLER", 1, None),
    # The `alone` cases last, then this module's other `alone` tests: one run of them in a
    # row, which drains the other xdist workers once (conftest.py).
    # A tiny model on gloo over loopback: the allreduce is most of the step, and saying
    # so is right (docs/network.md). With real compute per step it is BALANCED.
    ("balanced", "COMM-BOUND", None, "sync"),
    ("compute-all", "BALANCED", None, None),
    ("forward", "COMPUTE STRAGGLER", 1, "forward"),
]


@pytest.fixture(scope="module")
def scenario_job(tmp_path_factory) -> Callable[[str], Finished]:
    """One 3-rank job per scenario for this module: the DDP-trap test reads the 'forward'
    case's job rather than running the same job again."""
    done: dict[str, Finished] = {}

    def get(scenario: str) -> Finished:
        if scenario not in done:
            args = ("--scenario", scenario, "--rank", "1", "--steps", "80", "--delay-ms", "25")
            if scenario == "batch":
                args += ("--dim", "512", "--batch", "64")
            if scenario == "contended":
                args += ("--batch", "512")
            done[scenario] = run_job(tmp_path_factory.mktemp(scenario), "ddp_toy.py",
                                     script_args=args, name=scenario)
        return done[scenario]
    return get


# Cases whose verdict rests on shares or absolute times of a step, not on one rank's
# injected 25 ms against the others': under xdist no other test's load runs beside them
# (the 'forward' job is also the DDP-trap test's, which reads milliseconds).
# 'batch' too: its 4x-batch rank's extra compute is CPU time, and on a machine shared with
# other tests' jobs a neighbour's backward took as long (8.9 ms against the culprit's 6.5,
# twice in fresh-clone runs): BALANCED by its medians.
ALONE = {"balanced", "compute-all", "forward", "batch"}


# Jobs whose ranks do the same work. Beside a process busy on one of the machine's cores
# (another test's job, a CPU hog), one rank's thread can wait for its core: it is then
# truly behind, and a straggler said to be its host's cores is the right verdict, one
# sending the user to look for model-side work alone the wrong one (fresh-clone run 22).
# Where its own wait per step does not explain the gap (the step's shares cannot say in
# which phase a thread waited: fresh-clone run 48), the shared host is said beside it.
EVEN = {"balanced", "compute-all"}


def _a_straggler_its_cores_made(doc: dict) -> None:
    d = doc["diagnosis"]
    assert d["label"] in ("COMPUTE STRAGGLER", "STRAGGLER") and d["rank"] is not None, d
    if "for a CPU core" not in d["summary"]:
        assert "the host's cores are shared" in d["summary"], d
        return
    assert "model-side work" not in d["summary"], d
    waits = {r["rank"]: r["cpu_wait_pct"] for r in doc["ranks"]}
    others = [w for r, w in waits.items() if r != d["rank"] and w is not None]
    assert others and (waits[d["rank"]] or 0.0) > min(others), waits  # beyond a neighbour


@pytest.mark.parametrize(("scenario", "label", "rank", "phase"),
                         [pytest.param(*c, id=c[0], marks=[pytest.mark.alone] * (c[0] in ALONE))
                          for c in CASES])
def test_injected_problem_is_diagnosed(scenario_job, scenario, label, rank, phase):
    job = scenario_job(scenario)
    assert job.returncode == 0, job.stderr[-3000:]
    doc = job.summary
    validate_schema(doc)
    d = doc["diagnosis"]
    if scenario in EVEN and (d["label"], d["rank"]) != (label, rank):
        _a_straggler_its_cores_made(doc)
    else:
        assert (d["label"], d["rank"]) == (label, rank), d
        if phase is not None:
            assert d["phase"] == phase, d
        elif scenario in ("batch", "contended"):
            assert d["phase"] in ("forward", "backward"), d
    # Every rank reported every step, and every standard phase is in the document.
    assert [r["steps"] for r in doc["ranks"]] == [80, 80, 80]
    if HAS_SCHEDSTAT:  # a job of 1-3 s still has its ranks' CPU waits (the final sample)
        assert all(r["cpu_wait_pct"] is not None for r in doc["ranks"]), doc["ranks"]
    assert {"dataloader", "h2d", "forward", "backward", "sync", "optimizer", "wait"} <= set(
        doc["phases"])
    # The text summary printed at the end names the same diagnosis.
    assert f"Diagnosis: {d['label']}" in job.stdout


def test_a_straggler_on_an_oversubscribed_core_is_said_to_wait_for_it(scenario_job):
    """Rank 1 gets a third of a core (two busy processes pinned beside it): its compute
    takes longer, and the evidence says why, from the kernel's run queue, instead of
    sending the user to look for extra model-side work it does not have. The ranks that
    have cores of their own waited little for them."""
    job = scenario_job("contended")
    assert job.returncode == 0, job.stderr[-3000:]
    d = job.summary["diagnosis"]
    assert "waited" in d["summary"] and "for a CPU core" in d["summary"], d
    assert "model-side work" not in d["summary"], d
    waits = {r["rank"]: r["cpu_wait_pct"] for r in job.summary["ranks"]}
    assert waits[1] >= max(waits[0], waits[2]) + 20.0, waits  # percent of their time
    assert "for a CPU core" in job.stdout


@pytest.mark.alone  # milliseconds and seconds, measured
def test_waiting_ranks_are_not_blamed_for_their_sync_time(scenario_job):
    """The DDP trap: the fast ranks wait for rank 1 inside backward's allreduce. That wait
    must be reported as their 'sync' phase, not as their backward compute."""
    job = scenario_job("forward")  # rank 1's forward 25 ms slower
    assert job.returncode == 0, job.stderr[-3000:]
    ranks = {r["rank"]: r for r in job.summary["ranks"]}
    waiter, straggler = ranks[0], ranks[1]
    sync_gap = waiter["phase_ms"]["sync"]["median"] - straggler["phase_ms"]["sync"]["median"]
    assert sync_gap > 15.0, (waiter["phase_ms"], straggler["phase_ms"])
    # Backward compute stays comparable across ranks: nobody's backward holds the wait.
    bwd = [r["phase_ms"]["backward"]["median"] for r in ranks.values()]
    assert max(bwd) < 15.0, bwd


@pytest.mark.alone  # milliseconds and seconds, measured
def test_a_straggler_that_recovers_is_cleared_within_10_steps_or_2_s(tmp_path):
    """Rank 1's forward is 40 ms slower for steps 30-79 only (~128 ms steps). The label
    follows the newest steps, not only the 32-step window: it is cleared within
    max(10 steps, 2 s) of the recovery (the window alone took 24 steps, 3.1 s), and the
    episode stays in the summary with its steps and the time it cost the job."""
    from jobs import EXAMPLES, traceml

    out = tmp_path / "runs"
    proc = traceml("run", str(EXAMPLES / "frameworks" / "ddp_variants.py"), "--nproc-per-node",
                   "3", "--headless", "--out", str(out), "--run-name", "transient", "--",
                   "--steps", "140",
                   env={"FAULTS": "compute:1:30:80", "BASE_FORWARD_MS": "120",
                        "EXTRA_MS": "40"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    doc = json.loads((out / "transient" / "final_summary.json").read_text())
    validate_schema(doc)
    episodes = [e for e in doc["timeline"] if e["label"] == "COMPUTE STRAGGLER"]
    assert [(e["rank"], e["phase"]) for e in episodes] == [(1, "forward")], doc["timeline"]
    episode = episodes[0]
    step_ms = doc["ranks"][0]["step_ms"]["median"]
    promised = max(10, round(2000 / step_ms)) + 2  # + ingest and evaluation cadence
    # The live label left within the promise (cleared_step: the newest step then); the
    # episode itself is filed on its slow steps (evidence-dated, docs/diagnosis.md).
    assert 80 < episode["cleared_step"] <= 80 + promised, (episode, step_ms)
    assert abs(episode["start_step"] - 30) <= 10 and abs(episode["end_step"] - 79) <= 10
    # It cost about its 40 ms gap on every one of its steps (job seconds).
    named = episode["end_step"] - episode["start_step"] + 1
    assert 0.5 * named * 0.04 <= episode["lost_s"] <= 1.5 * named * 0.04, episode
    assert doc["diagnosis"]["label"] == "BALANCED"  # the run as a whole
    assert "COMPUTE STRAGGLER rank 1  (cost the job" in proc.stdout


# A rank 0 checkpoint read as PERIODIC STALL (label, period, gap, share, unmoved medians,
# the printed line): tests/e2e/test_e2e_stalls.py, whose 'every 20 steps' job is the same kind
# of run (one job there asserts what this module's 4-rank job did).
