"""The step log (runfolder/step_log.py) reduced to what the HTML report draws: per-rank
step time over the run as a median band and the worst ranks' lines, in at most
`MAX_POINTS` buckets of steps whatever the run's length and width.

Memory: the log itself is bounded (its byte budget keeps ~1.5-3 million records), and
reading keeps 20 bytes a record in packed arrays (rank, step, step ms, one phase's ms),
so a full log costs ~60 MB here; the output is O(MAX_POINTS x (WORST_RANKS + 3)).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from traceml_tui.runfolder.step_log import LoggedStep, read_steps

MAX_POINTS = 400  # buckets of steps: a line's points, ~2 per pixel column of the chart
WORST_RANKS = 4  # ranks drawn as lines (slowest by mean step time, plus the verdict's)
BAND_QUANTILES = (0.10, 0.50, 0.90)  # the band is p10-p90 over ranks and the bucket's steps


@dataclass
class Curve:
    rank: int
    xs: list[float]
    ys: list[float]  # the bucket's worst step of this rank: spikes survive downsampling


@dataclass
class Reduced:
    """One measure (step time, or one phase's time) over the run, downsampled."""

    xs: list[float] = field(default_factory=list)  # each bucket's first step
    low: list[float] = field(default_factory=list)
    median: list[float] = field(default_factory=list)
    high: list[float] = field(default_factory=list)
    worst: list[Curve] = field(default_factory=list)


@dataclass
class StepSeries:
    records: int = 0
    ranks: int = 0
    first_step: int = 0
    last_step: int = 0
    bucket_steps: int = 1
    step: Reduced = field(default_factory=Reduced)
    phase: str | None = None
    phase_series: Reduced | None = None


def read(log_dir: Path, phase: str | None = None, must_show: Sequence[int] = ()) -> StepSeries:
    """The run's step log reduced; `phase`: also reduce that phase's time (the verdict's);
    `must_show`: ranks drawn as lines whatever their times (the verdict's rank)."""
    return reduce(read_steps(log_dir), phase, must_show)


def reduce(records: Iterable[LoggedStep], phase: str | None = None,
           must_show: Sequence[int] = ()) -> StepSeries:
    ranks, steps = array("q"), array("q")
    ms, pms = array("f"), array("f")
    nan = float("nan")
    for r in records:
        ranks.append(r.rank)
        steps.append(r.step)
        ms.append(r.step_ms)
        if phase is not None:
            v = None
            if phase in r.phases:
                v = r.phase_ms[r.phases.index(phase)]
            pms.append(nan if v is None else v)
    out = StepSeries(records=len(ranks), phase=phase)
    if not ranks:
        return out
    rank_a = np.frombuffer(ranks, dtype=np.int64)
    step_a = np.frombuffer(steps, dtype=np.int64)
    ms_a = np.frombuffer(ms, dtype=np.float32).astype(np.float64)
    out.ranks = int(np.unique(rank_a).size)
    out.first_step, out.last_step = int(step_a.min()), int(step_a.max())
    width = out.last_step - out.first_step + 1
    out.bucket_steps = max(1, -(-width // MAX_POINTS))
    bucket = (step_a - out.first_step) // out.bucket_steps
    out.step = _reduce(bucket, rank_a, ms_a, out.first_step, out.bucket_steps, must_show)
    if phase is not None:
        p_a = np.frombuffer(pms, dtype=np.float32).astype(np.float64)
        ok = np.isfinite(p_a)
        if ok.any():
            out.phase_series = _reduce(bucket[ok], rank_a[ok], p_a[ok], out.first_step,
                                       out.bucket_steps, must_show)
    return out


def _reduce(bucket: np.ndarray, rank: np.ndarray, value: np.ndarray, first: int, width: int,
            must_show: Sequence[int]) -> Reduced:
    ok = np.isfinite(value)
    bucket, rank, value = bucket[ok], rank[ok], value[ok]
    red = Reduced()
    if not value.size:
        return red
    order = np.lexsort((value, bucket))
    b_sorted, v_sorted = bucket[order], value[order]
    used, starts, counts = np.unique(b_sorted, return_index=True, return_counts=True)
    qs = [v_sorted[starts + np.floor(q * (counts - 1)).astype(np.int64)]
          for q in BAND_QUANTILES]
    red.xs = (first + used * width).astype(float).tolist()
    red.low, red.median, red.high = (q.tolist() for q in qs)
    # The slowest ranks by their mean over the run, then the ones asked for.
    rank_ids, inverse = np.unique(rank, return_inverse=True)
    means = np.bincount(inverse, weights=value) / np.bincount(inverse)
    chosen = [int(rank_ids[i]) for i in np.argsort(-means, kind="stable")[:WORST_RANKS]]
    for r in must_show:
        if r not in chosen and r in rank_ids:
            chosen.insert(0, int(r))
    for r in chosen:
        mine = rank == r
        b, v = bucket[mine], value[mine]
        worst = np.full(int(bucket.max()) + 1, -np.inf)
        np.maximum.at(worst, b, v)
        have = np.flatnonzero(np.isfinite(worst))
        red.worst.append(Curve(r, (first + have * width).astype(float).tolist(),
                               worst[have].tolist()))
    return red
