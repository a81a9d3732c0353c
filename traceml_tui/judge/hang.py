"""Hang detection: pure rules over each rank's reported progress. No I/O, no clocks.

A job hangs when no rank has finished a step for longer than a threshold derived
from its recent step times. Then the ranks' progress tells the three cases apart,
the way a user would compare NCCL opCounts across rank logs, but live:

  diverged         the ranks' collective sequences differ (per process group: how many
                   collectives each entered, and the one it is in). The rank, or the
                   minority, whose sequence differs from the majority's took another code
                   path: a conditional collective only it entered (extra), or one it
                   skipped (missing). Which side is "behind" does not matter; asymmetry
                   does (the opCount comparison of NCCL logs). Two sides of equal size
                   are a tie, and said so.
  behind           the sequences agree, but some ranks made less progress (fewer steps,
                   or an earlier phase of the same step): the others are waiting for
                   them. A rank stuck in its own code (data loading, a deadlock, an
                   infinite loop) before the collective the others wait in.
  same collective  every rank is at the same point: all stuck in one collective
                   together, which points at the fabric, NCCL, or a shape mismatch.
  dead             a rank stopped sending anything, heartbeats included (they come
                   from a thread that does not need training): its process is gone
                   or frozen.
  relay lost       the silent ranks are those of nodes whose relay fell silent too:
                   what was lost is the relay (or its node's network), not necessarily
                   the ranks, which may be training still; "dead" would say too much.

A rank whose step count is frozen but which still makes progress the hooks cannot count
as steps (a whole-step CUDA graph it replays, DataLoader batches it fetches) or whose
agent is busy (stopping a deep trace) is not stalled: its steps are "not visible", said
with the reason (`hidden`), and hang detection is suspended for it. Its progress is the
job's: the other ranks' frozen steps may be their wait for it, so no hang is declared
while any rank shows such progress (as while any rank still steps).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from traceml_agent.vocab import MEASURED_PHASES

from .diagnosis import CRITICAL, HANG, Diagnosis

# No rank finished a step for at least this long: a floor that keeps a checkpoint or an
# evaluation pass of a few seconds from reading as a hang ...
HANG_FLOOR_S = 10.0
# ... and for at least this many median step times, so a job with 2 s steps gets 40 s.
HANG_STEPS = 20
# A running rank is heard at least every 2 s (a heartbeat a second; past 1,024 ranks a
# stepping rank's step batches instead, agent/transport.stepping_beat_s): this much
# silence means the process is gone or frozen.
DEAD_SILENCE_S = 5.0
# A rank's steps count as not visible once it closed none for this many median step times
# (at least QUIET_MIN_S: heartbeats come every second), the agent's own "stuck" rule
# (transport.STACK_STEPS, STACK_MIN_S), while other progress shows: its CUDA graph replays
# or DataLoader batches rose since its last step, and within the hang threshold (they
# must keep rising, not have risen once) ...
QUIET_STEPS = 5
QUIET_MIN_S = 3.0
# ... or its agent is busy (stopping a deep trace: the profiler's stop can take longer
# than a hang threshold), for at most this long: an agent busy for minutes is stuck too.
BUSY_MAX_S = 120.0
REPLAYS = "steps not visible: CUDA graph replays"
BATCHES = "steps not visible: DataLoader batches still fetched"

# How far into its step a rank is, by the phase it is in (the table's order; none: 0).
PHASE_ORDER: dict[str | None, int] = {None: 0, **{p: i for i, p in enumerate(MEASURED_PHASES, 1)}}

BEHIND, SAME_COLLECTIVE, DEAD, DIVERGED = "behind", "same collective", "dead", "diverged"
RELAY_LOST = "relay lost"


@dataclass(frozen=True, slots=True)
class RankProgress:
    rank: int
    host: str
    steps: int
    collectives: int
    phase: str | None
    in_collective: str | None
    since_step_s: float  # seconds since this rank last closed a step (its own clock)
    silent_s: float  # seconds since the collector last heard from it
    finished: bool = False
    agent_off: bool = False  # the agent stopped timing: its step count says nothing
    groups: tuple[tuple[str, int], ...] = ()  # collectives entered per process group
    in_group: str | None = None  # the group of the collective it is in
    # Seconds since its CUDA graph replays, and its DataLoader batches, last rose (None:
    # never seen rising); what keeps its agent busy, and for how many seconds.
    replays_idle_s: float | None = None
    batches_idle_s: float | None = None
    busy: str | None = None
    busy_s: float = 0.0
    node: int = 0
    relay_silent: bool = False  # its node's relay fell silent (snapshot.RELAY_SILENT_S)

    def position(self) -> tuple[int, int, int]:
        return (self.steps, self.collectives, PHASE_ORDER.get(self.phase, 0))

    def counts(self) -> dict[str, int]:
        """Collectives entered per group (all of them as one without the per-group
        figures, as from an older agent)."""
        return dict(self.groups) if self.groups else {"all": self.collectives}

    def sequence(self) -> tuple:
        """How far this rank is in the job's collective sequence: what a hang compares."""
        return (tuple(sorted(self.counts().items())), self.in_collective, self.in_group)

    def where(self) -> str:
        if self.in_collective:
            group = f" on group {self.in_group}" if self.in_group else ""
            return f"in {self.in_collective}{group}"
        return f"in {self.phase}" if self.phase else "between phases"


@dataclass(frozen=True, slots=True)
class HangReport:
    kind: str
    diagnosis: Diagnosis
    culprits: tuple[int, ...]
    stalled_s: float
    threshold_s: float


def threshold(median_step_ms: float | None, override_s: float | None = None) -> float:
    if override_s is not None:
        return override_s
    step_s = (median_step_ms or 0.0) / 1000.0
    return max(HANG_FLOOR_S, HANG_STEPS * step_s)


def _ranks(ranks: Sequence[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:6])
    return shown + (f" and {len(ranks) - 6} more" if len(ranks) > 6 else "")


def hidden(p: RankProgress, median_step_ms: float | None, limit: float) -> str | None:
    """Why this rank's frozen step count says nothing about progress, or None: it is
    replaying CUDA graphs or fetching batches (the counts rose since its last step, and
    within `limit`), or its agent is busy (for at most BUSY_MAX_S)."""
    stalled = p.since_step_s + p.silent_s
    if p.finished or p.agent_off or stalled <= max(
            QUIET_MIN_S, QUIET_STEPS * (median_step_ms or 0.0) / 1000.0):
        return None  # steps still come (or never will): nothing hidden
    if p.busy is not None and p.busy_s <= BUSY_MAX_S:
        return f"agent busy: {p.busy}"
    for idle, why in ((p.replays_idle_s, REPLAYS), (p.batches_idle_s, BATCHES)):
        if idle is not None and idle < stalled and idle <= limit:
            return why
    return None


def stepping(stalled_s: Sequence[float], median_step_ms: float | None,
             override_s: float | None = None) -> bool:
    """Whether every running rank closed a step so recently (`stalled_s`: per running
    rank, its seconds since its last step plus its silence) that neither `detect` nor
    `hidden_ranks` can find anything: no rank is quiet for long enough to hide progress,
    and none is stalled past the threshold. The common case, checked without a
    RankProgress per rank."""
    limit = threshold(median_step_ms, override_s)
    quiet = max(QUIET_MIN_S, QUIET_STEPS * (median_step_ms or 0.0) / 1000.0)
    return max(stalled_s, default=0.0) <= min(quiet, limit)


def hidden_ranks(progress: Sequence[RankProgress], median_step_ms: float | None,
                 override_s: float | None = None) -> dict[int, str]:
    """rank -> why its steps are not visible: the ranks whose progress suspends `detect`."""
    limit = threshold(median_step_ms, override_s)
    return {p.rank: why for p in progress
            if (why := hidden(p, median_step_ms, limit)) is not None}


def detect(progress: Sequence[RankProgress], median_step_ms: float | None,
           override_s: float | None = None) -> HangReport | None:
    """A HangReport when no running rank made progress for longer than the threshold.
    A rank whose steps are not visible (`hidden`) makes progress, and the others' frozen
    steps may be their wait for it (a synchronous job's ranks wait for each other): no
    hang is declared while any rank shows such progress."""
    limit = threshold(median_step_ms, override_s)
    running = [p for p in progress if not p.finished and not p.agent_off]
    if any(hidden(p, median_step_ms, limit) is not None for p in running):
        return None
    if not running or not any(p.steps > 0 for p in running):
        return None  # nothing stepped yet: loading a model is not a hang
    stalled = min(p.since_step_s + p.silent_s for p in running)
    if stalled <= limit:
        return None
    dead = sorted(p.rank for p in running if p.silent_s > DEAD_SILENCE_S)
    lost = _relay_lost(running, dead, stalled, limit)
    if lost is not None:
        return lost
    if dead:
        first = next(p for p in running if p.rank == dead[0])
        summary = (f"HANG: rank{'s' if len(dead) > 1 else ''} {_ranks(dead)} stopped reporting "
                   f"{first.silent_s:.0f} s ago (host {first.host}, last seen at step "
                   f"{first.steps} {first.where()}): the process is gone or frozen. Check its "
                   f"log and the host (OOM killer, a crash, a hung driver).")
        return HangReport(DEAD, Diagnosis(HANG, dead[0], first.phase, CRITICAL, summary),
                          tuple(dead), stalled, limit)
    diverged = _diverged(running, stalled, limit)
    if diverged is not None:
        return diverged
    ahead = max(p.position() for p in running)
    behind = sorted(p.rank for p in running if p.position() < ahead)
    if behind:
        first = next(p for p in running if p.rank == behind[0])
        leader = next(p for p in running if p.position() == ahead)
        summary = (f"No step anywhere for {limit:.0f}+ s: the other ranks wait for rank"
                   f"{'s' if len(behind) > 1 else ''} {_ranks(behind)} (host {first.host}), "
                   f"at step {first.steps} {first.where()} after {first.collectives} "
                   f"collectives, while rank {leader.rank} is at step {leader.steps} "
                   f"{leader.where()} after {leader.collectives}. Its stack shows where it is: "
                   f"a collective only some ranks call, or work stuck on that rank.")
        return HangReport(BEHIND, Diagnosis(HANG, behind[0], first.phase, CRITICAL, summary),
                          tuple(behind), stalled, limit)
    sample = running[0]
    summary = (f"No step anywhere for {limit:.0f}+ s: every rank is at step {sample.steps} "
               f"{sample.where()} after {sample.collectives} collectives. All stuck in the "
               f"same place points at the fabric or the collective itself: a shape mismatch, "
               f"a network or NCCL problem (try NCCL_DEBUG=INFO, nccl-tests).")
    return HangReport(SAME_COLLECTIVE, Diagnosis(HANG, None, sample.phase, CRITICAL, summary),
                      (), stalled, limit)


def _relay_lost(running: Sequence[RankProgress], dead: Sequence[int], stalled: float,
                limit: float) -> HangReport | None:
    """Every silent rank is on a node whose relay is silent too: the relay is what was
    lost (it died, or its node's network did), and its ranks may well be training."""
    silent = [p for p in running if p.rank in set(dead)]
    if not silent or not all(p.relay_silent for p in silent):
        return None
    nodes = sorted({p.node for p in silent})
    first = silent[0]
    which = ", ".join(f"node {n}'s" for n in nodes)
    summary = (f"HANG: {which} relay lost: nothing from it for {first.silent_s:.0f} s, so "
               f"rank{'s' if len(silent) > 1 else ''} {_ranks(dead)} (host {first.host}, last "
               f"seen at step {first.steps} {first.where()}) cannot be heard; they may still "
               f"run or wait. Check that node's terminal and relay log, and its network to "
               f"node 0.")
    return HangReport(RELAY_LOST, Diagnosis(HANG, None, first.phase, CRITICAL, summary,
                                            node=nodes[0], node_ranks=tuple(dead)),
                      tuple(dead), stalled, limit)


def _diverged(running: Sequence[RankProgress], stalled: float, limit: float
              ) -> HangReport | None:
    """The minority whose collective sequence differs from the majority's, or a tie."""
    sides: dict[tuple, list[RankProgress]] = {}
    for p in running:
        sides.setdefault(p.sequence(), []).append(p)
    if len(sides) < 2:
        return None
    ordered = sorted(sides.values(), key=lambda side: (-len(side), side[0].rank))
    biggest = ordered[0]
    if len(ordered[1]) == len(biggest):  # no majority: do not guess a side
        tied = [side for side in ordered if len(side) == len(biggest)]
        names = " and ".join(f"rank{'s' if len(side) > 1 else ''} "
                             f"{_ranks(sorted(p.rank for p in side))} ({side[0].where()})"
                             for side in tied)
        summary = (f"No step anywhere for {limit:.0f}+ s: the ranks' collective sequences "
                   f"differ, {names}, a tie of {len(biggest)} rank"
                   f"{'s' if len(biggest) > 1 else ''} each: one side took a code path "
                   f"with a collective the other does not call. Compare their stacks.")
        first = tied[0][0]
        return HangReport(DIVERGED, Diagnosis(HANG, None, first.phase, CRITICAL, summary),
                          tuple(sorted(side[0].rank for side in tied)), stalled, limit)
    culprits = sorted(p.rank for side in ordered[1:] for p in side)
    odd = next(p for p in running if p.rank == culprits[0])
    usual = biggest[0]
    majority = _ranks(sorted(p.rank for p in biggest))
    mine, theirs = odd.counts(), usual.counts()
    extra = [g for g in sorted(mine) if mine[g] > theirs.get(g, 0)]
    missing = [g for g in sorted(theirs) if theirs[g] > mine.get(g, 0)]
    name = f"rank{'s' if len(culprits) > 1 else ''} {_ranks(culprits)}"
    who = f"{name} (host {odd.host})"
    if extra:
        g = extra[0]
        op = odd.in_collective if odd.in_group == g else "a collective"
        what = (f"{who} entered {op} #{mine[g]} on group {g} that rank"
                f"{'s' if len(biggest) > 1 else ''} {majority} never entered (they are "
                f"{usual.where()}): a conditional collective on {name}'s code path")
    elif missing:
        g = missing[0]
        op = usual.in_collective if usual.in_group == g else "a collective"
        what = (f"rank{'s' if len(biggest) > 1 else ''} {majority} wait in {op} #{theirs[g]} "
                f"on group {g}, which {who} never entered (it is {odd.where()}): a collective "
                f"it skipped, or work stuck before it")
    else:
        what = (f"{who} is {odd.where()} while rank{'s' if len(biggest) > 1 else ''} "
                f"{majority} are {usual.where()}, after the same collectives")
    summary = (f"No step anywhere for {limit:.0f}+ s: {what}. Its stack shows where it "
               f"went its own way.")
    return HangReport(DIVERGED, Diagnosis(HANG, culprits[0], odd.phase, CRITICAL, summary),
                      tuple(culprits), stalled, limit)



# --- the latch: one hang held from its detection to its end -------------------------------

# A hang that ends within this many steps per rank of the end of a run stopped by a
# signal was ended by the stop itself: the Ctrl-C woke the stuck rank (its sleep raised
# inside `with traceml_agent.step()`, which closes the step) or tore the collective down,
# and the ranks exited. The record keeps the hang as it was latched, not the aftermath.
AFTERMATH_STEPS = 3

Threads = tuple[tuple[str, str], ...]  # (thread name, its stack), a rank's stacks


@dataclass(frozen=True, slots=True)
class EndedHang:
    """A latched hang that ended, kept for `HangLatch.restore`."""

    report: HangReport
    since: float | None
    stacks: dict[int, Threads]
    frontier: int  # the furthest step any rank had reported when it latched


def aftermath(frontier: int, last_steps: Sequence[int]) -> bool:
    """Whether the ranks (their newest steps) made at most AFTERMATH_STEPS steps each
    (together) beyond `frontier`, the furthest step any rank had reported when a hang
    was detected: what Ctrl-C lets them close on their way out. Steps up to it were
    taken before the hang, however late they arrive (a rank stuck holding the GIL sends
    its queue once woken), and are not the job going on."""
    beyond = sum(max(0, s - frontier) for s in last_steps)
    return beyond <= AFTERMATH_STEPS * max(1, len(last_steps))


class HangLatch:
    """The hang on display, from its detection until a step completes somewhere (ranks
    that exit or die while it lasts do not change who the others were waiting for), the
    stacks taken while it lasts, and the last one that ended (for a run stopped by a
    signal, whose record keeps the hang as latched: `restore`)."""

    def __init__(self) -> None:
        self.report: HangReport | None = None
        self.since: float | None = None
        self.steps = 0  # steps of all ranks together when the hang was detected
        # The furthest step any rank had reported when it was detected: steps up to it
        # that arrive later were taken before the hang, not progress after it.
        self.frontier = -1
        self.in_aftermath = False  # it came in the aftermath of the one kept (_end)
        self.stacks: dict[int, Threads] = {}  # taken while latched, by rank
        self.ended: EndedHang | None = None

    def holds(self, steps: int) -> bool:
        """Whether the latched hang is the same one: no step completed anywhere since."""
        return self.report is not None and steps == self.steps

    def hold(self, report: HangReport | None) -> None:
        """The same hang, longer: its stall time as the newest report reads it."""
        if self.report is not None and report is not None:
            self.report = replace(self.report, stalled_s=report.stalled_s)

    def latch(self, report: HangReport, steps: int, now: float,
              last_steps: Sequence[int]) -> None:
        """A new hang (no progress for the whole threshold is its own evidence): shown at
        once; one it replaces is kept (_end)."""
        if self.report is not None:
            self._end()
        kept = self.ended
        self.in_aftermath = kept is not None and aftermath(kept.frontier, last_steps)
        self.report, self.steps = report, steps
        self.frontier = max(last_steps, default=-1)
        self.since = now - report.stalled_s
        self.stacks = {}

    def clear(self) -> None:
        """A step completed: the hang (if any) ends."""
        if self.report is not None:
            self._end()
        self.report, self.since, self.stacks = None, None, {}

    def reset(self) -> None:
        """torchrun restarted the group: nothing of the last attempt's hangs holds."""
        self.report, self.since, self.stacks, self.ended = None, None, {}, None

    def keep_stacks(self, rank: int, threads: Threads) -> None:
        """The stacks a rank sent (or that were taken of it) during the latched hang,
        thread by thread: one taken from outside stays when the rank's own come later."""
        merged = dict(self.stacks.get(rank, ()))
        merged.update(threads)
        self.stacks[rank] = tuple(merged.items())

    def restore(self, steps: int, last_steps: Sequence[int]) -> HangReport | None:
        """At the end of a run stopped by a signal: the hang that ended within
        AFTERMATH_STEPS steps per rank beyond its frontier was ended by the stop, and is
        latched again as it was (culprits, kind, stacks); None when the job went on after
        it (a hang that resolved itself) or none ended."""
        ended = self.ended
        if ended is None or not aftermath(ended.frontier, last_steps):
            return None
        self.report, self.since, self.stacks = ended.report, ended.since, ended.stacks
        self.steps = steps
        return ended.report

    def _end(self) -> None:
        """The latched hang ends (a step, or another hang replaces it): kept for
        `restore`, unless it came in the aftermath of the one kept already (the exiting
        ranks' stale heartbeats make hang after hang)."""
        assert self.report is not None
        kept = self.ended
        if kept is not None and self.in_aftermath:
            # The kept hang may have latched before its culprits' stacks came (late
            # batches re-latched it a few steps on): theirs, taken since, complete it.
            late = {r: self.stacks[r] for r in kept.report.culprits
                    if r not in kept.stacks and r in self.stacks}
            if late:
                self.ended = replace(kept, stacks={**kept.stacks, **late})
            return
        self.ended = EndedHang(self.report, self.since, self.stacks, self.frontier)
