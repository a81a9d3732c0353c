"""The columnar judgement's array forms against the per-rank forms they replace: the same
numbers to the bit (medians, recent-step counts, stall thresholds, group sums), the table
built from rows and read back as rows, and the hang check's shortcut agreeing with the
full check whenever it answers."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from traceml_tui.judge import diagnosis as dx
from traceml_tui.judge import hang
from traceml_tui.judge.timings import Columns, Timings
from traceml_tui.judge.windows import WindowBlock, finite_median, median, nan_medians

RNG = random.Random(7)


def values(n: int, holes: bool) -> list[float]:
    out = [RNG.choice([RNG.uniform(0, 50), round(RNG.uniform(0, 5), 1)]) for _ in range(n)]
    if holes:
        for i in RNG.sample(range(n), n // 3):
            out[i] = RNG.choice([math.nan, math.inf, -math.inf])
    return out


@pytest.mark.parametrize("n", [0, 1, 2, 3, 8, 33, 64])
@pytest.mark.parametrize("holes", [False, True])
def test_the_array_median_is_the_median(n, holes):
    for _ in range(20):
        v = values(n, holes)
        assert finite_median(np.array(v, dtype=np.float64)) == median(v)


def test_column_medians_are_the_median_of_each_column():
    for holes in (False, True):
        x = np.array([values(12, holes) for _ in range(9)])
        x[np.isinf(x)] = np.nan  # nan_medians is over measured values: NaN, never inf
        got = nan_medians(x)
        for c in range(x.shape[1]):
            want = median(x[:, c].tolist())
            assert (got[c] == want) if want is not None else np.isnan(got[c])


def test_recent_steps_and_stall_thresholds_of_many_ranks_are_each_ranks():
    steps = [math.nan, 0.0, -3.0, 5e-324, 1.0, 250.0, 2000 / 4.5, 400.0, 800.0, 2000 / 2.5,
             1e6, *[RNG.uniform(0.1, 3000) for _ in range(200)]]
    arr = np.array(steps)
    assert dx.recent_steps_of(arr).tolist() == [
        dx.recent_steps(None if s != s else s) for s in steps]
    got = dx.stall_thresholds(arr).tolist()
    want = [dx.stall_threshold(None if s != s else s) for s in steps]
    assert [None if g != g else g for g in got] == want


def rows() -> list[dx.RankTiming]:
    out = []
    for r in range(12):
        phases = {p: (None if RNG.random() < 0.2 else RNG.uniform(0, 20))
                  for p in ("dataloader", "h2d", "forward", "backward", "optimizer", "sync")}
        out.append(dx.RankTiming(
            r * 3, RNG.randint(0, 40), None if r == 5 else RNG.uniform(5, 60), phases,
            f"host{r // 4}", r // 4,
            (dx.Untimed("forward", "never seen"),) if r == 7 else (),
            RNG.choice([0, 10_000_000]), dx.GpuHealth(1980.0) if r % 2 else None))
    return out


def test_a_table_of_rows_reads_back_as_the_rows_and_sums_groups_as_python_does():
    given = rows()
    t = Timings.of(given)
    assert [t.timing(r.rank) for r in given] == given
    assert t.timing(1) is None and Timings.of(t) is t
    group = ("dataloader", "h2d", "forward", "backward", "optimizer")
    sums, has = t.group(group)
    for r, s, h in zip(given, sums.tolist(), has.tolist(), strict=True):
        vals = [v for p in group if (v := r.phase_ms.get(p)) is not None]
        assert h == bool(vals) and (not h or s == sum(vals))
    ready = t.select(t.steps >= 8)
    assert set(ready.untimed) <= set(ready.ranks.tolist())
    assert set(ready.gpus()) == {r.rank for r in given if r.steps >= 8 and r.gpu}


def test_columns_keep_each_ranks_row_until_it_is_written_again():
    block = WindowBlock(6, 32)
    for rank in range(6):
        for step in range(20):
            block.append(rank, 10.0 + rank, ("forward", "sync"), (1.0 + rank, 2.0), step)
    cols = Columns(6)
    cols.put(np.arange(6), block.stats(range(6), 8))
    block.append(2, 99.0, ("forward", "custom"), (7.0, 3.0), 20)  # a new phase, rank 2
    cols.put(np.array([2]), block.stats([2], 1))  # its newest step alone
    table = cols.table(np.array([0, 2]), {0: "a", 2: "b"}, {})
    assert list(table.phases) == ["forward", "sync", "custom"]
    assert np.isnan(table.column("custom")[0]) and table.column("custom")[1] == 3.0
    timing = cols.timing(0, "a", None)
    assert timing.phase_ms == {"forward": 1.0, "sync": 2.0, "custom": None}
    assert timing.step_ms == 10.0 and timing.steps == 8


@pytest.mark.parametrize("dropped", [False, True])
def test_aligned_steps_read_from_a_gather_are_the_steps_read_from_the_block(dropped):
    """The cost model's steps taken from what the live statistics gathered (ranks in
    lockstep) equal the steps gathered again, records an agent dropped included."""
    block = WindowBlock(5, 40)
    for step in range(60):
        for rank in range(5):
            if dropped and rank == 3 and step == 55:
                continue  # never received: its slot holds another step
            block.append(rank, 10.0 + RNG.random(), ("forward", "sync"),
                         (1.0 + rank, None if step % 7 == 0 else 2.0), step)
    if dropped:  # rank 3 catches up: the same newest step as the others
        block.append(3, 10.0, ("forward", "sync"), (1.0, 2.0), 60)
        for rank in (0, 1, 2, 4):
            block.append(rank, 10.0, ("forward", "sync"), (1.0, 2.0), 60)
    stats = block.stats(range(5), 32, keep=True)
    assert stats.gather is not None
    again = block.aligned(list(range(5)), 32)
    reused = block.aligned(list(range(5)), 32, stats.gather)
    assert again is not None and reused is not None
    for a, b in [(again.step_ms, reused.step_ms),
                 *[(again.phase_ms[p], reused.phase_ms[p]) for p in again.phase_ms]]:
        assert np.array_equal(a, b, equal_nan=True)
    assert np.isnan(reused.step_ms).any() == dropped
    assert reused.step_ms.flags.writeable == dropped  # the gather itself, or a masked copy


def progress(rank: int, stalled: float, **kw) -> hang.RankProgress:
    return hang.RankProgress(rank, "h", 10, 20, "forward", None, stalled, 0.0, **kw)


@pytest.mark.parametrize("med", [None, 2.0, 300.0, 2000.0])
@pytest.mark.parametrize("override", [None, 1.0, 30.0])
def test_the_hang_shortcut_answers_only_where_the_full_check_finds_nothing(med, override):
    for _ in range(200):
        ps = [progress(r, RNG.choice([0.0, RNG.uniform(0, 60)]),
                       finished=RNG.random() < 0.1,
                       batches_idle_s=RNG.choice([None, 0.5]),
                       busy=RNG.choice([None, None, "stopping a trace"]))
              for r in range(4)]
        stalled = [p.since_step_s + p.silent_s for p in ps if not p.finished and not p.agent_off]
        if hang.stepping(stalled, med, override):
            assert hang.detect(ps, med, override) is None
            assert hang.hidden_ranks(ps, med, override) == {}
    assert not hang.stepping([60.0], med, override)  # a minute without a step: look
