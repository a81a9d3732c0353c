"""End to end: a job torchrun restarts (`traceml run --max-restarts 1`, gloo, 3 CPU ranks).

Rank 2 raises ValueError at step 40 in the first attempt only (examples/faults/
restart_job.py reads TORCHELASTIC_RESTART_COUNT); torchrun restarts the group and the
second attempt runs to the end. The record keeps both attempts and the summary leads with
the failure; the restart gap is no HANG (--hang-after 2 s, shorter than the gap). The near
miss: restarts allowed, none needed: one attempt and no word of restarts."""

from __future__ import annotations

import pytest

from jobs import Finished, run_job, validate_schema

pytestmark = pytest.mark.e2e

STEPS = 80


@pytest.fixture(scope="module")
def restarted(tmp_path_factory: pytest.TempPathFactory) -> Finished:
    return run_job(tmp_path_factory.mktemp("restart"), "faults/restart_job.py",
                   "--max-restarts", "1", "--hang-after", "2", nproc=3, name="restart",
                   script_args=("--fail-rank", "2", "--fail-at-step", "40",
                                "--steps", str(STEPS)))


@pytest.fixture(scope="module")
def near_miss(tmp_path_factory: pytest.TempPathFactory) -> Finished:
    return run_job(tmp_path_factory.mktemp("nearmiss"), "faults/restart_job.py",
                   "--max-restarts", "1", nproc=3, name="nearmiss",
                   script_args=("--steps", str(STEPS)))


def test_a_restarted_job_keeps_both_attempts(restarted: Finished) -> None:
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    doc = restarted.summary
    validate_schema(doc)
    first, second = doc["attempts"]
    assert (first["attempt"], second["attempt"]) == (1, 2)
    # The first attempt's steps, its failed rank and its exception are kept.
    assert [r["steps"] for r in first["rank_steps"]] == [40, 40, 40]
    assert first["failure"]["rank"] == 2 and first["failure"]["step"] == 40
    assert first["failure"]["error"].startswith("ValueError: bad batch at step 40")
    assert first["restart_s"] > 0
    assert [r["steps"] for r in second["rank_steps"]] == [STEPS] * 3
    assert second["failure"] is None
    assert doc["restarts"]["count"] == 1
    assert doc["run"]["exit_code"] == 0 and doc["failure"] is None


def test_no_episode_spans_two_attempts_and_no_hang(restarted: Finished) -> None:
    doc = restarted.summary
    assert {e["attempt"] for e in doc["timeline"]} == {1, 2}
    for e in doc["timeline"]:
        assert e["end_step"] is None or e["start_step"] <= e["end_step"], e
        if e["attempt"] == 1:
            assert e["end_step"] is not None and e["end_step"] < 40, e
    assert all(e["label"] != "HANG" for e in doc["timeline"]), doc["timeline"]
    assert doc["hang"] is None


def test_the_summary_leads_with_the_failed_attempt(restarted: Finished) -> None:
    text = (restarted.run_dir / "final_summary.txt").read_text()
    lead = text.splitlines()[0]
    assert lead.startswith("attempt 1: rank 2 raised ValueError at step 40"), lead
    assert "; restarted after " in lead, lead
    assert lead.endswith("; attempt 2 ran to the end; the job exited with code 0"), lead
    assert lead in restarted.stdout  # printed at the end of a headless run too
    assert "steps 39-0" not in text.replace(" ", "")


def test_a_job_that_needed_no_restart_says_nothing_of_restarts(near_miss: Finished) -> None:
    assert near_miss.returncode == 0, near_miss.stderr[-3000:]
    doc = near_miss.summary
    validate_schema(doc)
    assert [a["attempt"] for a in doc["attempts"]] == [1]
    assert doc["attempts"][0]["failure"] is None and doc["restarts"] is None
    assert [r["steps"] for r in doc["ranks"]] == [STEPS] * 3
    assert {e["attempt"] for e in doc["timeline"]} == {1}
    text = (near_miss.run_dir / "final_summary.txt").read_text()
    assert "attempt" not in text and "restart" not in text.lower(), text


def test_torchrun_gets_the_elastic_options(restarted: Finished) -> None:
    log = (restarted.run_dir / "logs")
    # torchrun's per-attempt log folders: it restarted the workers once.
    assert sorted(p.name for p in log.rglob("attempt_*")) == ["attempt_0", "attempt_1"]


def test_a_job_that_fails_in_every_attempt_exits_with_its_failure(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Restarts run out: both attempts are kept, the last one's failure is the job's."""
    job = run_job(tmp_path_factory.mktemp("exhausted"), "faults/restart_job.py",
                  "--max-restarts", "1", nproc=3, name="exhausted",
                  script_args=("--fail-rank", "2", "--fail-at-step", "20", "--fail-attempts",
                               "2", "--steps", "40"))
    assert job.returncode == 1, job.stderr[-3000:]
    doc = job.summary
    validate_schema(doc)
    assert [(a["attempt"], a["failure"]["rank"]) for a in doc["attempts"]] == [(1, 2), (2, 2)]
    assert doc["run"]["exit_code"] == 1 and doc["failure"]["rank"] == 2
    lead = (job.run_dir / "final_summary.txt").read_text().splitlines()[0]
    assert lead.startswith("attempt 1: rank 2 raised ValueError at step 20"), lead
    assert "; attempt 2: rank 2 raised ValueError at step 20" in lead, lead
    assert lead.endswith("; no restart left; the job exited with code 1"), lead


def test_a_rank_killed_without_a_word_is_named(tmp_path_factory: pytest.TempPathFactory
                                               ) -> None:
    """Rank 2 SIGKILLs itself (no goodbye); its peers raise when it vanishes. The record
    names it beside them, without claiming which came first; the gap is no HANG. (Its
    peers may take seconds to see it gone on a busy machine: a HANG of 2 s latched then
    in one fresh-clone run, before any goodbye; 10 s is beyond that, not the restart.)"""
    job = run_job(tmp_path_factory.mktemp("killed"), "faults/restart_job.py",
                  "--max-restarts", "1", "--hang-after", "10", nproc=3, name="killed",
                  script_args=("--fail-rank", "2", "--fail-at-step", "30", "--kill",
                               "--steps", "50"))
    assert job.returncode == 0, job.stderr[-3000:]
    doc = job.summary
    validate_schema(doc)
    first = doc["attempts"][0]
    # Its step is the last it reported: a killed rank's last batch of steps is lost.
    # Its peers may be stopped by torchrun before their goodbye too (a busy machine): they
    # are named beside it, as the record says, never in its place.
    silent = {s["rank"]: s["step"] for s in first["silent"]}
    assert 2 in silent and silent[2] <= 30, first["silent"]
    assert doc["hang"] is None and all(e["label"] != "HANG" for e in doc["timeline"])
    lead = (job.run_dir / "final_summary.txt").read_text().splitlines()[0]
    assert "ended without a word (killed by a signal, or stopped by torchrun)" in lead, lead
    assert lead.endswith("; attempt 2 ran to the end; the job exited with code 0"), lead
