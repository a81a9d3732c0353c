"""The hang rules (traceml_tui/judge/hang.py): pure, table-driven."""

from __future__ import annotations

import pytest

from traceml_tui.judge import hang
from traceml_tui.judge.hang import (
    BEHIND,
    DEAD,
    DIVERGED,
    SAME_COLLECTIVE,
    RankProgress,
    detect,
    threshold,
)


def rank(r: int, steps: int = 30, coll: int = 0, phase: str | None = "sync",
         since: float = 60.0, silent: float = 0.5, finished: bool = False,
         in_coll: str | None = None, groups: dict[str, int] | None = None,
         in_group: str | None = None) -> RankProgress:
    return RankProgress(r, f"host{r}", steps, coll, phase, in_coll, since, silent, finished,
                        False, tuple(sorted((groups or {}).items())), in_group)


def extra(r: int) -> RankProgress:
    """A rank inside an all_reduce on group "1" that the others never call."""
    return rank(r, coll=31, phase="backward", in_coll="all_reduce",
                groups={"world": 30, "1": 1}, in_group="1")


def usual(r: int) -> RankProgress:
    """A rank in DDP's backward (its allreduces are not explicit collectives)."""
    return rank(r, coll=30, phase="backward", groups={"world": 30})


CASES = [
    # name, ranks, expected kind, expected culprits
    ("one rank fewer steps", [rank(0), rank(1, steps=29), rank(2)], BEHIND, (1,)),
    # Collective sequences: the minority whose sequence differs is named, whether it
    # entered fewer collectives (skipped one) or more (a conditional collective).
    ("one rank entered fewer collectives",
     [rank(0, coll=5, in_coll="all_reduce"), rank(1, coll=4, phase="backward"),
      rank(2, coll=5, in_coll="all_reduce")], DIVERGED, (1,)),
    ("one rank entered an extra collective", [usual(0), usual(1), extra(2), usual(3)],
     DIVERGED, (2,)),
    ("an extra collective in a big job", [usual(r) for r in range(63)] + [extra(63)],
     DIVERGED, (63,)),
    ("two ranks on the other path", [usual(0), extra(1), usual(2), extra(3), usual(4)],
     DIVERGED, (1, 3)),
    ("one rank still before forward", [rank(0), rank(1, phase=None), rank(2)], BEHIND, (1,)),
    ("two ranks behind", [rank(0), rank(1, phase="forward"), rank(2, steps=28)], BEHIND,
     (1, 2)),
    ("all at the same point", [rank(0), rank(1), rank(2)], SAME_COLLECTIVE, ()),
    ("a silent rank is dead, not behind", [rank(0), rank(1, silent=30.0, phase=None), rank(2)],
     DEAD, (1,)),
    ("finished ranks are not waited for",
     [rank(0), rank(1, steps=10, finished=True), rank(2)], SAME_COLLECTIVE, ()),
]


@pytest.mark.parametrize(("name", "ranks", "kind", "culprits"), CASES, ids=[c[0] for c in CASES])
def test_hang_kinds(name, ranks, kind, culprits):
    report = detect(ranks, median_step_ms=50.0)
    assert report is not None
    assert report.kind == kind
    assert report.culprits == culprits
    assert report.diagnosis.label == "HANG" and report.diagnosis.severity == "critical"
    assert report.diagnosis.rank == (culprits[0] if culprits else None)


@pytest.mark.parametrize(("ranks", "why"), [
    ([rank(0, since=hang.HANG_FLOOR_S - 1), rank(1, since=hang.HANG_FLOOR_S - 1)],
     "below the floor: a checkpoint, not a hang"),
    ([rank(0, since=60.0), rank(1, since=0.1)], "one rank still steps"),
    ([rank(0, steps=0), rank(1, steps=0)], "nothing stepped yet (model loading)"),
    ([rank(0, finished=True), rank(1, finished=True)], "every rank finished"),
    ([], "no ranks"),
])
def test_no_hang(ranks, why):
    assert detect(ranks, median_step_ms=50.0) is None, why


def test_threshold_floor_steps_and_override():
    assert threshold(50.0) == hang.HANG_FLOOR_S  # 20 x 50 ms = 1 s: the floor wins
    assert threshold(2000.0) == hang.HANG_STEPS * 2.0  # slow steps: 40 s
    assert threshold(None) == hang.HANG_FLOOR_S
    assert threshold(50.0, override_s=4.0) == 4.0


def test_silence_counts_toward_the_stall():
    """A rank whose last heartbeat said 6 s and that has been silent 6 s more: 12 s."""
    ranks = [rank(0, since=6.0, silent=6.0), rank(1, since=6.0, silent=6.0)]
    report = detect(ranks, median_step_ms=50.0)
    assert report is not None and report.stalled_s == pytest.approx(12.0)


def test_the_sentence_names_where_the_culprit_and_a_leader_are():
    report = detect([rank(0, phase="backward"), rank(1, phase="forward"),
                     rank(2, phase="backward")], median_step_ms=50.0)
    assert report.kind == BEHIND
    text = report.diagnosis.summary
    assert "rank 1" in text and "in forward" in text and "in backward" in text


def test_the_rank_that_took_the_other_code_path_is_named_with_the_collective():
    report = detect([usual(0), usual(1), extra(2), usual(3)], median_step_ms=50.0)
    text = report.diagnosis.summary
    assert "rank 2 (host host2) entered all_reduce #1 on group 1" in text, text
    assert "ranks 0, 1, 3 never entered" in text and "conditional collective" in text


def test_a_skipped_collective_says_who_waits_in_which():
    ranks = [rank(r, coll=6, in_coll="barrier", groups={"world": 6}, in_group="world")
             for r in (0, 1, 3)] + [rank(2, coll=5, phase="forward", groups={"world": 5})]
    report = detect(ranks, median_step_ms=50.0)
    assert (report.kind, report.culprits) == (DIVERGED, (2,))
    text = report.diagnosis.summary
    assert "ranks 0, 1, 3 wait in barrier #6 on group world" in text, text
    assert "rank 2 (host host2) never entered" in text and "in forward" in text


@pytest.mark.parametrize("ranks", [
    [usual(0), extra(1)],
    [usual(0), extra(1), usual(2), extra(3)],
], ids=["two ranks", "two against two"])
def test_a_tie_is_said_as_a_tie(ranks):
    report = detect(ranks, median_step_ms=50.0)
    assert report.kind == DIVERGED and report.diagnosis.rank is None
    assert report.culprits == (0, 1)  # one of each side, for their stacks
    assert "a tie" in report.diagnosis.summary


# --- progress the steps cannot show: CUDA graph replays, batches, a trace stopping ----------

def frozen(r: int, since: float = 60.0, replays: float | None = None,
           batches: float | None = None, busy: str | None = None, busy_s: float = 0.0,
           **kw) -> RankProgress:
    """A rank whose steps stopped `since` s ago; its replays and batches last rose
    `replays` and `batches` s ago (None: never), its agent busy with `busy` for `busy_s`."""
    from dataclasses import replace

    return replace(rank(r, since=since, **kw), replays_idle_s=replays, batches_idle_s=batches,
                   busy=busy, busy_s=busy_s)


HIDDEN_CASES = [
    # (what, rank, median step ms, expected reason or None)
    ("replaying a whole-step graph: its replays rose a second ago",
     frozen(0, replays=1.0), 50.0, hang.REPLAYS),
    ("fetching batches on a background thread while its steps are frozen",
     frozen(0, batches=0.5), 50.0, hang.BATCHES),
    ("replays take precedence over batches", frozen(0, replays=1.0, batches=1.0), 50.0,
     hang.REPLAYS),
    ("stopping a deep trace", frozen(0, busy="deep trace stopping", busy_s=30.0), 50.0,
     "agent busy: deep trace stopping"),
    ("busy for minutes is stuck too", frozen(0, busy="deep trace stopping",
                                             busy_s=hang.BUSY_MAX_S + 1), 50.0, None),
    ("replays that stopped rising longer ago than the threshold",
     frozen(0, since=120.0, replays=hang.HANG_FLOOR_S + 5), 50.0, None),
    ("replays last rose before its last step: the steps stopped, nothing else moves",
     frozen(0, since=20.0, replays=25.0), 50.0, None),
    ("never replayed, never fetched", frozen(0), 50.0, None),
    ("steps still come (replays rise beside them)", frozen(0, since=0.2, replays=0.1), 50.0,
     None),
    ("a slow step is not yet frozen: 5 of its 2 s steps", frozen(0, since=8.0, replays=0.5),
     2000.0, None),
    ("frozen past 5 slow steps, replays rising", frozen(0, since=12.0, replays=0.5), 2000.0,
     hang.REPLAYS),
    ("a finished rank hides nothing", frozen(0, replays=1.0, finished=True), 50.0, None),
]


@pytest.mark.parametrize("what, p, med, expected", HIDDEN_CASES,
                         ids=[c[0] for c in HIDDEN_CASES])
def test_which_frozen_step_counts_hide_progress(what, p, med, expected):
    assert hang.hidden(p, med, threshold(med)) == expected


NO_HANG_WHILE_HIDDEN = [
    # (what, ranks, expected kind or None, culprits)
    ("every rank replays a whole-step CUDA graph",
     [frozen(r, replays=1.0) for r in range(4)], None, ()),
    ("one rank stops a deep trace while the others wait for it in a collective",
     [frozen(0, busy="deep trace stopping", busy_s=40.0)] + [frozen(r) for r in (1, 2)],
     None, ()),
    ("replays that stopped rising: judged again, all at one point",
     [frozen(r, replays=hang.HANG_FLOOR_S + 1, since=hang.HANG_FLOOR_S + 30)
      for r in range(2)], SAME_COLLECTIVE, ()),
    ("a rank's replays are the job's progress: the others' frozen steps may wait for it",
     [frozen(0, replays=1.0), rank(1), rank(2, steps=29)], None, ()),
    ("batches fetched on one rank only, the others frozen", [frozen(0, batches=2.0), rank(1)],
     None, ()),
]


@pytest.mark.parametrize("what, ranks, kind, culprits", NO_HANG_WHILE_HIDDEN,
                         ids=[c[0] for c in NO_HANG_WHILE_HIDDEN])
def test_hang_detection_is_suspended_for_ranks_with_hidden_progress(what, ranks, kind,
                                                                     culprits):
    report = detect(ranks, median_step_ms=50.0)
    if kind is None:
        assert report is None
    else:
        assert report is not None and (report.kind, report.culprits) == (kind, culprits)


def test_hang_py_reads_no_clock():
    """hidden() is a rule over the numbers the state passes in: the module imports no
    clock (time, datetime, monotonic) to decide it."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(hang))
    names = {a.name for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
             for a in node.names}
    modules = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not ({"time", "datetime", "monotonic"} & (names | modules))


# --- the same rule in the collector: state, view and summary say why -----------------------

# One step's phases (ms) by name; a phase added to the table is sent as not measured.
_STEP_MS = {"dataloader": 5.0, "h2d": 1.0, "forward": 15.0, "backward": 20.0, "sync": 2.0,
            "optimizer": 5.0, "wait": 2.0}


def _record(step: int, t: float) -> list:
    from traceml_agent.protocol import PHASES

    return [step, t, 50.0, *(_STEP_MS.get(p) for p in PHASES)]


def _state_with_steps(world: int = 2):
    from traceml_agent.protocol import PHASES, Identity, decode, encode
    from traceml_tui.judge.state import RunState

    state = RunState("graphs", world_size=world, started_at=1_700_000_000.0)
    idents = [Identity(r, r, 0, f"host{r}", 100 + r, world) for r in range(world)]
    for i in idents:
        records = [_record(s, 1_700_000_000.0 + s) for s in range(20)]
        state.ingest(decode(encode("steps", i, 0, 1_700_000_000.0, phases=list(PHASES),
                                   records=records)), now=1.0)
    return state, idents


def _beat(state, ident, now: float, since: float, **fields) -> None:
    from traceml_agent.protocol import decode, encode

    state.ingest(decode(encode("heartbeat", ident, 1, 1_700_000_000.0 + now, step=20,
                               since_step_s=since, phase=None, **fields)), now=now)


def test_a_job_replaying_cuda_graphs_is_not_a_hang_and_says_why():
    """After a whole-step capture no step closes, but the replays keep rising: no HANG for
    a minute; the view marks the ranks "hidden" and says why, and so does the summary.
    Once the replays stop rising too, the threshold runs out and HANG is declared."""
    from traceml_tui.collect import view_build
    from traceml_tui.report import summary
    from traceml_tui.runfolder import summary_model as model
    from traceml_tui.viewmodel import HIDDEN

    state, idents = _state_with_steps()
    for t in range(2, 62):
        for i in idents:
            _beat(state, i, float(t), since=t - 1.0, replays=100 * t, batches=20,
                  capture_skips=3, device_rule="parameters' device")
        assert state.evaluate(1_700_000_000.0 + t, mono_now=t + 0.5).label != "HANG", t
    snap = state.snapshot(1_700_000_062.0, 62.0, full=True)
    assert [r.steps_hidden for r in snap.ranks] == [hang.REPLAYS] * 2
    view = view_build.build(snap, state.recent_steps)
    assert {row.status for row in view.rows} == {HIDDEN}
    notes = view_build.detail(snap, 1, view, ()).notes
    assert "steps not visible: CUDA graph replays: hang detection suspended" in notes[0]
    assert "timing device: parameters' device" in notes
    assert any("6100 CUDA graph replays" in n and "3 phases not timed in a capture" in n
               for n in notes), notes
    doc = model.to_doc(summary.build(snap, summary.RunMeta()))
    assert doc["hang"] is None
    assert [(r["steps_hidden"], r["replays"], r["capture_skips"]) for r in doc["ranks"]] == [
        (hang.REPLAYS, 6100, 3)] * 2
    text = summary.render_text(doc)
    assert ("Rank(s) 0-1: steps not visible: CUDA graph replays (hang detection "
            "suspended).") in text, text
    # The replays stop rising: judged again, and after the threshold it is a hang.
    for t in range(62, 62 + int(hang.HANG_FLOOR_S) + 3):
        for i in idents:
            _beat(state, i, float(t), since=t - 1.0, replays=6100, batches=20)
        state.evaluate(1_700_000_000.0 + t, mono_now=t + 0.5)
    assert state.live.shown.label == "HANG"
    assert all(r.steps_hidden is None for r in state.snapshot(1_700_000_080.0, 80.0).ranks)


def test_a_deep_trace_stopping_on_one_rank_is_no_hang_for_the_others():
    """Rank 0's profiler takes 40 s to stop; rank 1 waits for it in its next collective."""
    state, idents = _state_with_steps()
    for t in range(2, 45):
        _beat(state, idents[0], float(t), since=t - 1.0, agent_busy="deep trace stopping")
        _beat(state, idents[1], float(t), since=t - 1.0, in_collective="all_reduce")
        assert state.evaluate(1_700_000_000.0 + t, mono_now=t + 0.5).label != "HANG", t
    snap = state.snapshot(1_700_000_045.0, 45.0)
    assert snap.ranks[0].steps_hidden == "agent busy: deep trace stopping"
    assert snap.ranks[1].steps_hidden is None


def test_records_the_collector_refused_are_counted_per_rank_and_shown():
    """One negative phase in a batch of ten: nine steps recorded, one counted as refused,
    in the ingest counters, the rank's row of the summary and its text."""
    from traceml_agent.protocol import PHASES, decode, encode
    from traceml_tui.report import summary
    from traceml_tui.runfolder import summary_model as model

    state, idents = _state_with_steps()
    records = [_record(s, 1_700_000_100.0 + s) for s in range(20, 30)]
    records[3][3 + PHASES.index("backward")] = -0.4  # a cross-stream pair of an older agent
    state.ingest(decode(encode("steps", idents[1], 2, 1_700_000_100.0, phases=list(PHASES),
                               records=records)), now=3.0)
    assert state.ranks[1].steps == 29 and state.counters["bad_records"] == 1
    doc = model.to_doc(summary.build(state.snapshot(1_700_000_130.0, 4.0, full=True),
                                     summary.RunMeta()))
    assert doc["collector"]["bad_records"] == 1
    assert [r["bad_records"] for r in doc["ranks"]] == [0, 1]
    assert "refused 1 malformed step record(s) of rank(s) 1" in summary.render_text(doc)


def test_a_hang_that_clears_leaves_the_label_at_once():
    """A step taken ends the hang: the next evaluation shows the window's label, not a
    HANG kept for the confirming evaluations with no hang behind it (the snapshot's and
    the summary's hang section null while the banner said HANG)."""
    from traceml_agent.protocol import PHASES, decode, encode

    state, idents = _state_with_steps()
    t = 2
    while state.evaluate(1_700_000_000.0 + t, mono_now=t + 0.5).label != "HANG":
        for i in idents:
            _beat(state, i, float(t), since=t - 1.0)
        t += 1
        assert t < 120, "no HANG declared"
    for i in idents:  # every rank steps again
        records = [_record(s, 1_700_000_000.0 + t) for s in range(20, 30)]
        state.ingest(decode(encode("steps", i, 2, 1_700_000_000.0 + t, phases=list(PHASES),
                                   records=records)), now=float(t))
    shown = state.evaluate(1_700_000_000.0 + t, mono_now=t + 0.5)
    snap = state.snapshot(1_700_000_000.0 + t, t + 0.5)
    assert shown.label != "HANG" and snap.live.label != "HANG"
    assert snap.hang is None
