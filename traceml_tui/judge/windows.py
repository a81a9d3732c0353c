"""Bounded windows of every rank's step records, and the statistics computed over them.

Memory does not grow with the length of a run: the collector keeps the last N steps of
every rank in one numpy array per series (the step time, then each phase), NaN where a
phase was not measured, whatever the number of steps. N shrinks as the world grows so
the whole collector stays within a fixed budget (see `window_steps_for`).

Statistics are computed for many ranks in one call (`WindowBlock.stats`): a sort along
the step axis of a (ranks, steps) array per series, instead of a Python sort per rank
and phase. At 1,024 ranks that is what keeps an evaluation and a live snapshot within
a few milliseconds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np

from traceml_agent.vocab import PHASES

# WARMUP_STEPS (vocab: the agent counts the same steps): never in the windows the
# diagnosis reads. On a GPU step 0 is also the step timed on the host while the agent
# learns the device; nor is it any episode's evidence (timeline.py).
NAN = float("nan")
MAX_WINDOW_STEPS = 512
MIN_WINDOW_STEPS = 32
# Series a rank keeps: its step time and the standard phases. Custom phases add one each.
STANDARD_SERIES = 1 + len(PHASES)
# 4M floats (32 MiB) for all ranks' standard series together.
WINDOW_VALUE_BUDGET = 4 * 1024 * 1024


def window_steps_for(world_size: int, n_series: int = STANDARD_SERIES) -> int:
    """Steps each rank keeps: 512 for small jobs, fewer at thousands of ranks."""
    per_rank = WINDOW_VALUE_BUDGET // max(1, world_size * n_series)
    return max(MIN_WINDOW_STEPS, min(MAX_WINDOW_STEPS, per_rank))


@dataclass(frozen=True, slots=True)
class Quantiles:
    median: float
    p95: float

    def to_json(self) -> dict[str, float]:
        return {"median": round(self.median, 4), "p95": round(self.p95, 4)}


def quantiles(values: Iterable[float]) -> Quantiles | None:
    """Median and nearest-rank p95 of the finite values, or None if there are none."""
    return sorted_quantiles(sorted(v for v in values if math.isfinite(v)))


def sorted_quantiles(vals: list[float]) -> Quantiles | None:
    n = len(vals)
    if n == 0:
        return None
    return Quantiles(_middle(vals), vals[max(0, math.ceil(0.95 * n) - 1)])


def _middle(vals: list[float]) -> float:
    """The median of sorted values (at least one): the mean of the middle two for an even
    count."""
    mid = len(vals) // 2
    return vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2.0


@overload
def median(values: Iterable[float]) -> float | None: ...
@overload
def median(values: Iterable[float], empty: float) -> float: ...
def median(values: Iterable[float], empty: float | None = None) -> float | None:
    """The median of the finite values (the mean of the middle two for an even count), or
    `empty` when there are none: the one median of the collector, with `nan_medians` its
    form over arrays."""
    vals = sorted(v for v in values if math.isfinite(v))
    return _middle(vals) if vals else empty


def finite_median(x: np.ndarray) -> float | None:
    """`median` of a 1-D array, by the same arithmetic: its finite values only, None when
    there are none."""
    vals = np.sort(x[np.isfinite(x)])
    n = len(vals)
    if n == 0:
        return None
    return float(vals[n // 2]) if n % 2 else float((vals[n // 2 - 1] + vals[n // 2]) / 2.0)


def nan_medians(x: np.ndarray) -> np.ndarray:
    """Per column (for the cost model: per step), the median of the measured values, by
    the same arithmetic as `median`; NaN where none. np.nanmedian falls back to a Python
    loop over columns when any value is NaN, and a sort is cheaper than np.median's
    partition across rows (four times, at 1,024 ranks x 32 steps)."""
    if x.shape[0] == 0:
        return np.full(x.shape[1], np.nan)
    ordered = np.sort(x, axis=0)  # NaN sorts last
    if not np.isnan(ordered[-1]).any():  # nothing missing: the same middle rows for all
        rows = x.shape[0]
        return (ordered[(rows - 1) // 2] + ordered[rows // 2]) / 2.0
    n = np.count_nonzero(~np.isnan(x), axis=0)
    cols = np.arange(x.shape[1])
    lo, hi = np.maximum((n - 1) // 2, 0), np.maximum(n // 2, 0)
    out = (ordered[lo, cols] + ordered[hi, cols]) / 2.0
    out[n == 0] = np.nan
    return out


def rolling_median(values: np.ndarray, width: int) -> np.ndarray:
    """Each value replaced by the median of the `width` values centred on it (fewer at
    the ends): a step-shaped change keeps its edge, a few stray steps are ignored."""
    n = len(values)
    if n == 0 or width <= 1:
        return values
    half = width // 2
    padded = np.pad(values, half, mode="edge")
    windows = np.lib.stride_tricks.sliding_window_view(padded, 2 * half + 1)
    return np.median(windows, axis=1)[:n]


@dataclass(frozen=True, slots=True)
class Gather:
    """Some ranks' newest values as one `WindowBlock.stats` gathered them: the slots read
    (flat indices into a (ranks, size) series) and, per series, the values (read-only).
    `WindowBlock.aligned` reads the same slots from them rather than from memory again."""

    flat: np.ndarray
    values: list[np.ndarray]


@dataclass(frozen=True, slots=True)
class BlockStats:
    """Quantiles of some ranks' newest steps, one row per rank asked for, one column per
    series (0: the step time, then the phases at their `index`). NaN where none had a value.

    A phase seen on at least one of a rank's steps counts 0 on the steps where it did
    not occur (it was hooked and took no time there); a phase never seen is NaN: not
    measured, never a made-up 0. `seen` counts the steps that measured each series."""

    steps: np.ndarray  # (k,) steps the statistics cover, per rank asked for
    index: dict[str, int]  # phase name -> column (column 0 is the step time)
    median: np.ndarray  # (k, series)
    p95: np.ndarray  # (k, series)
    seen: np.ndarray  # (k, series)
    # The values gathered, where `WindowBlock.stats` was asked to keep them (`keep`).
    gather: Gather | None = None

    def rows(self) -> list[tuple[Quantiles | None, dict[str, Quantiles | None]]]:
        """Per rank asked for: (step quantiles, {phase: quantiles}) in plain Python."""
        return self._per_rank([[None if a != a else Quantiles(a, b)
                                for a, b in zip(m, p, strict=True)]
                               for m, p in zip(self.median.tolist(), self.p95.tolist(),
                                               strict=True)])

    def medians(self) -> list[tuple[float | None, dict[str, float | None]]]:
        """Per rank asked for: (step median, {phase: median}); None for NaN."""
        return self._per_rank([[None if v != v else v for v in m]
                               for m in self.median.tolist()])

    def _per_rank(self, values: list[list[Any]]) -> list[tuple[Any, dict[str, Any]]]:
        phases = list(self.index)  # in column order: series are only ever appended
        return [(row[0], dict(zip(phases, row[1:], strict=True))) for row in values]

    def seen_of(self, row: int, names: Sequence[str]) -> dict[str, int]:
        """Of the steps row `row` covers, on how many each named phase was measured."""
        seen = self.seen[row]
        return {n: int(seen[i]) if (i := self.index.get(n)) is not None else 0 for n in names}


def _nan_quantiles(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Median and nearest-rank p95 of each row's finite values (NaN rows give NaN), the
    same arithmetic as `sorted_quantiles`."""
    data = np.sort(data, axis=1)  # NaN sorts last
    n = np.count_nonzero(~np.isnan(data), axis=1)
    if len(n) and n.min() == n.max():  # every row as long: the same columns, sliced
        m = int(n[0])
        if m == 0:
            return np.full(len(n), np.nan), np.full(len(n), np.nan)
        k = max(math.ceil(0.95 * m) - 1, 0)
        return (data[:, (m - 1) // 2] + data[:, m // 2]) / 2.0, data[:, k].copy()
    empty = n == 0
    lo = np.maximum((n - 1) // 2, 0)[:, None]
    hi = np.maximum(n // 2, 0)[:, None]
    # ceil(0.95 n) in float64, as math.ceil(0.95 * n) computes it.
    k = np.maximum(np.ceil(0.95 * n).astype(np.int64) - 1, 0)[:, None]
    med = (np.take_along_axis(data, lo, 1) + np.take_along_axis(data, hi, 1))[:, 0] / 2.0
    p95 = np.take_along_axis(data, k, 1)[:, 0]
    med[empty] = np.nan
    p95[empty] = np.nan
    return med, p95


@dataclass(frozen=True, slots=True)
class AlignedSteps:
    """Some ranks' values over the same steps: (ranks, steps) arrays in ms, NaN where a
    value was not measured (a phase absent from a step) or not received."""

    ranks: np.ndarray  # (k,) rank numbers, one per row
    steps: np.ndarray  # (n,) step numbers, one per column, oldest first
    step_ms: np.ndarray
    phase_ms: Mapping[str, np.ndarray]

    def tail(self, n: int) -> AlignedSteps:
        """The newest n steps."""
        return AlignedSteps(self.ranks, self.steps[-n:], self.step_ms[:, -n:],
                            {k: v[:, -n:] for k, v in self.phase_ms.items()})


class _Gathered(Mapping[str, np.ndarray]):
    """A block's phases lined up step by step, each gathered when first read: a pricing
    model reads the phases it needs (a straggler's: not the wait; residual wait's: only
    the wait), and each gather at 1,024 ranks is a pass over memory no cache holds.
    Read in the same evaluation as it was made (the block's records do not change
    meanwhile)."""

    def __init__(self, index: Mapping[str, int], take: Callable[[int], np.ndarray]) -> None:
        self.index = dict(index)
        self.take = take
        self.done: dict[str, np.ndarray] = {}

    def __getitem__(self, name: str) -> np.ndarray:
        out = self.done.get(name)
        if out is None:
            out = self.done[name] = self.take(self.index[name])
        return out

    def __iter__(self) -> Iterator[str]:
        return iter(self.index)

    def __len__(self) -> int:
        return len(self.index)

    def __contains__(self, name: object) -> bool:
        return name in self.index


class WindowBlock:
    """The last `size` steps of every rank of a run: one (ranks, size) float array per
    series, NaN where a series was not measured. Rows are ring buffers that share one
    write position per rank, so every series stays aligned with the step time."""

    def __init__(self, ranks: int, size: int) -> None:
        self.size = size
        self.ranks = ranks
        # Write positions and counts as Python lists: ingest touches them per record, and
        # a list item is cheaper to read and write than a numpy scalar. stats() converts.
        self.pos: list[int] = [0] * ranks
        self.count: list[int] = [0] * ranks
        # Phase name -> its series; series 0, the step time, has no name (any string may
        # be a phase's).
        self.index: dict[str, int] = {}
        # np.empty: pages are committed only for the ranks that report (reset fills them).
        self.series: list[np.ndarray] = []
        # Each series as a flat memoryview: a Python float stored in ~40 ns, where a
        # numpy item assignment costs several times that (ingest writes ~8 per record).
        self.flat: list[Any] = []  # memoryviews of doubles (typeshed types them as ints)
        self.known: list[set[str]] = [set() for _ in range(ranks)]  # phases each rank sent
        self.last_names: list[tuple[str, ...] | None] = [None] * ranks
        self.started = np.zeros(ranks, dtype=bool)
        # The step number of every slot (-1: none), so that ranks' windows can be lined
        # up step by step (`aligned`) even where a rank's agent dropped records.
        self.step_no = np.full((ranks, size), -1, dtype=np.int64)
        self.step_flat: Any = self.step_no.data.cast("B").cast("q")
        # For each tuple of phase names a batch carries: the series each name writes and
        # the series it leaves unmeasured (NaN). Rebuilt when the run gets a new series.
        self.plans: dict[tuple[str, ...], tuple[tuple[int, ...], tuple[int, ...]]] = {}
        self._add_series(None)

    def _add_series(self, name: str | None) -> int:
        arr = np.empty((self.ranks, self.size))
        arr[self.started] = NAN
        self.series.append(arr)
        self.flat.append(arr.data.cast("B").cast("d"))
        idx = len(self.series) - 1
        if name is not None:
            self.index[name] = idx
        self.plans.clear()
        return idx

    def reset(self, rank: int) -> None:
        """A rank's first message (or a restarted process): an empty window."""
        for arr in self.series:
            arr[rank].fill(NAN)
        self.pos[rank] = self.count[rank] = 0
        self.step_no[rank].fill(-1)
        self.known[rank] = set()
        self.last_names[rank] = None
        self.started[rank] = True

    def _plan(self, names: tuple[str, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        for name in names:
            if name not in self.index:
                self._add_series(name)
        cols = tuple(self.index[name] for name in names)
        sent = set(cols)
        missing = tuple(i for i in range(1, len(self.series)) if i not in sent)
        self.plans[names] = (cols, missing)
        return cols, missing

    def append(self, rank: int, step_ms: float, phase_names: Sequence[str],
               phase_ms: Sequence[float | None], step: int = -1) -> None:
        if not self.started[rank]:
            self.reset(rank)
        names = phase_names if type(phase_names) is tuple else tuple(phase_names)
        plan = self.plans.get(names)
        cols, missing = plan if plan is not None else self._plan(names)
        if self.last_names[rank] != names:
            self.known[rank].update(names)
            self.last_names[rank] = names
        pos = self.pos[rank]
        at = rank * self.size + pos
        flat = self.flat
        flat[0][at] = step_ms
        self.step_flat[at] = step
        for col, value in zip(cols, phase_ms, strict=False):
            flat[col][at] = NAN if value is None else value
        for col in missing:  # a series this record did not carry: not measured
            flat[col][at] = NAN
        if len(phase_ms) < len(cols):  # names without a value: not measured either
            for col in cols[len(phase_ms):]:
                flat[col][at] = NAN
        pos += 1
        self.pos[rank] = 0 if pos == self.size else pos
        if self.count[rank] < self.size:
            self.count[rank] += 1

    def last(self, rank: int, name: str | None, n: int) -> list[float]:
        """One series' newest n values of a rank, oldest first (name None: step times)."""
        n = min(n, self.count[rank])
        idx = 0 if name is None else self.index.get(name)
        if n <= 0 or idx is None:
            return []
        cols = (self.pos[rank] - n + np.arange(n)) % self.size
        return self.series[idx][rank, cols].tolist()

    def stats(self, ranks: Sequence[int] | np.ndarray,
              last: int | Sequence[int] | np.ndarray | None = None, keep: bool = False
              ) -> BlockStats:
        """Quantiles of each rank's newest `last` steps (a number, one per rank, or None
        for the whole window), for all the given ranks in one pass per series. `keep`:
        keep what was gathered (BlockStats.gather) where every rank had `last` steps, for
        `aligned` in the same evaluation."""
        r = np.asarray(ranks, dtype=np.int64)
        count = np.asarray(self.count, dtype=np.int64)[r]
        n = count if last is None else np.minimum(np.asarray(last, dtype=np.int64), count)
        width = int(n.max()) if len(r) else 0
        k, s = len(r), len(self.series)
        med = np.full((k, s), np.nan)
        p95 = np.full((k, s), np.nan)
        seen = np.zeros((k, s), dtype=np.int64)
        if width > 0:
            if last is None:
                # The whole window: quantiles ignore order, so each row as it lies in
                # its ring (a rank not yet round it has filled its first `n` slots).
                steps = np.arange(self.size)
                flat = None
                inside = steps[None, :] < n[:, None]
                full = bool((n == self.size).all())
            else:
                steps = np.arange(width)
                cols = (np.asarray(self.pos, dtype=np.int64)[r][:, None] - width
                        + steps[None, :]) % self.size
                flat = (r * self.size)[:, None] + cols  # one gather per series, in C
                inside = steps[None, :] >= (width - n)[:, None]  # the rank's own n newest
                full = bool((n == width).all())
            # Where every rank holds `width` steps, a series measured on all of them is
            # read at the same columns of every sorted row (_nan_quantiles' arithmetic).
            lo, hi = (width - 1) // 2, width // 2
            top = max(math.ceil(0.95 * width) - 1, 0)
            kept: list[np.ndarray] | None = [] if keep and full and flat is not None else None
            for i, arr in enumerate(self.series):
                data = arr[r] if flat is None else np.take(arr, flat)
                if kept is not None:  # kept as gathered; the statistics work on a copy
                    data.flags.writeable = False
                    kept.append(data)
                    data = data.copy()
                if not full:
                    data[~inside] = np.nan
                missing = np.isnan(data)
                if full and not missing.any():
                    data.sort(axis=1)
                    med[:, i] = (data[:, lo] + data[:, hi]) / 2.0
                    p95[:, i] = data[:, top]
                    seen[:, i] = width
                    continue
                if missing.all():  # measured by none of them: NaN, seen on no step
                    continue
                seen[:, i] = np.count_nonzero(~missing, axis=1)
                if i:  # a phase seen in the window took no time on its other steps
                    fill = missing & (seen[:, i] > 0)[:, None]
                    if not full:
                        fill &= inside
                    np.copyto(data, 0.0, where=fill)
                med[:, i], p95[:, i] = _nan_quantiles(data)
            if kept is not None and flat is not None:
                return BlockStats(n, dict(self.index), med, p95, seen, Gather(flat, kept))
        return BlockStats(n, dict(self.index), med, p95, seen)

    def aligned(self, ranks: Sequence[int], last: int, reuse: Gather | None = None
                ) -> AlignedSteps | None:
        """The given ranks' values over the same steps: up to `last` of the newest steps
        that all of them hold, for the cost model (cost.py), which compares ranks step by
        step. Ranks more than half a window behind the median rank's newest step (ended,
        stuck) are left out; a slot whose step number is not the one expected (records an
        agent dropped) is NaN. None when no step is common to them. `reuse`: values
        `stats` gathered in this evaluation, read where the slots are the same (ranks in
        lockstep: the newest steps of each are the common ones)."""
        r = np.asarray([x for x in ranks if self.count[x] > 0], dtype=np.int64)
        if len(r) == 0 or last <= 0:
            return None
        pos = np.asarray(self.pos, dtype=np.int64)[r]
        count = np.asarray(self.count, dtype=np.int64)[r]
        newest = self.step_no[r, (pos - 1) % self.size]
        keep = newest >= np.median(newest) - self.size // 2
        r, pos, count, newest = r[keep], pos[keep], count[keep], newest[keep]
        end = int(newest.min())
        behind = newest - end
        n = int(min(last, int((count - behind).min())))
        if n <= 0:
            return None
        cols = ((pos - 1 - behind)[:, None] - (n - 1) + np.arange(n)[None, :]) % self.size
        steps = np.arange(end - n + 1, end + 1, dtype=np.int64)
        flat = (r * self.size)[:, None] + cols  # one gather per series, in C
        wrong = np.take(self.step_no, flat) != steps[None, :]
        some_wrong = bool(wrong.any())

        same = (reuse is not None and reuse.flat.shape == flat.shape
                and np.array_equal(reuse.flat, flat))

        def take(series: int) -> np.ndarray:
            if same and reuse is not None and series < len(reuse.values):
                out = reuse.values[series]
                if not some_wrong:
                    return out
                out = out.copy()
            else:
                out = np.take(self.series[series], flat)
            if some_wrong:
                out[wrong] = np.nan
            return out
        return AlignedSteps(r, steps, take(0), _Gathered(self.index, take))

    def view(self, rank: int) -> RankWindow:
        return RankWindow(self, rank)


class RankWindow:
    """One rank's window in a block: what code about a single rank reads (tests, the
    sparkline). Batch work goes through `WindowBlock.stats`."""

    __slots__ = ("block", "rank")

    def __init__(self, block: WindowBlock, rank: int) -> None:
        self.block = block
        self.rank = rank

    @property
    def count(self) -> int:
        return self.block.count[self.rank]

    @property
    def phases(self) -> frozenset[str]:
        """The phases this rank has sent."""
        return frozenset(self.block.known[self.rank])

    def append(self, step_ms: float, phase_names: Sequence[str],
               phase_ms: Sequence[float | None], step: int = -1) -> None:
        self.block.append(self.rank, step_ms, phase_names, phase_ms, step)

    def last(self, name: str | None, n: int) -> list[float]:
        """A phase's newest n values, or with name None the step times."""
        return self.block.last(self.rank, name, n)

    def seen(self, names: Sequence[str], last: int | None = None) -> dict[str, int]:
        return self.block.stats([self.rank], last).seen_of(0, names)

    def stats(self, last: int | None = None
              ) -> tuple[Quantiles | None, dict[str, Quantiles | None]]:
        """Step and phase quantiles over the newest `last` steps (default: the whole
        window), for the phases this rank has sent."""
        if self.count == 0:
            return None, {}
        step, phases = self.block.stats([self.rank], last).rows()[0]
        return step, {k: v for k, v in phases.items() if k in self.block.known[self.rank]}


def whole_window_stats(block: WindowBlock, ranks: Sequence[int]) -> BlockStats:
    """`block.stats(ranks, None)`, the same figures to the bit, cheaper for the snapshot
    file's whole windows (issue 33). Where every rank holds the same number of steps
    (a run past its first window, or all started together), their slots are the same:
    a series measured on all of them takes no masks and reads its quantiles at the same
    place in every row, and a series no rank measured is not sorted."""
    r = np.asarray(ranks, dtype=np.int64)
    n = np.asarray(block.count, dtype=np.int64)[r]
    k, s, size = len(r), len(block.series), block.size
    med = np.full((k, s), np.nan)
    p95 = np.full((k, s), np.nan)
    seen = np.zeros((k, s), dtype=np.int64)
    c = int(n[0]) if k else 0
    # The same count below the size: no ring has wrapped, its steps are slots [0, c).
    same = k > 0 and bool((n == c).all())
    width = c if same else size
    inside = None if same else np.arange(size)[None, :] < n[:, None]
    lo, hi, top = (c - 1) // 2, c // 2, max(math.ceil(0.95 * c) - 1, 0)
    for i, arr in enumerate(block.series):
        data = arr[r, :width] if width < size else arr[r]
        if inside is not None:
            data[~inside] = np.nan
        missing = np.isnan(data)
        if same and c and not missing.any():  # every step of every rank measured
            data.sort(axis=1)
            med[:, i] = (data[:, lo] + data[:, hi]) / 2.0
            p95[:, i] = data[:, top]
            seen[:, i] = c
        elif not missing.all():  # as WindowBlock.stats does it
            seen[:, i] = np.count_nonzero(~missing, axis=1)
            if i:  # a phase seen in the window took no time on its other steps
                fill = missing & (seen[:, i] > 0)[:, None]
                data[fill if inside is None else fill & inside] = 0.0
            med[:, i], p95[:, i] = _nan_quantiles(data)
    return BlockStats(n, dict(block.index), med, p95, seen)
