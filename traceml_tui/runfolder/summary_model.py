"""final_summary.json as a typed model (docs/spec/SUMMARY.md, summary.schema.json).

The summary is written through `Summary` (summary.py builds the document, `encode`
validates it against these Structs) and every reader that loads one (compare, export,
the launcher's fallback, the headless progress lines) goes through `load`/`decode`: a
file that is not a summary is one line of error (`NotASummary`), never a KeyError deep
in a report. Reading is tolerant: keys this version does not know (a newer file) are
ignored, and everything beyond the contract's core has a default (an older or a
hand-written file). Field order is the file's key order.

Every section is typed (issue 43, item 2): a new field is one edit here that mypy
checks in every reader. Two inner shapes stay mappings, owned by their writers: the
preflight's slow nodes (netcheck_worker) and the collector's counters. Fields that a
writer sets only sometimes default to UNSET, so the file omits them as before.

It lives on the run folder's floor (runfolder/) beside the folder's other formats, so the
launcher, the report and the viewers all read it: the view socket's summary reply is
this model in msgpack (`to_msgpack`, `from_msgpack`), validated on receipt.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
from msgspec import UNSET, Struct, UnsetType

from traceml_agent.protocol import _ENVELOPE, Heartbeat, Sys
from traceml_agent.sanitize import clean_line
from traceml_agent.vocab import INFO

# A summary of 16,384 ranks is ~10 MB; anything far beyond that is not one of ours.
MAX_SUMMARY_BYTES = 512 * 1024 * 1024


class NotASummary(Exception):
    """A file that is not a readable traceml summary: its message is one line."""


class _S(Struct, kw_only=True):
    """Base: keyword construction; unknown keys are ignored when decoding."""


class Quantiles(_S, kw_only=True):
    median: float | None = None
    p95: float | None = None


class NodeRef(_S, kw_only=True):
    index: int
    ranks: list[int] = []


class Diagnosis(_S, kw_only=True):
    label: str
    rank: int | None = None
    phase: str | None = None
    severity: str = INFO
    summary: str = ""
    gap_ms: float | None = None
    gap_share: float | None = None
    node: NodeRef | None = None


class LiveDiagnosis(Diagnosis, kw_only=True):
    since: str | None = None


class Failure(_S, kw_only=True):
    """The rank that failed first, as the summary's lead (issue 32: failures first)."""

    rank: int
    exit_code: int | None = None  # the rank's own exit code; negative: killed by a signal
    signal: str | None = None  # e.g. "SIGKILL", when a signal killed it
    error: str | None = None  # the last line of its exception, when it raised
    step: int | None = None  # the steps it had completed
    others: list[int] = []  # ranks that failed after it (usually its consequences)
    summary: str = ""  # the line the text summary and the banner lead with


class CollectorRestarted(_S, kw_only=True):
    """A collector that started again over an earlier record of the same run."""

    earlier_record: str | None = None


class Run(_S, kw_only=True):
    name: str = ""
    world_size: int = 0
    nnodes: int = 1
    started_at: str | None = None
    ended_at: str | None = None
    duration_s: float | None = None
    exit_code: int | None = None
    failed_rank: int | None = None
    command: list[str] = []
    steps: int = 0
    ranks_reporting: int = 0
    parallel: str | None = None  # "ddp" or "fsdp", as the agents saw the model
    # What the launcher and the collector add when they have it (RunMeta.extra): absent,
    # not null, when they do not.
    run_dir: str | UnsetType = UNSET
    logs: str | UnsetType = UNSET
    torchrun_exit_code: int | None | UnsetType = UNSET
    native_stack_refused: int | UnsetType = UNSET  # native stacks refused (launcher)
    collector_restarted: CollectorRestarted | UnsetType = UNSET
    nodes_never_seen: list[int] | UnsetType = UNSET
    # In the live file: when its whole-window statistics (step_ms, the ranks' quantiles,
    # the diagnosis and its cost) were taken, where older than the file (they are
    # refreshed every collector.WINDOW_REFRESH_S; counters and steps every write)
    window_stats_at: str | UnsetType = UNSET


class StepMs(_S, kw_only=True):
    median: float | None = None
    worst: float | None = None
    worst_rank: int | None = None
    mean: float | None = None


class Throughput(_S, kw_only=True):
    steps_per_s: float | None = None
    samples_per_s: float | None = None
    batch_size: int | None | UnsetType = UNSET  # a rank's
    ranks: int | UnsetType = UNSET  # the job's: ranks with a rate


def _sys_fields() -> list[tuple[str, Any, Any]]:
    """A rank's `sys` row: protocol.Sys's figures (not its envelope, not its device: the
    row has it), each absent (UNSET) when the rank sent no sample, so `{}` stays `{}`."""
    plain = typing.get_type_hints(Sys)
    return [(n, plain[n] | UnsetType, UNSET) for n in Sys.__struct_fields__
            if n not in _ENVELOPE and n != "device"]


if TYPE_CHECKING:
    class RankSys(_S, kw_only=True):
        """A rank's latest system sample (protocol.Sys's figures)."""
else:
    RankSys = msgspec.defstruct("RankSys", _sys_fields(), bases=(_S,), kw_only=True,
                                module=__name__)


class Progress(_S, kw_only=True):
    """Where a rank was when the summary was taken (its last heartbeat)."""

    collectives: int = 0
    phase: str | None = None
    in_collective: str | None = None
    since_step_s: float | None = None


class Untimed(_S, kw_only=True):
    """A phase a rank could not time, and why (docs/frameworks.md)."""

    phase: str
    why: str = ""


class RankBase(_S, kw_only=True):
    """A rank's row, less what its heartbeat says that the row repeats (`Rank`)."""

    rank: int
    local_rank: int = 0
    node: int = 0
    host: str = ""
    pid: int | None = None
    device: str | None = None
    reported: bool = True
    steps: int = 0
    window_steps: int = 0
    step_ms: Quantiles = msgspec.field(default_factory=Quantiles)
    phase_ms: dict[str, Quantiles | None] = {}
    throughput: Throughput | None = None
    sys: RankSys = msgspec.field(default_factory=RankSys)
    exit_code: int | None = None
    error: str | None = None
    dropped_records: int = 0
    progress: Progress = msgspec.field(default_factory=Progress)
    untimed: list[Untimed] = []
    agent_off: str | None = None
    bad_records: int = 0
    device_rule: str | None = None
    steps_hidden: str | None = None
    agent_busy: str | None = None
    # Its training thread on a CPU and waiting for one, % of its stepping time (the run's)
    thread_cpu_pct: float | None = None
    cpu_wait_pct: float | None = None


def summarized(wire: type[Struct]) -> list[tuple[str, Any, Any]]:
    """A wire Struct's fields flagged protocol.SUMMARIZED, in its order, as (name, plain
    type, default): the summary's row reads them without the wire's bounds."""
    annotated = typing.get_type_hints(wire, include_extras=True)
    plain = typing.get_type_hints(wire)
    out = []
    for f in msgspec.structs.fields(wire):
        if any(isinstance(m, msgspec.Meta) and (m.extra or {}).get("summary")
               for m in getattr(annotated[f.name], "__metadata__", ())):
            default = (f.default if f.default is not msgspec.NODEFAULT
                       else msgspec.field(default_factory=f.default_factory))
            out.append((f.name, plain[f.name], default))
    return out


# What a rank's heartbeat counts and its row repeats (graph replays, batches, timing
# faults, capture skips...): declared once, on protocol.Heartbeat, and copied by name.
HEARTBEAT_FIELDS = summarized(Heartbeat)
if TYPE_CHECKING:
    Rank = RankBase
else:
    Rank = msgspec.defstruct("Rank", HEARTBEAT_FIELDS, bases=(RankBase,), kw_only=True,
                             module=__name__)


class Episode(_S, kw_only=True):
    label: str
    rank: int | None = None
    phase: str | None = None
    severity: str = INFO
    start: str | None = None
    end: str | None = None
    start_step: int | None = None  # its evidence's first and last step (episodes.py)
    end_step: int | None = None
    named_step: int | None = None  # the newest step when the live label named it
    cleared_step: int | None = None  # ... and when it left (None while open)
    summary: str = ""
    node: int | None = None
    lost_s: float | None = None
    lost_share: float | None = None
    gpu_hours_lost: float | None = None
    attempt: int = 1  # the attempt its steps belong to (they start again at 0 in each)


class RankSteps(_S, kw_only=True):
    rank: int
    steps: int = 0


class SilentRank(_S, kw_only=True):
    rank: int
    step: int = 0  # the step after its last one reported (its last batch may be lost)


class Attempt(_S, kw_only=True):
    """One attempt of a job torchrun restarted (judge/attempts.py), 1-based."""

    attempt: int
    started_at: str | None = None
    ended_at: str | None = None  # None: the last attempt (it ended with the run)
    steps: int = 0
    rank_steps: list[RankSteps] = []
    verdict: Diagnosis | None = None  # the live verdict when it ended
    failure: Failure | None = None  # its first failure (its step: the attempt's own)
    restart_s: float | None = None  # from its failure to the next attempt's first step
    silent: list[SilentRank] = []  # its ranks that ended without a goodbye


class Restarts(_S, kw_only=True):
    count: int = 0
    restart_s: float | None = None  # all restarts together
    dropped: int = 0  # attempts between the first and the newest kept not in `attempts`


class WhatIf(_S, kw_only=True):
    """The step the job would have without the diagnosed problem (judge/cost.py)."""

    label: str
    culprit: str | None = None
    rank: int | None = None
    node: int | None = None
    phase: str | None = None
    steps: int = 0
    now_step_ms: float = 0.0
    step_ms: float = 0.0
    saving_ms: float = 0.0
    share: float = 0.0
    speedup: float = 1.0
    excess_ms: float = 0.0
    paid_ms: float | None = None
    weak: str | None = None
    reasoning: str = ""


class Cost(_S, kw_only=True):
    lost_s: float | None = None
    lost_share: float | None = None
    gpu_hours_lost: float | None = None
    hours_unit: str = "GPU"
    what_if: WhatIf | None = None  # cost.WhatIf.to_json()


class Collective(_S, kw_only=True):
    """One (process group, op, phase issued in) of the run's collectives (judge/
    collectives.py); per-step figures are per step of the ranks that issued it."""

    group: str
    op: str
    phase: str
    ranks: int = 0
    count: int = 0
    bytes: int | None = None
    exposed_ms: float = 0.0
    count_per_step: float = 0.0
    bytes_per_step: float | None = None
    exposed_ms_per_step: float = 0.0
    share_of_sync: float | None = None


class StallRecord(_S, kw_only=True):
    """One stalling rank's stall log over the run (judge/stalls.py)."""

    rank: int
    period: int | None = None
    count: int = 0
    periodic_count: int = 0
    mean_excess_ms: float = 0.0
    phase: str = ""
    lost_s: float = 0.0
    last_step: int = 0
    recurring: bool = False


class MemoryRank(_S, kw_only=True):
    """One rank's memory over the run (judge/memory.py, report/memory_report.py)."""

    rank: int
    rss_mb: float | None = None
    rss_peak_mb: float | None = None
    rss_rate_mb_min: float | None = None
    gpu_mb: float | None = None
    gpu_rate_mb_min: float | None = None
    growing: str | None = None
    rise_mb: float | None = None
    headroom_mb: float | None = None
    limit_in_s: float | None = None


class MemoryImbalance(_S, kw_only=True):
    rank: int
    rss_mb: float
    others_median_mb: float
    ratio: float | None = None


class Memory(_S, kw_only=True):
    growing: list[int] = []
    imbalance: MemoryImbalance | None = None
    ranks: list[MemoryRank] = []


class Check(_S, kw_only=True):
    """A setup mistake seen on some ranks (agent/checks.py Finding.to_wire)."""

    id: str
    severity: str = INFO
    ranks: list[int] = []
    evidence: str = ""
    fix: str = ""


class UntimedPhase(_S, kw_only=True):
    """A phase not timed, why, and on which ranks."""

    phase: str
    why: str = ""
    ranks: list[int] = []


class Timing(_S, kw_only=True):
    complete: bool = True
    framework: str | None = None
    untimed: list[UntimedPhase] = []


class Nccl(_S, kw_only=True):
    """A rank's last collectives per its NCCL log (agent/nccl_log.py NcclState.to_wire)."""

    op: str | None = None
    op_count: int | None = None
    comm: str | None = None
    done: int | None = None
    unused: str | None = None


class HangProgress(_S, kw_only=True):
    rank: int
    host: str = ""
    steps: int = 0
    phase: str | None = None
    collectives: int = 0
    in_collective: str | None = None
    groups: dict[str, int] = {}
    in_group: str | None = None
    nccl: Nccl | None = None


class ThreadStack(_S, kw_only=True):
    thread: str
    stack: str = ""


class Hang(_S, kw_only=True):
    """The evidence of a hang going on when the summary was taken."""

    kind: str
    ranks: list[int] = []
    since: str | None = None
    stalled_s: float = 0.0
    threshold_s: float = 0.0
    progress: list[HangProgress] = []
    stacks: dict[str, list[ThreadStack]] = {}  # by rank, as a string (a JSON key)


class CommRank(_S, kw_only=True):
    rank: int
    sync_ms: float | None = None
    bytes_per_step: int | None = None
    busbw_gbps: float | None = None


class Comm(_S, kw_only=True):
    """The job's collective wait and achieved bus bandwidth (docs/network.md)."""

    sync_share: float | None = None
    busbw_gbps: float | None = None
    preflight_busbw_gbps: float | None = None
    ranks: list[CommRank] = []


class PreflightMissing(_S, kw_only=True):
    nodes: list[int] = []
    ranks: list[int] = []


class Preflight(_S, kw_only=True):
    """What `traceml run --preflight` found (collector._read_preflight); an unreadable
    file is its path and `error` only."""

    path: str = ""
    error: str | UnsetType = UNSET
    healthy: bool | UnsetType = UNSET
    slow: list[dict[str, Any]] | UnsetType = UNSET  # netcheck_worker's rows
    mtu_mismatch: str | None | UnsetType = UNSET
    missing: PreflightMissing | None | UnsetType = UNSET
    wall_s: int | float | None | UnsetType = UNSET
    all_reduce_busbw_gbps: int | float | None | UnsetType = UNSET
    all_reduce_bytes: int | None | UnsetType = UNSET


class Relays(_S, kw_only=True):
    """The node relays, when the run had any: which went silent, what they lost."""

    nodes: list[int] = []
    silent: list[int] = []
    batches: int = 0
    lost_batches: int = 0
    dropped: int = 0


class Summary(_S, kw_only=True):
    schema_version: str = "1"
    complete: bool = True
    failure: Failure | None = None
    run: Run
    phases: list[str] = []
    diagnosis: Diagnosis
    cost: Cost | None = None
    checks: list[Check] = []
    live_diagnosis: LiveDiagnosis | None = None
    step_ms: StepMs
    ranks: list[Rank]
    throughput: Throughput | None = None
    timing: Timing | None = None
    timeline: list[Episode] = []
    hang: Hang | None = None
    comm: Comm | None = None
    collectives: list[Collective] = []
    stalls: list[StallRecord] = []
    memory: Memory | None = None  # in the builder's order: after stalls
    preflight: Preflight | None = None
    collector: dict[str, int] = {}
    relays: Relays | None = None
    attempts: list[Attempt] = []
    restarts: Restarts | None = None


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(Summary)


def from_doc(doc: dict[str, Any]) -> Summary:
    """A summary document (summary.build's dict) as the model; raises NotASummary."""
    try:
        return msgspec.convert(doc, Summary)
    except msgspec.ValidationError as exc:
        raise NotASummary(f"not a traceml summary: {clean_line(str(exc))}") from None


def to_doc(s: Summary) -> dict[str, Any]:
    """The model as plain JSON values (for the text renderer, msgpack, JSON tools)."""
    out: dict[str, Any] = msgspec.to_builtins(s)
    return out


def plain(part: Struct | None) -> Any:
    """A section of the model as plain JSON values, keys in the file's order (UNSET
    fields absent): for a reader that prints a section as JSON."""
    return msgspec.to_builtins(part)


def encode(doc: dict[str, Any] | Summary, indent: int = 0) -> bytes:
    """JSON bytes of a summary, written through the model (a NaN becomes null)."""
    data = _ENCODER.encode(doc if isinstance(doc, Summary) else from_doc(doc))
    return msgspec.json.format(data, indent=indent) if indent else data


_MSGPACK_ENCODER = msgspec.msgpack.Encoder()
_MSGPACK_DECODER = msgspec.msgpack.Decoder(Summary)


def to_msgpack(s: Summary) -> bytes:
    """The summary as the view socket sends it (a viewer's export, `traceml export`)."""
    return _MSGPACK_ENCODER.encode(s)


def from_msgpack(data: bytes) -> Summary:
    """A summary from the view socket, validated; NotASummary("why") otherwise."""
    try:
        return _MSGPACK_DECODER.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise NotASummary(f"not a traceml summary: {clean_line(str(exc))}") from None


def decode(data: bytes | str, name: str = "summary") -> Summary:
    """A summary from JSON text; NotASummary("NAME is not a traceml summary: why")."""
    try:
        return _DECODER.decode(data)
    except msgspec.ValidationError as exc:
        why = str(exc)
    except msgspec.DecodeError as exc:
        why = f"not JSON ({exc})"
    raise NotASummary(clean_line(f"{name} is not a traceml summary: {why}")[:500])


def load(path: Path) -> Summary:
    """Read a summary file through the model; every failure is one NotASummary line."""
    path = Path(path)
    data, _ = read_bounded(path, _read_capped)
    return decode(data, str(path))


def _read_capped(path: Path) -> tuple[bytes, None]:
    with open(path, "rb") as f:
        return f.read(MAX_SUMMARY_BYTES + 1), None


T = TypeVar("T")


def read_bounded(path: Path, read: Callable[[Path], tuple[bytes, T]]) -> tuple[bytes, T]:
    """A summary file's bytes by `read` (the path, or a run folder's pinned descriptor),
    at most MAX_SUMMARY_BYTES; every failure is one NotASummary line."""
    try:
        data, extra = read(path)
    except FileNotFoundError:
        raise NotASummary(f"no such file: {clean_line(str(path))}") from None
    except OSError as exc:
        raise NotASummary(clean_line(f"cannot read {path}: {exc.strerror or exc}")) from None
    if len(data) > MAX_SUMMARY_BYTES:
        raise NotASummary(clean_line(f"{path} is not a traceml summary: over "
                                     f"{MAX_SUMMARY_BYTES >> 20} MB"))
    return data, extra
