"""What arrives from the ranks, written into their records: the only writer of per-rank
state (`RankState`) and of the run's counters, for both ingest paths.

`Intake.message` takes one validated protocol message (RunState.ingest is its door):
ownership and restarts (owners.py), the attempt it belongs to (attempts.py), then the
message's own fields. Step records are taken by one rule, `next_steps`, in its scalar form
record by record (`Intake.take_records`) and in its array form for whole columns
(ingest_columns.py, which comes here for every write of a rank's record). The evaluation
(state.py) reads what this writes and keeps its own caches (a rank's live row, its stall
threshold); it writes no record.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from traceml_agent.protocol import (
    NO_HEARTBEAT,
    CheckReport,
    Goodbye,
    Heartbeat,
    Hello,
    Identity,
    Message,
    NcclState,
    Stacks,
    StepRecord,
    Steps,
    Sys,
)
from traceml_agent.sanitize import clean_text
from traceml_agent.vocab import WARMUP_STEPS
from traceml_tui.runfolder.exit_codes import wire_exit_code

from . import diagnosis as dx
from .evidence import CPU_STEPPING_MIN_PCT
from .owners import RANK_QUIET_S
from .windows import RankWindow

if TYPE_CHECKING:
    from .state import RunState

COUNTER_MAX = (1 << 63) - 1
# How far a rank's steps may run ahead of the time it has been reporting: a rank's step
# number may be at most MAX_STEP_JUMP past its first, plus MAX_STEPS_PER_S for every
# second since then. No training step is shorter than 100 us (one Python-level forward
# and optimizer step of the smallest model takes longer), and MAX_STEP_JUMP covers the
# first record's numbering plus an agent's whole queue lost at once (RECORD_QUEUE, 50,000
# records). A bound on the rate, not on each record's jump: records climbing by the
# allowed jump each cannot climb past it (a per-record bound let one message of 20,000
# records climb by 2**20 each, and the rank's real steps then counted as duplicates).
MAX_STEP_JUMP = 1 << 20
MAX_STEPS_PER_S = 10_000
MAX_RELAYS = 1 << 16  # one per node; a key holder cannot make us keep more
# The thread name a stack taken from outside the process is shown under.
NATIVE_THREAD = "native (py-spy dump --native, innermost first)"
# Distinct phase names a run may use: the standard ones plus the agent's custom limit.
MAX_RUN_PHASES = 24
MAX_PHASE_LISTS = 64  # phase lists remembered as all in the run's (add_phases)


@dataclass(slots=True)
class Relay:
    last_seen: float
    batches: int = 0  # the next batch number expected (= batches it has sent)
    lost: int = 0
    dropped: int = 0
    conn: object = None  # the connection that relays its node's ranks


def relay_owner(ranks: Iterable[RankState], node: int, conn: object) -> bool:
    """Whether connection `conn` relays a rank of `node` (its record's route: the relay's
    connection and a route that is not None): the only one that speaks for that node's
    relay. Node 0's ranks reach the collector directly, so no connection relays them."""
    return any(rs.ident.node == node and isinstance(rs.conn, tuple) and len(rs.conn) == 2
               and rs.conn[0] == conn and rs.conn[1] is not None for rs in ranks)


@dataclass
class RankState:
    ident: Identity
    window: RankWindow
    steps: int = 0
    last_step: int = -1
    last_seen: float = 0.0
    last_step_at: float = 0.0
    sys: Sys | None = None
    gpu: dx.GpuHealth | None = None  # from the latest sys sample (NVML health)
    heartbeat: Heartbeat = NO_HEARTBEAT
    exit_code: int | None = None
    error: str | None = None
    finished: bool = False
    finished_at: float = 0.0
    dropped: int = 0
    device: str = ""
    dirty: bool = True
    live: dx.RankTiming | None = None  # its live row as an object, once a view asked
    # The step time from which a step is a stall (dx.stall_threshold of the typical step
    # of the last evaluation): stalled steps go to the run's stall log (stalls.py).
    stall_at_ms: float | None = None
    # Seconds since its last step as of its last message: 0 after a steps batch, the
    # agent's own figure after a heartbeat.
    since_step_at_msg_s: float = 0.0
    stacks: tuple[tuple[str, str], ...] = ()
    stacks_after_step: int = -1  # the last step before the stacks were taken
    nccl: NcclState | None = None  # its NCCL log's last collectives, with the stacks
    forced: dict[str, int] = field(default_factory=dict)  # phases closed without an end
    auto: bool = True  # the zero-code hooks time this rank (hello says; assumed before it)
    bad_records: int = 0  # records of its batches the decoder refused (protocol._records)
    # When its graph replays and batches last rose, and since when its agent is busy
    # (_progress_seen); None: not seen.
    replays_at: float | None = None
    batches_at: float | None = None
    busy_since: float | None = None
    conn: object = None  # the connection it reports on (RunState.ingest's `conn`)
    # Its process's key (protocol.Hello.key), from its first hello or heartbeat that had
    # one: what its process shows to continue the record from another connection.
    key: str | None = None
    first_step: int = -1  # its first step recorded, and when (the step-rate bound)
    first_step_at: float = 0.0
    attempt: int = 1  # the attempt its process belongs to (attempts.py)

    def step_bound(self) -> int:
        """The highest step number a record of it may carry now (its first record may
        carry any): faster than any training steps is absurd, a jump to 2**62 (or a climb
        to it, record by record) that would make every later real step a duplicate
        (`next_steps`, the record-acceptance rule)."""
        return self.first_step + MAX_STEP_JUMP + int(
            MAX_STEPS_PER_S * max(0.0, self.last_seen - self.first_step_at))


StepNo = TypeVar("StepNo", int, np.ndarray)


def next_steps(step: StepNo, last: StepNo, bound: StepNo) -> StepNo:
    """The record-acceptance rule: a record is taken when its step is past the rank's
    newest (at or before it: replayed or out of order, a duplicate) and within the
    step-rate bound (RankState.step_bound: past it, absurd). For one record (ints) or a
    rank's records in columns (arrays, `last` each record's predecessor). A rank's very
    first record carries any step (it sets the bound's origin); a record below
    WARMUP_STEPS is taken but kept out of the windows (`in_window`)."""
    return (step > last) & (step <= bound)


def in_window(step: StepNo) -> StepNo:
    """Whether a taken record goes into its rank's window (warm-up steps do not)."""
    return step >= WARMUP_STEPS


class Intake:
    """The run's intake: every message's effect on the ranks' records and the counters.
    It writes into its RunState's parts (ranks, window block, books, counters); the
    state owns them, evaluates and snapshots."""

    def __init__(self, state: RunState) -> None:
        self.state = state
        self._lists_in: set[tuple[str, ...]] = set()  # phase lists all in state.phases

    def count_malformed(self) -> None:
        self.state.counters["malformed"] += 1

    def relay_seen(self, node: int, batches: int, dropped: int, now: float,
                   conn: object = None) -> None:
        """A node relay's batch arrived (relay.py): its numbering shows batches lost on
        the way, its count the rank messages it had to drop. `conn`: the connection it came
        on (None in-process): counters are taken only from the one that relays the node's
        ranks (relay_owner), so no key holder rewrites a node's counters or adds a relay."""
        relay = self.state.relays.get(node)
        if conn is not None and (relay is None or relay.conn != conn):
            if relay_owner(self.state.ranks.values(), node, conn):
                if relay is not None:  # its relay restarted, its ranks came back through it
                    relay.conn, relay.batches, relay.dropped = conn, batches, 0
            elif relay is not None:  # another connection speaking for a node's relay
                self.state.counters["not_owner"] += 1
                return
            elif node < max(self.state.nnodes, 1):
                return  # not yet: it counts once a hello of its node's ranks came through it
        if relay is None:
            if node >= max(self.state.nnodes, 1) or len(self.state.relays) >= MAX_RELAYS:
                self.state.counters["foreign"] += 1  # not a node of this run
                return
            relay = self.state.relays[node] = Relay(now, batches, conn=conn)
        relay.last_seen = now
        if batches > relay.batches:
            relay.lost = min(COUNTER_MAX, relay.lost + batches - relay.batches)
        elif batches < relay.batches:  # the relay restarted: its numbering too
            relay.dropped = 0
        relay.batches = batches + 1
        relay.dropped = max(relay.dropped, min(dropped, COUNTER_MAX))

    def message(self, msg: Message, now: float, conn: object = None) -> bool:
        """Apply one validated message. Returns False for a message from outside this run.
        `conn`: the connection it came on (None in-process: no ownership check)."""
        ident = msg.ident
        if not self.state.min_world_size <= ident.world_size <= self.state.world_size:
            self.state.counters["foreign"] += 1
            return False
        if msg.kind == "steps" and not self.phases_fit(msg.phases):
            self.state.counters["malformed"] += 1
            return False
        rs = self.state.ranks.get(ident.rank)
        if rs is not None and conn is not None and rs.conn != conn:
            if not self.state.owners.may_take_over(rs, msg, now, conn):
                self.state.counters["not_owner"] += 1
                return False
            if rs.ident.pid == ident.pid:  # the same process, reconnected
                rs.conn = conn
            else:  # a new process that said hello here: the rank restarted
                self.state.counters["restarts"] += 1
                self.state.checks.forget(ident.rank)
                rs = None
        if rs is not None and rs.ident.pid != ident.pid:
            # Another process for a rank we know: a restart only when it says hello
            # (a new process's first message). Anything else is an impostor or a stale
            # straggler of the old process, and must not reset the rank's record.
            if msg.kind != "hello":
                self.state.counters["foreign"] += 1
                return False
            self.state.counters["restarts"] += 1
            self.state.checks.forget(ident.rank)
            rs = None
        if rs is None and not self.state.owners.of_job(ident, conn):
            self.state.counters["not_owner"] += 1  # a process the launcher did not start
            return False
        self.state.counters["messages"] += 1
        if rs is None:
            if isinstance(msg.body, Hello):  # a new process: perhaps of a new attempt
                self._attempt_seen(msg.body.attempt, msg.t, now)
            self.state.block.reset(ident.rank)
            self.state.stall_book.forget(ident.rank)  # a new process numbers its steps afresh
            self.state.memory.forget(ident.rank)
            rs = RankState(ident, self.state.block.view(ident.rank), conn=conn,
                           attempt=self.state.attempts.number)
            self.state.ranks[ident.rank] = rs
            self.state.records_made += 1
            self.state.live_cols.cpu.forget(ident.rank)  # the old process's, if any
            self.state.owners.forget(ident.rank)
        rs.last_seen = now
        body = msg.body
        if isinstance(body, Steps):
            self._steps(rs, msg, body)
        elif isinstance(body, Sys):
            self._sample(rs, body)
        elif isinstance(body, Heartbeat):
            self._beat(rs, body, now)
        elif isinstance(body, Stacks):
            # They belong to the stall after the last step seen (a rank's messages arrive
            # in order): cleared when it steps again, so an old stall's stack is never
            # shown for a healthy rank or a later hang.
            # A stack taken from outside during this same stall (set_native_stack) stays:
            # it shows where the process was while it could not speak.
            native = tuple(st for st in rs.stacks if st[0] == NATIVE_THREAD
                           and rs.stacks_after_step == rs.last_step)
            rs.stacks = (*body.stacks, *native)
            rs.nccl = body.nccl if isinstance(body.nccl, NcclState) else None
            rs.stacks_after_step = rs.last_step
        elif isinstance(body, Hello):
            if rs.key is None:
                rs.key = body.key
            rs.device = body.device
            rs.auto = body.auto
            rs.dirty = True
        elif isinstance(body, CheckReport):
            self.state.checks.add(ident.rank, ident.host, body.findings, body.facts)
        elif isinstance(body, Goodbye):
            if rs.finished:  # one goodbye per process: a second is not its own
                self.state.counters["messages"] -= 1  # counted above: foreign instead
                self.state.counters["foreign"] += 1
                return False
            rs.finished = True
            rs.finished_at = now
            rs.exit_code = wire_exit_code(body.exit_code)
            rs.error = body.error
            if rs.attempt == self.state.attempts.number:
                self.state.attempts.goodbye(ident.rank, body.exit_code, body.error,
                                      rs.last_step + 1, msg.t, now)
        return True

    def relayed(self, body: Heartbeat | Sys, now: float, conn: object) -> bool:
        """A heartbeat or sys sample from a relay's typed lists (protocol.RelayBatch), of a
        rank known on this very connection as this very process: `message`'s effect, whose
        checks of run, owner and process it passes as they stand. False for any other (a
        new or restarted process, another connection's rank): ingest it as a message."""
        ident = body.id
        rs = self.state.ranks.get(ident.rank)
        if (rs is None or rs.conn != conn or rs.ident.pid != ident.pid
                or not self.state.min_world_size <= ident.world_size <= self.state.world_size):
            return False
        self.state.counters["messages"] += 1
        rs.last_seen = now
        if isinstance(body, Heartbeat):
            self._beat(rs, body, now)
        else:
            self._sample(rs, body)
        return True

    def _sample(self, rs: RankState, body: Sys) -> None:
        """A sys sample's figures: CPU share and wait, memory, GPU health, its device.
        The one sent at a process's end brings only its training thread's shares."""
        self._cpu_seen(rs, body)
        if body.at_exit:
            return
        rs.sys = body
        self.state.memory.seen(rs.ident.rank, body.t, body)
        # NVML health, beside a compute straggler's evidence (diagnosis reads its map)
        gpu = (dx.GpuHealth.of(body.sample())
               if body.sm_clock_mhz is not None or body.throttle else None)
        if gpu != rs.gpu:
            rs.gpu = gpu
            if rs.live is not None:  # the next evaluation reads it, steps or not
                rs.live = replace(rs.live, gpu=gpu)
        if body.device:
            rs.device = body.device

    def _beat(self, rs: RankState, body: Heartbeat, now: float) -> None:
        """A heartbeat's news: progress, the agent's counts and state, since its step."""
        if rs.key is None and body.key is not None:
            rs.key = body.key  # an agent whose hello this collector missed
        self._progress_seen(rs, body, now)
        rs.heartbeat = body
        if body.parallel in ("ddp", "fsdp") and self.state.parallel != "fsdp":
            self.state.parallel = body.parallel
        rs.since_step_at_msg_s = body.since_step_s or 0.0
        self.state.framework = body.framework or self.state.framework

    def _attempt_seen(self, attempt: int | None, t: float, now: float) -> None:
        """A new process's hello names its attempt: one newer than the current closes it."""
        if self.state.attempts.rises(attempt):
            assert attempt is not None
            self._next_attempt(attempt, t, now)
        self.state.attempts.hello(attempt, t)

    def _next_attempt(self, attempt: int, t: float, now: float) -> None:
        """torchrun restarted the group: the current attempt's record is kept (attempts.py)
        with its open episode closed at its last step. The new attempt numbers its steps
        from 0 again: its timeline, live label and step clock start afresh, and the old
        attempt's ranks that have ended or gone quiet (RANK_QUIET_S) leave the live record
        (their steps are the attempt's); a rank still speaking stays until its own hello."""
        number = self.state.attempts.number
        kept = self.state.timeline.close_attempt(self.state.newest_step(), t)
        ours = [rs for rs in self.state.ranks.values() if rs.attempt == number]
        self.state.attempts.close(attempt, t, now, {rs.ident.rank: rs.steps for rs in ours},
                            self.state.live.shown if self.state.live else None, kept,
                            tuple(sorted((rs.ident.rank, rs.last_step + 1) for rs in ours
                                         if not rs.finished)))
        for rank, rs in list(self.state.ranks.items()):
            if rs.finished or now - rs.last_seen >= RANK_QUIET_S:
                del self.state.ranks[rank]
                self.state.block.reset(rank)
        self.state.live = None
        self.state.hangs.reset()

    @staticmethod
    def _progress_seen(rs: RankState, body: Heartbeat, now: float) -> None:
        """When the rank's CUDA graph replays and DataLoader batches last rose, and since
        when its agent is busy (hang.hidden: progress its step count cannot show)."""
        old = rs.heartbeat
        if body.replays > old.replays:
            rs.replays_at = now
        if body.batches > old.batches:
            rs.batches_at = now
        busy = body.agent_busy
        if busy is None:
            rs.busy_since = None
        elif busy != old.agent_busy or rs.busy_since is None:
            rs.busy_since = now

    def phases_fit(self, phases: tuple[str, ...]) -> bool:
        """Each new phase name costs a window per rank: a sender inventing names must not
        grow the collector without bound."""
        if phases in self._lists_in:
            return True
        new = sum(1 for name in phases if name not in self.state.phases)
        return len(self.state.phases) + new <= MAX_RUN_PHASES

    def add_phases(self, phases: tuple[str, ...]) -> None:
        """A batch's phase names into the run's (they fit: _phases_fit). Agents send the
        same list in every batch: a list whose names are all in is remembered (bounded)."""
        if phases in self._lists_in:
            return
        self.state.phases.extend(name for name in phases if name not in self.state.phases)
        if len(self._lists_in) >= MAX_PHASE_LISTS:
            self._lists_in.clear()
        self._lists_in.add(phases)

    def _cpu_seen(self, rs: RankState, body: Sys) -> None:
        """A sample of the training thread's time on a CPU and waiting for one. The agent
        sends them only for an interval in which the rank stepped (sysmetrics), and says
        how much of it (stepping_pct): one mostly spent elsewhere is not taken
        (CPU_STEPPING_MIN_PCT; an agent that does not say is taken as before)."""
        run, wait = body.thread_cpu_pct, body.cpu_wait_pct
        if run is None or wait is None:
            return
        if body.stepping_pct is not None and body.stepping_pct < CPU_STEPPING_MIN_PCT:
            return
        cpu = self.state.live_cols.cpu
        rank = rs.ident.rank
        cpu.seen(rank, run / 100.0, wait / 100.0)
        if rs.live is not None:  # the next evaluation reads it, steps or not
            rs.live = replace(rs.live, cpu_run=float(cpu.run[rank]),
                              cpu_wait=float(cpu.wait[rank]))

    def _steps(self, rs: RankState, msg: Message, body: Steps) -> None:
        self.add_phases(msg.phases)
        self.take_counts(rs, body.dropped, msg.phases, msg.forced)
        if msg.bad_records:
            self.bad_records(rs, msg.bad_records)
        if body.colls:
            self.state.collectives.add(rs.ident.rank, body.colls)
        self.take_records(rs, msg.records, msg.phases)
        self.stepped_past_stacks(rs)

    def stepped_past_stacks(self, rs: RankState) -> None:
        """A rank that stepped since its stacks were taken is past that stall: they go.
        During a latched hang they are first kept in its record, as every tick keeps them
        (_keep_hang_stacks): a stack that came after the last tick, its rank woken before
        the next (a Ctrl-C), would otherwise never reach the record."""
        if rs.stacks and rs.last_step > rs.stacks_after_step:
            if self.state.hangs.report is not None:
                self.state.hangs.keep_stacks(rs.ident.rank, rs.stacks)
            rs.stacks = ()
            rs.nccl = None

    def take_counts(self, rs: RankState, dropped: int, phases: tuple[str, ...],
                    forced: Iterable[int] | None) -> None:
        """A steps batch's counts: records its agent dropped so far, and phases it closed
        without their end hook (per phase, so far)."""
        # Saturating: ranks may claim up to 2**62 each (and a restarted rank counts
        # afresh); the sum must stay an integer every encoder takes.
        self.state.counters["agent_dropped"] = min(
            COUNTER_MAX, self.state.counters["agent_dropped"] + max(0, dropped - rs.dropped))
        rs.dropped = max(rs.dropped, dropped)
        for name, count in zip(phases, forced or (), strict=False):
            if count:
                rs.forced[name] = max(rs.forced.get(name, 0), count)

    def take_records(self, rs: RankState, records: Iterable[StepRecord],
                     phases: tuple[str, ...]) -> int:
        """Validated records of a rank's batch, in order; how many were taken (the others
        are duplicates or absurd steps). judge/ingest_columns.py does the same for whole
        columns, and comes here for a rank whose records are not simply the next steps."""
        taken = 0
        counters = self.state.counters
        for rec in records:
            if rs.first_step < 0 and rec.step > rs.last_step:  # the bound's origin
                rs.first_step, rs.first_step_at = rec.step, rs.last_seen
            if not next_steps(rec.step, rs.last_step, rs.step_bound()):
                counters["duplicate_records" if rec.step <= rs.last_step
                         else "absurd_steps"] += 1
                continue
            if in_window(rec.step):
                rs.window.append(rec.step_ms, phases, rec.phase_ms, rec.step)
                if rs.stall_at_ms is not None and rec.step_ms >= rs.stall_at_ms:
                    self.stall_seen(rs, rec.step, rec.step_ms, phases, rec.phase_ms)
            self.took(rs, 1, rec.step)
            taken += 1
        return taken

    def took(self, rs: RankState, n: int, last_step: int) -> None:
        """`n` records taken for a rank, its newest now `last_step` (both ingest paths;
        the columns' own window writes are ingest_columns._to_windows)."""
        rs.last_step_at = rs.last_seen
        rs.since_step_at_msg_s = 0.0
        rs.last_step = last_step
        rs.steps += n
        self.state.counters["records"] += n
        rs.dirty = True

    @staticmethod
    def since_step(rs: RankState, seconds: float) -> None:
        """Seconds since the rank's last step as of its last message (a heartbeat's own
        figure, where it came after the records: ingest_columns.flush)."""
        rs.since_step_at_msg_s = seconds

    def bad_records(self, rs: RankState, n: int) -> None:
        """Records of its batches the decoder refused: the agent counted them as sent, the
        gap must show here."""
        rs.bad_records = min(COUNTER_MAX, rs.bad_records + n)
        counters = self.state.counters
        counters["bad_records"] = min(COUNTER_MAX, counters["bad_records"] + n)

    def stall_seen(self, rs: RankState, step: int, step_ms: float, phases: tuple[str, ...],
                   phase_ms: tuple[float | None, ...]) -> None:
        """A step at or past the rank's stall threshold: to the stall log, against its
        live timings of the last evaluation."""
        live = self.state.evaluated(rs)
        if live is not None and live.step_ms is not None:
            st = dx.stall_of(step, step_ms, live.step_ms, phases, phase_ms, live.phase_ms)
            self.state.stall_book.add(rs.ident.rank, st.step, st.excess_ms, st.phase)

    def set_native_stack(self, rank: int, pid: int, text: str) -> None:
        """A stuck rank's stack taken from outside (native_stacks.py): kept beside any
        the rank sent itself, for this stall only, and only for the process that is
        that rank now (a restarted rank has another pid)."""
        rs = self.state.ranks.get(rank)
        if rs is None or rs.ident.pid != pid:
            return
        named = [(n, t) for n, t in rs.stacks if n != NATIVE_THREAD]
        rs.stacks = (*named, (NATIVE_THREAD, clean_text(text)))
        rs.stacks_after_step = rs.last_step

    def relay_stack(self, conn: object, node: int, rank: int, pid: int, text: str) -> bool:
        """A stuck rank's dump from its node (its launcher, through its relay): taken only
        from the connection that relays that rank's own messages, of a node relay heard
        from, for the process that is that rank now. A rank's key opens the ingest socket;
        it does not make its connection another rank's relay."""
        rs = self.state.ranks.get(rank)
        route = rs.conn if rs is not None else None
        if (rs is None or not isinstance(route, tuple) or len(route) != 2
                or route[0] != conn or route[1] is None
                or rs.ident.node != node or node not in self.state.relays or rs.ident.pid != pid):
            return False
        self.set_native_stack(rank, pid, text)
        return True
