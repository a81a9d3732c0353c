"""Attempts of a job torchrun restarts (judge/attempts.py), offline: RunState fed with real
wire messages (encoded, then decoded) as a restart sends them, and the summary built from
its snapshot. tests/e2e/test_e2e_restarts.py runs the same with torchrun."""

from __future__ import annotations

import pytest

from jobs import validate_schema
from traceml_agent.protocol import PHASES, Identity, decode, encode
from traceml_tui.judge import attempts as att
from traceml_tui.judge import diagnosis as dx
from traceml_tui.judge.state import RunState
from traceml_tui.report import attempts as words
from traceml_tui.report import summary
from traceml_tui.runfolder import summary_model as model
from traceml_tui.runfolder.summary_model import from_doc

T0 = 1_700_000_000.0
BALANCED_MS = [5.0, 1.0, 30.0, 50.0, 4.0, 8.0, 2.0]  # PHASES order, 100 ms
SLOW_MS = [5.0, 1.0, 90.0, 50.0, 4.0, 8.0, 2.0]  # 60 ms more forward: a straggler


def ident(rank: int, pid: int, world: int = 2) -> Identity:
    return Identity(rank, rank, 0, f"host{rank}", pid, world)


def hello(rank: int, pid: int, attempt: int | None, t: float):
    return decode(encode("hello", ident(rank, pid), 0, t, run="run", device="cpu", env={},
                         auto=True, attempt=attempt))


def steps(rank: int, pid: int, ids, ms=BALANCED_MS):
    records = [[s, T0 + s, sum(ms), *ms] for s in ids]
    return decode(encode("steps", ident(rank, pid), 1, T0, phases=list(PHASES),
                         records=records, dropped=0))


def goodbye(rank: int, pid: int, code: int, error: str, t: float):
    return decode(encode("goodbye", ident(rank, pid), 2, t, exit_code=code, error=error,
                         steps=0))


def run_attempt(state: RunState, pids: tuple[int, int], attempt: int, n: int, t: float,
                mono: float, slow_rank: int | None = None) -> float:
    """Hellos of a new group, then `n` steps of both ranks in batches of 5, evaluated
    after each batch; returns the monotonic time after it."""
    for rank, pid in enumerate(pids):
        state.ingest(hello(rank, pid, attempt, t), now=mono)
    for start in range(0, n, 5):
        mono += 0.5
        for rank, pid in enumerate(pids):
            state.ingest(steps(rank, pid, range(start, start + 5),
                               SLOW_MS if rank == slow_rank else BALANCED_MS), now=mono)
        state.evaluate(t + mono, mono)
    return mono


def restarted(max_restarts: int = 1) -> tuple[RunState, float]:
    """Attempt 1: rank 1 (a straggler) raises at step 40, rank 0 fails after it; attempt 2
    runs 60 steps to the end."""
    state = RunState("run", world_size=2, started_at=T0, max_restarts=max_restarts)
    mono = run_attempt(state, (100, 101), 0, 40, T0, 0.0, slow_rank=1)
    state.ingest(goodbye(1, 101, 1, "Traceback ...\nValueError: bad batch", T0 + 30.0), mono)
    state.ingest(goodbye(0, 100, 1, "RuntimeError: Connection closed by peer", T0 + 30.1),
                 mono)
    mono = run_attempt(state, (200, 201), 1, 60, T0 + 36.0, mono + 6.0)
    return state, mono


def test_each_attempt_keeps_its_steps_failure_and_episodes():
    state, mono = restarted()
    snap = state.snapshot(T0 + 100.0, mono, full=True)
    first, second = snap.attempts
    assert (first.number, second.number) == (1, 2)
    assert first.rank_steps == ((0, 40), (1, 40)) and second.rank_steps == ((0, 60), (1, 60))
    assert [(f.rank, f.step) for f in first.failures] == [(1, 40), (0, 40)]
    assert first.verdict is not None and first.verdict.label == dx.COMPUTE_STRAGGLER
    assert second.failures == () and second.ended_at is None
    # No episode spans two attempts: each one's steps are its own attempt's.
    assert {e.attempt for e in snap.timeline} == {1, 2}
    for e in snap.timeline:
        assert e.end_step is None or e.end_step >= e.start_step, e
        assert e.end_step is None or e.end_step < (40 if e.attempt == 1 else 60), e
    assert any(e.label == dx.COMPUTE_STRAGGLER and e.attempt == 1 for e in snap.timeline)


def test_the_summary_leads_with_the_failed_attempt():
    state, mono = restarted()
    doc = model.to_doc(summary.build(state.snapshot(T0 + 100.0, mono, full=True),
                        summary.RunMeta(exit_code=0, ended_at=T0 + 100.0)))
    validate_schema(doc)
    from_doc(doc)  # the typed model reads it
    first = doc["attempts"][0]
    assert first["failure"]["rank"] == 1 and first["failure"]["step"] == 40
    assert first["failure"]["error"] == "ValueError: bad batch"
    assert doc["restarts"]["count"] == 1 and doc["restarts"]["restart_s"] > 0
    assert doc["failure"] is None and doc["run"]["exit_code"] == 0
    text = summary.render_text(doc)
    lead = text.splitlines()[0]
    assert lead.startswith("attempt 1: rank 1 raised ValueError at step 40 (then rank(s) 0); "
                           "restarted after "), lead
    assert lead.endswith("; attempt 2 ran to the end; the job exited with code 0"), lead
    assert "attempt 1, steps" in text and "attempt 2, steps" in text


def test_no_hang_while_torchrun_restarts_the_group():
    """Rank 1 raised; rank 0 was killed without a word; the new group is not up yet."""
    for max_restarts, expected in ((1, False), (0, True)):
        state = RunState("run", world_size=2, started_at=T0, hang_after_s=5.0,
                         max_restarts=max_restarts)
        mono = run_attempt(state, (100, 101), 0, 40, T0, 0.0)
        state.ingest(goodbye(1, 101, 1, "ValueError: bad batch", T0 + 30.0), mono)
        shown = state.evaluate(T0 + 60.0, mono + 30.0)
        assert (shown.label == dx.HANG) is expected, (max_restarts, shown)
        # ... nor while the restarted group starts, before its first step
        if max_restarts:
            state.ingest(hello(0, 200, 1, T0 + 61.0), mono + 31.0)
            assert state.evaluate(T0 + 90.0, mono + 60.0).label != dx.HANG


def test_a_run_with_restarts_allowed_and_no_failure_has_one_attempt():
    state = RunState("run", world_size=2, started_at=T0, max_restarts=1)
    mono = run_attempt(state, (100, 101), 0, 40, T0, 0.0)
    doc = model.to_doc(summary.build(state.snapshot(T0 + 50.0, mono, full=True),
                        summary.RunMeta(exit_code=0, ended_at=T0 + 50.0)))
    validate_schema(doc)
    assert [a["attempt"] for a in doc["attempts"]] == [1] and doc["restarts"] is None
    assert "attempt" not in summary.render_text(doc) and "restart" not in summary.render_text(doc)


def test_outside_torchrun_there_are_no_attempts():
    state = RunState("run", world_size=2, started_at=T0)
    mono = run_attempt(state, (100, 101), None, 20, T0, 0.0)  # type: ignore[arg-type]
    assert state.snapshot(T0 + 50.0, mono).attempts == ()


def test_attempts_kept_are_bounded():
    state = RunState("run", world_size=2, started_at=T0, max_restarts=100)
    mono = 0.0
    for attempt in range(40):
        mono = run_attempt(state, (1000 + 2 * attempt, 1001 + 2 * attempt), attempt, 10,
                           T0 + attempt * 10, mono + 1.0)
        state.ingest(goodbye(0, 1000 + 2 * attempt, 1, "ValueError: x", T0 + attempt * 10 + 5),
                     mono)
    snap = state.snapshot(T0 + 500.0, mono)
    assert len(snap.attempts) == att.MAX_ATTEMPTS_KEPT + 1  # the kept, and the current
    assert snap.attempts[0].number == 1 and snap.attempts[-1].number == 40
    assert state.attempts.dropped == 40 - 1 - att.MAX_ATTEMPTS_KEPT


def test_an_old_attempts_goodbye_does_not_count_in_the_new_one():
    state, mono = restarted()
    state.ingest(goodbye(1, 101, 1, "ValueError: late", T0 + 90.0), mono)  # the old pid
    assert state.attempts.failures == {}


@pytest.mark.parametrize(("failure", "words_"), [
    ({"exit_code": 1, "error": "ValueError: bad batch"}, "raised ValueError"),
    ({"exit_code": 1, "error": "torch.OutOfMemoryError: CUDA out of memory"},
     "raised torch.OutOfMemoryError"),
    ({"exit_code": 3, "error": None}, "exited with code 3"),
    ({"exit_code": 1, "error": "something odd happened"}, "exited with code 1"),
    ({"exit_code": -9, "signal": "SIGKILL", "error": None}, "was killed by signal 9 (SIGKILL)"),
])
def test_how_an_attempt_ended(failure, words_):
    assert words.how_it_ended(model.Failure(rank=0, **failure)) == words_


# --- traceml run's elastic options, as torchrun gets them ---------------------------------


def _torchrun_args(*flags: str) -> list[str]:
    from pathlib import Path

    from traceml_tui import cli
    from traceml_tui.launch.options import RunOptions, torchrun_command

    args = cli.build_parser().parse_args(["run", "train.py", *flags])
    nodes = cli._node_flags(args, Path("train.py"))
    opts = RunOptions(script=Path("train.py"), max_restarts=args.max_restarts,
                      min_nodes=nodes.pop("min_nodes"), rdzv_backend=args.rdzv_backend,
                      rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id, **nodes)
    return torchrun_command(opts, 29500, ["-m", "x"])


@pytest.mark.parametrize(("flags", "expected"), [
    ((), ["--nnodes", "1"]),
    (("--max-restarts", "2"), ["--max-restarts", "2"]),
    (("--nnodes", "1:4", "--run-name", "r"), ["--nnodes", "1:4"]),
    (("--nnodes", "2:2", "--run-name", "r"), ["--nnodes", "2"]),
    (("--rdzv-backend", "c10d", "--rdzv-endpoint", "h:29400", "--rdzv-id", "job7"),
     ["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:29400", "--rdzv-id", "job7"]),
])
def test_torchrun_gets_the_elastic_options(monkeypatch, flags, expected):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_STEP_ID", raising=False)
    cmd = _torchrun_args(*flags)
    at = cmd.index(expected[0])
    assert cmd[at:at + len(expected)] == expected, cmd
    if "--max-restarts" not in flags:
        assert "--max-restarts" not in cmd  # torchrun's own default: none


@pytest.mark.parametrize("bad", ["3:1", "0:2", "a:b", "1:"])
def test_a_bad_node_range_is_refused(bad, capsys):
    from traceml_tui import cli

    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["run", "train.py", "--nnodes", bad])
    assert "--nnodes" in capsys.readouterr().err


def test_elastic_membership_takes_the_ranks_of_a_smaller_world():
    """--nnodes MIN:MAX: an attempt with fewer nodes reports a smaller world, which belongs
    to the run (between MIN and MAX nodes' ranks); any other world is foreign, as before."""
    def of_world(world: int, rank: int = 0):
        return decode(encode("steps", Identity(rank, rank, 0, "h", 100 + rank, world), 1, T0,
                             phases=list(PHASES), records=[[0, T0, 100.0, *BALANCED_MS]],
                             dropped=0))

    elastic = RunState("run", world_size=4, nnodes=2, nproc_per_node=2, min_world_size=2)
    fixed = RunState("run", world_size=4, nnodes=2, nproc_per_node=2)
    for world, taken in ((2, True), (4, True), (1, False), (3 + 2, False)):
        assert elastic.ingest(of_world(world), now=1.0) is taken, world
    assert fixed.ingest(of_world(2), now=1.0) is False
    assert (elastic.counters["foreign"], fixed.counters["foreign"]) == (2, 1)


def test_hang_detection_waits_for_a_restart_for_a_bounded_time():
    book = att.AttemptBook(max_restarts=1)
    book.hello(0, T0)
    assert not book.restarting(10.0)  # nothing failed
    book.goodbye(1, 1, "ValueError: x", 40, T0 + 5.0, mono=10.0)
    assert book.restarting(10.0 + att.RESTART_WAIT_S - 1)
    assert not book.restarting(10.0 + att.RESTART_WAIT_S)
    book.close(1, T0 + 20.0, 20.0, {0: 40}, None, ())
    assert book.restarting(20.0 + att.RESTART_WAIT_S - 1)  # the new group not yet stepping
    assert not book.restarting(20.0 + att.RESTART_WAIT_S)  # a forged hello cannot hide more
    book.goodbye(0, 1, "ValueError: x", 3, T0 + 25.0, mono=25.0)
    assert not book.restarting(26.0)  # no restart left: a hang is a hang


def test_ranks_that_ended_without_a_word_are_named_not_blamed():
    """Rank 1 was SIGKILLed (no goodbye); rank 0 raised when its peer vanished: the lead
    names both and does not say which came first."""
    state = RunState("run", world_size=2, started_at=T0, max_restarts=1)
    mono = run_attempt(state, (100, 101), 0, 40, T0, 0.0)
    state.ingest(goodbye(0, 100, 1, "RuntimeError: Connection reset by peer", T0 + 30.0),
                 mono)
    mono = run_attempt(state, (200, 201), 1, 20, T0 + 36.0, mono + 6.0)
    doc = model.to_doc(summary.build(state.snapshot(T0 + 100.0, mono, full=True),
                        summary.RunMeta(exit_code=0, ended_at=T0 + 100.0)))
    validate_schema(doc)
    assert doc["attempts"][0]["silent"] == [{"rank": 1, "step": 40}]
    lead = summary.render_text(doc).splitlines()[0]
    assert lead.startswith("attempt 1: rank 0 raised RuntimeError at step 40; rank(s) 1 ended "
                           "without a word (killed by a signal, or stopped by torchrun); "
                           "restarted after "), lead
