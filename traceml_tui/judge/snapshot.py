"""What a tick of the collector freezes: a `Snapshot` of the run (every rank's
`RankSnapshot`, the timeline's `Episode`s, the relays heard from) that the summary
writer, the view builder and the metrics read. Immutable: built by
`RunState.snapshot` (state.py) and never changed after, so every reader of one tick
sees the same figures.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from traceml_agent.findings import Finding
from traceml_agent.protocol import NO_HEARTBEAT, Heartbeat, NcclState, Sys

from . import collectives as coll
from . import cost, hang
from . import diagnosis as dx

if TYPE_CHECKING:
    from .attempts import Attempt
from .history import Point
from .memory import MemoryTrend
from .stalls import StallFinding
from .windows import BlockStats, Quantiles

# A node relay sends a batch at least every second (relay.KEEPALIVE_S): three missed
# means it is gone (or its network is), and its node's ranks cannot reach us.
RELAY_SILENT_S = 3.0


@dataclass(frozen=True, slots=True)
class Episode:
    label: str
    rank: int | None
    phase: str | None
    severity: str
    start: float  # epoch seconds
    end: float | None
    start_step: int
    end_step: int | None
    summary: str
    node: int | None = None  # the episode blames a whole node
    # Job seconds the culprit cost while the episode lasted: its gap (the time every rank
    # waits for it each step) times the steps taken. None for labels without a culprit.
    lost_s: float | None = None
    # Its steps are those of its evidence (episodes.py), not of the evaluations that
    # named and cleared the label; named_step/cleared_step: the newest step at those.
    dated: bool = False
    named_step: int | None = None
    cleared_step: int | None = None
    # The attempt it belongs to (attempts.py; 1 unless torchrun restarted the job): its
    # steps are that attempt's, which start again at 0, so no episode spans two.
    attempt: int = 1

    def closed(self, end: float, end_step: int) -> Episode:
        return replace(self, end=end, end_step=end_step)


@dataclass(frozen=True, slots=True)
class RankSnapshot:
    rank: int
    local_rank: int
    node: int
    host: str
    pid: int
    reported: bool
    steps: int
    window_steps: int
    step_ms: Quantiles | None
    phase_ms: Mapping[str, Quantiles | None]  # full snapshots: read from `Snapshot.whole`
    live_step_ms: float | None
    live_phase_ms: dict[str, float | None]
    recent_step_ms: tuple[float, ...]
    sys: Sys | None  # its latest system sample, as the protocol decoded it
    idle_s: float | None  # seconds since this rank's last message
    since_step_s: float | None  # seconds since this rank last completed a step
    exit_code: int | None
    error: str | None
    finished: bool
    dropped: int
    device: str
    # Its latest heartbeat as decoded (protocol.Heartbeat: step, phase, collectives and
    # their groups, gradient bytes, what its agent counted and why it is off or busy);
    # NO_HEARTBEAT, every field at its default, before the first.
    heartbeat: Heartbeat = NO_HEARTBEAT
    stacks: tuple[tuple[str, str], ...] = ()
    untimed: tuple[dx.Untimed, ...] = ()  # phases the agent could not time, and why
    nccl: NcclState | None = None  # last collectives per its NCCL log (--nccl-debug)
    bad_records: int = 0  # records of its batches the collector refused
    steps_hidden: str | None = None  # why its frozen steps are not a stall (hang.hidden)
    # Its training thread's share of time waiting for a CPU, recent (timings.ThreadCpu);
    # and its shares on a CPU and waiting for one over the run (the summary's row).
    cpu_wait: float | None = None
    cpu_over_run: tuple[float, float] | None = None


def hours_unit(ranks: tuple[RankSnapshot, ...]) -> str:
    """What a lost job-second costs per rank: "GPU"-hours when the ranks ran on GPUs, else
    "rank"-hours (a CPU job)."""
    return "GPU" if any(r.device.startswith("cuda") for r in ranks) else "rank"


@dataclass(frozen=True, slots=True)
class WholeWindow:
    """The reporting ranks' statistics over their whole windows, by column: one numpy pass
    per series, taken once per full snapshot. Its rank rows, the final diagnosis and the
    summary's rank rows read these columns; no per-rank object is built for them."""

    rows: dict[int, int]  # rank -> its row
    phases: tuple[str, ...]  # the run's phases: columns 1.. (column 0: the step time)
    median: np.ndarray  # (rows, 1 + phases), ms; NaN: not measured
    p95: np.ndarray
    medians: list[list[float]]  # `median` as Python floats (NaN kept)
    p95s: list[list[float]]

    @classmethod
    def of(cls, ranks: list[int], phases: tuple[str, ...], stats: BlockStats) -> WholeWindow:
        nan = int(stats.median.shape[1])  # a NaN column for phases never measured
        cols = np.array([0] + [stats.index.get(p, nan) for p in phases], dtype=np.int64)
        pad = np.full((len(ranks), 1), np.nan)
        median = np.concatenate([stats.median, pad], axis=1)[:, cols]
        p95 = np.concatenate([stats.p95, pad], axis=1)[:, cols]
        return cls({rank: row for row, rank in enumerate(ranks)}, phases, median, p95,
                   median.tolist(), p95.tolist())

    def step(self, row: int) -> Quantiles | None:
        m = self.medians[row][0]
        return None if m != m else Quantiles(m, self.p95s[row][0])


@dataclass(frozen=True, slots=True)
class WindowPart:
    """A full snapshot's whole-window part: every rank's whole-window statistics, the
    diagnosis over them and what it costs. The costliest part of a snapshot (a sort of
    every rank's window per series), and it moves slowly (a window is hundreds of steps):
    the live file reuses it for up to `RunState.snapshot`'s `window_max_age_s`, and says
    when it was computed (summary `run.window_stats_at`)."""

    at: float  # wall time it was computed
    mono: float  # collector's clock, for its age
    key: tuple[int, ...]  # what it covers (ranks, attempt, restarts, phases): reused only
    whole: WholeWindow
    untimed: Mapping[int, tuple[dx.Untimed, ...]]
    final: dx.Diagnosis
    final_what_if: cost.WhatIf | None
    mean_step_ms: float | None
    stalls: tuple[StallFinding, ...]


class WindowPartCache:
    """The last full snapshot's whole-window part, served again while it covers the same
    rank records, attempt and phases (its `key`) and is younger than the caller allows."""

    __slots__ = ("part",)

    def __init__(self) -> None:
        self.part: WindowPart | None = None

    def serving(self, key: tuple[int, ...], mono_now: float, max_age_s: float
                ) -> WindowPart | None:
        part = self.part
        if (part is None or max_age_s <= 0 or not 0 <= mono_now - part.mono < max_age_s
                or part.key != key):
            return None
        return part

    def keep(self, part: WindowPart) -> WindowPart:
        self.part = part
        return part


class PhaseRow(Mapping[str, "Quantiles | None"]):
    """One rank's whole-window phase quantiles, read from the columns when asked for."""

    __slots__ = ("whole", "row", "cols")

    def __init__(self, whole: WholeWindow, row: int, cols: dict[str, int]) -> None:
        self.whole, self.row, self.cols = whole, row, cols

    def __getitem__(self, phase: str) -> Quantiles | None:
        i = self.cols[phase]
        m = self.whole.medians[self.row][i]
        return None if m != m else Quantiles(m, self.whole.p95s[self.row][i])

    def __iter__(self) -> Iterator[str]:
        return iter(self.whole.phases)

    def __len__(self) -> int:
        return len(self.whole.phases)


@dataclass(frozen=True, slots=True)
class RelaySnapshot:
    node: int
    silent_s: float  # since its last batch (it sends one at least every second)
    batches: int  # batches it says it sent
    lost_batches: int  # batches missing from its numbering: lost between it and us
    dropped: int  # rank messages it could not forward (its queues were full)

    @property
    def silent(self) -> bool:
        return self.silent_s > RELAY_SILENT_S


@dataclass(frozen=True, slots=True)
class Snapshot:
    run_name: str
    world_size: int
    nnodes: int
    started_at: float
    now: float
    phases: tuple[str, ...]
    ranks: tuple[RankSnapshot, ...]
    live: dx.Diagnosis
    live_since: float
    final: dx.Diagnosis | None  # over the whole window; only in full snapshots
    timeline: tuple[Episode, ...]
    counters: dict[str, int]
    hang: hang.HangReport | None = None
    hang_since: float | None = None
    # rank -> its stacks as taken during the latched hang (kept when its later steps
    # or exit clear the rank's own: the record shows the hang as it was)
    hang_stacks: dict[int, tuple[tuple[str, str], ...]] = field(default_factory=dict)
    parallel: str | None = None  # "ddp" or "fsdp", as the agents saw the model
    checks: tuple[Finding, ...] = ()  # setup mistakes, merged across ranks
    batch_sizes: dict[int, int] = field(default_factory=dict)  # DataLoader batch per rank
    framework: str | None = None  # the training framework the agents saw
    preflight_busbw: float | None = None  # GB/s, from `traceml run --preflight`
    preflight: dict[str, Any] | None = None  # its result (collector._read_preflight)
    relays: tuple[RelaySnapshot, ...] = ()  # the node relays heard from (relay.py)
    what_if: cost.WhatIf | None = None  # the live label's, over the newest steps
    final_what_if: cost.WhatIf | None = None  # the final diagnosis's, over the window
    mean_step_ms: float | None = None  # the job's mean step over the window (full only)
    history: tuple[Point, ...] = ()  # step and own work over the run (history.py)
    # The run's collectives per (group, op, phase), most exposed first (collectives.py)
    collectives: tuple[coll.CollectiveStat, ...] = ()
    # Each stalling rank's stall log over the run (stalls.py; full snapshots only)
    stalls: tuple[StallFinding, ...] = ()
    # Every rank's memory over the run, by rank (memory.py; a live view's may be seconds
    # old, memory.LIVE_EVERY_S)
    memory: tuple[MemoryTrend, ...] = ()
    whole: WholeWindow | None = None  # full snapshots: every rank's whole-window statistics
    # When the whole-window part (`whole`, `final`, `final_what_if`, `mean_step_ms`,
    # `stalls`) was computed, where it is older than `now` (a live file's, WindowPart)
    window_at: float | None = None
    # Under torchrun's elastic agent: every kept attempt, the current one last (attempts.py)
    attempts: tuple[Attempt, ...] = ()

    @property
    def reporting(self) -> int:
        return sum(1 for r in self.ranks if r.reported)

    @property
    def total_steps(self) -> int:
        return max((r.steps for r in self.ranks), default=0)
