"""The collector's RunState fed with real wire messages (encoded, then decoded): ingest,
duplicates, foreign and restarted senders, snapshots and the timeline of episodes."""

from __future__ import annotations

import pytest

from traceml_agent.protocol import PHASES, Identity, decode, encode
from traceml_agent.vocab import WARMUP_STEPS
from traceml_tui.judge import diagnosis as dx
from traceml_tui.judge.state import LIVE_STEPS, RunState

T0 = 1_700_000_000.0
# Per PHASES order: dataloader, h2d, forward, backward, sync, optimizer, wait (100 ms).
BALANCED_MS = [5.0, 1.0, 30.0, 50.0, 4.0, 8.0, 2.0]


def ident(rank: int, world: int = 2, pid: int | None = None) -> Identity:
    return Identity(rank, rank, 0, f"host{rank}", 1000 + rank if pid is None else pid, world)


def steps(rank: int, step_ids, phase_ms=BALANCED_MS, world: int = 2, pid: int | None = None,
          dropped: int = 0):
    """A decoded steps message for `rank` with one record per step id."""
    records = [[s, T0 + s, sum(phase_ms), *phase_ms] for s in step_ids]
    payload = encode("steps", ident(rank, world, pid), 1, T0, phases=list(PHASES),
                     records=records, dropped=dropped)
    return decode(payload)


def test_ingest_two_ranks():
    state = RunState("run", world_size=2)
    for rank in (0, 1):
        assert state.ingest(steps(rank, range(10)), now=5.0)
    assert sorted(state.ranks) == [0, 1]
    assert [state.ranks[r].steps for r in (0, 1)] == [10, 10]
    assert state.counters["messages"] == 2
    assert state.counters["records"] == 20
    assert state.counters["duplicate_records"] == 0
    snap = state.snapshot(T0, mono_now=6.0)
    assert snap.reporting == 2 and snap.total_steps == 10
    assert [r.live_step_ms for r in snap.ranks] == [100.0, 100.0]
    assert snap.ranks[1].live_phase_ms["forward"] == 30.0
    assert snap.ranks[0].idle_s == 1.0


def test_replayed_and_out_of_order_records_are_not_double_counted():
    state = RunState("run", world_size=2)
    state.ingest(steps(0, range(10)), now=1.0)
    state.ingest(steps(0, range(5, 15)), now=2.0)  # 5..9 replayed, 10..14 new
    state.ingest(steps(0, [3, 20, 17]), now=3.0)  # 3 and 17 are out of order
    rs = state.ranks[0]
    assert rs.steps == 16  # 0..14 and 20
    assert rs.window.count == 15  # step 0 is warm-up: counted, not in the window
    assert rs.last_step == 20
    assert state.counters["duplicate_records"] == 5 + 2
    assert state.counters["records"] == 16


def test_agent_dropped_counts_the_increase_only():
    state = RunState("run", world_size=2)
    for dropped in (0, 3, 3, 5):
        state.ingest(steps(0, [], dropped=dropped), now=1.0)
    assert state.counters["agent_dropped"] == 5
    assert state.ranks[0].dropped == 5


def test_message_from_another_world_size_is_foreign():
    state = RunState("run", world_size=2)
    assert state.ingest(steps(3, range(10), world=4), now=1.0) is False
    assert state.counters["foreign"] == 1
    assert state.counters["messages"] == 0 and state.counters["records"] == 0
    assert state.ranks == {}


def hello(rank: int, pid: int):
    return decode(encode("hello", ident(rank, pid=pid), 0, T0, run="run", device="cpu",
                         env={}, auto=True))


def test_restarted_rank_starts_afresh():
    state = RunState("run", world_size=2)
    state.ingest(steps(0, range(10), pid=111), now=1.0)
    state.ingest(hello(0, pid=222), now=2.0)  # a new process says hello first
    state.ingest(steps(0, range(4), pid=222), now=2.0)  # ... and its steps restart at 0
    rs = state.ranks[0]
    assert rs.ident.pid == 222
    assert rs.steps == 4 and rs.window.count == 3  # its step 0 is warm-up again
    assert state.counters["duplicate_records"] == 0
    assert state.counters["restarts"] == 1


def test_another_pid_without_hello_cannot_reset_a_rank():
    """Issue 20 finding 6: messages for rank 0 from another pid used to reset its record."""
    state = RunState("run", world_size=2)
    state.ingest(steps(0, range(10), pid=111), now=1.0)
    for _ in range(3):
        assert not state.ingest(steps(0, [0], pid=666), now=2.0)
    assert state.ranks[0].steps == 10 and state.ranks[0].ident.pid == 111
    assert state.counters["foreign"] == 3


def test_an_absurd_step_number_cannot_swallow_the_real_steps():
    state = RunState("run", world_size=2)
    state.ingest(steps(0, range(10)), now=1.0)
    absurd = [[1 << 62, T0, sum(BALANCED_MS), *BALANCED_MS]]
    state.ingest(decode(encode("steps", ident(0), 1, T0, phases=list(PHASES), records=absurd,
                               dropped=0)), now=2.0)
    state.ingest(steps(0, range(10, 30)), now=3.0)
    assert state.ranks[0].steps == 30
    assert state.counters["absurd_steps"] == 1 and state.counters["duplicate_records"] == 0


def test_full_snapshot_lists_ranks_that_never_reported():
    state = RunState("run", world_size=4, nnodes=2)
    for rank in (0, 2):
        state.ingest(steps(rank, range(12), world=4), now=1.0)
    snap = state.snapshot(T0, mono_now=1.0, full=True)
    assert [r.rank for r in snap.ranks] == [0, 1, 2, 3]
    assert [r.reported for r in snap.ranks] == [True, False, True, False]
    for r in (snap.ranks[1], snap.ranks[3]):
        assert r.steps == 0 and r.step_ms is None and r.live_step_ms is None
        assert r.idle_s is None and r.recent_step_ms == ()
        assert r.phase_ms == {p: None for p in PHASES}
    assert (snap.ranks[3].node, snap.ranks[3].local_rank) == (1, 1)
    assert snap.ranks[2].step_ms.median == 100.0
    assert snap.ranks[2].phase_ms["backward"].median == 50.0
    assert isinstance(snap.final, dx.Diagnosis) and snap.final.label == dx.BALANCED


def test_live_snapshot_skips_whole_window_quantiles():
    state = RunState("run", world_size=2)
    state.ingest(steps(0, range(12)), now=1.0)
    snap = state.snapshot(T0, mono_now=1.0)
    assert snap.final is None
    assert snap.ranks[0].step_ms is None and snap.ranks[0].live_step_ms == 100.0


def _feed(state: RunState, first: int, n: int, slow_dl: float = 0.0) -> None:
    """n synchronous steps on 4 ranks; rank 2 spends slow_dl more in the dataloader
    while the others wait that long in sync."""
    for rank in range(4):
        ms = list(BALANCED_MS)
        ms[PHASES.index("dataloader" if rank == 2 else "sync")] += slow_dl
        state.ingest(steps(rank, range(first, first + n), ms, world=4), now=0.0)


def _evaluate(state: RunState, t: float, ticks: int = dx.CONFIRM_TICKS) -> float:
    for _ in range(ticks):
        t += 1.0
        state.evaluate(t)
    return t


def test_timeline_keeps_a_straggler_episode_that_came_and_went():
    state = RunState("run", world_size=4)
    _feed(state, 0, 2 * dx.MIN_STEPS)
    t = _evaluate(state, 0.0)
    assert state.live.shown.label == dx.BALANCED
    slow = 2 * dx.MIN_STEPS  # the first slow step; then LIVE_STEPS slow, as many clean
    _feed(state, slow, LIVE_STEPS, slow_dl=40.0)
    t_in = _evaluate(state, t)  # the straggler is shown on the last, confirming tick
    assert (state.live.shown.label, state.live.shown.rank) == (dx.INPUT_STRAGGLER, 2)
    _feed(state, slow + LIVE_STEPS, LIVE_STEPS)
    t = _evaluate(state, t_in)

    timeline = state.snapshot(t, mono_now=0.0).timeline
    assert [(e.label, e.rank) for e in timeline] == [
        (dx.BALANCED, None), (dx.INPUT_STRAGGLER, 2), (dx.BALANCED, None)]
    episode = timeline[1]
    assert episode.phase == "dataloader"
    # Dated by its evidence (its slow steps), not by the evaluations that named it (t_in,
    # at its last slow step) and cleared it (t, LIVE_STEPS later); times are its steps'.
    assert (episode.start_step, episode.end_step) == (slow, slow + LIVE_STEPS - 1)
    assert (episode.named_step, episode.cleared_step) == (slow + LIVE_STEPS - 1,
                                                          slow + 2 * LIVE_STEPS - 1)
    assert timeline[0].end_step == slow - 1 and timeline[2].start_step == slow + LIVE_STEPS
    assert episode.start < episode.end <= timeline[2].start <= t_in < t
    assert episode.lost_s == pytest.approx(LIVE_STEPS * 0.040, rel=0.02)
    assert timeline[2].end is None
    assert state.live.shown.label == dx.BALANCED


def test_a_recovered_straggler_is_cleared_by_its_recent_steps_not_the_whole_window():
    """Rank 2 is slow for 60 steps, then recovers. The 32-step window still holds slow
    steps for 16 more steps (and hysteresis kept the label longer); the recent steps
    clear it within dx.RECENT_MAX recovered steps plus the confirmation ticks. The
    episode stays in the timeline with its steps and the time it cost."""
    state = RunState("run", world_size=4)
    _feed(state, 0, 2 * dx.MIN_STEPS)
    t = _evaluate(state, 0.0)
    step = 100
    for _ in range(60):  # one step per evaluation: the label follows every step
        _feed(state, step, 1, slow_dl=40.0)
        step += 1
        t += 0.5
        state.evaluate(t)
    assert (state.live.shown.label, state.live.shown.rank) == (dx.INPUT_STRAGGLER, 2)
    recovered = 0
    while state.live.shown.label != dx.BALANCED:
        _feed(state, step, 1)
        step += 1
        recovered += 1
        t += 0.5
        state.evaluate(t)
        assert recovered <= 20, "still blamed 20 steps after recovering"
    # A median of 8 flips after 5 recovered steps; then CONFIRM_TICKS evaluations.
    assert recovered <= dx.RECENT_MAX // 2 + 1 + dx.CONFIRM_TICKS, recovered
    episode = [e for e in state.timeline if e.label == dx.INPUT_STRAGGLER][-1]
    assert episode.rank == 2 and episode.end_step is not None
    # Named for about the 60 slow steps (entry takes the window's median), at 40 ms each.
    assert 40 * 0.04 <= episode.lost_s <= 60 * 0.04 + 0.5, episode.lost_s


def test_a_straggler_that_stays_is_not_cleared_by_a_few_fast_steps():
    """The recent check must not make a steady straggler flicker: three fast steps among
    its slow ones change nothing."""
    state = RunState("run", world_size=4)
    _feed(state, 0, LIVE_STEPS, slow_dl=40.0)
    t = _evaluate(state, 0.0)
    assert state.live.shown.label == dx.INPUT_STRAGGLER
    step = LIVE_STEPS
    for k in range(40):
        _feed(state, step, 1, slow_dl=0.0 if k % 8 in (0, 3, 5) else 40.0)
        step += 1
        t += 0.5
        assert state.evaluate(t).label == dx.INPUT_STRAGGLER, k


@pytest.mark.parametrize("n_steps, label", [(WARMUP_STEPS + dx.MIN_STEPS - 1, dx.WARMUP),
                                            (WARMUP_STEPS + dx.MIN_STEPS, dx.BALANCED)])
def test_evaluate_waits_for_min_steps(n_steps, label):
    state = RunState("run", world_size=4)
    _feed(state, 0, n_steps)
    assert state.evaluate(1.0).label == label


def test_a_sender_inventing_phase_names_cannot_grow_the_collector():
    """Each new phase name costs a window per rank; names beyond the run's limit are refused."""
    from traceml_tui.judge.ingest import MAX_RUN_PHASES

    state = RunState("run", world_size=1)
    ident = Identity(rank=0, local_rank=0, node=0, host="h", pid=1, world_size=1)
    for i in range(200):
        names = [f"p{i}"]
        msg = decode(encode("steps", ident, i, 1.0, phases=names, records=[[i, 1.0, 1.0, 0.5]],
                            dropped=0))
        state.ingest(msg, 0.0)
    assert len(state.phases) <= MAX_RUN_PHASES
    assert len(state.ranks[0].window.phases) <= MAX_RUN_PHASES
    assert state.counters["malformed"] >= 200 - MAX_RUN_PHASES


def stacks(rank: int, where: str):
    payload = encode("stacks", ident(rank), 2, T0, stacks=[["MainThread", where]])
    return decode(payload)


def test_stacks_belong_to_the_stall_they_were_taken_in():
    """A stack taken while a rank was slow to start (imports) is dropped once it steps;
    a later stall's stack replaces it, never the other way round."""
    state = RunState("run", world_size=2)
    state.ingest(stacks(0, "importlib._bootstrap"), now=1.0)
    assert state.snapshot(T0, mono_now=1.0).ranks[0].stacks  # shown while it is stuck
    state.ingest(steps(0, range(20)), now=2.0)
    assert state.ranks[0].stacks == ()  # it stepped: that stall is over
    state.ingest(stacks(0, "time.sleep in forward"), now=3.0)
    assert "time.sleep" in state.snapshot(T0, mono_now=3.0).ranks[0].stacks[0][1]
    state.ingest(steps(0, [20]), now=4.0)
    assert state.snapshot(T0, mono_now=4.0).ranks[0].stacks == ()


def test_step_zero_is_warm_up_and_never_judged():
    """Step 0 carries one-off costs (model.to, CUDA context, cudnn autotuning, compile):
    a 30 s first step on one rank must not make it a straggler in any window."""
    state = RunState("run", world_size=2)
    slow_first = [5.0, 1.0, 30_000.0, 50.0, 4.0, 8.0, 2.0]
    state.ingest(steps(0, [0], phase_ms=slow_first), now=1.0)
    state.ingest(steps(0, range(1, 12)), now=2.0)
    state.ingest(steps(1, range(12)), now=2.0)
    assert state.ranks[0].steps == 12 and state.ranks[0].window.count == 11
    snap = state.snapshot(3.0, 3.0, full=True)
    assert snap.ranks[0].phase_ms["forward"].p95 == 30.0
    assert state.evaluate(3.0).label == dx.BALANCED


def test_lost_time_counts_every_step_once_however_evaluations_are_spaced():
    """Rank 2 stays 40 ms slow in its input. Whether evaluations come every step or after
    more steps than a window holds (a collector backing off), the episode's lost time is
    the steps taken since it opened times what rank 2 costs each (40 ms: the others wait
    it all in sync), and the live what-if gives the step without it."""
    state = RunState("run", world_size=4, window_steps=32)
    _feed(state, 0, 2 * dx.MIN_STEPS, slow_dl=40.0)
    t = _evaluate(state, 0.0)
    assert state.live.shown.label == dx.INPUT_STRAGGLER
    opened = max(rs.last_step for rs in state.ranks.values())
    step = opened + 1
    for n in (1, 5, 31, 100, 3, 250):  # 100 and 250: more than the window
        _feed(state, step, n, slow_dl=40.0)
        step += n
        t += 1.0
        state.evaluate(t)
    episode = state.timeline[-1]
    assert episode.label == dx.INPUT_STRAGGLER and episode.end is None
    # Dated by its evidence: from the first judged step (the label was confirmed later).
    assert (episode.start_step, episode.named_step) == (WARMUP_STEPS, opened)
    taken = step - WARMUP_STEPS
    assert episode.lost_s == pytest.approx(taken * 0.040, rel=0.02)
    w = state.what_if
    assert w is not None and w.rank == 2
    assert w.step_ms == pytest.approx(sum(BALANCED_MS), rel=0.02)
    assert w.now_ms == pytest.approx(sum(BALANCED_MS) + 40.0, rel=0.02)


def test_phases_lost_to_a_cuda_graph_capture_give_timing_incomplete_not_a_straggler():
    """Issue 29: rank 1's forward and backward run inside a CUDA graph capture, so its agent
    sends them as not measured (None) and counts the skips. Their time lands in its wait
    and its step looks slower, but no straggler is named: TIMING INCOMPLETE, with why."""
    state = RunState("run", world_size=3)
    captured = [5.0, 1.0, None, None, 4.0, 8.0, 2.0 + 30.0 + 50.0 + 40.0]
    for rank in range(3):
        ms = captured if rank == 1 else BALANCED_MS
        records = [[s, T0 + s, sum(v for v in ms if v is not None), *ms] for s in range(40)]
        state.ingest(decode(encode("steps", ident(rank, 3), 1, T0, phases=list(PHASES),
                                   records=records)), now=1.0)
        state.ingest(decode(encode("heartbeat", ident(rank, 3), 2, T0, step=40,
                                   since_step_s=0.1, capture_skips=80 if rank == 1 else 0)),
                     now=1.0)
    labels = {state.evaluate(T0 + 2 + i).label for i in range(4)}
    assert labels == {dx.TIMING_INCOMPLETE}
    d = state.live.shown
    assert d.rank is None and "CUDA graph capture (80 skipped)" in d.summary, d.summary
    assert "rank 1" in d.summary
    final = state.snapshot(T0 + 10, 10.0, full=True).final
    assert final.label == dx.TIMING_INCOMPLETE
