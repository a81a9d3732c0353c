"""Per-step phase accounting: the agent's hot path.

Hooks call `begin`/`end` around a phase and `close_step` at each optimizer step.

Phases nest, because real training code nests them: Lightning runs forward and
backward inside `optimizer.step(closure)`, manual optimization steps the optimizer
inside the DDP module's forward, and a step may all-gather a count between
forward and optimizer. Open phases form a stack, and every nanosecond is charged
to the *innermost* open phase only (exclusive time): the optimizer's own update is
"optimizer", its closure's forward and backward are forward and backward.

Two exceptions keep the labels meaning what users expect:
  * the DataLoader is opaque: whatever runs inside `next(loader)` (a module in a
    collate function, a collective in a sampler) is input time;
  * the same phase inside itself (a module calling a module) is one phase.

A phase may stay open across one step boundary (manual optimization closes the
step inside forward; the rest of that forward belongs to the next step). A phase
still open at the following boundary lost its closing hook: it is closed there and
counted in `forced`, which the agent reports, so the recorder can never stay stuck
and the collector can say which phases could not be timed. An `end` for a phase
buried under others closes those others the same way.

A finished step is appended to `out` (a bounded deque drained by the sender
thread) as ``(step, t_end_ns, wall_ns, phase_ns)``, where ``phase_ns[i]`` is the
time in ``MEASURED[i]`` in nanoseconds, or None when that phase was not seen
during the step. "wait" is derived later (wall minus the measured phases).

`CudaRecorder` times device phases with CUDA events and resolves them with
`query()` on later steps: it never synchronizes the training thread. It makes no
CUDA call at all while any CUDA graph capture is in progress in the process (hooks.py
counts them through `torch.cuda.CUDAGraph.capture_begin/capture_end`): in CUDA's default
"global" capture mode an event query from any thread invalidates the user's capture.

Threads (docs/agent-api.md, "Threads"): the phase stack belongs to the training thread;
the hooks let other threads through untimed (hooks.py decides). A DataLoader iterated
on a background thread is accounted apart: the time the training thread spends outside
every phase while such a fetch is running is its input wait.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from time import perf_counter_ns
from typing import Any

from . import device, visible_devices, vocab

# Phases the recorder measures, by index (vocab.PHASE_TABLE's order). "wait" is derived,
# never recorded. The hooks' phases as plain ints: the hot path compares and indexes them.
MEASURED = vocab.MEASURED_PHASES
DATALOADER = MEASURED.index(vocab.DATALOADER)
H2D = MEASURED.index(vocab.H2D)
FORWARD = MEASURED.index(vocab.FORWARD)
BACKWARD = MEASURED.index(vocab.BACKWARD)
SYNC = MEASURED.index(vocab.SYNC)
OPTIMIZER = MEASURED.index(vocab.OPTIMIZER)
MAX_CUSTOM_PHASES = 8
NO_PHASE = -1
# A stack deeper than this is a hook pairing bug, not real nesting: close the oldest.
MAX_DEPTH = 32
FLUSH_DEADLINE_S = 2.0  # at shutdown, how long the device gets to finish timed work
# Device segments (event pairs) kept for one step: a loop without optimizer steps
# (evaluation, inference) never reaches a step boundary to resolve them.
MAX_STEP_PAIRS = 4096
# Distinct (group, op, phase) keys of one step's collectives: past this, "other".
MAX_COLL_KEYS = 8
COLL_OTHER = ("other", "other", NO_PHASE)
# Steps' collective tables waiting for the sender (it drains them ~10 times a second).
MAX_COLL_STEPS = 4096
# Steps waiting for their device times: graph replays let the host run hundreds of steps
# ahead of the device (CUDA's launch queue holds ~1024 entries per stream). Past this many
# the oldest is sent on the host clock (device phases not measured) and counted in
# `late_steps`: memory stays bounded, and no step is lost.
MAX_PENDING_STEPS = 1024
# Idle timing events kept for reuse: a few steps' worth. An evaluation pass can take
# thousands; they go back to CUDA instead of staying pooled for the rest of the run.
MAX_POOL = 64

# CUDA graph captures in progress in this process (any thread, any mode), counted by
# hooks.py's wrappers of CUDAGraph.capture_begin/capture_end. Read before any CUDA call.
_captures = 0


def capture_began() -> None:
    global _captures
    _captures += 1


def capture_ended() -> None:
    global _captures
    _captures = max(0, _captures - 1)


def capturing() -> bool:
    """Whether a CUDA graph capture is in progress anywhere in this process: then the
    agent makes no CUDA call (an event query, a pinned allocation, the profiler)."""
    return _captures > 0


class Recorder:
    """Host-clock recorder, used on CPU jobs."""

    DEFERRED = False  # steps are appended as they close (CudaRecorder parks them)
    # grads_ready() only stores perf_counter_ns() in t_ready: hooks.py's final callback
    # does that itself (a Python call saved per backward). CudaRecorder records an event.
    HOST_READY = True

    __slots__ = (
        "out",
        "names",
        "index",
        "acc",
        "stack",
        "active",
        "owner",
        "t_mark",
        "forced",
        "step",
        "step_start",
        "t_ready",
        "explicit_steps",
        "collectives",
        "parallel",
        "step_listener",
        "in_collective",
        "groups",
        "in_group",
        "grad_bytes",
        "last_step_t",
        "last_wall",
        "device_sources",
        "device_tensor",
        "replays",
        "replay_mark",
        "batches",
        "timing_faults",
        "capture_skips",
        "device_rule",
        "agent_busy",
        "thread",
        "check_threads",
        "loader_thread",
        "bg_loader",
        "bg_busy",
        "bg_since",
        "bg_total",
        "bg_seen",
        "coll",
        "coll_out",
        "ddp_group",
    )

    def __init__(self, out: deque) -> None:
        self.out = out
        self.names: list[str] = list(MEASURED)
        self.index: dict[str, int] = {n: i for i, n in enumerate(self.names)}
        self.acc: list[int | None] = [None] * len(self.names)
        # Open phases, innermost last: (phase index, owner, step it began in).
        self.stack: list[tuple[int, Any, int]] = []
        self.active = NO_PHASE  # the innermost open phase (stack[-1]), for cheap checks
        self.owner: Any = None
        self.t_mark = 0  # since when the innermost open phase has been accruing time
        self.forced: list[int] = [0] * len(self.names)  # phases closed for lack of an end
        self.step = 0
        self.step_start = 0  # 0: the first step starts at its first phase
        self.t_ready = 0  # when backward's gradients were all computed (sync split)
        self.explicit_steps = False
        # Progress, read by the heartbeat thread (which needs nothing from this one):
        self.collectives = 0  # explicit torch.distributed collectives entered
        self.parallel: str | None = None  # "ddp" or "fsdp", learned during the first step
        self.grad_bytes = 0  # gradient bytes DDP all-reduces per step (hooks.py)
        # Called after each closed step, only while a deep-trace capture is asked or running.
        self.step_listener: Any = None
        self.in_collective: str | None = None
        # Collectives entered per process group (hooks.py names the groups; bounded there),
        # and the group of the one in progress: a hang compares these sequences.
        self.groups: dict[str, int] = {}
        self.in_group: str | None = None
        self.last_step_t = perf_counter_ns()
        self.last_wall = 0  # the last step's wall time, ns
        # What the hooks saw that may hold the training device (device.py), as weak
        # references: only a LazyCudaRecorder reads them, at step boundaries.
        self.device_sources: list[Any] = []
        self.device_tensor: int | None = None  # the CUDA index of the first batch moved there
        # Progress and health, read by the heartbeat thread:
        self.replays = 0  # CUDA graph replays (a replayed whole step runs no hook)
        self.replay_mark = -1  # the step count at the last replay (hooks.py)
        self.batches = 0  # DataLoader batches fetched, by any thread
        self.timing_faults = 0  # device pairs that could not be timed (negative, failed)
        self.capture_skips = 0  # timing events not recorded because a graph was capturing
        self.device_rule: str | None = None  # which rule chose the timed device (device.py)
        self.agent_busy: str | None = None  # a long pause of the agent's own, while it lasts
        # The training thread (get_ident), once it opens forward, backward or optimizer;
        # before that, the thread whose DataLoader fetch was provisionally timed.
        self.thread: int | None = None
        # Whether the forward/backward/optimizer hooks must ask which thread calls them:
        # until the training thread is known, and once the job has another thread of
        # its own (alive at the claim, or started later: hooks.py wraps Thread.start).
        # A job without one pays no thread query there (the DataLoader hook always asks).
        self.check_threads = True
        self.loader_thread: int | None = None
        # Fetches on a background loader thread: how many run now, since when, and the
        # time any ran in total (ns); bg_seen: that total when last charged as input.
        self.bg_loader = False
        self.bg_busy = 0
        self.bg_since = 0
        self.bg_total = 0
        self.bg_seen = 0
        # Collectives of the step in progress: (group, op, phase it was issued in) ->
        # [calls, bytes (-1: unknown), exposed ns] (hooks.py, `account`), bounded to
        # MAX_COLL_KEYS keys; handed to the sender at the step's close (one deque append
        # on the steps that had one, a truthiness test on the others).
        self.coll: dict[tuple[str, str, int], list[int]] = {}
        self.coll_out: deque = deque(maxlen=MAX_COLL_STEPS)
        self.ddp_group = "world"  # the process group DDP's reducer all-reduces on
    # --- threads ------------------------------------------------------------------

    def claim_thread(self, ident: int) -> None:
        """`ident` is the training thread (it opens a step's work). What another thread's
        provisional DataLoader fetch left on the stack was not the training thread's."""
        self.thread = ident
        self.check_threads = self._other_threads()
        if self.loader_thread not in (None, ident):
            self.stack = []
            self.active, self.owner = NO_PHASE, None
            self.acc = [None] * len(self.names)
            self.step_start = 0
        self.loader_thread = None

    def _other_threads(self) -> bool:
        """Whether a Python thread other than the training thread and the agent's own
        ("traceml-*") is alive: one of the job's, which may call a hooked function."""
        me = self.thread
        return any(t.ident != me and not t.name.startswith("traceml")
                   for t in threading.enumerate())

    def bg_begin(self) -> None:
        """A background thread starts a DataLoader fetch (off the stack)."""
        if not self.bg_busy:
            self.bg_since = perf_counter_ns()
        self.bg_busy += 1
        self.bg_loader = True

    def bg_end(self) -> None:
        busy = self.bg_busy - 1
        self.bg_busy = max(0, busy)
        if busy <= 0:
            self.bg_total += perf_counter_ns() - self.bg_since

    def _bg_input(self, t: int) -> None:
        """The training thread leaves idle time at `t`: the part of that idle stretch a
        background fetch was running is input wait (it was waiting for the batch)."""
        if not self.t_mark:
            return
        busy = self.bg_total + (t - self.bg_since if self.bg_busy else 0)
        dt = min(t - self.t_mark, busy - self.bg_seen)
        self.bg_seen = busy
        if dt > 0:
            _add(self.acc, DATALOADER, dt)

    # --- phases -------------------------------------------------------------------

    def begin(self, idx: int, owner: Any = None) -> bool:
        """Open a phase inside whatever is open. False when it is not timed (inside the
        DataLoader, or the same phase already innermost): then do not call `end`.

        This and `end` run several times per step on the training thread, so they are
        _charge/_push/_pop written out inline (a Python call costs ~0.1 us each);
        CudaRecorder, which hooks those steps, uses the composed versions."""
        active = self.active
        if active == DATALOADER or active == idx:
            return False
        t = perf_counter_ns()
        if not self.step_start:
            self.step_start = t
        stack = self.stack
        if active != NO_PHASE:
            acc = self.acc
            prev = acc[active]
            acc[active] = t - self.t_mark if prev is None else prev + t - self.t_mark
            if len(stack) >= MAX_DEPTH:  # unreachable with paired hooks
                self._force(0, t)
        elif self.bg_loader:
            self._bg_input(t)
        stack.append((idx, owner, self.step))
        self.active = idx
        self.owner = owner
        self.t_mark = t
        return True

    def end(self, owner: Any = None) -> None:
        """Close the phase `owner` opened. Phases opened inside it and never closed are
        closed with it (and counted as forced); an unknown owner is ignored."""
        if owner is not self.owner:
            self._end_buried(owner)
            return
        active = self.active
        if active == NO_PHASE:
            return
        t = perf_counter_ns()
        acc = self.acc
        prev = acc[active]
        acc[active] = t - self.t_mark if prev is None else prev + t - self.t_mark
        stack = self.stack
        stack.pop()
        if stack:
            self.active, self.owner, _ = stack[-1]
        else:
            self.active, self.owner = NO_PHASE, None
        self.t_mark = t

    def _begin_composed(self, idx: int, owner: Any = None) -> bool:
        """`begin` built from the overridable steps (_charge, _push): CudaRecorder's."""
        active = self.active
        if active == DATALOADER or active == idx:
            return False
        t = perf_counter_ns()
        if not self.step_start:
            self.step_start = t
            self._step_began()
        if active != NO_PHASE:
            self._charge(active, t)
            if len(self.stack) >= MAX_DEPTH:  # unreachable with paired hooks
                self._force(0, t)
        elif self.bg_loader:
            self._bg_input(t)
        self._push(idx, owner, t)
        return True

    def _end_composed(self, owner: Any = None) -> None:
        """`end` built from the overridable steps (_charge, _pop): CudaRecorder's."""
        if owner is not self.owner:
            self._end_buried(owner)
            return
        if self.active == NO_PHASE:
            return
        t = perf_counter_ns()
        self._charge(self.active, t)
        self._pop(t)

    def cancel(self) -> None:
        """The innermost phase turned out not to be one (a dtype cast, not a copy): its
        time so far goes back to the phase around it."""
        if self.active == NO_PHASE:
            return
        t = perf_counter_ns()
        self.stack.pop()
        self._resume(t)
        # t_mark is left where the cancelled phase began: the parent accrues that time.
        if self.active == NO_PHASE:
            self.t_mark = t

    def _step_began(self) -> None:
        """The first step starts at its first phase (CudaRecorder marks it on the device)."""

    def _push(self, idx: int, owner: Any, t: int) -> None:
        self.stack.append((idx, owner, self.step))
        self.active = idx
        self.owner = owner
        self.t_mark = t

    def _pop(self, t: int) -> None:
        self.stack.pop()
        self._resume(t)
        self.t_mark = t

    def _resume(self, t: int) -> None:
        """The phase under the one just removed is innermost again."""
        if self.stack:
            idx, owner, _ = self.stack[-1]
            self.active, self.owner = idx, owner
        else:
            self.active, self.owner = NO_PHASE, None

    def _charge(self, idx: int, t: int) -> None:
        """Time since t_mark belongs to phase `idx` (the innermost open one)."""
        _add(self.acc, idx, t - self.t_mark)

    def _end_buried(self, owner: Any) -> None:
        self._end_buried_to(owner)
        if owner is self.owner and self.active != NO_PHASE:
            self._pop(self.t_mark)  # its time was charged when the phases above it closed

    def _force(self, keep: int, t: int) -> None:
        """Close every open phase above position `keep` of the stack (their time is
        already charged), counting each as forced."""
        stack = self.stack
        while len(stack) > keep:
            idx = stack.pop()[0]
            self.forced[idx] += 1
        self._resume(t)
        self.t_mark = t

    # --- the DDP sync split ---------------------------------------------------------

    def grads_ready(self) -> None:
        """Called from autograd's final callback: local gradient work is done."""
        self.t_ready = perf_counter_ns()

    def begin_backward(self, owner: Any) -> bool:
        """`begin(BACKWARD)` written out (hot: once per backward), and the split reset."""
        active = self.active
        if active == DATALOADER or active == BACKWARD:
            return False
        t = perf_counter_ns()
        if not self.step_start:
            self.step_start = t
        stack = self.stack
        if active != NO_PHASE:
            acc = self.acc
            prev = acc[active]
            acc[active] = t - self.t_mark if prev is None else prev + t - self.t_mark
            if len(stack) >= MAX_DEPTH:
                self._force(0, t)
        elif self.bg_loader:
            self._bg_input(t)
        stack.append((BACKWARD, owner, self.step))
        self.active = BACKWARD
        self.owner = owner
        self.t_mark = t
        self.t_ready = 0
        return True

    def end_backward(self, owner: Any) -> None:
        """Split backward's last stretch into local compute and exposed collective wait:
        DDP's reducer waits for its allreduces after the last gradient is ready."""
        if owner is not self.owner:
            self._end_buried_to(owner)
            if owner is not self.owner:
                return
        t = perf_counter_ns()
        ready, mark = self.t_ready, self.t_mark
        acc = self.acc
        # _add written out (hot: once per backward): backward's and sync's shares.
        if ready and mark <= ready <= t:
            back, sync = ready - mark, t - ready
        elif ready and ready < mark:  # ready before a phase nested in backward: all wait
            back, sync = None, t - mark
        else:
            back, sync = t - mark, None
        if back is not None:
            prev = acc[BACKWARD]
            acc[BACKWARD] = back if prev is None else prev + back
        if sync is not None:
            prev = acc[SYNC]
            acc[SYNC] = sync if prev is None else prev + sync
        stack = self.stack  # _pop written out (hot: once per backward)
        stack.pop()
        if stack:
            self.active, self.owner, _ = stack[-1]
        else:
            self.active, self.owner = NO_PHASE, None
        self.t_mark = t

    def _end_buried_to(self, owner: Any) -> None:
        """Force-close the phases above `owner`'s, leaving its own open."""
        stack = self.stack
        for pos in range(len(stack) - 2, -1, -1):
            if stack[pos][1] is owner:
                t = perf_counter_ns()
                self._charge(self.active, t)
                self._force(pos + 1, t)
                return

    # --- steps --------------------------------------------------------------------

    def close_step(self) -> None:
        t = perf_counter_ns()
        start = self.step_start or t
        if self.active != NO_PHASE:
            # Open phases go on into the next step; what they did so far belongs here.
            self._charge(self.active, t)
            self.t_mark = t
            self._close_stale(t)
        elif self.bg_loader:
            self._bg_input(t)
            self.t_mark = t
        if self.coll:  # before the record: a sender that has the record has its table
            self.coll_out.append(self.coll)
            self.coll = {}
        if self.DEFERRED:
            self._emit(self.step, t, t - start, self.acc)
        else:  # _emit written out (a Python call saved per step on the host clock)
            self.out.append((self.step, t, t - start, self.acc))
        self.step += 1
        self.step_start = t
        self.last_step_t = t
        self.last_wall = t - start
        self.acc = [None] * len(self.names)
        listener = self.step_listener
        if listener is not None:
            listener()

    def end_step(self, owner: Any) -> None:
        """`end(owner)` then `close_step()`: the stepping optimizer's post hook, once a step.
        Written out for the common case (the optimizer is the only open phase, no
        background loader): one Python call and one clock read where the two took two
        each. Anything else, and the device recorders, take the composed path."""
        stack = self.stack
        if owner is not self.owner or len(stack) != 1 or self.bg_loader:
            self._end_step_composed(owner)
            return
        t = perf_counter_ns()
        acc = self.acc
        active = self.active
        prev = acc[active]
        acc[active] = t - self.t_mark if prev is None else prev + t - self.t_mark
        stack.pop()
        self.active, self.owner = NO_PHASE, None
        self.t_mark = t
        if self.coll:  # before the record: a sender that has the record has its table
            self.coll_out.append(self.coll)
            self.coll = {}
        start = self.step_start or t
        self.out.append((self.step, t, t - start, acc))
        self.step += 1
        self.step_start = t
        self.last_step_t = t
        self.last_wall = t - start
        self.acc = [None] * len(self.names)
        listener = self.step_listener
        if listener is not None:
            listener()

    def _end_step_composed(self, owner: Any) -> None:
        self.end(owner)
        self.close_step()

    def _close_stale(self, t: int) -> None:
        """A phase open since before the previous boundary lost its end hook."""
        stack, step = self.stack, self.step
        for pos, frame in enumerate(stack):
            if frame[2] < step:
                self._force(pos, t)
                return

    def _emit(self, step: int, t: int, wall: int, acc: list[int | None]) -> None:
        self.out.append((step, t, wall, acc))

    def account(self, group: str, op: str, phase: int, ns: int, nbytes: int) -> None:
        """One explicit collective of this step: `ns` of exposed wait (0 when untimed),
        `nbytes` this rank's input (-1: unknown). Once per collective call, not per step."""
        coll = self.coll
        key = (group, op, phase)
        entry = coll.get(key)
        if entry is None:
            if len(coll) >= MAX_COLL_KEYS:
                key = COLL_OTHER
                entry = coll.get(key)
            if entry is None:
                entry = coll[key] = [0, 0, 0]
        entry[0] += 1
        if nbytes < 0 or entry[1] < 0:
            entry[1] = -1
        else:
            entry[1] += nbytes
        entry[2] += ns

    def replayed(self, on_training_thread: bool) -> None:
        """A CUDA graph was replayed. A whole-step graph runs no hook: when the training
        thread replays outside every phase and no step closed since its last replay, the
        replay is the step (its phases not timed, None; its time on the device clock
        between step ends). A graph replayed inside a phase (torch.compile's cudagraph
        trees replay inside forward and backward) is part of that phase's step."""
        self.replays += 1
        if on_training_thread and self.active == NO_PHASE and not self.explicit_steps:
            if self.step == self.replay_mark:
                self.close_step()
            self.replay_mark = self.step

    def open_step(self) -> None:
        """Explicit API: a step starts now (the time before it is not part of any step)."""
        t = perf_counter_ns()
        self.step_start = t
        self.t_mark = t
        self.acc = [None] * len(self.names)

    def phase_index(self, name: str) -> int | None:
        idx = self.index.get(name)
        if idx is None and len(self.names) < len(MEASURED) + MAX_CUSTOM_PHASES:
            idx = len(self.names)
            self.names.append(name)
            self.index[name] = idx
            self.acc.append(None)
            self.forced.append(0)
        return idx

    def in_phase(self) -> tuple[str | None, float]:
        """What the training thread is doing now (read racily by the heartbeat thread)."""
        idx, t0 = self.active, self.t_mark
        if idx == NO_PHASE:
            return None, 0.0
        return self.names[idx], max(0.0, (perf_counter_ns() - t0) / 1e9)

    def flush(self) -> None:
        """Nothing pending on the host clock."""


def _add(acc: list, idx: int, dt: int) -> None:
    prev = acc[idx]
    acc[idx] = dt if prev is None else prev + dt


class CudaRecorder(Recorder):
    """Times device phases with CUDA events, resolved later with `query()`.

    The dataloader is host work, timed on the host clock. h2d, forward, backward,
    sync and optimizer are timed between events recorded on the rank's step stream:
    each time the innermost phase changes to or from a device phase one event is
    recorded, and the device time between two consecutive events belongs to the
    phase that was innermost between them (exclusive time, as on the host). The step
    time is the device time between consecutive step-end events, so an idle GPU
    waiting for input shows up as step time the phases do not cover.

    The step stream (issue 40; docs/agent-api.md, "The step stream"): the device's
    default stream, unless the rank's whole step runs on another one (its first device
    phase and its end on the same non-default stream, as in PyTorch's CUDA-graph
    warm-up recipe). It is re-learned at every step end. Every event, phase or step
    end, goes on it, never on the current stream: a collective FSDP issues on its own
    stream then times as the compute stream's exposed wait for it (not the collective
    kernel's duration), and no pair spans two streams. The step on which the stream
    changes is sent as not measured (its events were on the old stream) and counted
    as a timing fault.
    """

    __slots__ = ("torch", "pool", "pairs", "pending", "prev_end", "ev_mark", "ev_ready",
                 "max_pending", "dropped_pairs", "_capturing", "device", "device_uuid",
                 "stream", "begin_stream", "late_steps", "stream_changes")
    DEVICE_PHASES = frozenset(MEASURED.index(p) for p in vocab.DEVICE_PHASES)
    DEFERRED = True
    HOST_READY = False
    begin = Recorder._begin_composed
    end = Recorder._end_composed
    end_step = Recorder._end_step_composed

    def __init__(self, out: deque, torch_module: Any, max_pending: int = MAX_PENDING_STEPS,
                 device: int | None = None) -> None:
        super().__init__(out)
        self.torch = torch_module
        self.device = device  # the CUDA index the rank trains on (device.py)
        self.device_uuid: str | None = None  # its UUID, as torch reports it (for NVML)
        self.pool: list[Any] = []
        self.pairs: list[tuple[int, Any, Any]] = []
        self.dropped_pairs = 0  # times the pairs of one step were cut to stay bounded
        self.stream: Any = None  # the step stream: every event is recorded on it
        self.begin_stream: Any = None  # the current stream at this step's first device phase
        self.late_steps = 0  # steps sent on the host clock: the device was too far behind
        self.stream_changes = 0  # times the step stream changed (that step not measured)
        self._capturing = getattr(torch_module.cuda, "is_current_stream_capturing", None)
        self.pending: deque = deque()
        self.prev_end: Any = None
        self.ev_mark: Any = None  # event at t_mark, when the innermost phase is on device
        self.ev_ready: Any = None
        self.max_pending = max_pending

    def _in_capture(self) -> bool:
        """A CUDA graph capture is in progress: one begun through CUDAGraph (counted by
        hooks.py, any thread: no CUDA call is then made at all), or the current stream
        of the rank's device captures (a capture begun before the agent's wrappers).
        Capture is asked only when the current device is the rank's: asking about
        another device's stream would open a context there."""
        if _captures:
            return True
        capturing = self._capturing
        return (capturing is not None and self.torch.cuda.current_device() == self.device
                and capturing())

    def _event(self) -> Any:
        """A timing event recorded on the step stream of the rank's own device (not the
        current device, which stays 0 in scripts that never call set_device); None during
        a capture: recording then would raise into the user's step (or be baked into the
        graph). The segments it would have bounded stay untimed (None), which the
        collector reports as a phase it could not see."""
        if self._in_capture():
            self.capture_skips += 1
            return None
        cuda = self.torch.cuda
        stream = self.stream
        if stream is None:  # until a step's end says otherwise: the default stream
            stream = self.stream = cuda.default_stream(self.device)
        ev = self.pool.pop() if self.pool else cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev

    def _pair(self, idx: int, a: Any, b: Any) -> None:
        """A device segment of phase `idx`, between events `a` and `b`; bounded."""
        pairs = self.pairs
        if len(pairs) >= MAX_STEP_PAIRS:  # no step boundary comes (eval, inference)
            del pairs[: len(pairs) // 2]  # the oldest half: memory stays bounded
            self.dropped_pairs += 1
        pairs.append((idx, a, b))

    def _charge(self, idx: int, t: int) -> None:
        if idx in self.DEVICE_PHASES:
            ev = self._event()
            if ev is not None and self.ev_mark is not None:
                self._pair(idx, self.ev_mark, ev)
            self.ev_mark = ev
        else:
            super()._charge(idx, t)

    def _push(self, idx: int, owner: Any, t: int) -> None:
        super()._push(idx, owner, t)
        self._mark(idx)

    def _resume(self, t: int) -> None:
        super()._resume(t)
        self._mark(self.active)

    def _mark(self, idx: int) -> None:
        """The device segment of the (new) innermost phase starts now."""
        if idx in self.DEVICE_PHASES:
            if self.begin_stream is None and not self._in_capture():
                self.begin_stream = self.torch.cuda.current_stream(self.device)
            if self.prev_end is None:
                # No step-end event before this step (the first, or the first after a
                # capture): its wall runs from here, on the device clock like its phases.
                self.prev_end = self._step_event()
            if self.ev_mark is None:
                self.ev_mark = self._event()
        else:
            self.ev_mark = None

    def grads_ready(self) -> None:
        super().grads_ready()
        self.ev_ready = self._event()

    def begin_backward(self, owner: Any) -> bool:
        self.ev_ready = None
        if not self._begin_composed(BACKWARD, owner):
            return False
        self.t_ready = 0
        return True

    def end_backward(self, owner: Any) -> None:
        if owner is not self.owner:
            self._end_buried_to(owner)
            if owner is not self.owner:
                return
        ev_end = self._event()
        ready, mark = self.ev_ready, self.ev_mark
        if ev_end is None:  # capturing: this stretch is not timed
            pass
        elif ready is not None and mark is not None and self.t_ready >= self.t_mark:
            self._pair(BACKWARD, mark, ready)
            self._pair(SYNC, ready, ev_end)
        elif mark is not None:
            self._pair(SYNC if ready is not None else BACKWARD, mark, ev_end)
        self.ev_mark = ev_end
        self._pop(perf_counter_ns())

    def _step_event(self) -> Any:
        """The step-end event, on the step stream like every other."""
        return self._event()

    def _learn_stream(self) -> bool:
        """At a step's end, the step stream for the next step: the stream the step ended
        on if its first device phase ran there too (the whole step ran on it; a step of
        no phase, a graph replay, runs on the stream it is replayed on), else the
        device's default stream. False when that changes it: this step's events were on
        the old stream, which may sit idle (a warm-up stream), so its wall is not to be
        trusted."""
        began, self.begin_stream = self.begin_stream, None
        if self._in_capture():
            return True
        cuda = self.torch.cuda
        ended = cuda.current_stream(self.device)
        want = ended if began is None or began == ended else cuda.default_stream(self.device)
        old = self.stream
        if old is not None and want == old:
            return True
        self.stream = want
        if old is None:
            return True
        self.stream_changes += 1
        self.timing_faults += 1
        return False

    def _step_began(self) -> None:
        """The first step's wall runs from its first phase, on the device clock."""
        if self.prev_end is None:
            self.prev_end = self._step_event()

    def _emit(self, step: int, t: int, wall: int, acc: list[int | None]) -> None:
        """The step's device times are not known yet: park it until its events complete.
        During a capture nothing is resolved (an event query would break it). When the
        step stream changes, the step goes out on the host clock (no prev_end)."""
        same = self._learn_stream()
        end_ev = self._step_event()
        self.pending.append((step, t, wall, acc, self.pairs, self.prev_end if same else None,
                             end_ev))
        self.prev_end = end_ev
        self.pairs = []
        if end_ev is not None:
            self._resolve()

    def _resolve(self) -> None:
        """Steps whose end event completed, in order. A pair that fails or comes out
        negative (its events on two streams) is a timing fault: that phase is sent as
        not measured (None) for the step, never as a made-up or negative value. A step
        whose own wall fails is dropped (one step lost; the agent stays on). A sticky
        device error (the job's own) propagates."""
        pending = self.pending
        if _captures:
            return
        while pending and (pending[0][6] is None or pending[0][6].query()):
            step, t, host_wall, acc, pairs, prev_end, end_ev = pending.popleft()
            bad: set[int] = set()
            for idx, a, b in pairs:
                ns = _elapsed_ns(a, b)
                if ns is None:
                    bad.add(idx)
                else:
                    _add(acc, idx, ns)
            if bad:
                self.timing_faults += len(bad)
                for idx in bad:
                    acc[idx] = None
            self._recycle(pairs, prev_end)
            wall = None if prev_end is None or end_ev is None else _elapsed_ns(prev_end, end_ev)
            if wall is None:  # a step in or just after a capture, or a failed wall
                if prev_end is not None and end_ev is not None:
                    self.timing_faults += 1
                self.out.append((step, t, host_wall, _host_only(acc)))
                continue
            _expose_input(acc, wall)
            self.out.append((step, t, wall, acc))
        while len(pending) > self.max_pending:  # device far behind: never block, never drop
            step, t, host_wall, acc, _, _, _ = pending.popleft()
            self.late_steps += 1
            self.out.append((step, t, host_wall, _host_only(acc)))

    def _recycle(self, pairs: list, prev_end: Any) -> None:
        """Events of a resolved step go back to the pool, except those a later segment
        still starts from (a phase open across the step boundary)."""
        live = {id(e) for e in (self.ev_mark, self.ev_ready, self.prev_end)}
        for later in self.pending:
            live.add(id(later[5]))
            live.update(id(a) for _, a, _ in later[4])
        live.update(id(a) for _, a, _ in self.pairs)
        seen = set()
        pool = self.pool
        for ev in [prev_end, *(e for pair in pairs for e in pair[1:])]:
            if ev is not None and id(ev) not in live and id(ev) not in seen:
                seen.add(id(ev))
                if len(pool) < MAX_POOL:  # after a burst the rest go back to CUDA
                    pool.append(ev)

    def flush(self, deadline_s: float = FLUSH_DEADLINE_S) -> None:
        """At shutdown: resolve what the device finishes within `deadline_s`. Polled, never
        `synchronize()`: on a GPU stuck in a collective (the hang this tool exists to
        diagnose) that would keep the rank from ever exiting."""
        end = perf_counter_ns() + int(deadline_s * 1e9)
        if _captures:  # a capture still running at exit: no CUDA call may break it
            return
        try:
            while self.pending and perf_counter_ns() < end:
                self._resolve()
                if self.pending:
                    time.sleep(0.01)
            self._resolve()
        except Exception:
            pass


def _elapsed_ns(a: Any, b: Any) -> int | None:
    """Device time from event `a` to `b` in ns; None when it cannot be timed: negative
    (events on two streams) or CUDA's "not ready" (a side stream lagging the step end).
    A sticky device error is the job's own and propagates."""
    try:
        ns = int(a.elapsed_time(b) * 1e6)
    except RuntimeError as exc:
        if is_sticky_cuda_error(exc):
            raise
        return None
    return ns if ns >= 0 else None


# Sticky CUDA errors: the context is unusable after them, for the job and the agent alike.
STICKY_CUDA_ERRORS = ("device-side assert", "illegal memory access", "illegal instruction",
                      "misaligned address", "unspecified launch failure", "ECC error",
                      "hardware stack error", "launch timeout")


def is_sticky_cuda_error(exc: BaseException) -> bool:
    """An error of the job's own GPU work that every later CUDA call reports (the agent's
    query included): the job's error, not the agent's."""
    text = str(exc)
    return "CUDA error" in text and any(k in text for k in STICKY_CUDA_ERRORS)


def _host_only(acc: list) -> list:
    """A step without a device wall keeps its host-timed phases only: device times on
    a host wall would mix two clocks (the device phases are sent as not measured)."""
    for idx in CudaRecorder.DEVICE_PHASES:
        acc[idx] = None
    return acc


def _expose_input(acc: list, wall: int) -> None:
    """On the device clock, the batch fetch costs only what the device sat idle for it.

    The fetch is timed on the host; while the host runs ahead of the GPU (the healthy
    case) it overlaps kernels already queued and costs nothing. The device time of the
    step outside every device phase is when the device had no work queued: the fetch
    counts as input time up to that much (docs/diagnosis.md, "Input on a GPU")."""
    fetched = acc[DATALOADER]
    if fetched is None:
        return
    busy = 0
    for idx in CudaRecorder.DEVICE_PHASES:
        v = acc[idx]
        if v is not None:
            busy += v
    acc[DATALOADER] = min(fetched, max(0, wall - busy))


class LazyCudaRecorder(CudaRecorder):
    """A CudaRecorder that times on the host clock until the script has used CUDA and
    the rank's device is known (device.py), then becomes a CudaRecorder at a step
    boundary. Until then it makes no CUDA call at all: a script may still set
    CUDA_VISIBLE_DEVICES itself, and forked workers must find CUDA untouched."""

    __slots__ = ()  # the same layout as CudaRecorder: the class can be switched in place
    begin = Recorder.begin
    end = Recorder.end
    begin_backward = Recorder.begin_backward
    end_backward = Recorder.end_backward
    grads_ready = Recorder.grads_ready
    _charge = Recorder._charge
    _push = Recorder._push
    _resume = Recorder._resume
    _emit = Recorder._emit
    end_step = Recorder._end_step_composed  # its close_step learns the device
    DEFERRED = False
    HOST_READY = True

    def close_step(self) -> None:
        Recorder.close_step(self)
        if _captures:
            return
        found = device.learn(self.torch, self.device_sources, self.device_tensor,
                             settled=self.step >= 2)
        if found is not None:
            index, self.device_rule = found
            # Read here, on the training thread: the sender opens NVML by it.
            self.device_uuid = visible_devices.torch_uuid(self.torch, index)
            self.device = index
            self.ev_mark = self.ev_ready = None
            # Device phases are timed by events from now on (same slots, so this is safe).
            self.__class__ = CudaRecorder  # type: ignore[assignment]
            # The next step's wall runs from this event: the first device-timed step is
            # on the device clock throughout, never a host wall around device phases.
            self.prev_end = self._step_event()

    def flush(self, deadline_s: float = FLUSH_DEADLINE_S) -> None:
        """Nothing pending: nothing was timed on the device."""
