"""Memory over time, per rank: a bounded series of each rank's host RSS and GPU memory,
and the rules that read it (docs/diagnosis.md, "Memory growth").

A rank that leaks a few MB per step walks toward an OOM kill, the commonest end of a
multi-hour job; on the way it swaps and turns into a straggler whose step time alone
does not say why. The agent samples memory about once a second (agent/sysmetrics.py);
the collector keeps, per rank, the newest RING samples and a whole-run series thinned
by halves (every stride-th sample, the stride doubling each time WHOLE fill), so the
slope of a multi-hour run is still read over the whole run in a fixed 5 KB per rank.

The rule (`growth`) is a pure function of one series: least squares over the samples
after the warm-up (the first WARMUP_SHARE of the time: weights, optimizer state and the
allocator's caches are taken then), growth only when the rise over that span is at
least MIN_RISE_MB and MIN_RISE_SHARE of the level, and when each third of the span
rises at THIRD_SHARE of the whole slope or more: a plateau after warm-up, or one step
of the allocator's cache, rises in one third only and is not growth. The time left to
the limit is the headroom the agent reads on the rank's host (its cgroup's limit less
usage, else the host's available memory) or the GPU's free memory (NVML), over the rate.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import islice
from typing import NamedTuple

import numpy as np

from traceml_agent.protocol import Sys
from traceml_agent.vocab import MEMORY_GPU, MEMORY_HOST

from . import diagnosis as dx

RING = 120  # newest samples per rank (2 minutes at one a second, 10 at one in 5 s)
WHOLE = 256  # the whole-run series: every stride-th sample, halved when full
# The first share of a series' time span is warm-up: not judged.
WARMUP_SHARE = 0.25
# A series needs this many judged samples over this many seconds: a minute's trend on
# a rank that has run 20 s would be noise.
MIN_SAMPLES = 12
MIN_SPAN_S = 10.0
# Growth: a rise over the judged span of at least MIN_RISE_MB and MIN_RISE_SHARE of the
# level it started from (RSS breathes by tens of MB as batches come and go; a leak of a
# few MB a step adds hundreds per minute), and every third of the span rising at no
# less than THIRD_SHARE of the whole slope (a plateau, or one allocator step, does not).
MIN_RISE_MB = 64.0
MIN_RISE_SHARE = 0.10
THIRD_SHARE = 0.25
# Imbalance: a rank whose memory is IMBALANCE_RATIO times the median of the others' and
# IMBALANCE_MB more (a small process twice as big as another is not worth a line).
IMBALANCE_RATIO = 1.5
IMBALANCE_MB = 128.0
# A live view and the live file read the trends at most every LIVE_EVERY_S (judging
# them for every 2 s write was ~10 % of the collector's CPU at 1,024 ranks: a trend of
# one sample a second moves little in 5 s); any read judges again at most
# TRENDS_PER_READ ranks with new samples, those waiting longest first (about 70 us a
# rank: 70 ms a read; up to 1,024 ranks every read is fresh, at 16,384 a rank's trend is
# at most 16 reads old). The record's are judged afresh, every rank's (0.5 s at 16,384
# ranks and 60 samples each, measured in-process: once a run).
LIVE_EVERY_S = 5.0
TRENDS_PER_READ = 1024


class Growth(NamedTuple):
    """One series' trend over its judged span."""

    rate_mb_s: float  # least-squares slope
    rise_mb: float  # the slope over the span
    start_mb: float  # the fit's value where the span starts
    span_s: float
    growing: bool  # the rule's verdict (module docstring)


def _slope(t: np.ndarray, y: np.ndarray) -> float:
    dt = t - t.mean()
    den = float(dt @ dt)
    return 0.0 if den <= 0 else float(dt @ (y - y.mean())) / den


def growth(t: np.ndarray, mb: np.ndarray) -> Growth | None:
    """The trend of one series (`t` seconds ascending, `mb` megabytes; NaN: not read);
    None when too few samples over too short a span to judge."""
    t, mb = np.asarray(t, dtype=np.float64), np.asarray(mb, dtype=np.float64)
    ok = ~np.isnan(mb)
    t, mb = t[ok], mb[ok]
    if len(t) < 2:
        return None
    judged = t >= t[0] + WARMUP_SHARE * (t[-1] - t[0])
    t, mb = t[judged], mb[judged]
    span = float(t[-1] - t[0]) if len(t) else 0.0
    if len(t) < MIN_SAMPLES or span < MIN_SPAN_S:
        return None
    rate = _slope(t, mb)
    rise = rate * span
    start = float(mb.mean() - rate * (t.mean() - t[0]))
    steady = rise >= MIN_RISE_MB and rise >= MIN_RISE_SHARE * max(start, 0.0)
    if steady:
        cuts = t[0] + span * np.array([1 / 3, 2 / 3])
        for part in np.split(np.arange(len(t)), np.searchsorted(t, cuts)):
            if len(part) < 2 or _slope(t[part], mb[part]) < THIRD_SHARE * rate:
                steady = False
                break
    return Growth(rate, rise, start, span, steady)


def imbalance(ranks: np.ndarray, mb: np.ndarray) -> tuple[int, float, float] | None:
    """(rank, its MB, the others' median MB) of the rank whose memory stands out from the
    others' (IMBALANCE_*); None with fewer than two ranks read or none standing out."""
    ok = ~np.isnan(mb)
    ranks, mb = ranks[ok], mb[ok]
    if len(mb) < 2:
        return None
    i = int(np.argmax(mb))
    others = float(np.median(np.delete(mb, i)))
    top = float(mb[i])
    if top >= IMBALANCE_RATIO * others and top - others >= IMBALANCE_MB:
        return int(ranks[i]), top, others
    return None


@dataclass(frozen=True, slots=True)
class MemoryTrend:
    """One rank's memory over the run, as the summary and the view show it."""

    rank: int
    rss_mb: float | None  # latest
    rss_peak_mb: float | None
    rss_rate_mb_min: float | None  # over the judged span; None: too few samples yet
    gpu_mb: float | None  # latest: the allocator's allocated, else NVML's used
    gpu_rate_mb_min: float | None
    growing: str | None  # MEMORY_HOST or MEMORY_GPU: the finding's, when one grows
    rise_mb: float | None  # of the growing series over its judged span
    # What it may still take before the limit: the GPU's free memory when its GPU memory
    # grows, else the host's (its cgroup's limit less usage, or the host's available).
    headroom_mb: float | None
    limit_in_s: float | None  # headroom over the rate of the growing series


class _Series:
    """One rank's samples: the newest RING, and the whole run thinned (module docstring).
    Columns: seconds since its first sample, host RSS, GPU MB (NaN: not read); float32
    (a day's seconds to a hundredth, megabytes to a few hundredths over a terabyte)."""

    __slots__ = ("ring", "whole", "t0", "n", "kept", "stride", "peak", "last", "host_room",
                 "gpu_room")

    def __init__(self) -> None:
        self.ring = np.full((RING, 3), np.nan, dtype=np.float32)
        self.whole = np.full((WHOLE, 3), np.nan, dtype=np.float32)
        self.t0: float | None = None
        self.n = 0  # samples seen
        self.kept = 0  # rows of `whole` in use
        self.stride = 1
        self.peak = float("nan")
        self.last = (float("nan"), float("nan"))  # host, GPU: the newest sample's, exact
        self.host_room: float | None = None
        self.gpu_room: float | None = None

    def add(self, t: float, host: float, gpu: float) -> None:
        if self.t0 is None:
            self.t0 = t
        t -= self.t0
        if self.n and t <= self.ring[(self.n - 1) % RING, 0]:
            return  # a clock step back, or a duplicate: the slope needs ascending times
        row = (t, host, gpu)
        self.ring[self.n % RING] = row
        if self.n % self.stride == 0:
            if self.kept == WHOLE:
                half = self.whole[::2].copy()
                self.whole[:] = np.nan
                self.whole[: len(half)] = half
                self.kept, self.stride = len(half), self.stride * 2
            if self.n % self.stride == 0:
                self.whole[self.kept] = row
                self.kept += 1
        self.n += 1
        self.last = (host, gpu)
        if host == host:
            self.peak = host if self.peak != self.peak else max(self.peak, host)

    def recent(self) -> np.ndarray:
        if self.n <= RING:
            return self.ring[: self.n]
        at = self.n % RING
        return np.concatenate([self.ring[at:], self.ring[:at]])


def _judged(series: _Series, col: int) -> Growth | None:
    """The whole run's trend, or the newest samples' when only they grow (a leak that
    began late in a long run)."""
    whole = series.whole[: series.kept]
    fit = growth(whole[:, 0], whole[:, col])
    if series.n > RING and (fit is None or not fit.growing):
        recent = series.recent()
        late = growth(recent[:, 0], recent[:, col])
        if late is not None and late.growing:
            return late
    return fit


def _nan_none(v: float) -> float | None:
    return None if v != v else float(v)


class MemoryBook:
    """Every rank's memory series and trend (bounded: about 5 KB per rank, measured with
    tracemalloc; 85 MB at 16,384 ranks)."""

    def __init__(self) -> None:
        self.series: dict[int, _Series] = {}
        self._trends: dict[int, MemoryTrend] = {}  # each rank's, as last judged
        self._dirty: dict[int, None] = {}  # ranks with samples since, oldest first
        self._read_at: float | None = None  # a live view's last read
        self._out: tuple[MemoryTrend, ...] = ()

    def seen(self, rank: int, t: float, body: Sys) -> None:
        """One system sample of `rank`, sent at `t` (the agent's clock, seconds)."""
        host = body.rss_mb
        gpu = body.gpu_alloc_mb if body.gpu_alloc_mb is not None else body.gpu_mem_mb
        if host is None and gpu is None:
            return
        s = self.series.get(rank)
        if s is None:
            s = self.series[rank] = _Series()
        s.add(t, np.nan if host is None else host, np.nan if gpu is None else gpu)
        s.host_room = body.mem_avail_mb
        s.gpu_room = (body.gpu_mem_total_mb - body.gpu_mem_mb
                      if body.gpu_mem_total_mb is not None and body.gpu_mem_mb is not None
                      else None)
        self._dirty.setdefault(rank)

    def forget(self, rank: int) -> None:
        """A restarted rank's memory is a new process's."""
        self.series.pop(rank, None)
        self._dirty.pop(rank, None)
        if self._trends.pop(rank, None) is not None:
            self._out = tuple(self._trends[r] for r in sorted(self._trends))

    def trends(self, now: float | None = None, every: bool = False) -> tuple[MemoryTrend, ...]:
        """Every rank's trend, by rank; with `now` (a live view's clock), as read within
        LIVE_EVERY_S. At most TRENDS_PER_READ ranks are judged again per read, unless
        `every` (the record: each rank with new samples is judged now)."""
        if now is not None:
            if self._read_at is not None and 0 <= now - self._read_at < LIVE_EVERY_S:
                return self._out
            self._read_at = now
        if self._dirty:
            todo = list(self._dirty if every else islice(self._dirty, TRENDS_PER_READ))
            for rank in todo:
                del self._dirty[rank]
                self._trends[rank] = self._trend(rank, self.series[rank])
            self._out = tuple(self._trends[r] for r in sorted(self._trends))
        return self._out

    @staticmethod
    def _trend(rank: int, s: _Series) -> MemoryTrend:
        host, gpu = _judged(s, 1), _judged(s, 2)
        last = s.last
        grows, room = None, s.host_room
        if host is not None and host.growing:
            grows = (MEMORY_HOST, host)
        elif gpu is not None and gpu.growing:
            grows, room = (MEMORY_GPU, gpu), s.gpu_room
        return MemoryTrend(
            rank=rank, rss_mb=_nan_none(last[0]), rss_peak_mb=_nan_none(s.peak),
            rss_rate_mb_min=None if host is None else host.rate_mb_s * 60,
            gpu_mb=_nan_none(last[1]),
            gpu_rate_mb_min=None if gpu is None else gpu.rate_mb_s * 60,
            growing=None if grows is None else grows[0],
            rise_mb=None if grows is None else grows[1].rise_mb,
            headroom_mb=room,
            limit_in_s=(None if grows is None or room is None
                        else room / grows[1].rate_mb_s))


def imbalance_of(trends: tuple[MemoryTrend, ...]) -> tuple[int, float, float] | None:
    """The rank whose host memory stands out (`imbalance`) among the latest samples."""
    return imbalance(np.array([t.rank for t in trends], dtype=np.int64),
                     np.array([np.nan if t.rss_mb is None else t.rss_mb for t in trends]))


def growth_sentence(t: MemoryTrend, whose: str = "its") -> str:
    """'its host memory grew 310 MB (+620 MB/min); about 37 min left before its limit'."""
    rate = t.rss_rate_mb_min if t.growing == MEMORY_HOST else t.gpu_rate_mb_min
    left = ("" if t.limit_in_s is None
            else f"; about {format_duration(t.limit_in_s)} left before its limit")
    return (f"{whose} {t.growing} memory grew {t.rise_mb or 0:.0f} MB "
            f"(+{rate or 0:.0f} MB/min){left}")


def worst_first(t: MemoryTrend) -> tuple[bool, float, int]:
    """Sort key: the growing ranks, fastest first, then the others by their host rate."""
    rate = t.gpu_rate_mb_min if t.growing == MEMORY_GPU else t.rss_rate_mb_min
    return (t.growing is None, -(rate or 0.0), t.rank)


def _mb(v: float) -> str:
    return f"{v / 1024:.1f} GB" if v >= 10_240 else f"{v:.0f} MB"


def panel_line(t: MemoryTrend) -> str:
    """One rank's memory in one line (the rank panel): 'memory grows: host 611 MB,
    +600 MB/min, about 37 min left before its limit', 'memory: host 310 MB, steady'."""
    parts = []
    if t.rss_mb is not None:
        parts.append(f"host {_mb(t.rss_mb)}")
    if t.gpu_mb is not None:
        parts.append(f"gpu {_mb(t.gpu_mb)}")
    rate = t.gpu_rate_mb_min if t.growing == MEMORY_GPU else t.rss_rate_mb_min
    if t.growing:
        left = ("" if t.limit_in_s is None
                else f", about {format_duration(t.limit_in_s)} left before its limit")
        return f"memory grows ({t.growing}): {', '.join(parts)}, +{rate or 0:.0f} MB/min{left}"
    trend = "" if rate is None else ", steady"
    return f"memory: {', '.join(parts)}{trend}"


def format_duration(s: float) -> str:
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def memory_evidence(d: dx.Diagnosis, trends: tuple[MemoryTrend, ...]) -> dx.Diagnosis:
    """A verdict that names a rank whose memory grows says so: a rank that swaps, or
    whose allocator runs short, is slow in whichever phase touches the memory, and the
    phase alone would send the user to the model."""
    if d.rank is None:
        return d
    grows = next((t for t in trends if t.rank == d.rank and t.growing), None)
    if grows is None:
        return d
    whose = f"Rank {d.rank}'s"
    return replace(d, summary=f"{d.summary} {growth_sentence(grows, whose)}: a rank that "
                              f"swaps or runs short of memory is slow too.")
