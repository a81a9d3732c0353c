"""Canned collector states at a fixed clock, for tests, screenshots and benchmarks
(importable from the package, so none of them edits sys.path).

Synthetic step records go through the real pipeline (protocol messages → RunState →
Snapshot → RunView), so what the dashboard shows in a test is what it would show
for the same numbers from a live job.
"""

from __future__ import annotations

import random

from msgspec.structs import replace

from traceml_agent.findings import Finding
from traceml_agent.protocol import (
    NO_HEARTBEAT,
    PHASES,
    PROTOCOL_VERSION,
    CheckReport,
    Identity,
    Message,
    StepRecord,
    Steps,
    Sys,
)
from traceml_agent.requests import CaptureReply
from traceml_agent.vocab import (
    BACKWARD,
    DATALOADER,
    FORWARD,
    H2D,
    OPTIMIZER,
    SYNC,
    WAIT,
)
from traceml_tui.collect import view_build
from traceml_tui.judge.state import RunState
from traceml_tui.report import summary
from traceml_tui.runfolder import summary_model
from traceml_tui.viewmodel import DeepTraceView, RankDetail, RunView

T0 = 1_700_000_000.0  # a fixed clock: canned states never read the real one
BASE_MS = {DATALOADER: 0.3, H2D: None, FORWARD: 1.0, BACKWARD: 1.5, SYNC: 2.0,
           OPTIMIZER: 0.4, WAIT: 0.4}


def make_state(world_size: int = 8, nproc_per_node: int = 4, steps: int = 40,
               straggler: int | None = 2, phase: str = DATALOADER, extra_ms: float = 30.0,
               seed: int = 0, stale: tuple[int, ...] = (), hosts: str = "node",
               also_slow: tuple[int, ...] = (), silent_nodes: tuple[int, ...] = (),
               findings: tuple[Finding, ...] = (),
               thread_cpu: tuple[float, float] | None = (60.0, 2.0)) -> RunState:
    """`also_slow`: more ranks as slow as the straggler (a whole node, say); ranks on
    `silent_nodes` never report (a node that has not started); `thread_cpu`: every
    training thread's % of time on a CPU and waiting for one (None: not read)."""
    rng = random.Random(seed)
    nnodes = max(1, world_size // nproc_per_node)
    state = RunState("demo-run", world_size, nnodes, nproc_per_node, started_at=T0,
                     window_steps=max(steps, 32))
    for rank in range(world_size):
        node = rank // nproc_per_node
        if node in silent_nodes:
            continue
        ident = Identity(rank, rank % nproc_per_node, node, f"{hosts}{node:03d}", 1000 + rank,
                         world_size)
        records = []
        n = steps // 2 if rank in stale else steps
        for step in range(n):
            values = {p: (None if v is None else v * (1 + 0.05 * rng.random()))
                      for p, v in BASE_MS.items()}
            if rank == straggler or rank in also_slow:
                values[phase] = (values[phase] or 0.0) + extra_ms
            else:  # everybody else waits for the straggler in the allreduce
                values[SYNC] = (values[SYNC] or 0.0) + (extra_ms if straggler is not None
                                                            else 0.0)
            step_ms = sum(v for v in values.values() if v is not None)
            records.append(StepRecord(step, T0 + step * step_ms / 1000, step_ms,
                                      tuple(values.get(p) for p in PHASES)))
        batch = Steps(v=PROTOCOL_VERSION, id=ident, seq=0, t=T0, phases=list(PHASES),
                      records=[])
        state.ingest(Message("steps", ident, 0, T0, batch, PHASES, tuple(records)), 0.0)
        # The training threads' shares on a CPU and waiting for one, as a job on cores of
        # its own reads them: the straggler's advice then rests on a comparison, not on
        # waits never read (evidence.CPU_UNREAD).
        run, wait = thread_cpu or (None, None)
        sys = Sys(v=PROTOCOL_VERSION, id=ident, seq=1, t=T0, cpu_pct=95.0 + rank % 5,
                  thread_cpu_pct=run, cpu_wait_pct=wait, rss_mb=900.0 + rank)
        state.ingest(Message("sys", ident, 1, T0, sys), 0.0)
        mine = tuple(f for f in findings if rank in f.ranks)
        if mine:
            state.ingest(Message("checks", ident, 2, T0, CheckReport(mine, None)), 0.0)
        if rank in stale:
            state.ranks[rank].last_step_at = -60.0  # made no step for a minute
    for tick in range(3):
        state.evaluate(T0 + 1 + tick)
    return state


def make_view(state: RunState, now_offset: float = 75.0) -> RunView:
    snap = state.snapshot(T0 + now_offset, 0.5)
    return view_build.build(snap, state.recent_steps)


class StaticSource:
    """A ViewSource serving canned states: each fetch takes the next, then repeats the last."""

    def __init__(self, states: list[RunState] | RunState) -> None:
        self.states = states if isinstance(states, list) else [states]
        self.index = 0
        self.fetches = 0
        self.captures: list[tuple[list[int] | None, int]] = []
        self.capture_view: DeepTraceView | None = None  # served as the view's capture

    def fetch(self, pinned: int | None) -> tuple[RunView, RankDetail | None]:
        state = self.states[min(self.index, len(self.states) - 1)]
        self.index += 1
        self.fetches += 1
        snap = state.snapshot(T0 + 75.0, 0.5)
        view = replace(view_build.build(snap, state.recent_steps), capture=self.capture_view)
        detail = None
        if pinned is not None:
            detail = view_build.detail(snap, pinned, view, state.recent_steps(pinned))
        return view, detail

    def summary(self) -> summary_model.Summary:
        state = self.states[min(self.index, len(self.states)) - 1]
        snap = state.snapshot(T0 + 75.0, 0.5, full=True)
        return summary.build(snap, summary.RunMeta(complete=False))

    def capture(self, ranks: list[int] | None = None, steps: int = 5) -> CaptureReply:
        self.captures.append((ranks, steps))
        return CaptureReply(True, id=len(self.captures), ranks=ranks or [0], steps=steps)

    def close(self) -> None:
        pass


def with_history(state: RunState, seconds: float = 75.0, onset_s: float = 25.0,
                 step_ms: float = 6.0, extra_ms: float = 30.0) -> RunState:
    """A run's time chart: balanced steps, then a straggler from `onset_s` (fixed values,
    one point per 0.5 s evaluation, as the collector adds them)."""
    from traceml_tui.judge.history import History

    state.timeline.history = History()
    t = 0.0
    while t <= seconds:
        slow = t >= onset_s
        state.timeline.history.add((t, step_ms + (extra_ms if slow else 0.0), step_ms * 0.4,
                           step_ms * 0.45 + (extra_ms if slow else 0.0)))
        t += 0.5
    return state


def make_hang_state(world_size: int = 8, stuck: int = 5) -> RunState:
    """A hang: every rank stopped stepping 30 s ago; rank `stuck` is a step behind, in its
    forward, with the stack its agent sent, the others wait in an all_reduce."""
    state = with_history(make_state(world_size=world_size, straggler=None), seconds=75.0,
                         onset_s=1e9)
    for rank, rs in state.ranks.items():
        rs.since_step_at_msg_s = 30.0
        behind = rank == stuck
        rs.heartbeat = replace(NO_HEARTBEAT, id=rs.ident, step=rs.steps - (1 if behind else 0),
                               collectives=2 * rs.steps - (2 if behind else 0),
                               phase=FORWARD if behind else SYNC,
                               in_collective=None if behind else "all_reduce")
        if behind:
            rs.steps -= 1
            rs.stacks = (("MainThread",
                          'File "train.py", line 212, in <module>\n    main()\n'
                          'File "train.py", line 180, in main\n    loss = model(batch)\n'
                          'File "model.py", line 77, in forward\n'
                          '    tokens = self.tokenizer.lookup(ids)  # waits on a lock\n'),)
    state.evaluate(T0 + 75.0, mono_now=0.5)
    return state
