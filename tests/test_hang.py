"""The hang rules (traceml_tui/hang.py): pure, table-driven."""

from __future__ import annotations

import pytest

from traceml_tui import hang
from traceml_tui.hang import (
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
