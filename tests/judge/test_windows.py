"""Bounded windows: quantiles, phase alignment, the memory budget that sizes each rank's
window, and the vectorised block checked against the pure-Python rings it replaced
(tests/support/window_reference.py) on random traffic."""

from __future__ import annotations

import ast
import math
from collections import deque
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import window_reference as ref
from traceml_tui.judge.windows import (
    MAX_WINDOW_STEPS,
    MIN_WINDOW_STEPS,
    STANDARD_SERIES,
    WINDOW_VALUE_BUDGET,
    Quantiles,
    RankWindow,
    WindowBlock,
    median,
    nan_medians,
    quantiles,
    window_steps_for,
)
from window_reference import Ring

NAN = math.nan


def same(a: list[float], b: list[float]) -> bool:
    """Element-wise equality where NaN equals NaN."""
    if len(a) != len(b):
        return False
    return all(x == y or (x != x and y != y) for x, y in zip(a, b, strict=True))


# --- Ring ----------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8])
def test_ring_last_matches_a_reference_deque(size):
    ring, ref = Ring(size), deque(maxlen=size)
    for i in range(4 * size + 1):
        for n in range(size + 2):
            expected = list(ref)[-n:] if n else []
            assert ring.last(n) == expected, (size, i, n)
        ring.append(float(i))
        ref.append(float(i))
        assert ring.count == len(ref)


def test_ring_wraps_and_returns_oldest_first_across_the_boundary():
    ring = Ring(4)
    for v in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0):
        ring.append(v)
    assert ring.pos == 2  # the next write lands in the middle: 5 and 6 sit at the front
    assert ring.last(4) == [3.0, 4.0, 5.0, 6.0]
    assert ring.last(3) == [4.0, 5.0, 6.0]  # crosses the end of the array
    assert ring.last(2) == [5.0, 6.0]
    assert ring.last(100) == [3.0, 4.0, 5.0, 6.0]
    assert ring.last(0) == [] and ring.last(-3) == []


def test_ring_keeps_nan():
    ring = Ring(3)
    for v in (1.0, NAN, 3.0):
        ring.append(v)
    assert same(ring.last(3), [1.0, NAN, 3.0])


@pytest.mark.parametrize("size", [1, 7, 64])
def test_ring_memory_is_bounded(size):
    ring = Ring(size)
    for i in range(10 * size):
        ring.append(float(i))
    assert ring.count == size
    assert len(ring.data) == size
    assert ring.last(size) == [float(i) for i in range(9 * size, 10 * size)]


# --- quantiles -----------------------------------------------------------------------------

QUANTILE_CASES = [
    ("single", [7.0], 7.0, 7.0),
    ("odd", [3.0, 1.0, 2.0], 2.0, 3.0),
    ("even", [4.0, 1.0, 3.0, 2.0], 2.5, 4.0),
    ("ten", [float(i) for i in range(1, 11)], 5.5, 10.0),  # ceil(9.5) = 10th value
    ("twenty", [float(i) for i in range(20, 0, -1)], 10.5, 19.0),  # ceil(19) = 19th value
    ("hundred", [float(i) for i in range(1, 101)], 50.5, 95.0),
    ("nan-ignored", [NAN, 1.0, NAN, 3.0], 2.0, 3.0),
    ("outlier", [10.0] * 19 + [1000.0], 10.0, 10.0),
    ("outlier-top-5pct", [10.0] * 18 + [1000.0] * 2, 10.0, 1000.0),
]


@pytest.mark.parametrize("values, med, p95", [c[1:] for c in QUANTILE_CASES],
                         ids=[c[0] for c in QUANTILE_CASES])
def test_quantiles(values, med, p95):
    assert quantiles(values) == Quantiles(med, p95)
    assert median(values) == med


@pytest.mark.parametrize("n", [1, 2, 19, 20, 21, 39, 40, 41, 99, 100, 101, 1000, 1001])
def test_p95_is_nearest_rank(n):
    values = [float(i) for i in range(1, n + 1)]  # value i has rank i
    assert quantiles(values).p95 == -(-95 * n // 100)  # ceil(0.95 n) in exact integers


@pytest.mark.parametrize("values", [[], [NAN], [NAN, NAN]], ids=["empty", "nan", "all-nan"])
def test_quantiles_of_nothing_is_none(values):
    assert quantiles(values) is None
    assert median(values) is None


def test_quantiles_to_json_rounds():
    assert Quantiles(1.234567, 2.0).to_json() == {"median": 1.2346, "p95": 2.0}


def test_quantiles_ignore_infinities():
    assert quantiles([math.inf]) is None
    assert quantiles([1.0, 3.0, math.inf, -math.inf]) == Quantiles(2.0, 3.0)


# --- RankWindow (one rank of a WindowBlock) ---------------------------------------------


def window(size: int) -> RankWindow:
    return WindowBlock(1, size).view(0)


def test_phase_appearing_late_has_nan_history():
    win = window(8)
    for _ in range(3):
        win.append(100.0, ["forward"], [60.0])
    win.append(110.0, ["forward", "dataloader"], [60.0, 10.0])
    assert same(win.last("dataloader", 4), [NAN, NAN, NAN, 10.0])
    assert win.last("forward", 4) == [60.0] * 4
    assert win.last(None, 4) == [100.0, 100.0, 100.0, 110.0]


def test_phase_appearing_late_in_a_full_window_stays_aligned():
    win = window(4)
    for i in range(6):
        win.append(float(i), ["forward"], [1.0])
    win.append(6.0, ["forward", "optimizer"], [1.0, 2.0])
    assert same(win.last("optimizer", 4), [NAN, NAN, NAN, 2.0])
    assert win.last(None, 4) == [3.0, 4.0, 5.0, 6.0]


def test_a_phase_new_to_the_run_has_nan_history_on_every_rank():
    block = WindowBlock(3, 4)
    for rank in range(3):
        for _ in range(5):
            block.append(rank, 10.0, ["forward"], [5.0])
    block.append(1, 12.0, ["forward", "optimizer"], [5.0, 1.0])
    assert same(block.last(0, "optimizer", 4), [NAN] * 4)  # rank 0 never sent it
    assert same(block.last(1, "optimizer", 4), [NAN, NAN, NAN, 1.0])
    assert block.view(0).stats()[1] == {"forward": Quantiles(5.0, 5.0)}


def test_phase_absent_on_some_steps_is_nan_there():
    win = window(8)
    win.append(100.0, ["forward", "sync"], [60.0, 8.0])
    win.append(100.0, ["forward"], [60.0])  # sync not sent at all
    win.append(100.0, ["forward", "sync"], [60.0, None])  # sent, not measured
    assert same(win.last("sync", 3), [8.0, NAN, NAN])


def test_a_restarted_rank_starts_an_empty_window():
    block = WindowBlock(2, 4)
    for _ in range(3):
        block.append(1, 10.0, ["forward"], [5.0])
    block.reset(1)
    assert block.view(1).count == 0 and block.view(1).stats() == (None, {})
    block.append(1, 20.0, ["sync"], [3.0])
    assert block.view(1).stats() == (Quantiles(20.0, 20.0), {"sync": Quantiles(3.0, 3.0)})


def test_stats_count_absent_steps_as_zero_once_a_phase_was_seen():
    win = window(8)
    win.append(100.0, ["forward", "sync"], [60.0, 8.0])
    win.append(110.0, ["forward"], [70.0])
    win.append(120.0, ["forward", "sync", "h2d"], [80.0, None, None])
    step, phases = win.stats()
    assert step == Quantiles(110.0, 120.0)
    assert phases["forward"] == Quantiles(70.0, 80.0)
    assert phases["sync"] == Quantiles(0.0, 8.0)  # [8, 0, 0]
    assert phases["h2d"] is None  # reported but never measured: not a made-up 0
    assert win.seen(["forward", "sync", "h2d", "optimizer"]) == {
        "forward": 3, "sync": 1, "h2d": 0, "optimizer": 0}


def test_stats_over_the_newest_steps_only():
    win = window(16)
    win.append(500.0, ["forward", "sync"], [400.0, 9.0])
    for _ in range(1, 5):
        win.append(100.0, ["forward"], [60.0])
    step, phases = win.stats(last=4)
    assert step == Quantiles(100.0, 100.0)
    assert phases["forward"] == Quantiles(60.0, 60.0)
    assert phases["sync"] is None  # seen, but not within the last 4 steps
    assert win.stats()[1]["sync"] == Quantiles(0.0, 9.0)
    assert win.stats(last=100)[0] == win.stats()[0]


def test_empty_window_stats():
    assert window(4).stats() == (None, {})


@pytest.mark.parametrize("size", [MIN_WINDOW_STEPS, 100, MAX_WINDOW_STEPS])
def test_window_memory_is_bounded(size):
    block = WindowBlock(2, size)
    win = block.view(1)
    names = ["dataloader", "forward", "backward"]
    for i in range(10 * size):
        win.append(float(i), names, [1.0, None, float(i)])
    assert win.count == size
    assert [a.shape for a in block.series] == [(2, size)] * 4  # step + 3 phases, fixed
    assert win.stats()[1]["backward"].median == 9.5 * size - 0.5


# --- the block against the reference rings -------------------------------------------------

NAMES = ["dataloader", "forward", "backward", "sync", "custom"]
value = st.one_of(st.none(), st.floats(0.0, 1e6, allow_nan=False, allow_infinity=False),
                  st.sampled_from([0.0, 1.0, 2.5]))
record = st.tuples(
    st.integers(0, 2),  # rank
    st.floats(0.001, 1e6, allow_nan=False, allow_infinity=False),  # step time
    st.lists(st.tuples(st.sampled_from(NAMES), value), max_size=5,
             unique_by=lambda nv: nv[0]))


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 9), st.lists(record, max_size=60),
       st.one_of(st.none(), st.integers(0, 12)))
def test_the_block_computes_what_the_per_rank_rings_computed(size, records, last):
    """Any traffic: every rank's quantiles and seen-counts from the vectorised block equal
    the pure-Python rings' (the code the block replaced), bit for bit."""
    block = WindowBlock(3, size)
    rings = {r: ref.RankWindow(size) for r in range(3)}
    for rank, step_ms, phases in records:
        names, values = [n for n, _ in phases], [v for _, v in phases]
        block.append(rank, step_ms, names, values)
        rings[rank].append(step_ms, 0.0, names, values)
    for rank in range(3):
        assert block.view(rank).stats(last) == rings[rank].stats(last), rank
        assert block.view(rank).seen(NAMES, last) == rings[rank].seen(NAMES, last)
    # All ranks at once, each with its own `last`, give the same as one at a time.
    lasts = [3, size, 1]
    together = block.stats([2, 0, 1], [lasts[2], lasts[0], lasts[1]]).rows()
    for row, rank in enumerate([2, 0, 1]):
        step, phases = rings[rank].stats(lasts[rank])
        assert together[row][0] == step
        assert {k: v for k, v in together[row][1].items() if v is not None} == {
            k: v for k, v in phases.items() if v is not None}


# --- window_steps_for ----------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 8, 64, 256, 512])
def test_small_worlds_keep_the_full_window(world):
    assert window_steps_for(world) == MAX_WINDOW_STEPS


@pytest.mark.parametrize("world", [8192, 16384, 1 << 20])
def test_huge_worlds_keep_at_least_the_minimum(world):
    steps = window_steps_for(world)
    assert MIN_WINDOW_STEPS <= steps < MAX_WINDOW_STEPS


def test_8192_ranks_fit_the_budget():
    steps = window_steps_for(8192)
    assert steps >= 32
    assert 8192 * STANDARD_SERIES * steps <= WINDOW_VALUE_BUDGET


def test_window_shrinks_monotonically_with_world_size():
    worlds = list(range(1, 5000)) + list(range(5000, 1 << 20, 997))
    sizes = [window_steps_for(w) for w in worlds]
    assert all(a >= b for a, b in zip(sizes, sizes[1:], strict=False))
    assert sizes[0] == MAX_WINDOW_STEPS and sizes[-1] == MIN_WINDOW_STEPS
    assert len(set(sizes)) > 10  # it really shrinks, not just jumps from max to min


@pytest.mark.parametrize("values, empty, expected", [
    ([3.0, 1.0, 2.0], None, 2.0),
    ([4.0, 1.0, 3.0, 2.0], None, 2.5),
    ([1.0, NAN, math.inf, 3.0], None, 2.0),  # only finite values count
    ([], None, None),
    ([NAN], 0.0, 0.0),
    ((x for x in (5, 7)), None, 6.0),  # any iterable, ints too
])
def test_median_of_the_finite_values(values, empty, expected):
    assert median(values, empty=empty) == expected


def test_nan_medians_per_column_match_median():
    data = np.array([[1.0, NAN, 5.0, NAN], [3.0, 2.0, NAN, NAN], [2.0, 4.0, 1.0, NAN]])
    got = nan_medians(data)
    for col in range(3):
        assert got[col] == median(data[:, col].tolist())
    assert math.isnan(got[3])
    assert nan_medians(data[:, :1]).tolist() == [2.0]  # no NaN: numpy's own median


def test_one_median_for_the_collector():
    """The median is windows.median (and nan_medians over arrays): no module of the
    collector or the agent imports statistics, calls numpy's nan-median or writes its own."""
    root = Path(__file__).resolve().parents[2]
    found = []
    for path in sorted([*(root / "traceml_tui").rglob("*.py"), *(root / "agent").rglob("*.py")]):
        own = path == root / "traceml_tui" / "judge" / "windows.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            where = f"{path.relative_to(root)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.ImportFrom | ast.Import) and any(
                    "statistics" in (a.name, getattr(node, "module", None))
                    for a in node.names):
                found.append(f"{where}: statistics")
            elif isinstance(node, ast.Attribute) and node.attr == "nanmedian":
                found.append(f"{where}: nanmedian")
            elif (isinstance(node, ast.FunctionDef) and node.name.strip("_") == "median"
                  and not own):
                found.append(f"{where}: def {node.name}")
    assert not found
