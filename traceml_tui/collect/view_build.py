"""The collector's side of the view: a `RunView` built from a `Snapshot`.

viewmodel.py is the model every viewer reads; this module is the only place that
knows both it and the collector's state, so viewers never import the collector.
"""

from __future__ import annotations

from collections.abc import Callable

from msgspec.structs import replace

from traceml_agent.protocol import Sys
from traceml_tui.judge import memory as mem
from traceml_tui.judge.snapshot import RankSnapshot, Snapshot, hours_unit
from traceml_tui.judge.windows import median
from traceml_tui.report.summary import failure_of
from traceml_tui.runfolder.exit_codes import STOP_EXIT_CODES
from traceml_tui.viewmodel import (
    AGENT_OFF,
    DONE,
    FAILED,
    HIDDEN,
    MAX_VIEW_COLLECTIVES,
    OK,
    STALE,
    STALE_MIN_S,
    STALE_SILENCE_S,
    STALE_STEPS,
    STOPPED,
    VIEW_PHASES,
    WAITING,
    CostView,
    RankDetail,
    RankRow,
    RunView,
    node_rows,
    own_work,
)


def rank_status(r: RankSnapshot) -> str:
    if not r.reported:
        return WAITING
    if r.finished:
        if not r.exit_code:
            return DONE
        return STOPPED if r.exit_code in STOP_EXIT_CODES else FAILED
    if r.heartbeat.agent_off is not None:
        return AGENT_OFF
    if r.idle_s is not None and r.idle_s > STALE_SILENCE_S:
        return STALE
    if r.steps_hidden is not None:
        return HIDDEN
    step_ms = r.live_step_ms
    if r.since_step_s is not None and step_ms:
        if r.since_step_s > max(STALE_MIN_S, STALE_STEPS * step_ms / 1000.0):
            return STALE
    return OK


def _row(r: RankSnapshot) -> RankRow:
    phases = tuple(r.live_phase_ms.get(p) for p in VIEW_PHASES)
    sys = r.sys
    if sys is None:
        return RankRow(r.rank, r.node, r.host, r.steps, r.live_step_ms, phases, None, None,
                       None, None, r.idle_s, rank_status(r))
    # GPU memory: the rank's own (torch's allocator, reserved), what a batch size is sized
    # by; NVML's device figure, which counts every process on the GPU, only without it.
    gpu_mem = sys.gpu_reserved_mb if sys.gpu_reserved_mb is not None else sys.gpu_mem_mb
    return RankRow(r.rank, r.node, r.host, r.steps, r.live_step_ms, phases, sys.cpu_pct,
                   sys.rss_mb, sys.gpu_util, gpu_mem, r.idle_s, rank_status(r))


def detail(snap: Snapshot, rank: int, view: RunView, recent: tuple[float, ...]
           ) -> RankDetail | None:
    """The panel for one rank: its live timings beside the median rank's."""
    if not 0 <= rank < len(snap.ranks):
        return None
    r = snap.ranks[rank]
    row = view.rows[rank]
    stack = r.stacks[0][1] if r.stacks else None  # the agent sends MainThread first
    return RankDetail(rank, r.host, r.live_step_ms, view.median_step_ms, row.phase_ms,
                      view.median_phase_ms, recent, row.status,
                      r.error or (f"agent off: {off}" if (off := r.heartbeat.agent_off) else None),
                      stack,
                      gpu_line(r.sys), agent_notes(r), cpu_line(r),
                      memory_lines(snap, rank, others=rank == view.rank))


# A rank's wait for a CPU is shown in its panel from this share of its time: below it,
# a busy machine's ordinary scheduling; above it, worth a look (docs/diagnosis.md).
CPU_WAIT_SHOWN = 0.10


def cpu_line(r: RankSnapshot) -> str | None:
    """Its training thread's wait for a CPU, averaged while it stepped, in one line."""
    if r.cpu_wait is None or r.cpu_wait < CPU_WAIT_SHOWN:
        return None
    busy = r.sys.cpu_pct if r.sys is not None else None
    load = f"CPU {busy:.0f}%  " if busy is not None else "CPU  "
    return f"{load}its training thread waited {100 * r.cpu_wait:.0f}% of its time for a core"


# Other growing ranks the worst-rank panel names, fastest first.
MEMORY_PANEL_OTHERS = 3


def memory_lines(snap: Snapshot, rank: int, others: bool) -> tuple[str, ...]:
    """The rank's memory in one line and, with `others`, the other ranks whose memory
    grows (a leak on a rank that is not the slowest is still the job's end)."""
    own = next((t for t in snap.memory if t.rank == rank), None)
    out = [] if own is None else [mem.panel_line(own)]
    if others:
        grow = sorted((t for t in snap.memory if t.growing and t.rank != rank),
                      key=mem.worst_first)
        out += [f"rank {t.rank} {mem.panel_line(t)}" for t in grow[:MEMORY_PANEL_OTHERS]]
    return tuple(out)


def agent_notes(r: RankSnapshot) -> tuple[str, ...]:
    """What the rank's agent could not show as steps or time, and what it was refused."""
    notes = []
    hb = r.heartbeat
    if r.steps_hidden:
        notes.append(f"{r.steps_hidden}: hang detection suspended for this rank")
    if hb.agent_busy and not r.steps_hidden:
        notes.append(f"agent busy: {hb.agent_busy}")
    if hb.device_rule:
        notes.append(f"timing device: {hb.device_rule}")
    counts = [f"{n} {what}" for n, what in (
        (hb.replays, "CUDA graph replays"), (hb.capture_skips, "phases not timed in a capture"),
        (hb.timing_faults, "timing faults (phases sent as not measured)"),
        (hb.late_steps, "steps sent on the host clock (device too far behind)"),
        (r.bad_records, "step records refused by the collector")) if n]
    if counts:
        notes.append(", ".join(counts))
    return tuple(notes)


def gpu_line(sys: Sys | None) -> str | None:
    """A rank's GPU health in one line (SM clock of its maximum, power, temperature, the
    throttle reasons), then why any figure is missing (sysmetrics' gpu_note)."""
    if sys is None:
        return None
    parts = []
    clock, top = sys.sm_clock_mhz, sys.sm_clock_max_mhz
    if clock is not None:
        parts.append(f"SM {clock:.0f}" + (f"/{top:.0f} MHz" if top else " MHz"))
    if sys.power_w is not None:
        parts.append(f"{sys.power_w:.0f} W")
    if sys.temp_c is not None:
        parts.append(f"{sys.temp_c:.0f} C")
    reasons = [t for t in sys.throttle or () if t != "idle"]
    if reasons:
        parts.append("clocks held by " + ", ".join(reasons))
    note = sys.gpu_note
    if note:
        parts.append(f"({note})" if parts else note)
    return ("GPU " + "  ".join(parts)) if parts else None


def build(snap: Snapshot, recent: Callable[[int], tuple[float, ...]] = lambda rank: (),
          finished: bool = False, exit_code: int | None = None) -> RunView:
    """`recent(rank)`: that rank's recent step times, fetched only for the worst rank."""
    rows = tuple(_row(r) for r in snap.ranks)
    live = [r for r in rows if r.step_ms is not None]
    med_step = median([s for r in live if (s := r.step_ms) is not None])
    med_phases = tuple(
        median([v for r in live if (v := r.phase_ms[i]) is not None])
        for i in range(len(VIEW_PHASES)))
    d = snap.live
    devices = {r.device for r in snap.ranks if r.device}
    view = RunView(
        run_name=snap.run_name, world_size=snap.world_size, nnodes=snap.nnodes,
        elapsed_s=max(0.0, snap.now - snap.started_at), steps=snap.total_steps,
        # No rank steps during a hang: the rate of the last steps would be a lie.
        steps_per_s=0.0 if snap.hang is not None else (1000.0 / med_step) if med_step else None,
        label=d.label, rank=d.rank,
        phase=d.phase, severity=d.severity, summary=d.summary,
        label_for_s=max(0.0, snap.now - snap.live_since), rows=rows, median_step_ms=med_step,
        median_phase_ms=med_phases, worst=None,
        device="cuda" if any(x.startswith("cuda") for x in devices) else "cpu",
        finished=finished, exit_code=exit_code, node=d.node,
        checks=tuple((f.id, f.severity, f.ranks, f.evidence, f.fix) for f in snap.checks),
        relays_silent=tuple(r.node for r in snap.relays if r.silent),
        node_rows=node_rows(rows) if snap.nnodes > 1 else (), cost=cost_view(snap),
        history=snap.history,
        episodes=tuple((max(0.0, e.start - snap.started_at),
                        None if e.end is None else max(0.0, e.end - snap.started_at),
                        e.label, e.severity) for e in snap.timeline),
        failure=_failure(snap),
        collectives=tuple((c.group, c.op, c.phase, c.count_per_step, c.bytes_per_step,
                           c.exposed_ms_per_step, c.share_of_sync)
                          for c in snap.collectives[:MAX_VIEW_COLLECTIVES]))
    worst_rank = d.rank if d.rank is not None else _slowest(rows)
    if worst_rank is None:
        return view
    return replace(view, worst=detail(snap, worst_rank, view, recent(worst_rank)))


def _failure(snap: Snapshot) -> str | None:
    """The first failed rank's line, as the summary will lead with it; a rank the user
    stopped (Ctrl-C, SIGTERM) is not a failure."""
    f = failure_of([(r.rank, r.exit_code, r.error, r.steps) for r in snap.ranks
                    if r.exit_code not in STOP_EXIT_CODES])
    return None if f is None else f.summary


def cost_view(snap: Snapshot) -> CostView | None:
    """The live what-if of the label on display, with what its episodes cost so far."""
    w, d = snap.what_if, snap.live
    if w is None or w.label != d.label:
        return None
    lost = [e.lost_s for e in snap.timeline if e.lost_s is not None
            and (e.label, e.rank, e.node) == (d.label, d.rank, d.node)]
    lost_s = sum(lost) if lost else None
    unit = hours_unit(snap.ranks)
    return CostView(w.share, w.now_ms, w.step_ms, w.speedup, lost_s,
                    None if lost_s is None else lost_s * snap.world_size / 3600.0, unit,
                    w.weak, w.reasoning)


def _slowest(rows: tuple[RankRow, ...]) -> int | None:
    """Without a straggler label, the worst-rank panel shows the rank with most local work."""
    best, worst = None, -1.0
    for r in rows:
        local = own_work(r.phase_ms) or 0.0
        if r.step_ms is not None and local > worst:
            best, worst = r.rank, local
    return best

