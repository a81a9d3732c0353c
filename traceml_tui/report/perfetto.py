"""The whole job as one Chrome trace ("traceEvents" JSON) that ui.perfetto.dev opens.

Built from the step log (traceml_tui/runfolder/step_log.py) and a run's summary, read
through its model (final_summary.json or live_snapshot.json, runfolder/summary_model.py).
In Perfetto:

  diagnosis            the diagnosis episodes as spans, the hang from its start;
                       a global marker (a line across every rank) where a label other
                       than BALANCED/WARMUP begins, and where the hang was detected
  rank 0 (host-a)      "step" track: one "step N" span per step
    dataloader ...     one track per phase (PHASES order, then custom phases)
  rank 1 (host-a) ...

Phase spans are a reconstruction. The agent measures each phase's *duration*, not
its timestamps; only the step's end (t_end) is a clock reading. Each step's measured
phases are laid out back-to-back in PHASES order so the last one ends at t_end. The
widths are exact; where they sit inside the step is not (a phase measured in two
pieces, such as sync inside backward, is drawn as one). A phase not measured on a step
(None) has no span. Spans never overlap on a track: one that would start before the
previous span on its track ended is clipped to start there (Perfetto cannot nest them).

Timestamps are microseconds from the whole second before the earliest time in the
export; that epoch (seconds) is in otherData.epoch_base_s. A long run's export is large
(~0.75 KB and ~40 µs to build a step of a rank): `last_steps_per_rank` keeps only each
rank's latest steps.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict, deque
from collections.abc import Callable, Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

from traceml_agent.protocol import MAX_WORLD_SIZE, PHASES
from traceml_tui.judge import diagnosis as dx
from traceml_tui.runfolder import summary_model as model
from traceml_tui.runfolder.folders import write_atomic_with
from traceml_tui.runfolder.step_log import LoggedStep

DIAGNOSIS_PID = MAX_WORLD_SIZE  # ranks are < MAX_WORLD_SIZE, so this pid is never a rank's
STEP_TID = 0  # a rank's step track; phase i of the export's phase order is tid i + 1
EPISODE_TID, HANG_TID = 1, 2
# Labels that are not news: no global marker where they begin.
_QUIET_LABELS = (dx.BALANCED, dx.WARMUP)
RECONSTRUCTION_NOTE = ("phase spans are reconstructed: phases are measured durations, laid out "
                       "back-to-back in PHASES order ending at each step's measured end")


def build_trace(records: Iterable[LoggedStep], run_summary: model.Summary | None = None,
                *, last_steps_per_rank: int | None = None) -> dict[str, Any]:
    """The Chrome trace document. `records` in any order; repeats of a step are dropped.
    `run_summary`: the ranks' hosts, the declared phases, the episodes and the hang."""
    by_rank: dict[int, deque[LoggedStep]] = defaultdict(lambda: deque(maxlen=last_steps_per_rank))
    for rec in records:
        by_rank[rec.rank].append(rec)
    doc = run_summary
    hosts = {} if doc is None else {r.rank: r.host or None for r in doc.ranks}
    phases = _phase_order(() if doc is None else doc.phases, by_rank.values())
    steps = {rank: _dedupe(recs) for rank, recs in by_rank.items()}

    episodes = [] if doc is None else [e for e in doc.timeline if _epoch(e.start) is not None]
    hang = doc.hang if doc is not None and doc.hang and _epoch(doc.hang.since) else None
    run = None if doc is None else doc.run
    times = [min(_start(r) for r in recs) for recs in steps.values() if recs]
    times += [t for t in (_epoch(e.start) for e in episodes) if t is not None]
    times += [t for t in (_epoch(hang.since if hang else None),
                          _epoch(run.started_at if run else None)) if t is not None]
    # A whole second: epoch floats are only good to ~0.2 µs, and subtracting a whole
    # second adds no rounding of its own, so a span's start is never a hair below 0.
    base = float(math.floor(min(times, default=0.0)))
    ends = [recs[-1].t_end for recs in steps.values() if recs]
    ends += [t for t in (_epoch(run.ended_at if run else None),) if t is not None]
    end = max(ends + times, default=base)

    def us(t: float) -> float:  # epoch seconds -> µs on the export's clock
        return round((t - base) * 1e6, 3)

    events: list[dict[str, Any]] = []
    for rank in sorted(set(steps) | set(hosts)):
        events += _rank_metadata(rank, hosts.get(rank), phases)
        events += _rank_events(rank, steps.get(rank, []), phases, us)
    if episodes or hang:
        events += _diagnosis_events(episodes, hang, us, end)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"generator": "traceml", "run": run.name if run else None,
                      "epoch_base_s": base, "phases": list(phases),
                      "note": RECONSTRUCTION_NOTE},
    }


def write_trace(path: str | Path, records: Iterable[LoggedStep],
                run_summary: model.Summary | None = None, *,
                last_steps_per_rank: int | None = None) -> Path:
    """Build and write atomically (temp file in the same folder, then os.replace), streamed
    to the file so a large export is not held twice in memory."""
    path = Path(path)
    trace = build_trace(records, run_summary, last_steps_per_rank=last_steps_per_rank)
    write_atomic_with(path, lambda f: json.dump(trace, f, separators=(",", ":")))
    return path


# --- ranks -----------------------------------------------------------------------------


def _phase_order(declared: Iterable[str], ranks: Iterable[Iterable[LoggedStep]]) -> tuple:
    """PHASES first, then any custom phase in the order it was first seen."""
    order = dict.fromkeys(PHASES)
    order.update(dict.fromkeys(declared))
    for recs in ranks:
        for rec in recs:
            order.update(dict.fromkeys(rec.phases))
    return tuple(order)


def _start(rec: LoggedStep) -> float:
    """Where a step's drawing begins: its measured start, or earlier if its phases add up
    to more than the step (they are laid out to end at t_end)."""
    laid_ms = sum(ms for ms in rec.phase_ms if ms is not None)
    return rec.t_end - max(rec.step_ms, laid_ms) / 1000


def _dedupe(recs: Iterable[LoggedStep]) -> list[LoggedStep]:
    out: list[LoggedStep] = []
    for rec in sorted(recs, key=lambda r: (r.t_end, r.step)):
        if out and (out[-1].step, out[-1].t_end) == (rec.step, rec.t_end):
            out[-1] = rec
        else:
            out.append(rec)
    return out


def _meta(kind: str, pid: int, tid: int, **args: Any) -> dict[str, Any]:
    return {"ph": "M", "name": kind, "pid": pid, "tid": tid, "args": args}


def _rank_metadata(rank: int, host: str | None, phases: tuple[str, ...]) -> list[dict]:
    label = f"rank {rank} ({host})" if host else f"rank {rank}"
    events = [_meta("process_name", rank, 0, name=label),
              # After the diagnosis process (0): Perfetto orders processes by this index.
              _meta("process_sort_index", rank, 0, sort_index=rank + 1),
              _meta("thread_name", rank, STEP_TID, name="step"),
              _meta("thread_sort_index", rank, STEP_TID, sort_index=STEP_TID)]
    for i, phase in enumerate(phases, start=1):
        events += [_meta("thread_name", rank, i, name=phase),
                   _meta("thread_sort_index", rank, i, sort_index=i)]
    return events


class _Track:
    """One track's spans in time order, clipped so none starts before the last one ended."""

    def __init__(self, pid: int, tid: int) -> None:
        self.pid, self.tid = pid, tid
        self.last_end = float("-inf")
        self.events: list[dict[str, Any]] = []

    def span(self, name: str, start: float, end: float, args: dict[str, Any]) -> None:
        start = max(start, self.last_end)
        if end <= start:
            return
        self.events.append({"ph": "X", "name": name, "pid": self.pid, "tid": self.tid,
                            "ts": start, "dur": round(end - start, 3), "args": args})
        self.last_end = end


def _rank_events(rank: int, recs: list[LoggedStep], phases: tuple[str, ...],
                 us: Callable[[float], float]) -> list[dict[str, Any]]:
    steps = _Track(rank, STEP_TID)
    tracks = {p: _Track(rank, i) for i, p in enumerate(phases, start=1)}
    for rec in recs:
        end = us(rec.t_end)
        steps.span(f"step {rec.step}", round(end - rec.step_ms * 1000, 3), end,
                   {"step": rec.step, "step_ms": rec.step_ms})
        measured = dict(zip(rec.phases, rec.phase_ms, strict=False))
        laid = [(p, ms) for p in phases if (ms := measured.get(p)) is not None]
        t = end - sum(ms for _, ms in laid) * 1000
        for phase, ms in laid:
            start, t = t, t + ms * 1000
            tracks[phase].span(phase, round(start, 3), round(t, 3),
                               {"step": rec.step, "ms": ms})
    return steps.events + [e for track in tracks.values() for e in track.events]


# --- diagnosis -------------------------------------------------------------------------


def _epoch(iso_time: str | None) -> float | None:
    if iso_time is None:
        return None
    try:
        return datetime.fromisoformat(iso_time).timestamp()
    except ValueError:
        return None


def _episode_args(e: model.Episode) -> dict[str, Any]:
    return {"severity": e.severity, "rank": e.rank, "phase": e.phase,
            "start_step": e.start_step, "end_step": e.end_step, "summary": e.summary}


def _diagnosis_events(episodes: list[model.Episode], hang: model.Hang | None,
                      us: Callable[[float], float], end: float) -> list[dict[str, Any]]:
    events = [_meta("process_name", DIAGNOSIS_PID, 0, name="diagnosis"),
              _meta("process_sort_index", DIAGNOSIS_PID, 0, sort_index=0),
              _meta("thread_name", DIAGNOSIS_PID, EPISODE_TID, name="episodes"),
              _meta("thread_name", DIAGNOSIS_PID, HANG_TID, name="hang")]
    track = _Track(DIAGNOSIS_PID, EPISODE_TID)
    markers = []
    for e, begin in sorted(((e, _epoch(e.start) or 0.0) for e in episodes),
                           key=lambda pair: pair[1]):
        name = e.label + (f" rank {e.rank}" if e.rank is not None else "")
        start, stop = us(begin), us(_epoch(e.end) or end)
        args = _episode_args(e)
        track.span(name, start, stop, args)
        if e.label not in _QUIET_LABELS:
            markers.append({"ph": "i", "s": "g", "name": name, "pid": DIAGNOSIS_PID,
                            "tid": EPISODE_TID, "ts": start, "args": args})
    events += track.events
    if hang is not None:
        since = us(_epoch(hang.since) or end)
        name = f"HANG ({hang.kind}): rank(s) {', '.join(map(str, hang.ranks))}"
        args = {"kind": hang.kind, "ranks": list(hang.ranks), "stalled_s": hang.stalled_s,
                "threshold_s": hang.threshold_s}
        hang_track = _Track(DIAGNOSIS_PID, HANG_TID)
        hang_track.span(name, since, us(end), args)
        events += hang_track.events
        markers.append({"ph": "i", "s": "g", "name": name, "pid": DIAGNOSIS_PID,
                        "tid": HANG_TID, "ts": since, "args": args})
    return events + markers
