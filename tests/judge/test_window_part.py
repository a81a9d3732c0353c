"""The live file's whole-window part (every rank's window sorted per series, the verdict
over it and its cost) is reused for up to `window_max_age_s` and says when it was taken;
the counters and steps are fresh in every snapshot, and the final record is always
fresh. Near misses: a rank added, a restart, an attempt, or the age reached: recomputed."""

from __future__ import annotations

from msgspec import UNSET

from traceml_agent import protocol
from traceml_agent.protocol import PHASES, PROTOCOL_VERSION, Identity, Message, StepRecord, Steps
from traceml_tui.collect.canned import BASE_MS, T0, make_state
from traceml_tui.judge import diagnosis as dx
from traceml_tui.judge.state import RunState
from traceml_tui.report import summary

AGE = 10.0


def _balanced_steps(state: RunState, first: int, count: int) -> None:
    """`count` steps on every rank, none slower than the others (the straggler healed)."""
    for rs in list(state.ranks.values()):
        ident = rs.ident
        step_ms = sum(v for v in BASE_MS.values() if v is not None)
        records = tuple(StepRecord(s, T0 + s * step_ms / 1000, step_ms,
                                   tuple(BASE_MS.get(p) for p in PHASES))
                        for s in range(first, first + count))
        batch = Steps(v=PROTOCOL_VERSION, id=ident, seq=5, t=T0, phases=list(PHASES),
                      records=[])
        state.ingest(Message("steps", ident, 5, T0, batch, PHASES, records), 1.0)


def _live_doc(state: RunState, now: float, mono: float, age: float = AGE):
    snap = state.snapshot(now, mono, full=True, window_max_age_s=age)
    return snap, summary.build(snap, summary.RunMeta(complete=False))


def test_the_window_part_is_reused_within_its_age_and_says_when_it_was_taken():
    state = make_state(steps=40)
    first, doc = _live_doc(state, T0 + 100.0, 0.0)
    assert first.final.label == dx.INPUT_STRAGGLER and first.window_at is None
    assert doc.run.window_stats_at is UNSET
    _balanced_steps(state, 40, 200)  # the window (40 steps) now holds only balanced steps
    again, doc = _live_doc(state, T0 + 105.0, 5.0)
    assert again.whole is first.whole and again.final.label == dx.INPUT_STRAGGLER
    assert again.window_at == T0 + 100.0
    assert doc.run.window_stats_at == summary.iso(T0 + 100.0)
    assert {r.steps for r in again.ranks} == {240}  # the counters are this moment's
    # The final record (no age): fresh, whatever the live file holds.
    final = state.snapshot(T0 + 106.0, 6.0, full=True)
    assert final.final.label != dx.INPUT_STRAGGLER and final.window_at is None
    # A fresh part serves the live file in turn; past its age, another is taken.
    later, _ = _live_doc(state, T0 + 111.0, 11.0)
    assert later.whole is final.whole and later.window_at == T0 + 106.0
    late, doc = _live_doc(state, T0 + 116.0, 16.0)
    assert late.whole is not final.whole and late.window_at is None
    assert doc.run.window_stats_at is UNSET


def test_a_rank_added_or_restarted_makes_the_part_anew():
    state = make_state(steps=40, silent_nodes=(1,))  # node 1's ranks 4-7 not yet seen
    first, _ = _live_doc(state, T0 + 100.0, 0.0)
    assert len(first.whole.rows) == 4
    for rank in range(4, 8):  # node 1 reports, through the real intake
        ident = Identity(rank, rank % 4, 1, "node001", 1000 + rank, 8)
        records = tuple(StepRecord(s, T0 + s * 0.01, 6.0, tuple(BASE_MS.get(p) for p in PHASES))
                        for s in range(40))
        batch = Steps(v=PROTOCOL_VERSION, id=ident, seq=0, t=T0, phases=list(PHASES),
                      records=[])
        state.ingest(Message("steps", ident, 0, T0, batch, PHASES, records), 1.0)
    added, _ = _live_doc(state, T0 + 101.0, 1.0)
    assert added.whole is not first.whole and len(added.whole.rows) == 8
    assert added.window_at is None
    # Rank 5's new process says hello, through the real intake: its record is made anew.
    ident = Identity(5, 1, 1, "node001", 2005, 8)
    assert state.ingest(Message("hello", ident, 0, T0 + 101.5, protocol.Hello(
        v=PROTOCOL_VERSION, id=ident, seq=0, t=T0 + 101.5, run="demo-run")), 1.5)
    assert state.ranks[5].ident.pid == 2005
    restarted, _ = _live_doc(state, T0 + 102.0, 2.0)
    assert restarted.whole is not added.whole
    reused, _ = _live_doc(state, T0 + 103.0, 3.0)
    assert reused.whole is restarted.whole and reused.window_at == T0 + 102.0
