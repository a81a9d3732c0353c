"""One evaluation's timings as a table: what the diagnosis rules read (diagnosis.py).

Every rank's median timings over the window, one numpy array per figure (one row per
rank, one column per phase), so that the rules compare 1,024 ranks with a few array
operations instead of a Python object and a loop per rank. The few figures only some
ranks have (phases that could not be timed, GPU health) are small mappings by rank.
`RankTiming` is one rank's row as an object: what tables in tests are written in
(`Timings.of` converts them) and what a view of one rank reads (`Timings.timing`).

The figures keep the per-rank objects' meaning exactly: NaN is "not measured" (None
there), and every sum and median below is the arithmetic the rules did on those objects
(`windows.median`: finite values only, the mean of the middle two for an even count).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from .windows import BlockStats, finite_median

NAN = float("nan")
V = TypeVar("V")


@dataclass(frozen=True, slots=True)
class Untimed:
    """A phase the agent could not time on a rank, and why."""

    phase: str
    why: str


@dataclass(frozen=True, slots=True)
class GpuHealth:
    """A rank's GPU at its latest NVML sample (agent/sysmetrics.py). None: not read."""

    sm_clock_mhz: float | None = None
    throttle: tuple[str, ...] = ()
    power_w: float | None = None
    temp_c: float | None = None

    @classmethod
    def of(cls, sys: Mapping[str, object]) -> GpuHealth | None:
        """From a rank's latest "sys" sample (validated by the protocol); None without
        NVML health figures."""
        clock, reasons = sys.get("sm_clock_mhz"), sys.get("throttle")
        power, temp = sys.get("power_w"), sys.get("temp_c")
        if clock is None and not reasons:
            return None
        num = (int, float)
        # An idle GPU drops its clocks: that reading says nothing about its clock under load.
        idle = isinstance(reasons, tuple | list) and "idle" in reasons
        return cls(float(clock) if isinstance(clock, num) and not idle else None,
                   tuple(str(x) for x in reasons) if isinstance(reasons, tuple | list) else (),
                   float(power) if isinstance(power, num) else None,
                   float(temp) if isinstance(temp, num) else None)


@dataclass(frozen=True, slots=True)
class RankTiming:
    """One rank's median timings over the window, in ms. None: not measured."""

    rank: int
    steps: int
    step_ms: float | None
    phase_ms: Mapping[str, float | None]
    host: str = ""
    node: int = 0
    untimed: tuple[Untimed, ...] = ()
    comm_bytes: int = 0  # gradient bytes all-reduced per step (DDP), 0 when unknown
    gpu: GpuHealth | None = None  # its GPU's health, where NVML sampled it
    # Shares of its time its training thread ran on a CPU and waited for one (the run
    # queue; sysmetrics.ThreadSchedule), over the samples while it stepped; None: not read.
    cpu_run: float | None = None
    cpu_wait: float | None = None


def _nan(v: float | None) -> float:
    return NAN if v is None else float(v)


def _none(v: float) -> float | None:
    return None if v != v else v


@dataclass(frozen=True, slots=True)
class Timings:
    """Some ranks' median timings (ms), one row per rank. NaN: not measured."""

    ranks: np.ndarray  # (k,) rank numbers
    steps: np.ndarray  # (k,) steps each rank's medians cover
    step_ms: np.ndarray  # (k,)
    phases: Mapping[str, int]  # phase -> its column of `medians`
    medians: np.ndarray  # (k, phases)
    node: np.ndarray  # (k,)
    comm_bytes: np.ndarray  # (k,) gradient bytes all-reduced per step, 0: unknown
    # (k,) shares of its time each rank's training thread ran on a CPU and waited for
    # one (ThreadCpu), NaN: not read
    cpu_run: np.ndarray
    cpu_wait: np.ndarray
    hosts: Mapping[int, str]  # rank -> host (may hold more ranks than the table)
    untimed: Mapping[int, tuple[Untimed, ...]]  # only ranks of the table with some
    gpu: Mapping[int, GpuHealth]  # rank -> its GPU's health, where sampled (may hold more)

    @classmethod
    def of(cls, rows: Sequence[RankTiming] | Timings) -> Timings:
        """The table of some per-rank rows (a table is returned as it is)."""
        if isinstance(rows, Timings):
            return rows
        phases: dict[str, int] = {}
        for r in rows:
            for p in r.phase_ms:
                phases.setdefault(p, len(phases))
        medians = np.array([[NAN if (v := r.phase_ms.get(p)) is None else v for p in phases]
                            for r in rows], dtype=np.float64).reshape(len(rows), len(phases))
        return cls(np.array([r.rank for r in rows], dtype=np.int64),
                   np.array([r.steps for r in rows], dtype=np.int64),
                   np.array([_nan(r.step_ms) for r in rows], dtype=np.float64),
                   phases, medians,
                   np.array([r.node for r in rows], dtype=np.int64),
                   np.array([r.comm_bytes for r in rows], dtype=np.int64),
                   np.array([_nan(r.cpu_run) for r in rows], dtype=np.float64),
                   np.array([_nan(r.cpu_wait) for r in rows], dtype=np.float64),
                   {r.rank: r.host for r in rows},
                   {r.rank: r.untimed for r in rows if r.untimed},
                   {r.rank: r.gpu for r in rows if r.gpu is not None})

    def __len__(self) -> int:
        return len(self.ranks)

    def select(self, keep: np.ndarray) -> Timings:
        """The rows where `keep` holds."""
        ranks = self.ranks[keep]
        untimed = self.untimed
        if untimed:
            kept = set(ranks.tolist())
            untimed = {r: u for r, u in untimed.items() if r in kept}
        return Timings(ranks, self.steps[keep], self.step_ms[keep], self.phases,
                       self.medians[keep], self.node[keep], self.comm_bytes[keep],
                       self.cpu_run[keep], self.cpu_wait[keep], self.hosts, untimed,
                       self.gpu)

    def row(self, rank: int) -> int | None:
        """The row of a rank (None: not in the table)."""
        hit = np.flatnonzero(self.ranks == rank)
        return int(hit[0]) if len(hit) else None

    def column(self, phase: str) -> np.ndarray:
        """A phase's medians, one per row (NaN where not measured)."""
        i = self.phases.get(phase)
        return np.full(len(self.ranks), NAN) if i is None else self.medians[:, i]

    def group(self, phases: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Per row, the sum of the finite medians of a group of phases, and whether any
        was finite (where none is, the sum says nothing). Added phase by phase in the
        group's order, as a Python sum of the per-rank values would."""
        total = np.zeros(len(self.ranks))
        has = np.zeros(len(self.ranks), dtype=bool)
        for p in phases:
            i = self.phases.get(p)
            if i is None:
                continue
            col = self.medians[:, i]
            ok = np.isfinite(col)
            total += np.where(ok, col, 0.0)
            has |= ok
        return total, has

    def gpus(self) -> dict[int, GpuHealth]:
        """The GPU health of the ranks of the table that have one."""
        if not self.gpu:
            return {}
        inside = set(self.ranks.tolist())
        return {r: g for r, g in self.gpu.items() if r in inside}

    def timing(self, rank: int) -> RankTiming | None:
        """One rank's row as an object (for the few ranks a view or a summary names)."""
        i = self.row(rank)
        if i is None:
            return None
        values = self.medians[i].tolist()
        return RankTiming(rank, int(self.steps[i]), _none(float(self.step_ms[i])),
                          {p: _none(values[c]) for p, c in self.phases.items()},
                          self.hosts.get(rank, ""), int(self.node[i]),
                          self.untimed.get(rank, ()), int(self.comm_bytes[i]),
                          self.gpu.get(rank), _none(float(self.cpu_run[i])),
                          _none(float(self.cpu_wait[i])))


Table = Timings | Sequence[RankTiming]  # what the rules accept (a sequence is converted)


def median_of(values: np.ndarray, empty: float = 0.0) -> float:
    """`windows.median` of an array (finite values only), `empty` when there are none."""
    m = finite_median(values)
    return empty if m is None else m


class ThreadCpu:
    """Every rank's training-thread shares of time on a CPU and waiting for one, from the
    sys samples of the intervals it stepped in (sysmetrics.ThreadSchedule): recent (an
    average weighted WEIGHT to the newest sample) for the live table, and over the run
    for the whole-window one, as its medians are. NaN: not read."""

    # About the last 8 samples (8 s up to 1,024 ranks): as long as the live window's
    # steps of a typical job.
    WEIGHT = 0.125

    def __init__(self, world: int) -> None:
        self.run = np.full(world, NAN)
        self.wait = np.full(world, NAN)
        self.run_sum = np.zeros(world)
        self.wait_sum = np.zeros(world)
        self.samples = np.zeros(world, dtype=np.int64)

    def seen(self, rank: int, run: float, wait: float) -> None:
        old_run, old_wait = self.run[rank], self.wait[rank]
        if old_run != old_run:  # the first sample
            self.run[rank], self.wait[rank] = run, wait
        else:
            self.run[rank] = old_run + self.WEIGHT * (run - old_run)
            self.wait[rank] = old_wait + self.WEIGHT * (wait - old_wait)
        self.run_sum[rank] += run
        self.wait_sum[rank] += wait
        self.samples[rank] += 1

    def forget(self, rank: int) -> None:
        """A new process for the rank: the old one's samples say nothing of it."""
        self.run[rank] = self.wait[rank] = NAN
        self.run_sum[rank] = self.wait_sum[rank] = 0.0
        self.samples[rank] = 0

    def recent(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.run[rows], self.wait[rows]

    def over_run(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        n = self.samples[rows].astype(np.float64)
        n[n == 0] = NAN
        return self.run_sum[rows] / n, self.wait_sum[rows] / n


class Columns:
    """Every rank's timings as of its last refresh, by rank number, kept between
    evaluations: a refresh writes the rows of the ranks that stepped (`put`), an
    evaluation reads the rows of the ranks that reported (`table`), a view of one rank
    its row (`timing`). No object per rank: a column per figure."""

    def __init__(self, world: int) -> None:
        self.steps = np.zeros(world, dtype=np.int64)
        self.step_ms = np.full(world, NAN)
        self.phases: dict[str, int] = {}  # in the block's order: series are only appended
        self.medians = np.full((world, 0), NAN)
        self.node = np.zeros(world, dtype=np.int64)
        self.comm_bytes = np.zeros(world, dtype=np.int64)
        self.cpu = ThreadCpu(world)  # written at each sys sample, not by put
        self.untimed: dict[int, tuple[Untimed, ...]] = {}  # only the ranks with some
        self.fresh = np.zeros(world, dtype=bool)  # written since the rank last stepped

    def put(self, rows: np.ndarray, stats: BlockStats) -> None:
        """Write some ranks' statistics (one row of `stats` per rank of `rows`)."""
        new = [p for p in stats.index if p not in self.phases]
        if new:  # a phase first seen: a column of "not measured" for every rank
            for p in new:
                self.phases[p] = len(self.phases)
            self.medians = np.hstack([self.medians,
                                      np.full((len(self.steps), len(new)), NAN)])
        self.steps[rows] = stats.steps
        self.step_ms[rows] = stats.median[:, 0]
        if stats.index:
            cols = np.fromiter((self.phases[p] for p in stats.index), np.int64,
                               len(stats.index))
            series = np.fromiter(stats.index.values(), np.int64, len(stats.index))
            self.medians[rows[:, None], cols[None, :]] = stats.median[:, series]
        self.fresh[rows] = True

    def table(self, rows: np.ndarray, hosts: Mapping[int, str],
              gpu: Mapping[int, GpuHealth]) -> Timings:
        """The rows of some ranks (their order) as a table."""
        untimed = self.untimed
        if untimed:
            inside = set(rows.tolist())
            untimed = {r: u for r, u in untimed.items() if r in inside}
        return Timings(rows, self.steps[rows], self.step_ms[rows], dict(self.phases),
                       self.medians[rows], self.node[rows], self.comm_bytes[rows],
                       *self.cpu.recent(rows), hosts, untimed, gpu)

    def timing(self, rank: int, host: str, gpu: GpuHealth | None) -> RankTiming:
        """One rank's row as an object."""
        values = self.medians[rank].tolist()
        return RankTiming(rank, int(self.steps[rank]), _none(float(self.step_ms[rank])),
                          {p: _none(values[c]) for p, c in self.phases.items()}, host,
                          int(self.node[rank]), self.untimed.get(rank, ()),
                          int(self.comm_bytes[rank]), gpu,
                          _none(float(self.cpu.run[rank])), _none(float(self.cpu.wait[rank])))


class Lookup(Mapping[int, V]):
    """A mapping by rank read through each rank's own state when asked (nothing is
    copied per evaluation); a rank whose value is None is absent."""

    def __init__(self, source: Mapping[int, Any], get: Callable[[Any], V | None]) -> None:
        self.source = source
        self.get_of = get

    def __getitem__(self, rank: int) -> V:
        value = self.get_of(self.source[rank])
        if value is None:
            raise KeyError(rank)
        return value

    def __iter__(self) -> Iterator[int]:
        return (r for r, x in self.source.items() if self.get_of(x) is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)
