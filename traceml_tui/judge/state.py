"""The collector's state: what every rank has reported, and frozen snapshots of it
(the frozen types are snapshot.py's).

`RunState.ingest` takes validated protocol messages (ingest.py's `Intake` writes them into
the ranks' records); `RunState.evaluate` runs the live diagnosis (a few times a second)
and keeps the run's timeline of episodes (timeline.py) and its hang latch (hang.py);
`RunState.snapshot` freezes everything into a `Snapshot` that the summary
writer and dashboards read. Nothing here does I/O or reads a clock: the
collector passes the time in, so the whole state machine is testable offline.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import Any

import numpy as np

from traceml_agent.protocol import (
    NO_HEARTBEAT,
    PHASES,
    Message,
)

from . import collectives as coll
from . import cost, hang, progress
from . import diagnosis as dx
from .attempts import AttemptBook
from .hang import HangReport, Threads
from .ingest import Intake, RankState, Relay
from .memory import MemoryBook, memory_evidence
from .owners import Owners
from .rank_snapshot import rank_snapshot
from .setup_checks import ChecksBoard
from .snapshot import (
    RankSnapshot,
    RelaySnapshot,
    Snapshot,
    WholeWindow,
    WindowPart,
    WindowPartCache,
)
from .stalls import StallBook, StallFinding
from .timeline import Timeline
from .timings import Columns, Lookup, Timings
from .windows import (
    AlignedSteps,
    BlockStats,
    Gather,
    Quantiles,
    WindowBlock,
    finite_median,
    whole_window_stats,
    window_steps_for,
)

# Steps of each rank that the live diagnosis looks at: enough for a stable median,
# few enough that a straggler appearing mid-run flips it within ~LIVE_STEPS/2 steps.
LIVE_STEPS = dx.LIVE_WINDOW_STEPS
SPARKLINE_STEPS = 60


def _rarely_seen(stats: BlockStats) -> np.ndarray:
    """Per row of `stats`: a judged window (MIN_STEPS) in which an expected phase was
    seen on fewer than half the steps; only these ranks (and those with phases closed
    without their end hook) can have untimed phases (diagnosis.untimed_phases)."""
    n = stats.steps
    seen = np.stack([stats.seen[:, i] if (i := stats.index.get(p)) is not None
                     else np.zeros(len(n), dtype=np.int64)
                     for p in dx.EXPECTED_PHASES], axis=1)
    return (n >= dx.MIN_STEPS) & (seen * 2 < n[:, None]).any(axis=1)


class RunState:
    def __init__(self, run_name: str, world_size: int, nnodes: int = 1,
                 nproc_per_node: int | None = None, started_at: float = 0.0,
                 window_steps: int | None = None, hang_after_s: float | None = None,
                 max_restarts: int = 0, min_world_size: int | None = None) -> None:
        self.run_name = run_name
        self.world_size = world_size
        self.nnodes = nnodes
        self.nproc_per_node = nproc_per_node or max(1, world_size // max(1, nnodes))
        self.started_at = started_at
        self.window_steps = window_steps or window_steps_for(world_size)
        # Every rank's window in one block: statistics for all ranks in one numpy pass.
        self.block = WindowBlock(world_size, self.window_steps)
        self.ranks: dict[int, RankState] = {}
        self.phases: list[str] = list(PHASES)
        self.counters = {"messages": 0, "malformed": 0, "foreign": 0, "records": 0,
                         "duplicate_records": 0, "agent_dropped": 0, "rejected_peers": 0,
                         "restarts": 0, "absurd_steps": 0, "backlog_refused": 0,
                         "not_owner": 0, "bad_records": 0}
        # Who may write each rank's record (owners.py).
        self.owners = Owners(nnodes)
        # The connections whose messages wait in the collector's queue at this
        # evaluation (collect/ingest_pump.py): their ranks are not silent (progress.waiting).
        self.waiting_routes: frozenset[object] = frozenset()
        self.live: dx.LiveLabel | None = None
        # Every rank's live timings (LIVE_STEPS) and newest few steps' (dx.recent_steps),
        # as columns by rank: what an evaluation reads, with no object per rank.
        self.live_cols = Columns(world_size)
        self.recent_cols = Columns(world_size)
        # What this evaluation's refresh gathered, for the cost model's aligned steps.
        self._gather: Gather | None = None
        # The ranks' windows lined up by step, as read in this evaluation (by the newest
        # steps wanted, and whether the refresh's values served): the diagnosis's
        # per-step rules and the cost model ask for the same steps.
        self._reads: dict[tuple[int, bool], AlignedSteps | None] = {}
        # Episodes, their cost, the live what-if and the time chart's history.
        self.timeline = Timeline(started_at, self.window_steps)
        self.collectives = coll.CollectiveBook()  # which collective took the sync time
        # What `traceml run --preflight` measured; its largest all-reduce's bus bandwidth
        # (GB/s) is what COMM-BOUND's evidence compares against.
        self.preflight: dict[str, Any] | None = None
        self.preflight_busbw: float | None = None
        self.hang_after_s = hang_after_s
        # "fsdp" once any rank reports an FSDP model: collectives then run inside forward
        # and backward, and the diagnosis compares only the phases without them.
        self.parallel: str | None = None
        self.window_parts = WindowPartCache()  # the last full snapshot's (snapshot)
        # Rank records made so far (Intake: a new process, a restart): what a whole-window
        # part covers is the same while this, the attempt and the phases are.
        self.records_made = 0
        self.checks = ChecksBoard(world_size)
        self.hangs = hang.HangLatch()  # the hang on display, its stacks, the last ended
        self.framework: str | None = None  # named in the hint when timing is incomplete
        self.relays: dict[int, Relay] = {}  # node -> its relay, once heard from
        # rank -> why its frozen step count is not a stall (hang.hidden), as of the last
        # evaluation: hang detection is suspended for it, and the view and summary say why.
        self.hidden: dict[int, str] = {}
        # Every rank's stalled steps over the whole run, whatever the window (stalls.py).
        self.stall_book = StallBook()
        # Every rank's memory over the run, whatever its length (memory.py).
        self.memory = MemoryBook()
        # The attempts of a job torchrun restarts, each one's record (attempts.py).
        self.attempts = AttemptBook(max_restarts)
        # torchrun's elastic membership (--nnodes MIN:MAX): an attempt may run with fewer
        # nodes, its ranks then report a smaller world; the record is sized for MAX.
        self.min_world_size = min(world_size, min_world_size or world_size)
        # The only writer of the ranks' records and the counters (ingest.py).
        self.intake = Intake(self)

    # --- ingest ---------------------------------------------------------------------

    def ingest(self, msg: Message, now: float, conn: object = None) -> bool:
        """Apply one validated message (Intake.message). Returns False for a message from
        outside this run. `conn`: the connection it came on (None in-process: no ownership
        check)."""
        return self.intake.message(msg, now, conn)

    def _relay_snapshots(self, now: float) -> tuple[RelaySnapshot, ...]:
        """A relay is silent only while its node still has ranks to hear from: after its
        ranks' goodbyes, its node's launcher stops it (and node 0 may still be running)."""
        if not self.relays:
            return ()
        done: dict[int, int] = {}
        for rs in self.ranks.values():
            if rs.finished:
                done[rs.ident.node] = done.get(rs.ident.node, 0) + 1
        return tuple(
            RelaySnapshot(node, 0.0 if done.get(node, 0) >= self.nproc_per_node
                          else max(0.0, now - r.last_seen), r.batches, r.lost, r.dropped)
            for node, r in sorted(self.relays.items()))

    @property
    def of_the_job(self) -> Callable[[int], bool] | None:
        """Whether a pid is one of the job's processes, where the collector can tell."""
        return self.owners.of_the_job

    @of_the_job.setter
    def of_the_job(self, check: Callable[[int], bool] | None) -> None:
        self.owners.of_the_job = check

    def set_preflight(self, result: dict[str, Any]) -> None:
        self.preflight = result
        busbw = result.get("all_reduce_busbw_gbps")
        self.preflight_busbw = busbw if isinstance(busbw, (int, float)) and busbw > 0 else None

    def failures(self) -> list[tuple[int, int]]:
        """(rank, exit code) of the ranks that reported a non-zero exit, first failure first."""
        failed = [rs for rs in self.ranks.values() if rs.finished and rs.exit_code]
        failed.sort(key=lambda rs: rs.finished_at)
        return [(rs.ident.rank, rs.exit_code) for rs in failed if rs.exit_code]

    # --- live diagnosis -------------------------------------------------------------

    def _live_timing(self, rs: RankState) -> dx.RankTiming:
        """One rank's live timings as an object, for a view that names it."""
        if rs.dirty or not self.live_cols.fresh[rs.ident.rank]:
            self._refresh_live()
        live = self.evaluated(rs)
        assert live is not None  # _refresh_live wrote every dirty rank's row
        return live

    def evaluated(self, rs: RankState) -> dx.RankTiming | None:
        """A rank's live timings as of the last refresh (None before its first)."""
        if rs.live is None and self.live_cols.fresh[rs.ident.rank]:
            rs.live = self.live_cols.timing(rs.ident.rank, rs.ident.host, rs.gpu)
        return rs.live

    def _live_table(self) -> Timings:
        """Every reported rank's live timings (refreshed where it stepped), as a table;
        what the refresh gathered is kept for this evaluation's cost model."""
        self._refresh_live(keep=True)
        rows = np.fromiter(self.ranks, np.int64, len(self.ranks))
        return self.live_cols.table(rows, Lookup(self.ranks, lambda rs: rs.ident.host),
                                    Lookup(self.ranks, lambda rs: rs.gpu))

    def _refresh_live(self, keep: bool = False) -> None:
        """The live timings of every rank that stepped since the last evaluation, over its
        newest LIVE_STEPS steps, computed together (one WindowBlock.stats call) into
        `live_cols`: its median, untimed phases, gradient bytes and stall threshold."""
        cols = self.live_cols
        fresh = cols.fresh.tolist()  # a list item reads faster than a numpy one
        todo = [rs for r, rs in self.ranks.items() if rs.dirty or not fresh[r]]
        if not todo:
            return
        rows = np.fromiter((rs.ident.rank for rs in todo), np.int64, len(todo))
        stats = self.block.stats(rows, LIVE_STEPS, keep=keep)
        self._gather = stats.gather
        cols.put(rows, stats)
        self.recent_cols.fresh[rows] = False  # asked again only by a straggler rule
        at = dx.stall_thresholds(stats.median[:, 0]).tolist()  # set past warm-up (past)
        past = (stats.steps >= dx.MIN_STEPS).tolist()
        node, grad, forced = [], [], []
        for i, rs in enumerate(todo):
            node.append(rs.ident.node)
            grad.append(rs.heartbeat.grad_bytes)
            if rs.forced:
                forced.append(i)
            if past[i]:
                stall_at = at[i]
                rs.stall_at_ms = None if stall_at != stall_at else stall_at
            rs.live = None  # rebuilt from the row when a view asks (_evaluated)
            rs.dirty = False
        cols.node[rows] = node
        cols.comm_bytes[rows] = grad
        self._refresh_untimed(todo, rows, stats, forced)

    def _refresh_untimed(self, todo: list[RankState], rows: np.ndarray, stats: BlockStats,
                         forced: list[int]) -> None:
        """The untimed phases of the refreshed ranks, asked (`_untimed`) only of the ranks
        that may have some: an expected phase seen on fewer than half their steps, or a
        phase closed without its end hook."""
        n = stats.steps
        maybe = _rarely_seen(stats)
        maybe[forced] = True
        untimed = self.live_cols.untimed
        if untimed:
            refreshed = set(rows.tolist())
            for rank in [r for r in untimed if r in refreshed]:
                del untimed[rank]
        for i in np.flatnonzero(maybe).tolist():
            found = self._untimed(todo[i], int(n[i]), stats, i)
            if found:
                untimed[int(rows[i])] = found

    def _live_steps(self) -> AlignedSteps | None:
        """Every rank's live window lined up step by step (reusing what the refresh
        gathered), for the rules that compare the ranks one step at a time."""
        if not self.ranks:
            return None
        return self._aligned(cost.steps_to_read(len(self.ranks), self.window_steps,
                                                LIVE_STEPS), True)

    def _recent_timings(self) -> Timings:
        """Every rank's newest few steps (dx.recent_steps), to see a straggler recover
        before the window does. A second pass over the block, so only a straggler rule
        that holds on the window asks for it."""
        cols = self.recent_cols
        rows = np.fromiter(self.ranks, np.int64, len(self.ranks))
        todo = rows[~cols.fresh[rows]]
        if len(todo):
            live = self.live_cols
            typical = np.where(live.fresh[todo], live.step_ms[todo], np.nan)
            cols.put(todo, self.block.stats(todo, dx.recent_steps_of(typical)))
        return cols.table(rows, {}, {})

    def stall_findings(self) -> list[StallFinding]:
        """What each stalling rank's stall log says now (its typical step: the live one)."""
        out = []
        cols = self.live_cols
        for rank in sorted(self.stall_book.stalling):
            rs = self.ranks.get(rank)
            typical = (float(cols.step_ms[rank]) if rs is not None and cols.fresh[rank]
                       else None)
            found = (None if rs is None else
                     self.stall_book.finding(rank, None if typical != typical else typical,
                                             rs.last_step))
            if found is not None and rs is not None:
                hb = None if rs.heartbeat is NO_HEARTBEAT else rs.heartbeat
                out.append(replace(found, heartbeat=hb))  # the advice's evidence
        return out

    @staticmethod
    def _untimed(rs: RankState, window: int, stats: BlockStats, row: int
                 ) -> tuple[dx.Untimed, ...]:
        seen = stats.seen_of(row, dx.EXPECTED_PHASES)
        hb = rs.heartbeat  # the agent's own counts say why a phase went unmeasured
        return dx.untimed_phases(seen, window, rs.forced, rs.steps, rs.auto,
                                 hb.capture_skips, hb.timing_faults)

    def evaluate(self, now: float, mono_now: float | None = None) -> dx.Diagnosis:
        """One live evaluation: hang check, then the diagnosis of the recent window, and
        the timeline. Without `mono_now` (offline use) there is no hang check."""
        if self.attempts.waiting and any(rs.steps and rs.attempt == self.attempts.number
                                         for rs in self.ranks.values()):
            self.attempts.resumed(now)  # the restarted group stepped: what it cost
        self._reads = {}
        timings = self._live_table()
        before = self.live.shown if self.live else None
        report = None
        if mono_now is not None:
            step_ms = timings.step_ms
            if self.attempts.restarting(mono_now):  # torchrun restarts the group: no hang
                report, self.hidden = None, {}
            else:
                report, self.hidden = progress.check(
                    self.ranks, self.relays, self.waiting_routes, mono_now,
                    finite_median(step_ms[step_ms != 0]), self.hang_after_s)
        steps = sum(rs.steps for rs in self.ranks.values())
        if self.hangs.holds(steps) and not self.hidden:
            # Latched: until a step completes somewhere, this is the same hang. Ranks that
            # exit or die while it lasts (a Ctrl-C, a scheduler's SIGTERM) do not change
            # who the others were waiting for when it was detected. Progress the steps
            # cannot show (graph replays, batches, a trace stopping) ends it too.
            self.hangs.hold(report)
            self._keep_hang_stacks()
        elif report is not None:
            self.hangs.latch(report, steps, now, self._last_steps())
            self._keep_hang_stacks()
            self.live = dx.LiveLabel(report.diagnosis)
        else:
            self.hangs.clear()
            active = self.live.shown.label if self.live else None
            recent = self._recent_timings
            self.live = dx.settle(self.live, self._named(dx.diagnose(
                timings, active, self.parallel == "fsdp", self.framework, recent,
                self.stall_findings(), self.preflight_busbw, self._live_steps)))
        assert self.live is not None  # set above, or by the hang that latched
        shown = self.live.shown
        newest, fsdp = self.newest_step(), self.parallel == "fsdp"
        self.timeline.clock.mark(newest, now)
        if (before is None or shown.subject != before.subject
                or self.timeline.cause_changed(shown)):
            hang_since = self.hang_since if self.hang is not None else None
            self.timeline.new_episode(shown, now if hang_since is None else hang_since,
                                      newest, self.attempts.number, len(self.ranks),
                                      self._aligned, fsdp)
        self.timeline.count_cost(shown, newest, len(self.ranks), self._aligned, fsdp)
        self.timeline.add_history(now, timings)
        # What the refresh gathered, and the reads, serve this evaluation only.
        self._gather, self._reads = None, {}
        return shown

    def _keep_hang_stacks(self) -> None:
        """The stacks ranks sent (or that were taken of them) during the latched hang."""
        for rs in self.ranks.values():
            if rs.stacks:
                self.hangs.keep_stacks(rs.ident.rank, rs.stacks)

    def _last_steps(self) -> list[int]:
        return [rs.last_step for rs in self.ranks.values()]

    def keep_latched_hang(self) -> bool:
        """At the end of a run stopped by a signal (Ctrl-C, SIGTERM): a hang that ended
        within AFTERMATH_STEPS steps per rank beyond its frontier (hang.aftermath) was
        ended by the stop, so the record says HANG as it was latched (culprits, kind,
        stacks), its timeline episode open to the end, not the aftermath: neither the
        steps a woken rank's agent flushes, nor the few the ranks closed on their way
        out, nor the "hang" their stale heartbeats then make. True when restored."""
        steps = sum(rs.steps for rs in self.ranks.values())
        report = self.hangs.restore(steps, self._last_steps())
        if report is None:
            return False  # none ended, or the job went on after it: it resolved itself
        self.live = dx.LiveLabel(report.diagnosis)
        # The aftermath's episodes go; the hang's stays open to the end.
        self.timeline.reopen(report.diagnosis.label, self.hangs.since)
        return True

    # What the collector, the summary and tests read of the latch.
    @property
    def hang(self) -> HangReport | None:
        return self.hangs.report

    @property
    def hang_since(self) -> float | None:
        return self.hangs.since

    @property
    def hang_stacks(self) -> dict[int, Threads]:
        return self.hangs.stacks

    @property
    def what_if(self) -> cost.WhatIf | None:
        """The live what-if of the label on display (timeline.py)."""
        return self.timeline.what_if

    def newest_step(self) -> int:
        return max((rs.last_step for rs in self.ranks.values()), default=-1)

    def _aligned(self, want: int, reuse: bool) -> AlignedSteps | None:
        """The ranks' windows lined up by step, the newest `want` (timeline.Aligned);
        `reuse`: what this evaluation's refresh gathered may serve."""
        key = (want, reuse)
        if key not in self._reads:
            self._reads[key] = self.block.aligned(list(self.ranks), want,
                                                  self._gather if reuse else None)
        return self._reads[key]

    def recent_steps(self, rank: int) -> tuple[float, ...]:
        """The rank's last step times, oldest first (for a sparkline)."""
        rs = self.ranks.get(rank)
        return () if rs is None else tuple(rs.window.last(None, SPARKLINE_STEPS))

    # --- snapshots ------------------------------------------------------------------

    def _full_diagnosis(self, ranks: tuple[RankSnapshot, ...], whole: WholeWindow,
                        aligned: AlignedSteps | None = None) -> dx.Diagnosis:
        """The diagnosis over each rank's whole window (the summary's verdict), read as one
        table from the window's columns (no per-rank object)."""
        listed = [r for r in ranks if r.reported]
        at = np.array([whole.rows[r.rank] for r in listed], dtype=np.int64)
        numbers = np.array([r.rank for r in listed], dtype=np.int64)
        timings: dx.Table = [] if not listed else Timings(
            numbers, np.array([r.window_steps for r in listed], dtype=np.int64),
            whole.median[at, 0], {p: i for i, p in enumerate(whole.phases)},
            whole.median[at, 1:], np.array([r.node for r in listed], dtype=np.int64),
            np.array([r.heartbeat.grad_bytes for r in listed], dtype=np.int64),
            *self.live_cols.cpu.over_run(numbers), {r.rank: r.host for r in listed},
            {r.rank: r.untimed for r in listed if r.untimed},
            {r.rank: gpu for r in listed if (gpu := self.ranks[r.rank].gpu) is not None})
        return self._named(dx.diagnose(timings, collectives_in_compute=self.parallel == "fsdp",
                                       framework=self.framework, stalls=self.stall_findings(),
                                       preflight_busbw=self.preflight_busbw, steps=aligned))

    def _collective_stats(self) -> tuple[coll.CollectiveStat, ...]:
        reporting = sum(1 for rs in self.ranks.values() if rs.steps)
        mean_steps = sum(rs.steps for rs in self.ranks.values()) / max(1, reporting)
        return self.collectives.stats(mean_steps)

    def _named(self, d: dx.Diagnosis) -> dx.Diagnosis:
        """COMM-BOUND's evidence names the collective and group that dominate the sync."""
        if d.label != dx.COMM_BOUND:
            return d
        return coll.with_evidence(d, self._collective_stats())

    def snapshot(self, now: float, mono_now: float, full: bool = False,
                 window_max_age_s: float = 0.0, record: bool = False) -> Snapshot:
        """Freeze the state. `full` adds whole-window quantiles and the final diagnosis
        (costlier: used for the snapshot file and the summary, not every live tick);
        `window_max_age_s`: that part may be reused for so long (WindowPart), while the
        ranks, their run and its covering do not change; `record`: the run's record,
        every part judged at the moment, whatever a live read may leave for later."""
        shown = self.live.shown if self.live is not None else self.evaluate(now)
        part = (self.window_parts.serving(self._window_key(), mono_now, window_max_age_s)
                if full else None)
        # Full: every rank's whole window, in one pass per series, kept as columns.
        whole, untimed = ((part.whole, part.untimed) if part is not None
                          else self._whole_window() if full else (None, {}))
        none: Mapping[str, Quantiles | None] = MappingProxyType({p: None for p in self.phases})
        cols = {p: i for i, p in enumerate(self.phases, 1)}
        # Every rank's live timings, read from the live columns at once (no RankTiming).
        self._refresh_live()
        live = self.live_cols
        lives = (live.step_ms.tolist(), live.medians.tolist(), list(live.phases), live.untimed)
        # The CPU shares over the run only where the summary reads them (full snapshots).
        over = (None if whole is None else
                tuple(a.tolist() for a in live.cpu.over_run(np.arange(self.world_size))))
        cpu = (live.cpu.wait.tolist(), over)
        get, hidden = self.ranks.get, self.hidden
        ranks = tuple(rank_snapshot(r, get(r), self.nproc_per_node, hidden, mono_now, whole,
                                    untimed.get(r), none, cols, lives, cpu)
                      for r in range(self.world_size))
        if whole is not None and part is None:
            part = self._new_window_part(now, mono_now, ranks, whole, untimed)
        # Judged afresh for the record (every rank) and a full read (up to
        # memory.TRENDS_PER_READ ranks); for a viewer or the live file at most every
        # memory.LIVE_EVERY_S (their whole-window part is reused for longer still).
        trends = self.memory.trends(None if full and not window_max_age_s else mono_now,
                                    every=record)
        final = None if part is None else memory_evidence(part.final, trends)
        return Snapshot(
            run_name=self.run_name, world_size=self.world_size, nnodes=self.nnodes,
            started_at=self.started_at, now=now, phases=tuple(self.phases), ranks=ranks,
            live=memory_evidence(shown, trends), live_since=self.timeline.live_since,
            final=final,
            timeline=(*(e for a in self.attempts.kept for e in a.episodes), *self.timeline),
            counters=dict(self.counters), hang=self.hang,
            hang_since=self.hang_since, hang_stacks=dict(self.hang_stacks),
            parallel=self.parallel, checks=self.checks.merged(),
            batch_sizes=self.checks.batch_sizes(), framework=self.framework,
            preflight_busbw=self.preflight_busbw, preflight=self.preflight,
            relays=self._relay_snapshots(mono_now), what_if=self.timeline.what_if,
            history=self.timeline.history.view(),
            collectives=self._collective_stats(),
            stalls=() if part is None else part.stalls,
            memory=trends,
            final_what_if=None if part is None else part.final_what_if,
            mean_step_ms=None if part is None else part.mean_step_ms,
            whole=whole, window_at=None if part is None or part.at >= now else part.at,
            attempts=self.attempts.attempts(
                {r: rs.steps for r, rs in self.ranks.items() if rs.attempt == self.attempts.number},
                shown, tuple(self.timeline)))

    def _window_key(self) -> tuple[int, ...]:
        """What a whole-window part covers: a rank record made (a rank added or
        restarted), a new attempt (its old ranks leave) or a new phase makes it another."""
        return (self.records_made, self.attempts.number, len(self.phases))

    def _new_window_part(self, now: float, mono_now: float, ranks: tuple[RankSnapshot, ...],
                         whole: WholeWindow, untimed: Mapping[int, tuple[dx.Untimed, ...]]
                         ) -> WindowPart:
        aligned = self.block.aligned(list(self.ranks), cost.steps_to_read(
            len(self.ranks), self.window_steps, self.window_steps))
        final = self._full_diagnosis(ranks, whole, aligned)
        return self.window_parts.keep(WindowPart(
            at=now, mono=mono_now, key=self._window_key(), whole=whole, untimed=untimed,
            final=final,
            final_what_if=(None if aligned is None or final.label not in cost.COSTED_LABELS
                           else cost.what_if(final, aligned, self.parallel == "fsdp")),
            mean_step_ms=None if aligned is None else cost.job_step_ms(aligned),
            stalls=tuple(self.stall_findings())))

    def _whole_window(self) -> tuple[WholeWindow, dict[int, tuple[dx.Untimed, ...]]]:
        """Every reporting rank's whole window in one pass per series, and the phases each
        could not time over it (rank -> untimed)."""
        reported = list(self.ranks.values())
        stats = whole_window_stats(self.block, [rs.ident.rank for rs in reported])
        # Asked (`_untimed`) only of the ranks that may have some, as _refresh_untimed
        # does: an expected phase rarely seen, or a phase closed without its end hook.
        n = stats.steps
        maybe = _rarely_seen(stats).tolist()
        untimed = {rs.ident.rank: self._untimed(rs, int(n[row]), stats, row)
                   for row, rs in enumerate(reported) if maybe[row] or rs.forced}
        return WholeWindow.of([rs.ident.rank for rs in reported], tuple(self.phases),
                              stats), untimed
