"""A finished, crashed or orphaned run's record replayed into the dashboard's views.

`traceml watch RUN_DIR` on a run that is over opens the same dashboard on its record. The
step log (runfolder/step_log.py) is fed, batch by batch in the order the collector logged
it, through the SAME judge the collector ran (judge/state.py `RunState`: ingest, evaluate
every EVAL_INTERVAL_S of the run's own time, snapshot) and each keyframe is built by the
collector's own `view_build.build`: the view at a keyframe is what the live dashboard
showed then (the banner's label as it read then, the heat rows, the worst-rank panel, the
episodes so far), not a second, approximate implementation.

What the step log does not hold, the replay cannot show: system samples (CPU, memory, GPU;
the last keyframe takes each rank's last one from the summary), setup checks, stacks,
collectives, heartbeats. So no hang is re-detected from the steps
(a silence in the log is no proof of one); the summary's own record of a hang is shown on
the last keyframe, as the summary says it. The last keyframe carries the run's ending (exit
code, the first failure) from final_summary.json, or says that there is none.

Memory and time are bounded whatever the run's length: keyframes are kept encoded
(msgpack, decoded when shown) and at most MAX_KEYFRAMES of them (fewer for a wide job:
KEYFRAME_ROWS), spaced over the run's span when the record says when it ended; past it,
every other one is dropped and the spacing doubles (the oldest and newest stay).
Evaluations are every 0.5 s of run time as live, spaced out past MAX_EVALS and
EVAL_ROWS (or with the keyframes, EVALS_PER_KEYFRAME, when the end is not known), so a
long or wide run costs no more evaluations than a few thousand. A byte budget (KEYFRAME_BUDGET) caps
wide runs further (a 16,384-rank view is ~1.7 MB encoded). The log itself is bounded by its
writer's byte budget (256 MiB: its newest 1.5-3 million records).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
from msgspec.structs import replace

from traceml_agent.protocol import (
    PROTOCOL_VERSION,
    Identity,
    Message,
    ProtocolError,
    StepGroup,
    StepRow,
    Sys,
)
from traceml_agent.sanitize import clean_line
from traceml_agent.vocab import HANG
from traceml_tui.collect import view_build
from traceml_tui.judge import ingest_columns
from traceml_tui.judge.state import RunState
from traceml_tui.runfolder import folders
from traceml_tui.runfolder.exit_codes import STOP_EXIT_CODES
from traceml_tui.runfolder.layout import RunFolder
from traceml_tui.runfolder.step_log import StepColumns, read_columns
from traceml_tui.viewmodel import (
    DONE,
    FAILED,
    STOPPED,
    WAITING,
    RankRow,
    RunView,
    decode_view,
    encode_view,
)

# The collector's cadence (collector.EVAL_INTERVAL_S, not imported: that module brings
# the sockets): evaluations at the same spacing of run time date episodes as live did.
EVAL_INTERVAL_S = 0.5
# Keyframes kept: ~2 per column of a 120-column time chart, so every cursor position on
# the chart has a frame of its own; decoding one is a few ms even at 8,192 ranks.
MAX_KEYFRAMES = 240
# Evaluations per keyframe interval, once that interval is over 4 x 0.5 s (a run longer
# than ~8 min, or a wide one with fewer keyframes): a label shows once it held for
# CONFIRM_TICKS (2) evaluations (diagnosis.settle), so one lasting most of a keyframe
# interval still shows. The collector itself spaces evaluations out on a wide job (its
# EVAL_BACKOFF: ~1.5 s apart at 16,384 ranks), and they cost ~80 ms each there.
EVALS_PER_KEYFRAME = 4
# When the record says when the run ended: evaluations every 0.5 s of it, as live, unless
# that is more than MAX_EVALS (~1 ms each on a small job: a 33-minute run is judged every
# 0.5 s, a 28-hour one every 25 s) or EVAL_ROWS rank-evaluations (~25 us a rank with its
# ingest: ~30 at 16,384 ranks, as often as the live collector evaluates a job that wide,
# every ~5 s; a 50-minute 1,024-rank record every 6 s where live was 0.5 s).
MAX_EVALS = 4_000
EVAL_ROWS = 500_000
# Encoded keyframes kept in memory at most: 96 MiB, ~55 frames of a 16,384-rank job.
KEYFRAME_BUDGET = 96 << 20
# Rows (ranks x keyframes) built at most: a keyframe's snapshot and view cost ~30 us a
# rank (benchmarks/replay_open.py: they are most of a wide record's opening), so 2,048
# ranks still get all 240, 16,384 ranks 30 (one per ~3 columns of a 100-column chart).
KEYFRAME_ROWS = 500_000
# Evaluations replayed after the last record, while the job ended: the collector went on
# evaluating until the goodbyes, and a label the last steps brought needs a few evaluations
# to be confirmed (diagnosis.CONFIRM_TICKS).
END_TICKS = 10
# Records of one rank fed as one row at most (an agent's batch is up to 20,000).
BATCH_RECORDS = 1024


class ReplayError(Exception):
    """The folder cannot be replayed: one clear line for the user."""


@dataclass
class Record:
    """What the run folder says about the run besides its steps."""

    run_dir: Path
    name: str
    world_size: int
    nnodes: int
    started_at: float | None
    summary: dict[str, Any] | None  # final_summary.json, or None (the collector died)
    live: dict[str, Any] | None  # the collector's last live snapshot, if any
    hosts: dict[int, tuple[int, str, str]] = field(default_factory=dict)  # node, host, device

    @property
    def status(self) -> str:
        """The status bar's line on how the run ended."""
        doc = self.summary
        if doc is None:
            return "the collector died: steps only, no summary"
        run = doc.get("run") or {}
        failure = doc.get("failure") or {}
        if doc.get("complete") is False:  # written by the launcher from a live snapshot
            return (f"the collector died mid-run: summary from its last snapshot, exit "
                    f"{run.get('exit_code')}")
        if failure.get("summary"):
            return f"crashed: {failure['summary']}"
        return f"ended at step {run.get('steps', 0)}, exit {run.get('exit_code')}"


def _epoch(text: object) -> float | None:
    try:
        return datetime.fromisoformat(str(text)).timestamp()
    except ValueError:
        return None


def _json(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def open_record(run_dir: Path) -> Record:
    """The run folder's description; ReplayError if it is not one we may read."""
    folder = RunFolder(run_dir)
    if not run_dir.is_dir():
        raise ReplayError(f"no such run folder: {run_dir}")
    reason = folders.not_private(run_dir, True)
    if reason:  # the folder's permissions are the lock: no secret is needed to read it
        raise ReplayError(f"{run_dir} {reason}: not opening it (its record could be anyone's)")
    if not folder.step_log.is_dir() and not folder.summary_json.exists():
        raise ReplayError(f"{run_dir} has no record to replay (no steps/ and no summary)")
    summary = _json(folder.summary_json)
    live = _json(folder.live)
    doc = summary or live or {}
    run = doc.get("run") or {}
    hosts = {}
    for r in doc.get("ranks") or ():
        if isinstance(r, dict) and isinstance(r.get("rank"), int):
            hosts[r["rank"]] = (int(r.get("node") or 0), str(r.get("host") or ""),
                                str(r.get("device") or ""))
    return Record(run_dir, str(run.get("name") or run_dir.name),
                  int(run.get("world_size") or 0), int(run.get("nnodes") or 1),
                  _epoch(run.get("started_at")), summary, live, hosts)


@dataclass
class Keyframe:
    t: float  # seconds since the run started
    step: int  # the furthest step any rank had made
    subject: str  # what the banner named (label, rank, node): the cursor's episodes
    data: bytes  # the encoded RunView


class Replay:
    """The record's keyframes, built once by `load`, then read by index."""

    def __init__(self, record: Record) -> None:
        self.record = record
        self.frames: list[Keyframe] = []
        self.records = 0

    # --- what the dashboard reads -------------------------------------------------------

    def __len__(self) -> int:
        return len(self.frames)

    def view(self, index: int) -> RunView:
        return decode_view(self.frames[index].data)

    def times(self) -> list[float]:
        return [f.t for f in self.frames]

    def subjects(self) -> list[str]:
        return [f.subject for f in self.frames]

    # --- building -----------------------------------------------------------------------

    def load(self, progress: Callable[[int], None] = lambda records: None) -> None:
        """Feed the step log through the judge and keep the keyframes; `progress` is called
        every ~50,000 records with the count read so far."""
        rec = self.record
        chunks = read_columns(RunFolder(rec.run_dir).step_log)
        first = next(chunks, None)
        if first is None:
            self._no_steps()
            return
        world = max(rec.world_size, 1)
        t_first = float(first.t_end.min())
        started = rec.started_at if rec.started_at is not None else t_first - 1.0
        state = RunState(rec.name, world, rec.nnodes, started_at=started)
        builder = _Builder(state, world, started, rec)
        ended = _epoch(((rec.summary or rec.live or {}).get("run") or {}).get("ended_at"))
        if ended is not None:  # the span is known: keyframes spaced for it from the start
            span = max(0.0, ended - t_first)
            builder.interval = max(EVAL_INTERVAL_S, span / builder.max_frames)
            # Evaluations: every 0.5 s as live, as many as EVAL_ROWS and MAX_EVALS allow.
            evals = max(1, min(MAX_EVALS, EVAL_ROWS // world))
            builder.eval_every = max(EVAL_INTERVAL_S, span / evals)
        n = 0
        for cols in _chain(first, chunks):
            builder.add(cols)
            if (n + len(cols)) // 50_000 != n // 50_000:
                progress(n + len(cols))
            n += len(cols)
        self.records = n
        self.frames = builder.finish()
        progress(n)

    def _no_steps(self) -> None:
        """A record with a summary but no steps (none logged, or the log lost)."""
        self.frames = []


def _chain(first: StepColumns, rest: Iterator[StepColumns]) -> Iterator[StepColumns]:
    yield first
    yield from rest


class _Builder:
    """Ingest, evaluate on the run's clock, keep thinned keyframes.

    Records wait until the next evaluation is due, then go in as the collector takes a
    relay's columns (judge/ingest_columns.py: every rank's records with array
    operations, a rank's first records as a message), each rank's in their order. The
    judge reads its state only when it evaluates, so the order of ranks between two
    evaluations changes nothing, and a wide log costs no Python object per record."""

    def __init__(self, state: RunState, world: int, started: float, rec: Record) -> None:
        self.state, self.world, self.started, self.rec = state, world, started, rec
        self.interval = EVAL_INTERVAL_S  # between keyframes: one per evaluation, to start
        self.max_frames = max(8, min(MAX_KEYFRAMES, KEYFRAME_ROWS // world))
        self.eval_every: float | None = None  # set when the span is known
        self.next_eval: float | None = None
        self.next_frame: float | None = None
        self.frames: list[Keyframe] = []
        self.label: str | None = None
        self.now = started
        self.seq = 0
        self.idents: dict[int, Identity] = {}
        self.pending: list[StepColumns] = []
        self.bytes = 0

    def add(self, cols: StepColumns) -> None:
        ok = (cols.rank >= 0) & (cols.rank < self.world)  # sized by its run: others not ours
        if not ok.all():
            cols = _take(cols, ok)
        while len(cols):
            if self.next_eval is None:
                self.next_eval = self.next_frame = float(cols.t_end[0])
            due = cols.t_end >= self.next_eval
            if not due.any():
                self.pending.append(cols)
                break
            i = int(due.argmax())  # the first record that came after a tick was due
            if i:
                self.pending.append(_take(cols, slice(0, i)))
            self._flush()
            t = float(cols.t_end[i])
            while t >= self.next_eval:  # the ticks the collector made before it came
                self._tick(self.next_eval)
                self.next_eval += self._eval_spacing()
            self.pending.append(_take(cols, slice(i, i + 1)))
            cols = _take(cols, slice(i + 1, None))
        if self.pending:
            self.now = max(self.now, float(self.pending[-1].t_end.max()))

    def _flush(self) -> None:
        """The waiting records into the state, one phase list at a time."""
        by_phases: dict[tuple[str, ...], list[StepColumns]] = {}
        for cols in self.pending:
            by_phases.setdefault(cols.phases, []).append(cols)
        self.pending = []
        for phases, parts in by_phases.items():
            self._ingest(phases, parts)

    def _ingest(self, phases: tuple[str, ...], parts: list[StepColumns]) -> None:
        rank, step, t_end, step_ms, values = (
            np.concatenate([getattr(c, f) for c in parts])
            for f in ("rank", "step", "t_end", "step_ms", "values"))
        order = np.argsort(rank, kind="stable")  # each rank's records together, in order
        rank, step, t_end, step_ms, values = (a[order] for a in (rank, step, t_end, step_ms,
                                                                 values))
        group = StepGroup(list(phases), step.astype("<i8").tobytes(),
                          t_end.astype("<f8").tobytes(), step_ms.astype("<f8").tobytes(),
                          values.astype("<f8").tobytes())
        ranks, starts, counts = np.unique(rank, return_index=True, return_counts=True)
        rows: list[StepRow] = []
        for r, start, count in zip(ranks.tolist(), starts.tolist(), counts.tolist(),
                                   strict=True):
            for a in range(start, start + count, BATCH_RECORDS):
                n = min(BATCH_RECORDS, start + count - a)
                self.seq += 1
                rows.append(StepRow(self._ident(r), self.seq, float(t_end[a + n - 1]), 0, n))
        pending = ingest_columns.Pending()
        state = self.state
        for row, opened in zip(rows, ingest_columns.open_groups([group], rows), strict=True):
            if opened is None:
                continue
            g, start = opened
            if not ingest_columns.take_row(state, pending, row.id, None, row.t, row, g, start):
                if row.id.rank in pending.ranks:  # its earlier rows first, as the collector
                    ingest_columns.flush(state, pending)
                state.ingest(ingest_columns.message_of(row, g, start), row.t)
            if pending.records >= ingest_columns.MAX_PENDING_RECORDS:
                ingest_columns.flush(state, pending)
        ingest_columns.flush(state, pending)

    def _eval_spacing(self) -> float:
        if self.eval_every is not None:
            return self.eval_every
        return max(EVAL_INTERVAL_S, self.interval / EVALS_PER_KEYFRAME)

    def _ident(self, rank: int) -> Identity:
        ident = self.idents.get(rank)
        if ident is None:
            node, host, _ = self.rec.hosts.get(rank, (0, "", ""))
            ident = self.idents[rank] = Identity(rank, rank, node, host or "?", 1000 + rank,
                                                 self.world)
        return ident

    def _tick(self, now: float) -> None:
        shown = self.state.evaluate(now)
        changed = shown.label != self.label
        self.label = shown.label
        assert self.next_frame is not None
        if changed or now >= self.next_frame:
            self._keep(now)
            while self.next_frame <= now:
                self.next_frame += self.interval

    def _keep(self, now: float, finished: bool = False,
              rec: Record | None = None) -> None:
        state = self.state
        view = view_build.build(state.snapshot(now, now), state.recent_steps)
        if rec is not None:
            view = _ending(view, rec)
        data = encode_view(view)
        step = max((rs.last_step for rs in state.ranks.values()), default=0)
        self.frames.append(Keyframe(max(0.0, now - self.started), step,
                                   f"{view.label}|{view.rank}|{view.node}", data))
        self.bytes += len(data)
        if not finished:
            self._thin()

    def _thin(self) -> None:
        """Drop every other keyframe (first and last kept) once too many or too big."""
        # Twice the bound by count: the regular frames fill it, those where the banner
        # changed come on top (they are where `[` and `]` land); bytes bound them all.
        while len(self.frames) > 2 and (len(self.frames) > 2 * self.max_frames
                                        or self.bytes > KEYFRAME_BUDGET):
            last = self.frames[-1]
            kept = self.frames[:-1:2] + [last]
            self.bytes = sum(len(f.data) for f in kept)
            self.frames = kept
            self.interval *= 2

    def finish(self) -> list[Keyframe]:
        """The evaluations the collector made after the last record, while the ranks said
        goodbye (until the summary's end, at most END_TICKS: they confirm a label the last
        steps brought), and the keyframe with the run's end."""
        rec = self.rec
        self._flush()
        self._last_samples(self.now)
        ended = _epoch(((rec.summary or {}).get("run") or {}).get("ended_at"))
        now = self.now
        for _ in range(END_TICKS):
            if self.next_eval is None or ended is None or self.next_eval > ended:
                break
            now = self.next_eval
            self._tick(now)
            self.next_eval += EVAL_INTERVAL_S
        self.state.evaluate(now)
        self._keep(now, finished=True, rec=rec)
        return self.frames


    def _last_samples(self, t: float) -> None:
        """Each rank's last system sample as the record keeps it (its `ranks[].sys`),
        validated as the wire's: the step log holds none, and the run's end was judged
        with them (a straggler's CPU wait, a rank's memory). Before the end, the
        keyframes have no samples, and a straggler's CPU wait reads as not read."""
        doc = self.rec.summary or self.rec.live or {}
        for row in doc.get("ranks") or ():
            if not isinstance(row, dict) or not isinstance(row.get("sys"), dict):
                continue
            rank = row.get("rank")
            if not isinstance(rank, int) or rank not in self.state.ranks:
                continue
            ident = self._ident(rank)
            fields = {k: v for k, v in row["sys"].items() if k in _SAMPLE_FIELDS}
            try:
                body = msgspec.convert({**fields, "v": PROTOCOL_VERSION,
                                        "id": msgspec.to_builtins(ident), "seq": 0, "t": t},
                                       Sys)
            except (msgspec.ValidationError, ProtocolError):
                continue  # a record edited by hand, or another version's: not shown
            self.seq += 1
            self.state.ingest(Message("sys", ident, self.seq, t, body), t)


_SAMPLE_FIELDS = frozenset(Sys.__struct_fields__) - {"v", "id", "seq", "t", "at_exit"}


def _ending(view: RunView, rec: Record) -> RunView:
    """The last keyframe: the run's end as the summary records it."""
    doc = rec.summary
    if doc is None:
        return view
    run = doc.get("run") or {}
    failure = doc.get("failure") or {}
    code = run.get("exit_code")
    view = replace(view, finished=True, exit_code=code if isinstance(code, int) else None,
                   failure=failure.get("summary") or view.failure,
                   rows=_ended_rows(view.rows, doc.get("ranks")))
    verdict = doc.get("diagnosis") or {}
    label, rank, node = verdict.get("label"), verdict.get("rank"), verdict.get("node")
    if not isinstance(label, str) or not label or (
            label != HANG and (label, rank) == (view.label, view.rank)):
        return view
    # The record's verdict, where the last evaluation of its steps reads otherwise: a hang
    # is seen from silence, which the step log cannot show, and the summary judges the
    # whole run (its windows, the ranks' goodbyes) where a live view judged the last
    # window. Opening a record must not give a second answer to "what was wrong".
    return replace(view, label=clean_line(label), rank=rank if isinstance(rank, int) else None,
                   node=node if isinstance(node, int) else None,
                   phase=clean_line(str(verdict["phase"])) if verdict.get("phase") else None,
                   severity=str(verdict.get("severity") or view.severity),
                   summary=clean_line(str(verdict.get("summary") or "")), cost=None)


def _ended_rows(rows: tuple[RankRow, ...], ranks: Any) -> tuple[RankRow, ...]:
    """Each rank's state at the run's end, from the summary's ranks (the step log has no
    goodbyes, and every rank would read stale): done, stopped or failed by its exit code."""
    codes: dict[int, int | None] = {}
    for r in ranks if isinstance(ranks, list) else ():
        if isinstance(r, dict) and isinstance(r.get("rank"), int) and r.get("steps", 1):
            code = r.get("exit_code")
            codes[r["rank"]] = code if isinstance(code, int) else None
    out = []
    for row in rows:
        if row.rank not in codes or row.status == WAITING:
            out.append(row)
            continue
        code = codes[row.rank]
        status = (DONE if not code else STOPPED if code in STOP_EXIT_CODES else FAILED)
        out.append(replace(row, status=status))
    return tuple(out)


def _take(cols: StepColumns, which: np.ndarray | slice) -> StepColumns:
    return StepColumns(cols.phases, cols.rank[which], cols.step[which], cols.t_end[which],
                       cols.step_ms[which], cols.values[which])
