"""What one torch.profiler trace says about a training step, in numbers.

Input: the Chrome-trace JSON that ``prof.export_chrome_trace(path)`` writes (or a
.json.gz of it), one file per rank. Output: a frozen `TraceAnalysis` with the
figures a person would otherwise read off the Perfetto timeline by hand, each
finding tied to one pattern of the trace-reading guide (GPU idle gaps, AllReduce
not overlapping backward, straggler rank, DataLoader stall, launch-bound small
kernels, unpinned host-to-device copies) with a one-line hint.

Everything except `load_trace` is a pure function of the parsed events, so each
rule is testable with a hand-written trace. Times are microseconds (the trace's
own unit), shares are fractions of the analysed window.

The analysed window is the profiled steps: from the first ``ProfilerStep#N`` span's
start to the last one's end, stretched to the end of the last GPU activity (GPU
work queued by the last step finishes after its CPU span). A trace without step
spans is analysed over the span of all its events. GPU metrics need GPU events
(categories kernel, gpu_memcpy, gpu_memset); on a CPU-only trace they are None
and named in ``needs_gpu``, never reported as zeros.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import stat
from bisect import bisect_right
from collections import defaultdict
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

from traceml_agent.sanitize import clean_line

# --- thresholds ------------------------------------------------------------------------

# A kernel launch costs ~5-20 µs of CPU time (bottleneck guide, pattern 5): a kernel shorter than
# 10 µs finishes before the CPU can issue the next one, so a stream of them is launch-bound.
SMALL_KERNEL_US = 10.0
# "Most kernels tiny": above half of all kernels, fusing them is the first thing to try.
LAUNCH_BOUND_SMALL_SHARE = 0.5
# A GPU idle a fifth of the step is a fifth of the hardware wasted; below that, idle time is
# the normal cost of step boundaries and the optimizer's small kernels.
GPU_IDLE_SHARE = 0.20
# DDP overlaps most of the AllReduce with backward; under 30% overlapped, the collective is
# mostly serialised after backward (bucket too large, or find_unused_parameters=True).
LOW_OVERLAP_SHARE = 0.30
# Collective kernels under 2% of the window cost little even unoverlapped: no finding.
MIN_COLLECTIVE_SHARE = 0.02
# A well-fed job spends a few percent of its step in the DataLoader; a fifth is a stall.
DATALOADER_STEP_SHARE = 0.20
# Pageable copies are staged through a bounce buffer and block the CPU; at 2% of the window
# they are worth the one-line fix (pin_memory=True).
PAGEABLE_H2D_SHARE = 0.02
# compare(): the worst rank is a straggler when its local work (step minus collectives) exceeds
# the median rank's by a tenth of the median step, as in the live diagnosis (SKEW_ENTER): in a
# synchronous job every rank waits for the slowest, so that is a tenth of the job's throughput.
STRAGGLER_EXCESS_SHARE = 0.10

TOP_N = 10  # rows in each "top" table
MAX_TRACE_BYTES = 512 << 20  # a rank's trace file, on disk and decompressed
GAPS_N = 5  # idle gaps reported, longest first

# Pattern ids, each one section of the bottleneck guide, with its title.
PATTERNS = {
    "gpu_idle": "GPU idle gaps (bubbles)",
    "no_overlap": "AllReduce not overlapping backward",
    "straggler": "Straggler rank",
    "dataloader_stall": "DataLoader stall",
    "launch_bound": "Too many small kernels (launch overhead)",
    "unpinned_copy": "Long Memcpy HtoD (unpinned memory)",
}

GPU_METRICS = ("gpu_busy_share", "gpu_idle_share", "idle_gaps", "top_kernels",
               "small_kernels", "h2d_copies", "comm_overlap")

# Category names across torch versions (older ones wrote "Kernel", "Operator", "Runtime").
_CATEGORIES = {
    "kernel": "kernel", "gpu_memcpy": "gpu_memcpy", "memcpy": "gpu_memcpy",
    "gpu_memset": "gpu_memset", "memset": "gpu_memset", "cpu_op": "cpu_op",
    "operator": "cpu_op", "user_annotation": "user_annotation", "cuda_runtime": "cuda_runtime",
    "runtime": "cuda_runtime", "cuda_driver": "cuda_runtime",
}
_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_CPU_CATS = ("cpu_op", "user_annotation")
_STEP_PREFIX = "ProfilerStep#"
_DATALOADER_PREFIX = "enumerate(DataLoader)#"
_COLLECTIVE_PREFIXES = ("gloo:", "nccl:", "c10d::")
_COPY_KINDS = re.compile(r"\(\s*(\w+)\s*->\s*(\w+)\s*\)")
_EPS_US = 1e-3  # trace timestamps are floats with ns resolution


# --- results ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TracePattern:
    pattern: str  # a key of PATTERNS
    title: str
    evidence: str
    hint: str


@dataclass(frozen=True)
class StepStat:
    step: int
    dur_us: float
    dataloader_us: float


@dataclass(frozen=True)
class OpStat:
    name: str
    count: int
    total_us: float
    self_us: float  # total minus time in nested cpu_ops on the same thread


@dataclass(frozen=True)
class KernelStat:
    name: str
    count: int
    total_us: float
    mean_us: float


@dataclass(frozen=True)
class Gap:
    ts: float  # on the trace's clock, to find it in Perfetto
    offset_us: float  # from the window's start
    dur_us: float
    next_gpu_op: str | None  # the GPU activity that ended the gap; None at the window's end
    launch_call: str | None  # the CUDA runtime call that launched it
    launched_by: str | None  # the cpu_op that made that call
    link: str | None  # how launched_by was found: "correlation", "flow" or "time"
    cpu_during: str | None  # the CPU span on the main thread overlapping the gap the most


@dataclass(frozen=True)
class SmallKernels:
    threshold_us: float
    count: int
    count_share: float
    time_us: float
    time_share: float


@dataclass(frozen=True)
class HostToDevice:
    count: int
    total_us: float
    bytes: int
    pageable_count: int
    pageable_us: float
    pinned_count: int
    pinned_us: float
    unknown_count: int  # source memory kind not in the trace (older torch)
    longest_us: float


@dataclass(frozen=True)
class Overlap:
    collective_us: float  # collective (NCCL) kernel time
    overlapped_us: float  # of which other kernels ran at the same time
    share: float


@dataclass(frozen=True)
class TraceAnalysis:
    source: str | None
    rank: int | None  # from the trace's distributedInfo, when torch wrote it
    world_size: int | None
    steps: tuple[int, ...]  # ProfilerStep numbers covered
    window_us: float
    step_stats: tuple[StepStat, ...]
    dataloader_us: float
    collective_us: float  # collective kernels on GPU traces; on CPU ones, gloo spans' union
    cpu_ops: tuple[OpStat, ...]  # top cpu_ops by self time
    collectives: tuple[OpStat, ...]
    gpu_busy_share: float | None
    gpu_idle_share: float | None
    idle_gaps: tuple[Gap, ...] | None
    top_kernels: tuple[KernelStat, ...] | None
    small_kernels: SmallKernels | None
    h2d_copies: HostToDevice | None
    comm_overlap: Overlap | None  # None also on a GPU trace without collective kernels
    needs_gpu: tuple[str, ...]  # metrics left None because the trace has no GPU activity
    findings: tuple[TracePattern, ...]
    notes: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return _rounded(asdict(self))

    @property
    def mean_step_us(self) -> float | None:
        return _mean([s.dur_us for s in self.step_stats])


def _rounded(value: Any) -> Any:
    """Floats to 4 decimals (0.1 ns; shares to 0.01%) for JSON: trace timestamps are large
    floats, and their differences carry binary noise nobody should read."""
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(v) for v in value]
    return value


class _Span(NamedTuple):  # a tuple: traces hold ~10^6 events and dataclasses build slower
    name: str
    cat: str
    pid: Any
    tid: Any
    ts: float
    end: float
    args: dict[str, Any]

    @property
    def dur(self) -> float:
        return self.end - self.ts


# --- reading ---------------------------------------------------------------------------


def load_trace(path: str | Path, root: Path | None = None,
               limit: int = MAX_TRACE_BYTES) -> dict[str, Any]:
    """Parse a Chrome trace file, gzipped or not (told by its magic bytes, not its name).

    The path comes from a rank, so with `root` it must be a regular file inside that
    folder, opened without following links and without blocking (a FIFO would wedge
    the reader, /dev/zero never ends); file and decompressed sizes are capped."""
    raw = _read_confined(Path(path), root, limit) if root is not None else Path(path).read_bytes()
    if raw[:2] == b"\x1f\x8b":
        with gzip.GzipFile(fileobj=io.BytesIO(raw)) as gz:
            raw = gz.read(limit + 1)
        if len(raw) > limit:
            raise ValueError(f"trace larger than {limit >> 20} MiB decompressed")
    doc = json.loads(raw)
    return {"traceEvents": doc} if isinstance(doc, list) else doc


def _read_confined(path: Path, root: Path, limit: int) -> bytes:
    real_root = os.path.realpath(root)
    if os.path.commonpath([os.path.realpath(path.parent), real_root]) != real_root:
        raise ValueError(f"not inside {root}")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        if st.st_size > limit:
            raise ValueError(f"trace larger than {limit >> 20} MiB")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(limit)
    finally:
        os.close(fd)


def analyze_file(path: str | Path, root: Path | None = None) -> TraceAnalysis:
    return analyze(load_trace(path, root), source=str(path))


# --- analysis --------------------------------------------------------------------------


def analyze(trace: dict[str, Any], source: str | None = None) -> TraceAnalysis:
    events = trace.get("traceEvents") or []
    spans = _spans(events)
    info = trace.get("distributedInfo") or {}
    notes: list[str] = []
    steps = sorted((s for s in spans if s.name.startswith(_STEP_PREFIX)), key=lambda s: s.ts)
    gpu = [s for s in spans if s.cat in _GPU_CATS]
    if steps:
        start = steps[0].ts
        end = max([steps[-1].end] + [g.end for g in gpu])
    else:
        notes.append("no ProfilerStep spans: the window is the span of all events")
        start = min((s.ts for s in spans), default=0.0)
        end = max((s.end for s in spans), default=0.0)
    window = max(end - start, 0.0)
    main = _main_thread(spans, steps)
    loader = [s for s in spans if s.name.startswith(_DATALOADER_PREFIX)]
    step_stats = tuple(
        StepStat(_step_number(s), s.dur, sum(d.dur for d in loader if s.ts <= d.ts < s.end))
        for s in steps)
    collectives = _collectives(spans)
    fields: dict[str, Any] = dict.fromkeys(GPU_METRICS)
    if gpu:
        links = _Links(spans, _flows(events))
        fields.update(_gpu_metrics(spans, gpu, links, main, start, end, notes))
    overlap = fields["comm_overlap"]
    # On CPU traces gloo runs collectives on threads of its own, several at once: the time
    # any was in flight (a union), not their sum, which can exceed the step itself.
    collective_us = (overlap.collective_us if overlap is not None else sum(
        b - a for a, b in _union([(s.ts, s.end) for s in spans
                                  if s.cat in _CPU_CATS and s.name.startswith("gloo:")])))
    analysis = TraceAnalysis(
        source=source, rank=_int_or_none(info.get("rank")),
        world_size=_int_or_none(info.get("world_size")),
        steps=tuple(s.step for s in step_stats), window_us=window, step_stats=step_stats,
        dataloader_us=sum(d.dur for d in loader), collective_us=collective_us,
        cpu_ops=_top_cpu_ops(spans), collectives=collectives,
        needs_gpu=() if gpu else GPU_METRICS, findings=(), notes=tuple(notes), **fields)
    return _with_findings(analysis)


def _spans(events: list[Any]) -> list[_Span]:
    """Complete ("X") events of the categories analysed, with their category normalised."""
    out = []
    for e in events:
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue
        cat = _CATEGORIES.get(str(e.get("cat", "")).lower())
        ts, dur = e.get("ts"), e.get("dur", 0)
        if cat is None or not isinstance(ts, (int, float)) or not isinstance(dur, (int, float)):
            continue
        args = e.get("args") if isinstance(e.get("args"), dict) else {}
        # A trace is a rank's file: its names are text from outside (agent/sanitize.py).
        out.append(_Span(clean_line(str(e.get("name", ""))), cat, e.get("pid"), e.get("tid"),
                         float(ts), float(ts) + max(float(dur), 0.0), args))
    return out


def _int_or_none(value: Any) -> int | None:
    """The trace's rank and world size: numbers, or nothing (never its text)."""
    return value if type(value) is int else None


def _flows(events: list[Any]) -> tuple[dict[tuple[Any, Any, float], Any], dict[Any, tuple]]:
    """The "ac2g" arrows from a CUDA runtime call to its GPU activity: the arrow's id by
    its GPU end (pid, tid, ts), and its CPU start (pid, tid, ts) by id."""
    ends, starts = {}, {}
    for e in events:
        if isinstance(e, dict) and e.get("cat") == "ac2g" and isinstance(e.get("ts"), (int, float)):
            where = (e.get("pid"), e.get("tid"), round(float(e["ts"]), 3))
            if e.get("ph") == "f":
                ends[where] = e.get("id")
            elif e.get("ph") == "s":
                starts[e.get("id")] = where
    return ends, starts


def _step_number(span: _Span) -> int:
    try:
        return int(span.name[len(_STEP_PREFIX):])
    except ValueError:
        return -1


def _main_thread(spans: list[_Span], steps: list[_Span]) -> tuple[Any, Any] | None:
    """The training thread: the one with the step spans, else the one with most cpu_op time."""
    if steps:
        return steps[0].pid, steps[0].tid
    busy: dict[tuple[Any, Any], float] = defaultdict(float)
    for s in spans:
        if s.cat == "cpu_op":
            busy[s.pid, s.tid] += s.dur
    return max(busy, key=busy.__getitem__) if busy else None


def _top_cpu_ops(spans: list[_Span]) -> tuple[OpStat, ...]:
    """cpu_ops by self time: each op's duration minus its directly nested cpu_ops'."""
    by_thread: dict[tuple[Any, Any], list[_Span]] = defaultdict(list)
    for s in spans:
        if s.cat == "cpu_op":
            by_thread[s.pid, s.tid].append(s)
    count: dict[str, int] = defaultdict(int)
    total: dict[str, float] = defaultdict(float)
    child: dict[int, float] = defaultdict(float)  # by id(span)
    for ops in by_thread.values():
        ops.sort(key=lambda s: (s.ts, -s.dur))
        stack: list[_Span] = []
        for op in ops:
            while stack and stack[-1].end <= op.ts + _EPS_US:
                stack.pop()
            if stack and op.end <= stack[-1].end + _EPS_US:
                child[id(stack[-1])] += op.dur
            stack.append(op)
    self_us: dict[str, float] = defaultdict(float)
    for ops in by_thread.values():
        for op in ops:
            count[op.name] += 1
            total[op.name] += op.dur
            self_us[op.name] += max(op.dur - child[id(op)], 0.0)
    ranked = sorted(count, key=lambda n: (-self_us[n], n))[:TOP_N]
    return tuple(OpStat(n, count[n], total[n], self_us[n]) for n in ranked)


def _collectives(spans: list[_Span]) -> tuple[OpStat, ...]:
    """The CPU-side collective spans: ``gloo:``/``nccl:`` annotations, c10d ops and
    record_param_comms (named by its "Collective name" when torch recorded it)."""
    count: dict[str, int] = defaultdict(int)
    total: dict[str, float] = defaultdict(float)
    for s in spans:
        if s.cat not in _CPU_CATS:
            continue
        if s.name == "record_param_comms":
            name = clean_line(f"record_param_comms:{s.args.get('Collective name', '?')}")
        elif s.name.startswith(_COLLECTIVE_PREFIXES):
            name = s.name
        else:
            continue
        count[name] += 1
        total[name] += s.dur
    ranked = sorted(count, key=lambda n: (-total[n], n))
    return tuple(OpStat(n, count[n], total[n], total[n]) for n in ranked)


# --- GPU -------------------------------------------------------------------------------


def _gpu_metrics(spans: list[_Span], gpu: list[_Span], links: _Links,
                 main: tuple[Any, Any] | None, start: float, end: float,
                 notes: list[str]) -> dict[str, Any]:
    window = end - start
    busy = _union([(max(g.ts, start), min(g.end, end)) for g in gpu if g.end > start])
    busy_us = sum(b - a for a, b in busy)
    kernels = [g for g in gpu if g.cat == "kernel"]
    return {
        "gpu_busy_share": busy_us / window if window else None,
        "gpu_idle_share": 1 - busy_us / window if window else None,
        "idle_gaps": _gaps(spans, gpu, busy, links, main, start, end),
        "top_kernels": _top_kernels(kernels),
        "small_kernels": _small_kernels(kernels),
        "h2d_copies": _h2d(gpu, notes),
        "comm_overlap": _overlap(kernels, notes),
    }


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def _overlap_us(a: float, b: float, union: list[tuple[float, float]], ends: list[float]) -> float:
    """How much of [a, b] a sorted disjoint union covers, in O(log n + hits): traces of a
    long step hold tens of thousands of kernels and thousands of collectives."""
    total = 0.0
    i = bisect_right(ends, a)
    while i < len(union) and union[i][0] < b:
        x, y = union[i]
        total += min(b, y) - max(a, x)
        i += 1
    return total


def _gaps(spans: list[_Span], gpu: list[_Span], busy: list[tuple[float, float]],
          links: _Links, main: tuple[Any, Any] | None, start: float,
          end: float) -> tuple[Gap, ...]:
    edges = [start] + [x for iv in busy for x in iv] + [end]
    holes = [(a, b) for a, b in zip(edges[::2], edges[1::2], strict=True) if b - a > _EPS_US]
    holes.sort(key=lambda h: (-(h[1] - h[0]), h[0]))
    main_spans = [s for s in spans if s.cat in _CPU_CATS and (s.pid, s.tid) == main
                  and not s.name.startswith(_STEP_PREFIX)]
    gaps = []
    for a, b in holes[:GAPS_N]:
        following = [g for g in gpu if abs(g.ts - b) <= _EPS_US] if b < end else []
        nxt = min(following, key=lambda g: g.ts) if following else None
        call, op, link = links.launcher(nxt, main) if nxt else (None, None, None)
        gaps.append(Gap(ts=a, offset_us=a - start, dur_us=b - a,
                        next_gpu_op=nxt.name if nxt else None, launch_call=call,
                        launched_by=op, link=link, cpu_during=_cpu_during(main_spans, a, b)))
    return tuple(gaps)


def _cpu_during(candidates: list[_Span], a: float, b: float) -> str | None:
    """The span overlapping [a, b] the most; on a tie the outer one (earlier, longer)."""
    best = max((s for s in candidates if s.ts < b and s.end > a), default=None,
               key=lambda s: (min(b, s.end) - max(a, s.ts), -s.ts, s.dur))
    return best.name if best else None


class _Links:
    """Who launched a GPU activity: its correlation id names the CUDA runtime call, whose
    "External id" names the cpu_op. Without correlation ids the ac2g flow arrows lead to
    the call; without either, the innermost cpu_op running when the activity began (after
    an idle gap the queue was empty, so the GPU started it as soon as it was launched)."""

    def __init__(self, spans: list[_Span], flows: tuple[dict, dict]) -> None:
        self.runtime_by_corr = {s.args["correlation"]: s for s in spans
                                if s.cat == "cuda_runtime" and "correlation" in s.args}
        self.op_by_ext = {s.args["External id"]: s for s in spans
                          if s.cat == "cpu_op" and "External id" in s.args}
        self.flow_end, self.flow_start = flows
        self.by_thread: dict[tuple[Any, Any], list[_Span]] = defaultdict(list)
        for s in spans:
            if s.cat in ("cpu_op", "cuda_runtime"):
                self.by_thread[s.pid, s.tid].append(s)

    def launcher(self, gpu_op: _Span, main: tuple[Any, Any] | None,
                 ) -> tuple[str | None, str | None, str | None]:
        call = self.runtime_by_corr.get(gpu_op.args.get("correlation"))
        link = "correlation"
        if call is None:
            flow_id = self.flow_end.get((gpu_op.pid, gpu_op.tid, round(gpu_op.ts, 3)))
            origin = self.flow_start.get(flow_id)
            if origin is not None:
                call = self._innermost(*origin, "cuda_runtime")
                link = "flow"
        if call is None:
            op = self._innermost(*main, gpu_op.ts, "cpu_op") if main else None
            return None, op.name if op else None, "time" if op else None
        op = self.op_by_ext.get(call.args.get("External id"))
        op = op or self._innermost(call.pid, call.tid, call.ts, "cpu_op")
        return call.name, op.name if op else None, link

    def _innermost(self, pid: Any, tid: Any, t: float, cat: str) -> _Span | None:
        around = [s for s in self.by_thread.get((pid, tid), ())
                  if s.cat == cat and s.ts - _EPS_US <= t <= s.end + _EPS_US]
        return min(around, key=lambda s: s.dur, default=None)


def _top_kernels(kernels: list[_Span]) -> tuple[KernelStat, ...]:
    count: dict[str, int] = defaultdict(int)
    total: dict[str, float] = defaultdict(float)
    for k in kernels:
        count[k.name] += 1
        total[k.name] += k.dur
    ranked = sorted(count, key=lambda n: (-total[n], n))[:TOP_N]
    return tuple(KernelStat(n, count[n], total[n], total[n] / count[n]) for n in ranked)


def _small_kernels(kernels: list[_Span]) -> SmallKernels | None:
    if not kernels:
        return None
    small = [k for k in kernels if k.dur < SMALL_KERNEL_US]
    total = sum(k.dur for k in kernels)
    small_us = sum(k.dur for k in small)
    return SmallKernels(SMALL_KERNEL_US, len(small), len(small) / len(kernels), small_us,
                        small_us / total if total else 0.0)


def copy_kinds(event_name: str, args: dict[str, Any]) -> tuple[str | None, str | None]:
    """(source, destination) memory kinds of a memcpy, e.g. ("Pageable", "Device").

    Kineto writes them in the name ("Memcpy HtoD (Pageable -> Device)"); some tools put
    them in args "src"/"dst". (None, None) when the trace has neither."""
    match = _COPY_KINDS.search(event_name)
    if match:
        return match.group(1), match.group(2)
    src, dst = args.get("src"), args.get("dst")
    return (src if isinstance(src, str) else None), (dst if isinstance(dst, str) else None)


def _h2d(gpu: list[_Span], notes: list[str]) -> HostToDevice:
    copies, pageable, pinned, unknown = [], [], [], []
    for g in gpu:
        if g.cat != "gpu_memcpy":
            continue
        src, dst = copy_kinds(g.name, g.args)
        if "htod" not in g.name.lower() and not (src in ("Pageable", "Pinned")
                                                 and dst == "Device"):
            continue
        copies.append(g)
        if src == "Pageable":
            pageable.append(g)
        elif src == "Pinned":
            pinned.append(g)
        else:
            unknown.append(g)
    if unknown:
        notes.append(f"{len(unknown)} host-to-device copies do not say pageable or pinned")
    nbytes = sum(int(g.args.get("bytes", 0)) for g in copies
                 if isinstance(g.args.get("bytes"), (int, float)))
    return HostToDevice(
        count=len(copies), total_us=sum(g.dur for g in copies), bytes=nbytes,
        pageable_count=len(pageable), pageable_us=sum(g.dur for g in pageable),
        pinned_count=len(pinned), pinned_us=sum(g.dur for g in pinned),
        unknown_count=len(unknown), longest_us=max((g.dur for g in copies), default=0.0))


def is_collective_kernel(name: str) -> bool:
    lowered = name.lower()
    return "nccl" in lowered or "rccl" in lowered


def _overlap(kernels: list[_Span], notes: list[str]) -> Overlap | None:
    """How much of the collective kernels' time other kernels ran alongside. A stream runs
    one kernel at a time, so anything overlapping a collective is on another stream."""
    comms = [k for k in kernels if is_collective_kernel(k.name)]
    if not comms:
        notes.append("no collective (NCCL) kernels: communication overlap not measured")
        return None
    compute = _union([(k.ts, k.end) for k in kernels if not is_collective_kernel(k.name)])
    ends = [y for _, y in compute]
    total = sum(c.dur for c in comms)
    overlapped = sum(_overlap_us(c.ts, c.end, compute, ends) for c in comms)
    return Overlap(total, overlapped, overlapped / total if total else 0.0)


# --- findings --------------------------------------------------------------------------


def _finding(pattern: str, evidence: str, hint: str) -> TracePattern:
    return TracePattern(pattern, PATTERNS[pattern], evidence, hint)


def _with_findings(a: TraceAnalysis) -> TraceAnalysis:
    found = []
    window = a.window_us
    stepped = sum(s.dur_us for s in a.step_stats) or window
    if stepped and a.dataloader_us / stepped >= DATALOADER_STEP_SHARE:
        found.append(_finding(
            "dataloader_stall", f"DataLoader takes {a.dataloader_us / stepped:.0%} of the steps",
            "more DataLoader num_workers, pin_memory=True, prefetch; preprocess offline"))
    if a.gpu_idle_share is not None and a.gpu_idle_share >= GPU_IDLE_SHARE:
        top = a.idle_gaps[0] if a.idle_gaps else None
        where = (f"; longest gap {top.dur_us:.0f} µs, CPU in {top.cpu_during or '?'}, "
                 f"next launched by {top.launched_by or '?'}") if top else ""
        found.append(_finding(
            "gpu_idle", f"GPU idle {a.gpu_idle_share:.0%} of the window{where}",
            "the CPU op at the longest gap is what the GPU waits for: launches, input, or "
            "a collective blocking the next forward"))
    small = a.small_kernels
    if (small is not None and a.gpu_idle_share is not None
            and small.count_share >= LAUNCH_BOUND_SMALL_SHARE
            and a.gpu_idle_share >= GPU_IDLE_SHARE):
        found.append(_finding(
            "launch_bound", f"{small.count_share:.0%} of kernels are shorter than "
            f"{small.threshold_us:.0f} µs and the GPU is idle {a.gpu_idle_share:.0%}",
            "fuse ops with torch.compile(); autocast; CUDA graphs for static shapes"))
    h2d = a.h2d_copies
    if h2d is not None and window and h2d.pageable_us / window >= PAGEABLE_H2D_SHARE:
        found.append(_finding(
            "unpinned_copy", f"{h2d.pageable_count} pageable HtoD copies take "
            f"{h2d.pageable_us / window:.0%} of the window",
            "DataLoader(pin_memory=True) and .to(device, non_blocking=True)"))
    ov = a.comm_overlap
    if (ov is not None and window and ov.collective_us / window >= MIN_COLLECTIVE_SHARE
            and ov.share < LOW_OVERLAP_SHARE):
        found.append(_finding(
            "no_overlap", f"only {ov.share:.0%} of {ov.collective_us:.0f} µs of collective "
            "kernels overlaps other kernels",
            "smaller DDP bucket_cap_mb; drop find_unused_parameters=True"))
    return replace(a, findings=tuple(found))


# --- two ranks side by side ------------------------------------------------------------


@dataclass(frozen=True)
class CompareRow:
    metric: str
    worst: float | None
    median: float | None
    delta: float | None  # worst - median


@dataclass(frozen=True)
class Comparison:
    worst_rank: int | None
    median_rank: int | None
    rows: tuple[CompareRow, ...]
    findings: tuple[TracePattern, ...]

    def to_dict(self) -> dict[str, Any]:
        return _rounded(asdict(self))


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _per_step(total: float, a: TraceAnalysis) -> float | None:
    return total / len(a.step_stats) if a.step_stats else None


def _row_values(a: TraceAnalysis) -> dict[str, float | None]:
    return {
        "steps": float(len(a.step_stats)),
        "step_us": a.mean_step_us,
        "dataloader_us_per_step": _per_step(a.dataloader_us, a),
        "collective_us_per_step": _per_step(a.collective_us, a),
        "local_us_per_step": (None if not a.step_stats else
                              a.mean_step_us - a.collective_us / len(a.step_stats)),
        "gpu_busy_share": a.gpu_busy_share,
        "gpu_idle_share": a.gpu_idle_share,
        "comm_overlap_share": a.comm_overlap.share if a.comm_overlap else None,
        "small_kernel_share": a.small_kernels.count_share if a.small_kernels else None,
        "pageable_h2d_us": a.h2d_copies.pageable_us if a.h2d_copies else None,
        "longest_idle_gap_us": a.idle_gaps[0].dur_us if a.idle_gaps else None,
    }


def compare_ranks(worst: TraceAnalysis, median: TraceAnalysis) -> Comparison:
    """The worst rank's trace beside the median rank's, metric by metric.

    Straggler signature (bottleneck guide, pattern 3): in a synchronous job every rank's step takes
    as long as the slowest one's, so step times do not tell. The straggler does more local
    work (step minus collectives) and spends *less* time in collectives than the median
    rank, which sits in the AllReduce waiting for it."""
    w, m = _row_values(worst), _row_values(median)
    rows = tuple(CompareRow(k, w[k], m[k], None if w[k] is None or m[k] is None
                            else w[k] - m[k]) for k in w)
    found = []
    ms, wl, ml = m["step_us"], w["local_us_per_step"], m["local_us_per_step"]
    wc, mc = w["collective_us_per_step"], m["collective_us_per_step"]
    if (ms and None not in (wl, ml, wc, mc)
            and wl - ml >= STRAGGLER_EXCESS_SHARE * ms and wc < mc):
        who = f"rank {worst.rank}" if worst.rank is not None else "the worst rank"
        found.append(_finding(
            "straggler", f"{who} works {(wl - ml) / 1000:.2f} ms more per step outside "
            f"collectives and waits {(mc - wc) / 1000:.2f} ms less in them: the others wait "
            "for it",
            "uneven shards (DistributedSampler, drop_last=True), its input or its GPU "
            "(nvidia-smi -q -d PERFORMANCE)"))
    return Comparison(worst.rank, median.rank, rows, tuple(found))


# --- text ------------------------------------------------------------------------------


def _short(name: str | None, width: int = 60) -> str:
    if name is None:
        return "-"
    return name if len(name) <= width else name[: width - 1] + "…"


def render_text(a: TraceAnalysis) -> str:
    """A few lines: what the window holds, the GPU picture, the top ops, the findings."""
    who = f"rank {a.rank}" if a.rank is not None else "trace"
    steps = f"steps {a.steps[0]}-{a.steps[-1]}" if a.steps else "no step spans"
    lines = [f"{who}: {steps}, window {a.window_us / 1000:.2f} ms"]
    if a.step_stats:
        lines.append(f"  step mean {a.mean_step_us / 1000:.2f} ms, DataLoader "
                     f"{a.dataloader_us / len(a.step_stats) / 1000:.2f} ms/step")
    if a.needs_gpu:
        lines.append("  GPU: no GPU activity in this trace (" + ", ".join(a.needs_gpu)
                     + " need a CUDA trace)")
    else:
        lines.append(f"  GPU busy {a.gpu_busy_share:.0%}, idle {a.gpu_idle_share:.0%}")
        for g in a.idle_gaps[:3]:
            lines.append(f"    gap {g.dur_us:.0f} µs at +{g.offset_us / 1000:.2f} ms: CPU in "
                         f"{_short(g.cpu_during, 40)}, next by {_short(g.launched_by, 40)}")
        if a.comm_overlap is not None:
            lines.append(f"  collective kernels {a.comm_overlap.collective_us:.0f} µs, "
                         f"{a.comm_overlap.share:.0%} overlapped")
    for op in a.cpu_ops[:3]:
        lines.append(f"  cpu {_short(op.name)}: self {op.self_us / 1000:.2f} ms x{op.count}")
    for c in a.collectives[:3]:
        lines.append(f"  collective {_short(c.name)}: {c.total_us / 1000:.2f} ms x{c.count}")
    for f in a.findings:
        lines.append(f"  [{f.title}] {f.evidence} -> {f.hint}")
    return "\n".join(lines) + "\n"
