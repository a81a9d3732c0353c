"""Per-step phase accounting: the agent's hot path.

Hooks call `begin`/`end` around a phase and `close_step` at each optimizer step.
Phases do not nest: while one phase is open, any other begin is ignored, so the
outermost operation wins (a module called inside the DataLoader is input time,
a `.to()` inside forward is forward time). That one rule replaces depth counters
in every hook.

A finished step is appended to `out` (a bounded deque drained by the sender
thread) as ``(step, t_end_ns, wall_ns, phase_ns)``, where ``phase_ns[i]`` is the
time in ``MEASURED[i]`` in nanoseconds, or None when that phase was not seen
during the step. "wait" is derived later (wall minus the measured phases).

`CudaRecorder` times device phases with CUDA events and resolves them with
`query()` on later steps: it never synchronizes the training thread.
"""

from __future__ import annotations

from collections import deque
from time import perf_counter_ns
from typing import Any

# Phases the recorder measures, by index. "wait" is derived, never recorded.
MEASURED: tuple[str, ...] = ("dataloader", "h2d", "forward", "backward", "sync", "optimizer")
DATALOADER, H2D, FORWARD, BACKWARD, SYNC, OPTIMIZER = range(6)
MAX_CUSTOM_PHASES = 8
NO_PHASE = -1


class Recorder:
    """Host-clock recorder, used on CPU jobs."""

    __slots__ = (
        "out",
        "names",
        "index",
        "acc",
        "active",
        "owner",
        "t0",
        "step",
        "step_start",
        "t_ready",
        "explicit_steps",
        "collectives",
        "parallel",
        "step_listener",
        "in_collective",
        "last_step_t",
        "last_wall",
    )

    def __init__(self, out: deque) -> None:
        self.out = out
        self.names: list[str] = list(MEASURED)
        self.index: dict[str, int] = {n: i for i, n in enumerate(self.names)}
        self.acc: list[int | None] = [None] * len(self.names)
        self.active = NO_PHASE
        self.owner: Any = None
        self.t0 = 0
        self.step = 0
        self.step_start = 0  # 0: the first step starts at its first phase
        self.t_ready = 0  # when backward's gradients were all computed (sync split)
        self.explicit_steps = False
        # Progress, read by the heartbeat thread (which needs nothing from this one):
        self.collectives = 0  # explicit torch.distributed collectives entered
        self.parallel: str | None = None  # "ddp" or "fsdp", learned during the first step
        # Called after each closed step, only while a deep-trace capture is asked or running.
        self.step_listener: Any = None
        self.in_collective: str | None = None
        self.last_step_t = perf_counter_ns()
        self.last_wall = 0  # the last step's wall time, ns

    # --- phases -------------------------------------------------------------------

    def begin(self, idx: int, owner: Any = None) -> bool:
        if self.active != NO_PHASE:
            return False
        t = perf_counter_ns()
        if not self.step_start:
            self.step_start = t
        self.active = idx
        self.owner = owner
        self.t0 = t
        return True

    def end(self, owner: Any = None) -> None:
        if self.active == NO_PHASE or owner is not self.owner:
            return
        self._add(self.active, perf_counter_ns() - self.t0)
        self.active = NO_PHASE
        self.owner = None

    def cancel(self) -> None:
        """Forget the open phase (it turned out not to be one)."""
        self.active = NO_PHASE
        self.owner = None

    def _add(self, idx: int, dt: int) -> None:
        acc = self.acc
        prev = acc[idx]
        acc[idx] = dt if prev is None else prev + dt

    def grads_ready(self) -> None:
        """Called from autograd's final callback: local gradient work is done."""
        self.t_ready = perf_counter_ns()

    def begin_backward(self) -> bool:
        if not self.begin(BACKWARD):
            return False
        self.t_ready = 0
        return True

    def end_backward(self) -> None:
        """Split backward into local compute and exposed collective wait (DDP's reducer
        waits for its allreduces after the last gradient is ready)."""
        if self.active != BACKWARD:
            return
        t = perf_counter_ns()
        ready = self.t_ready
        if ready and self.t0 <= ready <= t:
            self._add(BACKWARD, ready - self.t0)
            self._add(SYNC, t - ready)
        else:
            self._add(BACKWARD, t - self.t0)
        self.active = NO_PHASE
        self.owner = None

    # --- steps --------------------------------------------------------------------

    def close_step(self) -> None:
        t = perf_counter_ns()
        start = self.step_start or t
        self._emit(self.step, t, t - start, self.acc)
        self.step += 1
        self.step_start = t
        self.last_step_t = t
        self.last_wall = t - start
        self.acc = [None] * len(self.names)
        listener = self.step_listener
        if listener is not None:
            listener()

    def _emit(self, step: int, t: int, wall: int, acc: list[int | None]) -> None:
        self.out.append((step, t, wall, acc))

    def open_step(self) -> None:
        """Explicit API: a step starts now (the time before it is not part of any step)."""
        self.step_start = perf_counter_ns()
        self.acc = [None] * len(self.names)

    def phase_index(self, name: str) -> int | None:
        idx = self.index.get(name)
        if idx is None and len(self.names) < len(MEASURED) + MAX_CUSTOM_PHASES:
            idx = len(self.names)
            self.names.append(name)
            self.index[name] = idx
            self.acc.append(None)
        return idx

    def in_phase(self) -> tuple[str | None, float]:
        """What the training thread is doing now (read racily by the heartbeat thread)."""
        idx, t0 = self.active, self.t0
        if idx == NO_PHASE:
            return None, 0.0
        return self.names[idx], max(0.0, (perf_counter_ns() - t0) / 1e9)

    def flush(self) -> None:
        """Nothing pending on the host clock."""


class CudaRecorder(Recorder):
    """Times device phases with CUDA events, resolved later with `query()`.

    The dataloader is host work, timed on the host clock. h2d, forward, backward,
    sync and optimizer are timed between events recorded on the current stream,
    and the step time is the device time between consecutive step-end events, so
    an idle GPU waiting for input shows up as step time the phases do not cover.
    """

    __slots__ = ("torch", "pool", "pairs", "pending", "prev_end", "ev0", "ev_ready", "max_pending")
    DEVICE_PHASES = frozenset({H2D, FORWARD, BACKWARD, OPTIMIZER})

    def __init__(self, out: deque, torch_module: Any, max_pending: int = 64) -> None:
        super().__init__(out)
        self.torch = torch_module
        self.pool: list[Any] = []
        self.pairs: list[tuple[int, Any, Any]] = []
        self.pending: deque = deque()
        self.prev_end: Any = None
        self.ev0: Any = None
        self.ev_ready: Any = None
        self.max_pending = max_pending

    def _event(self) -> Any:
        ev = self.pool.pop() if self.pool else self.torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def begin(self, idx: int, owner: Any = None) -> bool:
        if not super().begin(idx, owner):
            return False
        if idx in self.DEVICE_PHASES:
            self.ev0 = self._event()
        return True

    def end(self, owner: Any = None) -> None:
        idx = self.active
        if idx == NO_PHASE or owner is not self.owner:
            return
        if idx in self.DEVICE_PHASES:
            self.pairs.append((idx, self.ev0, self._event()))
            self.active = NO_PHASE
            self.owner = None
        else:
            super().end(owner)

    def grads_ready(self) -> None:
        super().grads_ready()
        self.ev_ready = self._event()

    def begin_backward(self) -> bool:
        self.ev_ready = None
        return super().begin_backward()

    def end_backward(self) -> None:
        if self.active != BACKWARD:
            return
        ev_end = self._event()
        if self.ev_ready is not None:
            self.pairs.append((BACKWARD, self.ev0, self.ev_ready))
            self.pairs.append((SYNC, self.ev_ready, ev_end))
        else:
            self.pairs.append((BACKWARD, self.ev0, ev_end))
        self.active = NO_PHASE
        self.owner = None

    def _emit(self, step: int, t: int, wall: int, acc: list[int | None]) -> None:
        """The step's device times are not known yet: park it until its events complete."""
        end_ev = self._event()
        self.pending.append((step, t, wall, acc, self.pairs, self.prev_end, end_ev))
        self.prev_end = end_ev
        self.pairs = []
        self._resolve()

    def _resolve(self) -> None:
        pending = self.pending
        while pending and pending[0][6].query():
            step, t, host_wall, acc, pairs, prev_end, end_ev = pending.popleft()
            for idx, a, b in pairs:
                try:  # an event on another stream may lag the step-end event: skip it
                    self._add_to(acc, idx, int(a.elapsed_time(b) * 1e6))
                except RuntimeError:
                    continue
                self.pool.append(a)
            wall = host_wall
            if prev_end is not None:
                wall = int(prev_end.elapsed_time(end_ev) * 1e6)
                # prev_end stays referenced by nothing once this step resolved
                self.pool.append(prev_end)
            self.out.append((step, t, wall, acc))
        while len(pending) > self.max_pending:  # device far behind: drop, never block
            pending.popleft()

    @staticmethod
    def _add_to(acc: list, idx: int, dt: int) -> None:
        prev = acc[idx]
        acc[idx] = dt if prev is None else prev + dt

    def flush(self) -> None:
        """At shutdown: the job is over, so waiting for the device is allowed here."""
        try:
            if self.pending:
                self.pending[-1][6].synchronize()
            self._resolve()
        except Exception:
            pass
