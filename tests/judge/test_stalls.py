"""The stall log (judge/stalls.py): every rank's stalls over the whole run, whatever the
window, bounded per rank; periods of 10 to 10,000 steps; 16,384 ranks; and the collector's
state fed real wire messages finding a checkpoint its 32-step windows cannot hold."""

from __future__ import annotations

import time

import numpy as np
import pytest
from test_state import BALANCED_MS, steps

from traceml_tui.judge import diagnosis as dx
from traceml_tui.judge import stalls as sl
from traceml_tui.judge.state import RunState
from traceml_tui.runfolder import summary_model as model

STEP = 10.0  # ms, the typical step of every simulated rank


def stall_steps(period: int, count: int, start: int = 50, jitter: int = 0,
                skip: tuple[int, ...] = ()) -> list[int]:
    """Steps of a stall every `period` (a stall may land `jitter` steps late; the ones at
    the indices in `skip` stayed under the threshold and were not seen)."""
    rng = np.random.default_rng(0)
    late = rng.integers(0, jitter + 1, count) if jitter else np.zeros(count, int)
    return [start + i * period + int(late[i]) for i in range(count) if i not in skip]


# (what, stall steps, expected period)
PERIOD_CASES = [
    ("every 10 steps", stall_steps(10, 20), 10),
    ("every 200 steps, four of them", stall_steps(200, 4), 200),
    ("every 10,000 steps", stall_steps(10_000, 6), 10_000),
    ("every 500 steps, landing up to 20 steps late", stall_steps(500, 30, jitter=20), 510),
    ("every 30 steps, one stall missed", stall_steps(30, 12, skip=(5,)), 30),
    ("every 30 steps, one stray hiccup", sorted([*stall_steps(30, 12), 101]), 30),
    ("two stalls are no rhythm", stall_steps(100, 2), None),
    ("consecutive slow steps are a stretch, not a rhythm", list(range(100, 120)), None),
    ("irregular hiccups", [3, 17, 21, 70, 71, 190, 260, 301, 650], None),
]


@pytest.mark.parametrize("what, at, expected", PERIOD_CASES, ids=[c[0] for c in PERIOD_CASES])
def test_period(what, at, expected):
    got = sl.period(at)
    if expected is None or got is None:
        assert got == expected
    else:  # late stalls move the median gap by a step or two
        assert abs(got - expected) <= 0.05 * expected, got


def test_the_log_keeps_the_newest_stalls_and_counts_every_one():
    book = sl.StallBook()
    at = stall_steps(20, 1000)
    for s in at:
        book.add(0, s, 250.0, "wait")
    log = book.logs[0]
    kept, excess, _ = log.ordered()
    assert log.kept == sl.STALL_LOG_KEEP and list(kept) == at[-sl.STALL_LOG_KEEP:]
    assert log.count == 1000 and log.lost_ms == pytest.approx(250_000.0)
    assert log.nbytes == 13 * sl.STALL_LOG_KEEP  # int64 step, float32 excess, uint8 phase
    f = book.finding(0, STEP, at[-1] + 5)
    assert f is not None
    assert (f.period, f.count, f.phase, f.recent) == (20, 1000, "wait", True)
    assert f.lost_ms == pytest.approx(250_000.0) and f.mean_ms == pytest.approx(250.0)


def test_hiccups_between_a_checkpoints_stalls_do_not_hide_its_period():
    """The e2e job on a busy box: rank 0's 240 ms checkpoint every 20 steps, and 30 ms
    scheduler hiccups of its own in between (they broke the rhythm of the whole set)."""
    book = sl.StallBook()
    events = [(s, 240.0) for s in stall_steps(20, 9, start=20)]
    events += [(s, 30.0) for s in (33, 71, 72, 118, 154)]
    for s, ms in sorted(events):
        book.add(0, s, ms, "backward" if ms < 100 else "wait")
    assert sl.period(sorted(s for s, _ in events)) is None  # the whole set has no rhythm
    f = book.finding(0, STEP, 199)
    assert f is not None
    assert (f.period, f.periodic, f.periodic_count, f.count) == (20, 9, 9, 14)
    assert (f.phase, f.periodic_ms, f.recent) == ("wait", pytest.approx(240.0), True)
    assert f.lost_ms == pytest.approx(9 * 240.0 + 5 * 30.0)


def test_a_hiccup_that_fits_the_tolerance_does_not_set_a_wrong_period():
    """The e2e job: 1 s checkpoints at steps 201, 401, 601 and 801, and a 35 ms hiccup at
    541; the whole set's gaps (200, 140, 60, 200) pass the tolerance around 170."""
    book = sl.StallBook()
    for s, ms in [(201, 1000.0), (401, 1000.0), (541, 35.0), (601, 1000.0), (801, 1000.0)]:
        book.add(0, s, ms, "wait")
    assert sl.period([201, 401, 541, 601, 801]) == 170
    f = book.finding(0, STEP, 999)
    assert f is not None
    assert (f.period, f.periodic, f.periodic_ms) == (200, 4, pytest.approx(1000.0))


def _hiccups(n: int, low: float, high: float, last: int, seed: int = 3
             ) -> list[tuple[int, float]]:
    """`n` scheduler hiccups of `low`..`high` ms at random steps up to `last`."""
    rng = np.random.default_rng(seed)
    at = rng.choice(np.arange(1, last), n, replace=False)
    return [(int(a), float(ms)) for a, ms in zip(at, rng.uniform(low, high, n), strict=True)]


# (what, the rank's stalls, expected period, its stalls' mean excess). Fresh-clone run 24:
# on a starved host rank 0 had 40 backward hiccups of 5-150 ms beside its four 1 s
# checkpoints; no quantile of the sizes reached the checkpoints, and the run read BALANCED.
CKPT = [(s, 1000.0) for s in (200, 400, 600, 800)]
HICCUP_CASES = [
    ("four 1 s checkpoints among 40 hiccups", CKPT + _hiccups(40, 5.0, 150.0, 1000), 200,
     1000.0),
    ("among 200 hiccups", CKPT + _hiccups(200, 5.0, 150.0, 1000), 200, 1000.0),
    ("among 40 hiccups nearly as large: no break, no rhythm",
     CKPT + _hiccups(40, 550.0, 990.0, 1000), None, None),
    ("40 hiccups alone: no rhythm", _hiccups(40, 5.0, 150.0, 1000), None, None),
    ("two sizes of hiccup, neither periodic",
     _hiccups(20, 5.0, 20.0, 1000) + _hiccups(20, 300.0, 400.0, 1000, seed=4), None, None),
    ("two checkpoints only among the hiccups: too few for a rhythm",
     CKPT[:2] + _hiccups(40, 5.0, 150.0, 1000), None, None),
]


@pytest.mark.parametrize("what, events, every, mean_ms", HICCUP_CASES,
                         ids=[c[0] for c in HICCUP_CASES])
def test_a_checkpoint_is_found_however_many_smaller_hiccups_fall_between(what, events, every,
                                                                         mean_ms):
    book = sl.StallBook()
    for s, ms in sorted(events):
        book.add(0, s, ms, "backward" if (s, ms) not in CKPT else "wait")
    f = book.finding(0, STEP, 999)
    assert f is not None and f.period == every, f
    if every is not None:
        assert (f.phase, f.periodic, f.periodic_ms) == ("wait", 4, pytest.approx(mean_ms)), f


def test_a_victims_sync_stalls_are_counted_not_kept():
    book = sl.StallBook()
    for s in stall_steps(20, 50):
        book.add(3, s, 240.0, "sync")
    assert book.logs[3].count == 0 and book.logs[3].victim_count == 50
    assert book.nbytes() == 0 and book.stalling == set()
    assert book.finding(3, STEP, 2000) is None


def test_a_restarted_rank_starts_a_new_log():
    book = sl.StallBook()
    for s in stall_steps(20, 5):
        book.add(1, s, 100.0, "wait")
    book.forget(1)
    assert book.finding(1, STEP, 500) is None and book.stalling == set()


def test_16384_ranks_find_a_500_step_period_in_bounded_memory():
    """Rank 8,191 checkpoints every 500 steps of a 10,000-step run; every other rank
    waits for each checkpoint in sync, and a few hundred have irregular hiccups of their
    own. The windows at this scale are 32 steps: only the stall log can see it."""
    world, last = 16_384, 10_000
    at = stall_steps(500, 19, start=400)
    book = sl.StallBook()
    rng = np.random.default_rng(1)
    noisy = set(rng.choice(world, 300, replace=False).tolist()) - {8191}
    t0 = time.perf_counter()
    for s in at:
        for rank in range(world):
            if rank == 8191:
                book.add(rank, s, 1000.0, "wait")  # a 1 s checkpoint: 16 % of the time
            else:
                book.add(rank, s + 1, 990.0, "sync")
    for rank in noisy:  # scheduler hiccups: no rhythm
        for s in sorted(rng.choice(last, 5, replace=False).tolist()):
            book.add(rank, s, 30.0, "wait")
    fed = time.perf_counter() - t0
    t1 = time.perf_counter()
    found = [f for r in sorted(book.stalling) if (f := book.finding(r, STEP, last)) is not None]
    ranks = [dx.RankTiming(r, 32, STEP, {"forward": 3.0, "sync": 6.0, "wait": 1.0})
             for r in range(world)]
    d = dx.diagnose(ranks, stalls=found)
    judged = time.perf_counter() - t1
    assert (d.label, d.rank, d.period, d.phase) == (dx.PERIODIC_STALL, 8191, 500, "wait"), d
    assert "stalls every 500 steps (19 times in the run" in d.summary
    # Memory: one full-size array set per rank with own stalls (the stalling one and the
    # noisy ones), none for the 16,000 victims.
    assert book.nbytes() == (1 + len(noisy)) * 13 * sl.STALL_LOG_KEEP
    print(f"16,384 ranks: fed {len(at) * world:,} stalls in {fed:.2f} s, judged in "
          f"{judged * 1000:.0f} ms, log arrays {book.nbytes() / 1e6:.2f} MB")
    assert judged < 5.0


def feed(state: RunState, rank: int, first: int, last: int, stall_every: int,
         stall_ms: float, world: int, now: float) -> None:
    """Steps first..last-1 of one rank, with a stall in `wait` (rank 0's checkpoint) or
    in `sync` (the others' wait for it) on every `stall_every`-th step."""
    for s in range(first, last):
        ms = [v / 10 for v in BALANCED_MS]  # a 10 ms step
        if s % stall_every == 0 and s:
            ms[PHASE_INDEX["wait" if rank == 0 else "sync"]] += stall_ms
        state.ingest(steps(rank, [s], ms, world=world), now=now)


PHASE_INDEX = {"sync": 4, "wait": 6}


def test_the_state_finds_a_checkpoint_every_200_steps_through_32_step_windows():
    """The collector's state fed real wire messages: 4 ranks, 32-step windows, rank 0
    stalling 400 ms every 200 steps of 1,000. A window holds no stall most of the time
    and never three: before the stall log it read BALANCED (here: no stall rule fired)."""
    world = 4
    state = RunState("run", world_size=world, window_steps=32)
    for chunk in range(0, 1000, 50):
        for rank in range(world):
            feed(state, rank, chunk, chunk + 50, 200, 400.0, world, 1.0 + chunk / 10)
        state.evaluate(1.0 + chunk / 10)
    snap = state.snapshot(200.0, 200.0, full=True)
    d = snap.final
    assert d is not None
    assert (d.label, d.rank, d.phase, d.period) == (dx.PERIODIC_STALL, 0, "wait", 200), d
    assert [(f.rank, f.period, f.count) for f in snap.stalls] == [(0, 200, 4)]
    assert snap.stalls[0].lost_ms == pytest.approx(4 * 400.0, rel=0.01)
    assert snap.live.label == dx.PERIODIC_STALL


def test_the_summary_lists_the_ranks_that_lost_most_bounded():
    """final_summary.json's `stalls`: most time lost first, at most STALLS_LISTED ranks
    (every rank evaluating at 16,384 ranks says one thing); the text, the first few."""
    from traceml_tui.report.summary import STALLS_LISTED, TEXT_STALLS, stall_lines, stalls_json

    book = sl.StallBook()
    for rank in range(40):
        for s in stall_steps(20, 10, start=20):
            book.add(rank, s, 100.0 + rank, "wait")
    found = [f for r in sorted(book.stalling) if (f := book.finding(r, STEP, 200))]
    rows = stalls_json(found)
    assert len(rows) == STALLS_LISTED
    assert [r.rank for r in rows[:3]] == [39, 38, 37]
    assert model.plain(rows[0]) == {
        "rank": 39, "period": 20, "count": 10, "periodic_count": 10, "mean_excess_ms": 139.0,
        "phase": "wait", "lost_s": 1.39, "last_step": 200, "recurring": True}
    lines = stall_lines(rows)
    assert lines[0] == "  Stalls: rank 39 every 20 steps, 10 times, about 139 ms each in wait: " \
                       "1.4 s lost"
    assert len(lines) == TEXT_STALLS + 1 and "more stalling ranks" in lines[-1]
