"""What a dashboard draws: a frozen, compact view of the collector's state.

The collector builds one `RunView` per evaluation tick (view_build.py) and
serves it to any number of viewers; a viewer decodes it and replaces its whole
state at once. The model is msgspec Structs: the collector encodes them, a viewer
decodes and validates them in C (8,192 rows in a few milliseconds), and rows are
arrays on the wire and untracked by the cycle collector. This module is the view
model only: it imports neither the dashboard nor the collector's state, so a viewer
carries none of the collector.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import itemgetter

import msgspec
from msgspec import Struct

from traceml_agent.vocab import LOCAL_PHASES, PHASES

# Columns of the heat rows, in order.
VIEW_PHASES = PHASES
# A rank is stale when no message arrived for this long (agents send ~10 a second and a
# heartbeat every second, so 3 s of silence means its sender or its host is gone) ...
STALE_SILENCE_S = 3.0
# ... or when it made no step for this many of its median step times (and at least
# STALE_MIN_S): it is alive but not progressing.
STALE_STEPS = 5
STALE_MIN_S = 5.0

OK, STALE, DONE, FAILED, WAITING = "ok", "stale", "done", "failed", "waiting"
STOPPED = "stopped"
AGENT_OFF = "agent off"  # the agent turned its timing off (it said why): not a stall
# Steps frozen while the rank replays CUDA graphs, fetches batches or its agent stops a
# trace (hang.hidden): progress the steps cannot show, not a stall.
HIDDEN = "hidden"


class RankRow(Struct, array_like=True, frozen=True, gc=False):
    """One rank's line: an array on the wire, and not tracked by the cycle collector, so
    decoding 8,192 rows a tick does not trigger long GC pauses."""

    rank: int
    node: int
    host: str
    steps: int
    step_ms: float | None
    phase_ms: tuple[float | None, ...]  # aligned with VIEW_PHASES
    cpu_pct: float | None
    rss_mb: float | None
    gpu_util: float | None
    gpu_mem_mb: float | None
    idle_s: float | None
    status: str


class RankDetail(Struct, frozen=True):
    """One rank next to the median rank, for the worst-rank and pinned panels."""

    rank: int
    host: str
    step_ms: float | None
    median_step_ms: float | None
    phase_ms: tuple[float | None, ...]
    median_phase_ms: tuple[float | None, ...]
    recent_step_ms: tuple[float, ...]
    status: str
    error: str | None
    stack: str | None = None  # the training thread's stack, sent by a rank that is stuck
    gpu: str | None = None  # its GPU's health in one line, or why NVML gave no figures
    # What its agent could not show as steps or time, what chose its timing device, and
    # its records the collector refused (view_build.agent_notes), one line each.
    notes: tuple[str, ...] = ()
    # How long its training thread waited for a CPU, when that is worth a line
    # (view_build.cpu_line): the host side of a straggler, beside the GPU's.
    cpu: str | None = None
    # Its memory in one line, then (the worst-rank panel) the other ranks whose memory
    # grows, fastest first (view_build.memory_lines; docs/diagnosis.md, "Memory growth").
    memory: tuple[str, ...] = ()


class CostView(Struct, frozen=True):
    """What the problem on display costs the job and the step it would have without it
    (the collector's cost model, cost.py), for the banner and the worst-rank panel."""

    share: float  # of every step
    now_ms: float  # the job's step now
    step_ms: float  # without the culprit
    speedup: float
    lost_s: float | None  # job seconds it cost so far (its episodes of this run)
    hours: float | None  # lost_s x world size / 3600
    unit: str  # "GPU" or "rank" (a CPU job loses rank-hours)
    weak: str | None  # why the estimate may be off
    reasoning: str


class DeepTraceView(Struct, frozen=True):
    """The latest deep trace, as viewers see it (collect/deep_traces.py): which ranks, how far each
    got, and the analysis once it is done."""

    id: int
    steps: int
    ranks: tuple[int, ...]
    roles: dict[str, str]  # rank -> "worst", "pinned" or "median"
    states: dict[str, str]  # rank -> "requested", "started", "done" or "failed"
    errors: dict[str, str]
    paths: dict[str, str]  # rank -> its trace file
    text: str | None = None  # the analysis, when done
    saved: str | None = None  # where the report was saved

    @property
    def tracing(self) -> bool:
        return bool(set(self.states.values()) & {"requested", "started"})


# A setup mistake found (agent/checks.py), merged across ranks:
# (id, severity, ranks, evidence, fix).
CheckRow = tuple[str, str, tuple[int, ...], str, str]


# The run's collectives, most exposed first (judge/collectives.py), per step of the ranks
# that issued each: (group, op, phase issued in, calls, bytes or None, exposed ms, share
# of all sync or None). At most MAX_VIEW_COLLECTIVES.
CollectiveRow = tuple[str, str, str, float, float | None, float, float | None]
MAX_VIEW_COLLECTIVES = 16


class RunView(Struct, frozen=True):
    run_name: str
    world_size: int
    nnodes: int
    elapsed_s: float
    steps: int
    steps_per_s: float | None
    label: str
    rank: int | None
    phase: str | None
    severity: str
    summary: str
    label_for_s: float
    rows: tuple[RankRow, ...]
    median_step_ms: float | None
    median_phase_ms: tuple[float | None, ...]
    worst: RankDetail | None
    device: str
    finished: bool = False
    exit_code: int | None = None
    node: int | None = None  # the diagnosis blames a whole node
    checks: tuple[CheckRow, ...] = ()  # most severe first
    capture: DeepTraceView | None = None  # the latest deep trace
    relays_silent: tuple[int, ...] = ()  # nodes whose relay stopped sending (relay.py)
    # Node view: per node, (its rank count, the worst of its ranks in every column as one
    # pseudo-row), built once per tick by the collector for every viewer (node_rows).
    node_rows: tuple[tuple[int, RankRow], ...] = ()
    cost: CostView | None = None  # what the label on display costs (None: no culprit)
    # The time chart: (seconds since start, median step, median own work, worst own
    # work) in ms, bounded (history.py); the diagnosis episodes on the same axis:
    # (start s, end s or None while open, label, severity).
    history: tuple[tuple[float, float | None, float | None, float | None], ...] = ()
    episodes: tuple[tuple[float, float | None, str, str], ...] = ()
    # The rank that failed first, in one line (report/summary.failure_of): the banner
    # leads with it, before the performance label of the steps before it.
    failure: str | None = None
    collectives: tuple[CollectiveRow, ...] = ()

    @property
    def reporting(self) -> int:
        return sum(1 for r in self.rows if r.status != WAITING)

    @property
    def nodes_waiting(self) -> tuple[int, ...]:
        """Nodes none of whose ranks has reported yet (started late, or not at all)."""
        seen: dict[int, bool] = {}
        for r in self.rows:
            seen[r.node] = seen.get(r.node, False) or r.status != WAITING
        return tuple(n for n, reported in sorted(seen.items()) if not reported)

    @property
    def stale(self) -> tuple[int, ...]:
        return tuple(r.rank for r in self.rows if r.status == STALE)


# Columns of a rank's own work (vocab.LOCAL_PHASES): not the time it waits for others.
OWN_COLUMNS = tuple(i for i, p in enumerate(VIEW_PHASES) if p in LOCAL_PHASES)


def own_work(phase_ms: tuple[float | None, ...]) -> float | None:
    """A rank's own work per step from its phase columns; None when none was measured."""
    vals = [v for i in OWN_COLUMNS if (v := phase_ms[i]) is not None]
    return sum(vals) if vals else None


# A rank's own-work columns in one C call: "worst first" keys run for every rank on every
# frame and every export. (itemgetter of a single index returns the value, not a 1-tuple.)
_own_cells = (itemgetter(*OWN_COLUMNS) if len(OWN_COLUMNS) > 1
              else lambda p: tuple(p[i] for i in OWN_COLUMNS))


def own_distance(mid: float | None) -> Callable[[RankRow], float]:
    """How far a rank's own work is from the median rank's `mid`: the measure of "worst
    first" (the dashboard's order, the ranks /metrics exports). 0 where the rank measured
    none or `mid` is unknown."""
    cells, n = _own_cells, len(OWN_COLUMNS)
    if mid is None:
        return lambda r: 0.0

    def far(r: RankRow) -> float:
        own = cells(r.phase_ms)  # the sum in C: skipping zeros adds the same
        return 0.0 if own.count(None) == n else abs(sum(filter(None, own)) - mid)

    return far


def subject_ranks(view: RunView) -> frozenset[int]:
    """The ranks the diagnosis names: its rank, or all ranks of the node it blames."""
    if view.node is not None:
        return frozenset(r.rank for r in view.rows if r.node == view.node)
    return frozenset() if view.rank is None else frozenset({view.rank})


def _worst(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return max(vals) if vals else None


def node_rows(rows: tuple[RankRow, ...] | list[RankRow]) -> tuple[tuple[int, RankRow], ...]:
    """One pseudo-row per node, in node order: its worst rank's value in every column,
    its first rank and host, its fewest steps, and its most alarming status."""
    by_node: dict[int, list[RankRow]] = {}
    for r in rows:
        by_node.setdefault(r.node, []).append(r)
    out = []
    for node, members in sorted(by_node.items()):
        phases = tuple(_worst([m.phase_ms[i] for m in members]) for i in range(len(VIEW_PHASES)))
        statuses = {m.status for m in members}
        status = next((s for s in (FAILED, STALE, WAITING) if s in statuses), OK)
        pseudo = RankRow(members[0].rank, node, members[0].host, min(m.steps for m in members),
                         _worst([m.step_ms for m in members]), phases,
                         _worst([m.cpu_pct for m in members]), _worst([m.rss_mb for m in members]),
                         _worst([m.gpu_util for m in members]),
                         _worst([m.gpu_mem_mb for m in members]), None, status)
        out.append((len(members), pseudo))
    return tuple(out)


_ENCODER = msgspec.msgpack.Encoder()
_VIEW = msgspec.msgpack.Decoder(RunView)
_DETAIL = msgspec.msgpack.Decoder(RankDetail | None)


def encode_view(view: RunView) -> bytes:
    return _ENCODER.encode(view)


def encode_detail(detail: RankDetail | None) -> bytes:
    return _ENCODER.encode(detail)


def decode_view(data: bytes) -> RunView:
    """A view from the collector's bytes; ValueError if they are not one."""
    try:
        return _VIEW.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ValueError(f"not a view: {exc}") from None


def decode_detail(data: bytes) -> RankDetail | None:
    try:
        return _DETAIL.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ValueError(f"not a rank detail: {exc}") from None
