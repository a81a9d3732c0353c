"""Episodes dated by their evidence (judge/episodes.py): pure functions over per-step
arrays, the step clock that puts them on the time axis, and RunState's timeline over
canned histories fed as real wire messages."""

from __future__ import annotations

import numpy as np
import pytest

from traceml_agent.protocol import PHASES, Identity, decode, encode
from traceml_tui.judge import diagnosis as dx
from traceml_tui.judge import episodes
from traceml_tui.judge.history import StepClock
from traceml_tui.judge.state import LIVE_STEPS, RunState

STRAG = dx.COMPUTE_STRAGGLER


def _hot(pattern: str) -> tuple[np.ndarray, np.ndarray]:
    """Steps 0.. and their evidence from a string: '#' evidence, '.' none."""
    return np.arange(len(pattern)), np.array([c == "#" for c in pattern])


@pytest.mark.parametrize(("label", "pattern", "after", "want"), [
    (STRAG, "..........", -1, None),  # no evidence
    (STRAG, "...####...", -1, (3, 6)),
    (STRAG, "...##.....", -1, None),  # two noisy steps are not an episode
    (STRAG, "..###.....##....", -1, (2, 4)),  # a later blip of 2 steps is noise
    (STRAG, "..####..#..#..#", -1, (2, 14)),  # holes of up to JOIN_GAP steps join
    (STRAG, "..###.....####.", -1, (10, 13)),  # two runs apart: the newest
    (STRAG, "..###.....####.", 11, None),  # after step 11: too few left
    (STRAG, "#####.........", 0, (1, 4)),  # nothing at or before `after`
    (dx.PERIODIC_STALL, "..#.......#.......#..", -1, (2, 18)),  # a rhythm joins
    (dx.COMM_BOUND, "#########", -1, None),  # no culprit, never evidence here
])
def test_span_is_the_newest_run_of_evidence(label, pattern, after, want):
    steps, hot = _hot(pattern)
    if label == dx.COMM_BOUND:
        hot = episodes.evidence(label, np.full(len(steps), 10.0), np.full(len(steps), 9.0))
    assert episodes.span(label, steps, hot, after) == want


@pytest.mark.parametrize(("label", "job", "saving", "want", "gap"), [pytest.param(*c, *(
    () if len(c) == 5 else (None,))) for c in [
    (STRAG, 10.0, 0.7, True),  # 7 % of the step: above SKEW_EXIT (6 %)
    (STRAG, 10.0, 0.5, False),
    (STRAG, 1.0, 0.1, False),  # 10 % but under MIN_GAP_MS
    (dx.INPUT_BOUND, 10.0, 2.0, False),  # under INPUT_BOUND_EXIT (22 %)
    (dx.INPUT_BOUND, 10.0, 2.5, True),
    (dx.PERIODIC_STALL, 10.0, 0.3, True),  # its pricing counts only stalled steps
    (dx.PERIODIC_STALL, 10.0, 0.0, False),
    (STRAG, np.nan, 0.7, True),  # a step with no job figure: the floor is MIN_GAP_MS
    (STRAG, 30.0, 9.0, False, 20.0),  # under half the gap it was named with
    (STRAG, 30.0, 10.0, True, 20.0),
    (dx.PERIODIC_STALL, 10.0, 0.3, True, 250.0),  # each stall is one: no half-gap edge
]])
def test_a_step_is_evidence_at_its_labels_exit_threshold(label, job, saving, want, gap):
    got = episodes.evidence(label, np.array([job]), np.array([saving]), gap)
    assert bool(got[0]) is want


def test_lost_ms_prices_the_steps_of_the_span_only():
    steps = np.arange(10)
    saving = np.arange(10, dtype=float)
    assert episodes.lost_ms(steps, saving, 3, 5) == 3 + 4 + 5
    assert episodes.lost_ms(steps, saving, 8, 20) == 17
    assert episodes.lost_ms(steps, saving, 6, 5) == 0


def test_step_clock_interpolates_and_stays_bounded():
    clock = StepClock(max_marks=8)
    assert clock.time_of(5, default=99.0) == 99.0
    for k in range(100):
        clock.mark(10 * k, 100.0 + k)
    clock.mark(5, 1.0)  # a step older than the newest mark adds nothing
    assert len(clock.marks) < 8 and clock.marks[-1] == (990, 199.0)
    assert clock.time_of(990, 0.0) == 199.0 and clock.time_of(5000, 0.0) == 199.0
    assert clock.time_of(0, 0.0) == clock.marks[0][1]
    s0, t0 = clock.marks[-2]
    assert clock.time_of((s0 + 990) // 2, 0.0) == pytest.approx((t0 + 199.0) / 2, abs=0.1)


# --- RunState over canned histories ----------------------------------------------------

WORLD = 4
SLOW = 2
# Per PHASES order: dataloader, h2d, forward, backward, sync, optimizer, wait; scaled
# to the step. Sync is 30 % of the step: BALANCED; a victim of a straggler as slow as
# two steps waits 77 % of its step in sync, which alone reads COMM-BOUND.
SHARES = [0.05, 0.0, 0.2, 0.3, 0.3, 0.05, 0.1]


def _steps(rank: int, first: int, last: int, step_ms: float, extra_ms: float,
           fault: range, everyone: bool = False, comm: range = range(0)) -> object:
    """Rank `rank`'s steps first..last: rank SLOW's forward takes extra_ms more on the
    steps in `fault`, and every other rank waits as long in sync (`everyone`: every
    rank waits that long in sync, a job-wide slowdown with no culprit; so on the steps
    in `comm`)."""
    records = []
    for s in range(first, last + 1):
        ms = [share * step_ms for share in SHARES]
        if s in fault:
            slow = rank == SLOW and not everyone
            ms[PHASES.index("forward" if slow else "sync")] += extra_ms
        if s in comm:
            ms[PHASES.index("sync")] += extra_ms
        records.append([s, 1000.0 + s, sum(ms), *ms])
    ident = Identity(rank, rank, 0, f"host{rank}", 1000 + rank, WORLD)
    return decode(encode("steps", ident, 1, 0.0, phases=list(PHASES), records=records))


def _run(step_ms: float, fault: range, total: int, lag: int = 0,
         everyone: bool = False, comm: range = range(0)) -> RunState:
    """A job of `total` steps (a faulty step takes 3 steps' time), evaluated every 0.5 s
    of its own time. `lag`: rank SLOW's records arrive that many steps after the others'
    (its sender is held up), so its victims' sync is seen before its own slow steps."""
    state = RunState("run", world_size=WORLD)
    extra = 2 * step_ms
    sent = dict.fromkeys(range(WORLD), -1)
    t, step, clock = 0.0, -1, 0.0
    while step < total - 1 or any(v < total - 1 for v in sent.values()):
        while step < total - 1 and clock < t + 0.5:  # the steps taken in this 0.5 s
            step += 1
            clock += (step_ms + extra if step in fault or step in comm else step_ms) / 1000.0
        for rank in range(WORLD):
            upto = step - lag if rank == SLOW and step < total - 1 else step
            if upto > sent[rank]:
                state.ingest(_steps(rank, sent[rank] + 1, upto, step_ms, extra, fault,
                                    everyone, comm), now=t)
                sent[rank] = upto
        t += 0.5
        state.evaluate(t)
    for _ in range(dx.CONFIRM_TICKS):
        t += 0.5
        state.evaluate(t)
    return state


@pytest.mark.parametrize("step_ms", [10.0, 100.0])
@pytest.mark.parametrize("lag", [0, 20], ids=["in-step", "late-records"])
def test_a_transient_straggler_is_filed_on_its_own_steps(step_ms, lag):
    """Rank 2's forward is two steps slower on steps 40-99 only. The timeline files the
    straggler on steps 40-99 (the live label was named and cleared later: the 32-step
    window, the confirming ticks, and at 10 ms steps 50 steps per evaluation), prices it
    over those 60 steps (what the others waited), and keeps no other label on them: the
    COMM-BOUND the victims showed before the straggler's own records came in was its
    symptom, not an episode of its own. Before, it read COMM-BOUND 50-150 and the
    straggler 150-200 costing 0 s."""
    fault = range(40, 100)
    state = _run(step_ms, fault, 300, lag)
    timeline = [e for e in state.timeline if e.label != dx.WARMUP]
    strag = [e for e in timeline if e.label == STRAG]
    assert [(e.rank, e.phase) for e in strag] == [(SLOW, "forward")], timeline
    e = strag[0]
    assert (e.start_step, e.end_step) == (40, 99), e
    assert e.lost_s == pytest.approx(60 * 2 * step_ms / 1000.0, rel=0.02), e
    # Named after its first step and cleared after its last: the live label's steps.
    assert e.named_step is not None and e.named_step > 40
    assert e.cleared_step is not None and e.cleared_step > 99
    # Nothing else on its steps; the episodes around it meet it.
    # At 10 ms steps the first evaluation (0.5 s) already holds step 40: no episode
    # before it. Nor after it the COMM-BOUND its victims' windows still showed.
    before = [x for x in timeline if x.start_step < 40]
    after = [x for x in timeline if x.start_step > 99]
    assert before + [e] + after == timeline
    assert [x.label for x in before + after] == [dx.BALANCED] * (len(timeline) - 1)
    assert [x.end_step for x in before] == [39] * len(before)
    assert after[0].start_step == 100 and after[-1].end_step is None
    # Its times are its steps' (the time chart draws it where the timeline says): 59
    # steps of three steps' time, within the 0.5 s between evaluations.
    assert all(x.end <= e.start for x in before) and e.end <= after[0].start
    assert e.end - e.start == pytest.approx(59 * 3 * step_ms / 1000.0, abs=0.5)


def test_a_label_without_a_culprit_is_dated_by_its_evaluation():
    """Every rank waits longer in sync from step 100 on: COMM-BOUND, which has no culprit
    to price step by step, starts at the newest step when the label changed."""
    state = _run(10.0, range(100, 300), 300, everyone=True)
    labels = [(e.label, e.dated) for e in state.timeline if e.label != dx.WARMUP]
    assert labels == [(dx.BALANCED, False), (dx.COMM_BOUND, False)], state.timeline
    e = state.timeline[-1]
    assert e.start_step == e.named_step and 100 < e.start_step < 200, e


def test_the_summary_and_the_time_chart_file_it_on_its_steps():
    """final_summary.json (schema-valid), its text and the dashboard's time chart say the
    same: the straggler on steps 40-99, drawn on the chart where those steps ran."""
    from jobs import validate_schema
    from traceml_tui.collect.view_build import build as build_view
    from traceml_tui.report import summary
    from traceml_tui.runfolder import summary_model as model
    from traceml_tui.view.dashboard.time_chart import episode_line

    state = _run(10.0, range(40, 100), 300, lag=20)
    snap = state.snapshot(state.timeline.clock.marks[-1][1] + 1.0, mono_now=0.0, full=True)
    doc = model.to_doc(summary.build(snap, summary.RunMeta(command=["x"], exit_code=0)))
    validate_schema(doc)
    (e,) = [x for x in doc["timeline"] if x["label"] == STRAG]
    assert (e["start_step"], e["end_step"], e["rank"]) == (40, 99, SLOW)
    assert e["named_step"] > 40 and e["cleared_step"] > 99
    assert "steps     40-99      COMPUTE STRAGGLER rank 2  (cost the job 1.2 s)" in (
        summary.render_text(doc))
    # The chart: the straggler's bar covers the share of the run its steps took.
    view = build_view(snap)
    t0, t_end = view.history[0][0], max(view.history[-1][0], view.elapsed_s)
    cols = 100
    line = episode_line(view, cols, t0, t_end).plain.split("│", 1)[1]
    first = line.index(f" {STRAG} ") - 1  # the label is written one cell into its bar
    (ep,) = [x for x in state.timeline if x.label == STRAG]
    assert abs(first - (ep.start - state.started_at - t0) / (t_end - t0) * cols) <= 1, line
    # ... and where the chart's history shows the slow steps: before them the step is
    # the clean 10 ms, on them three times that.
    slow = [p for p in view.history if p[1] is not None and p[1] > 20.0]
    assert slow and abs(slow[0][0] - (ep.start - state.started_at)) <= 1.0, (slow, ep)


@pytest.mark.parametrize("step_ms", [10.0, 100.0])
def test_a_real_label_after_a_dated_episode_stays(step_ms):
    """The straggler on steps 40-99, then every rank waits long in sync for 150 steps (a
    real COMM-BOUND, not its victims' window), then balanced again: the COMM-BOUND stays,
    from the step after the straggler's evidence."""
    state = _run(step_ms, range(40, 100), 400, comm=range(100, 250))
    labels = [(e.label, e.start_step) for e in state.timeline if e.label != dx.WARMUP]
    assert labels[-3:-1] == [(STRAG, 40), (dx.COMM_BOUND, 100)], state.timeline
    # No culprit: dated by its evaluation, after the window and the confirming ticks.
    late = LIVE_STEPS + (dx.CONFIRM_TICKS + 1) * round(500 / step_ms)
    assert labels[-1][0] == dx.BALANCED and 250 <= labels[-1][1] <= 250 + late, state.timeline


# --- one episode, one cause ------------------------------------------------------------

def _cpu_samples(state: RunState, seq: int, t: float, culprit_wait: float) -> None:
    """Every rank's sys sample: its training thread ran 10% of the interval; rank 2
    waited `culprit_wait` % for a core, the others 3 %."""
    for rank, rs in state.ranks.items():
        state.ingest(decode(encode("sys", rs.ident, seq, t, cpu_pct=35.0,
                                   thread_cpu_pct=10.0,
                                   cpu_wait_pct=culprit_wait if rank == 2 else 3.0)), 0.0)


def _cause_run(held: int) -> tuple[dx.Diagnosis, list]:
    """Rank 2 behind in backward, its cores not the cause (waits 2 %); then its waits
    rise (85 %) until the banner says its cores are the cause, which then holds for
    `held` more evaluations."""
    from traceml_tui.collect.canned import T0, make_state

    state = make_state(world_size=8, straggler=2, phase="backward")
    t = T0 + 10
    shown = state.evaluate(t)
    assert shown.label == STRAG and shown.rank == 2 and shown.cause is None
    for _ in range(40):  # the shares are smoothed: a few samples before they tell
        t += 1
        _cpu_samples(state, int(t), t, 85.0)
        shown = state.evaluate(t)
        if shown.cause == dx.CORES:
            break
    assert shown.cause == dx.CORES and "for a CPU core" in shown.summary  # words at once
    for _ in range(held - 1):
        t += 1
        _cpu_samples(state, int(t), t, 85.0)
        shown = state.evaluate(t)
    return shown, [e for e in state.timeline if e.label == STRAG]


@pytest.mark.parametrize(("held", "episodes_of_rank_2"), [
    (dx.CAUSE_CONFIRM_TICKS, 2),  # its cores took over and stayed: a second episode
    (dx.CAUSE_CONFIRM_TICKS - 1, 1),  # not quite long enough: one
])
def test_a_rank_slowed_by_another_cause_is_a_new_episode(held, episodes_of_rank_2):
    """Seen beside a CPU hog: a rank's injected straggle and then its starved cores were
    filed as one COMPUTE STRAGGLER episode with the first one's words. The banner's words
    follow the evidence at once; the timeline opens a new episode, with the cores'
    advice, once the new cause has held CAUSE_CONFIRM_TICKS evaluations."""
    shown, filed = _cause_run(held)
    assert shown.label == STRAG and shown.rank == 2
    assert len(filed) == episodes_of_rank_2, [(e.start_step, e.summary[-60:]) for e in filed]
    assert "for a CPU core" not in filed[0].summary
    if episodes_of_rank_2 == 2:
        assert "for a CPU core" in filed[1].summary and filed[0].end is not None
        assert filed[1].rank == 2 and filed[1].end is None


def _shown(cause: str | None, rank: int = 2, label: str = STRAG) -> dx.Diagnosis:
    return dx.Diagnosis(label, rank, "backward", dx.WARNING, "", cause=cause)


C, N = dx.CORES, None
K = dx.CAUSE_CONFIRM_TICKS


@pytest.mark.parametrize(("causes", "changed_at"), [
    ([C] * K, K - 1),  # held K evaluations: changed on the K-th
    ([C] * (K - 1), None),
    ([C, N] * K, None),  # the CPU wait's noise around its threshold: never
    ([C] * (K - 1) + [N] + [C] * (K - 1), None),  # a break starts the count again
    ([N] * (2 * K), None),  # the same cause as the episode's
])
def test_a_new_cause_must_hold_before_it_is_an_episode(causes, changed_at):
    from traceml_tui.judge.timeline import Timeline

    timeline = Timeline(0.0, 64)
    timeline.episode_dx = _shown(None)  # the open episode: rank 2, its own work
    got = [timeline.cause_changed(_shown(c)) for c in causes]
    assert (got.index(True) if True in got else None) == changed_at


def test_another_culprit_is_not_a_change_of_cause():
    """A new rank or label is a new subject (settle's CONFIRM_TICKS), not counted here."""
    from traceml_tui.judge.timeline import Timeline

    timeline = Timeline(0.0, 64)
    timeline.episode_dx = _shown(None)
    assert not any(timeline.cause_changed(_shown(C, rank=3)) for _ in range(2 * K))
