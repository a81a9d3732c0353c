"""The step-time diagnosis: pure functions from window statistics to a label.

No I/O, no clocks: the collector passes in every rank's median timings, one table with
a column per figure (timings.Timings; tests write rows, RankTiming, which it converts),
and gets a `Diagnosis` back, so every rule is testable from a table. The rules compare
ranks with array operations, by the arithmetic of one median (windows.median), ties to
the lowest rank. The rules are a table too
(`RULES`, near the end of the classifier): each a small function of one evaluation's
`WindowStats`, asked in order until one answers. docs/diagnosis.md lists them in that order
and explains each threshold.

The comparison is always worst rank vs median rank, on *local work* only:
input = dataloader + h2d, compute = forward + backward + optimizer. Time a rank
spends waiting for the others (the "sync" phase, the exposed collective wait
inside backward) is deliberately left out: under DDP a straggler's extra work
shows up as sync time on every *other* rank, so counting it would point at the
wrong ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from math import isfinite
from typing import NamedTuple

import numpy as np

from traceml_agent.vocab import (  # noqa: F401 (re-exported)
    BALANCED,
    COMM_BOUND,
    COMPUTE_PHASES,
    COMPUTE_STRAGGLER,
    CRITICAL,
    HANG,
    INFO,
    INPUT_BOUND,
    INPUT_PHASES,
    INPUT_STRAGGLER,
    LOAD_IMBALANCE,
    OPTIMIZER,
    PERIODIC_STALL,
    STALL_HINTS,
    STRAGGLER,
    SYNC,
    TIMING_INCOMPLETE,
    WAIT,
    WAIT_HEAVY,
    WARMUP,
    WARNING,
    format_ranks,
)

# The labels, severities and phase groups are the product's vocabulary (vocab.py); they
# are re-exported here because the rules below are where they get their meaning.
from .advice import advise
from .bandwidth import bus_factor, si_bytes
from .evidence import (
    CPU_ADVICE,
    CPU_UNREAD,
    GPU_ADVICE,
    cpu_explains,
    cpu_wait,
    gpu_evidence,
    node_cpu_evidence,
    node_gpu_evidence,
    ready_waits,
)
from .imbalance import STREAK_MIN_S, Spreads, StepSpread
from .stalls import (  # noqa: F401 (re-exported)
    STALL_FACTOR,
    STALL_MIN_COUNT,
    STALL_MIN_MS,
    Stall,
    StallFinding,
    stall_of,
    stall_threshold,
    stall_thresholds,
)
from .timings import GpuHealth, RankTiming, Table, Timings, Untimed, median_of  # noqa: F401
from .verdict import (  # noqa: F401 (re-exported: the judge's callers read them here)
    CAUSE_CONFIRM_TICKS,
    CONFIRM_TICKS,
    CORES,
    Diagnosis,
    LiveLabel,
    settle,
)
from .windows import AlignedSteps

# --- thresholds (docs/diagnosis.md gives the reasoning) -------------------------------------

# Steps a rank needs in the window before its medians mean anything: the first
# steps carry one-off costs (allocator warm-up, DDP bucket rebuild, lazy init).
MIN_STEPS = 8
# A worst-vs-median gap in input or compute matters when it costs at least this
# share of the median step: every rank of a synchronous job pays the straggler's
# gap once per step, so 10% of the step is 10% of the job's throughput.
SKEW_ENTER = 0.10
# Once a straggler label holds, it is kept until the gap falls below this share,
# so a gap hovering around 10% does not make the label flicker.
SKEW_EXIT = 0.06
# Gaps below this many milliseconds are timer and scheduler noise, whatever
# their share of a very short step.
MIN_GAP_MS = 0.2
# A rank behind in input and one behind in compute (or one rank behind in both) make
# "input and compute are both uneven" only when the smaller gap is at least this share
# of the larger: below it, fixing the larger pays over four times more, the advice to
# look at both sends the user to a phase that barely matters, and once the larger is
# fixed the next evaluation names the smaller on its own. Kept down to the exit share
# while the label holds, so a ratio hovering near a quarter does not flicker.
BOTH_GAPS_ENTER = 0.25
BOTH_GAPS_EXIT = 0.15
# A gap at least this share of the step is critical: the job runs at most
# 1/(1+share) of its balanced speed (two-thirds at 0.5).
CRITICAL_SHARE = 0.50
# Input is "broad" when the median rank spends this share of its step in input.
INPUT_BOUND_ENTER = 0.30
INPUT_BOUND_EXIT = 0.22
# Residual wait (not dataloader, h2d, forward, backward, sync or optimizer) this
# share of the median rank's step is worth a look: logging, checkpointing, stalls.
WAIT_HEAVY_ENTER = 0.30
WAIT_HEAVY_EXIT = 0.22
# The zero-code hooks see these phases in every training loop they time; a rank whose
# recent steps have none of one (after warm-up) ran it somewhere the hooks are blind to,
# and its time went to residual "wait".
EXPECTED_PHASES = COMPUTE_PHASES
# A phase closed for lack of its end hook (recorder.py) on this share of a rank's steps
# is not timed: its time after the missed end went to whatever was open around it. Rare
# forced closes (an exception unwinding through a hook-less frame) are noise.
FORCED_SHARE = 0.05
FORCED_MIN = 3
# The steps of a rank's live window (judge/state.py's LIVE_STEPS, the banner's): a clear
# straggler's streak is looked for only where one can fit in them (_streak_possible).
LIVE_WINDOW_STEPS = 32
# A straggler is named from LIVE_STEPS (32) steps, whose median moves only after 17 of
# them changed: a rank that recovered kept the banner for tens of steps. So the live
# label also asks the most recent steps (`recent` in diagnose): the straggler must still
# be at least SKEW_EXIT behind there. Their number is RECENT_S of steps, between
# RECENT_MIN and RECENT_MAX: a median of 8 flips after 5 recovered steps and ignores 3
# noisy ones; with slow steps, 3 steps (2 s of them, at least 3) keep clearing within
# a few seconds.
RECENT_MIN, RECENT_MAX = 3, 8
RECENT_S = 2.0


def recent_steps(step_ms: float | None) -> int:
    """How many of a rank's newest steps the recent check reads."""
    if step_ms is None or not step_ms > 0:
        return RECENT_MAX
    steps = RECENT_S * 1000.0 / step_ms  # inf for a sub-normal step: no round() of it
    return RECENT_MAX if steps >= RECENT_MAX else max(RECENT_MIN, round(steps))


def recent_steps_of(step_ms: np.ndarray) -> np.ndarray:
    """`recent_steps` of many ranks' steps at once (NaN: not known); numpy's rounding is
    Python's (half to even)."""
    out = np.full(len(step_ms), RECENT_MAX, dtype=np.int64)
    known = step_ms > 0
    with np.errstate(over="ignore", divide="ignore"):
        steps = RECENT_S * 1000.0 / step_ms[known]
    out[known] = np.where(steps >= RECENT_MAX, RECENT_MAX,
                          np.maximum(RECENT_MIN, np.round(steps)))
    return out


# The label needs a rank's own stalls to recur with a period (stalls.STALL_MIN_COUNT of
# them at least, stalls.PERIOD_*: the stall log keeps them over the whole run, whatever
# the window's size) and to go on still (stalls.RECENT_PERIODS), costing the job at least
# this share of its time since the oldest kept stall (the log's span): 5 % is what a user
# would fix (an async checkpoint recovers it); exit at 3 % against flicker.
STALL_SHARE_ENTER = 0.05
STALL_SHARE_EXIT = 0.03
# "Every rank" stalls only when every rank that reported stalls on its own with the
# leading stall's period and at least this share of its cost per stall: evaluation on
# every rank, say. A rank's own few hiccups on another rhythm (a busy host's 10 ms in
# backward every 60 steps), beside one rank's 300 ms checkpoint every 20, are not the
# same stall and must not turn "Rank 0" into "Every rank" (and its advice into a guess).
SAME_STALL_SHARE = 0.5
# COMM-BOUND when the median rank spends at least this share of its step in exposed
# collective wait (sync) and no straggler, input or stall rule fired first (a
# straggler's victims wait in sync too). Half: the accelerators then idle at least half
# of every step for the network; a DDP job whose allreduces overlap backward well
# exposes 5-25 % (bigger buckets and overlap are the first advice at 50 %). Exit at 40 %.
COMM_BOUND_ENTER = 0.50
COMM_BOUND_EXIT = 0.40
# LOAD IMBALANCE when on a typical step the slowest ranks' own work (the p95 across ranks,
# the slowest one up to 20 ranks) exceeds the median rank's by this share of the step, no
# rank being behind on most steps (imbalance.py). Four times a straggler's 10 %: every job
# has step-to-step noise, and the slowest of several noisy ranks is always some way above
# their median; at 20 % CPU-bound ranks sharing 2 cores with other jobs (balanced HF
# Trainer and DDP jobs in a fresh-clone test run) read 22-39 %. Exit at 30 %.
IMBALANCE_ENTER = 0.40
IMBALANCE_EXIT = 0.30
# The ranks' training threads waiting for a CPU core this share of their ready time (4
# ranks on 2 idle cores wait about a fifth) say that part of a moving spread may be the
# host's scheduling, not the data: each step another rank loses its core for a while.
# The evidence cannot tell the two apart, so the verdict says so beside the advice.
IMBALANCE_CPU_WAIT = 0.25
# A whole node is the straggler when every rank on the worst rank's node is behind the
# median rank by at least this share of the worst rank's gap, and no rank on another node
# is. Half, because with half the ranks slow the median sits halfway between the two
# groups: every slow rank is then exactly one worst-gap behind, every fast one ahead.
NODE_MEMBER_SHARE = 0.5




def bus_gbps(nbytes: float, ms: float, world: int) -> float | None:
    """nccl-tests' bus bandwidth of an all-reduce of `nbytes` in `ms` among `world`
    ranks, in GB/s: algorithm bandwidth (bytes / time) x 2(n-1)/n, the share of the data
    each rank's link carries in a ring, so figures compare across world sizes."""
    if not nbytes or not ms or ms <= 0 or world < 2:
        return None
    return nbytes / (ms / 1000.0) / 1e9 * bus_factor("all_reduce", world)


def untimed_phases(seen: Mapping[str, int], window_steps: int, forced: Mapping[str, int],
                   steps: int, auto: bool, capture_skips: int = 0,
                   timing_faults: int = 0) -> tuple[Untimed, ...]:
    """The phases of one rank that the diagnosis must not rely on. `seen`: of the rank's
    `window_steps` recent steps, on how many each expected phase was measured; `forced`:
    per phase, the times it was closed without its end hook in the rank's `steps` steps;
    `auto`: the zero-code hooks time the loop (with the explicit API the user decides
    what is timed). `capture_skips`, `timing_faults`: the agent's counts of timings it
    skipped inside a CUDA graph capture and of event pairs it could not use (negative or
    failed: sent as not measured). They say why a phase is missing, and with the explicit
    API they make a phase the user times but that was measured on fewer than half the
    steps untimed too (the agent, not the user, left it out)."""
    out = []
    agent_skipped = capture_skips > 0 or timing_faults > 0
    if (auto or agent_skipped) and window_steps >= MIN_STEPS:
        for phase in EXPECTED_PHASES:
            n = seen.get(phase, 0)
            if n * 2 < window_steps and (auto or n > 0):  # a loop's phase runs every step
                out.append(Untimed(phase, _missing_why(n, window_steps, capture_skips,
                                                       timing_faults)))
    listed = {u.phase for u in out}
    for phase, count in forced.items():
        if phase not in listed and count >= max(FORCED_MIN, FORCED_SHARE * steps):
            out.append(Untimed(phase, f"closed without its end hook on {count} of {steps} "
                                      f"steps"))
    return tuple(out)


def _missing_why(n: int, window_steps: int, capture_skips: int, timing_faults: int) -> str:
    """Why a phase of the loop was measured on fewer than half the recent steps."""
    causes = []
    if capture_skips:
        causes.append(f"not timed inside a CUDA graph capture ({capture_skips} skipped)")
    if timing_faults:
        causes.append(f"{timing_faults} timing faults (event pairs negative or failed)")
    if not causes:  # the hooks never opened it: a loop they do not see
        return ("never seen by the hooks" if n == 0 else
                f"seen on only {n} of {window_steps} steps")
    seen = "never measured" if n == 0 else f"measured on only {n} of {window_steps} steps"
    return f"{'; '.join(causes)}: {seen}"


# --- helpers -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Skew:
    rank: int
    gap_ms: float
    share: float


def _skew(t: Timings, phases: Sequence[str], step_ms: float) -> _Skew | None:
    """Worst rank vs median rank for a group of phases. Ties go to the lowest rank."""
    sums, has = t.group(phases)
    if np.count_nonzero(has) < 2:
        return None
    values, ranks = sums[has], t.ranks[has]
    mid = median_of(values)
    worst = float(values.max())
    gap = worst - mid
    return _Skew(int(ranks[values == worst].min()), gap, gap / step_ms)


def phase_gaps(ranks: Table, rank: int, phases: Sequence[str]) -> dict[str, float]:
    """For one rank: its median minus the median rank's, per phase (ms)."""
    t = Timings.of(ranks)
    me = t.row(rank)
    if me is None:
        raise ValueError(f"rank {rank} is not in the table")
    gaps = {}
    for p in phases:
        col = t.column(p)
        mine = float(col[me])
        if isfinite(mine) and np.isfinite(col).any():
            gaps[p] = mine - median_of(col)
    return gaps


def _worst_phase(t: Timings, rank: int, phases: Sequence[str]) -> str | None:
    gaps = phase_gaps(t, rank, phases)
    if not gaps:
        return None
    return max(phases, key=lambda p: gaps.get(p, float("-inf")))


def _share(t: Timings, phases: Sequence[str]) -> float:
    """The median rank's share of its step spent in a group of phases."""
    sums, has = t.group(phases)
    step_ms = t.step_ms
    ok = has & np.isfinite(step_ms) & (step_ms > 0)
    return median_of(sums[ok] / step_ms[ok])


# --- the classifier ----------------------------------------------------------------------


# Under FSDP, forward and backward contain the job's collectives (parameter all-gathers,
# gradient reduce-scatters): a rank waiting there for a straggler looks slower in forward
# than the straggler itself. Only phases without collectives are compared across ranks.
FSDP_COMPUTE_PHASES = (OPTIMIZER,)


def compared_phases(d: Diagnosis, fsdp: bool) -> tuple[str, ...]:
    """The phases a straggler verdict compared: its own `phases`, or for one made
    without them (by hand, in a table test) its label's group."""
    if d.phases:
        return d.phases
    compute = FSDP_COMPUTE_PHASES if fsdp else COMPUTE_PHASES
    return {INPUT_STRAGGLER: INPUT_PHASES, COMPUTE_STRAGGLER: compute,
            STRAGGLER: INPUT_PHASES + compute}.get(d.label, ())


Recent = Table | Callable[[], Table] | None


def _still_behind(recent: Recent, rank: int, phases: Sequence[str]) -> bool:
    """Whether `rank` is still at least SKEW_EXIT behind the median rank in `phases` over
    the most recent steps (see RECENT_S). Without recent timings (the whole-run verdict,
    offline use) there is nothing to contradict the window."""
    if recent is None:
        return True
    if callable(recent):
        recent = recent()
    t = Timings.of(recent)
    ready = t.select((t.steps >= RECENT_MIN) & np.isfinite(t.step_ms))
    sums, has = ready.group(phases)
    me = np.flatnonzero((ready.ranks == rank) & has)
    if len(me) == 0 or np.count_nonzero(has) < 2:
        return True
    step_ms = median_of(ready.step_ms)
    gap = float(sums[me[-1]]) - median_of(sums[has])
    return gap >= MIN_GAP_MS and gap >= SKEW_EXIT * step_ms


Steps = AlignedSteps | Callable[[], AlignedSteps | None] | None


def _named_gap(skew: _Skew, holding: bool, spread: StepSpread | None) -> bool:
    """Whether a worst-vs-median gap names a straggler: material (MIN_GAP_MS, SKEW_ENTER
    of the step; SKEW_EXIT while shown) and, where the steps can be compared one by one,
    a fixed culprit (behind on most steps, not the top of a draw that moves), named from
    SKEW_EXIT already when the gap is steady against its measured noise."""
    if skew.gap_ms < MIN_GAP_MS or skew.share < SKEW_EXIT:
        return False
    if spread is None:
        return holding or skew.share >= SKEW_ENTER
    if not spread.fixed(skew.rank, holding):
        return False
    return holding or skew.share >= SKEW_ENTER or spread.steady(skew.rank, skew.gap_ms)


def _streak_possible(step_ms: float) -> bool:
    """Whether a streak can be long enough (STREAK_MIN_S) within a live window's steps:
    with fast steps the window's medians name a straggler within a second anyway."""
    return step_ms * LIVE_WINDOW_STEPS >= STREAK_MIN_S * 1000.0


@dataclass(frozen=True, slots=True)
class WindowStats:
    """What every rule reads: one evaluation's ranks and the statistics over them. Built
    once per evaluation (`WindowStats.of`); the rules only read it."""

    ranks: Timings  # every rank that reported
    ready: Timings  # those with MIN_STEPS steps and a step time
    step_ms: float  # the median ready rank's step (0.0 while none is ready)
    active: str | None  # the label shown now: its own rule leaves at its exit threshold
    compute: tuple[str, ...]  # the compute phases compared across ranks (FSDP: fewer)
    untimed: frozenset[str]  # phases some ready rank could not time
    input_gap: _Skew | None  # the worst input gap, where it is material and still there
    compute_gap: _Skew | None  # the same for compute
    framework: str | None
    stalls: Sequence[StallFinding]  # each stalling rank's stall log (stalls.py)
    preflight_busbw: float | None
    # The ranks' windows lined up step by step, compared when a rule asks (imbalance.py);
    # without them (table tests, offline use) the rules read the medians alone.
    spreads: Spreads
    # What a rule computed that others ask for too (the periodic stall: its own rule, and
    # the stragglers and INPUT-BOUND weighing their cost against it), once per evaluation.
    memo: dict[str, Diagnosis | None] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, ranks: Table, active: str | None, fsdp: bool,
           framework: str | None, recent: Recent, stalls: Sequence[StallFinding] | None,
           preflight_busbw: float | None, steps: Steps = None) -> WindowStats:
        compute = FSDP_COMPUTE_PHASES if fsdp else COMPUTE_PHASES
        t = Timings.of(ranks)
        ready = t.select((t.steps >= MIN_STEPS) & np.isfinite(t.step_ms) & (t.step_ms > 0))
        step_ms = median_of(ready.step_ms)
        # Untimed local phases: their time sits in "wait", so balance, residual wait and
        # any comparison of that group cannot be judged; a group fully timed still can.
        untimed = frozenset(u.phase for us in ready.untimed.values() for u in us)
        spreads = Spreads(steps)

        def gap(phases: Sequence[str], group: Sequence[str], *holding: str) -> _Skew | None:
            if untimed & set(group):  # under FSDP an untimed forward blinds compute too
                return None
            holds = active in holding
            skew = _skew(ready, phases, step_ms)
            if skew is not None and _named_gap(skew, holds, spreads.of(phases)
                                               if skew.share >= SKEW_EXIT else None):
                if _still_behind(recent, skew.rank, phases):
                    return skew
            if recent is None or step_ms <= 0:
                return None
            # A clear straggler from its newest steps, before the window's medians move
            # (the live evaluation only: the summary's verdict is the whole window's).
            spread = spreads.of(phases) if _streak_possible(step_ms) else None
            found = None if spread is None else spread.streak()
            return None if found is None else _Skew(found[0], found[1], found[1] / step_ms)

        return cls(t, ready, step_ms, active, compute, untimed,
                   gap(INPUT_PHASES, INPUT_PHASES, INPUT_STRAGGLER, STRAGGLER),
                   gap(compute, COMPUTE_PHASES, COMPUTE_STRAGGLER, STRAGGLER),
                   framework, stalls or (), preflight_busbw, spreads)

    def over(self, share: float, enter: float, leave: float, label: str) -> bool:
        """Whether a share passes a rule's threshold: `leave` while its label is shown
        (hysteresis), `enter` otherwise."""
        return share >= (leave if self.active == label else enter)


# --- the rules, each a pure function of the window: a verdict, or None to pass -------------


def _warmup(w: WindowStats) -> Diagnosis | None:
    if w.ready:
        return None
    most = int(w.ranks.steps.max()) if len(w.ranks) else 0
    return Diagnosis(WARMUP, None, None, INFO,
                     f"Collecting steps: {most} of {MIN_STEPS} needed before judging.")


def _straggler_in_both(w: WindowStats) -> Diagnosis | None:
    """Behind in input and in compute: the larger gap names the rank (one rank: both).
    Where "both are uneven" would not fit the evidence, the rule passes and the larger
    gap's own rule names it, with its own evidence: the smaller gap is minor beside it
    (BOTH_GAPS_ENTER), or it is compute that its rank's CPU wait explains (cpu_wait: its
    host's cores, not uneven work; "both" would send the user to the model for it)."""
    inp, cmp = w.input_gap, w.compute_gap
    if inp is None or cmp is None:
        return None
    worst = inp if _larger_gap(w) is inp else cmp
    other = cmp if worst is inp else inp
    ratio = other.gap_ms / worst.gap_ms if worst.gap_ms > 0 else 1.0
    if (not w.over(ratio, BOTH_GAPS_ENTER, BOTH_GAPS_EXIT, STRAGGLER)
            or cpu_wait(w.ready, cmp.rank, cmp.gap_ms).explains is not None):
        return None
    phases = INPUT_PHASES + w.compute
    one = inp.rank == cmp.rank
    gap = inp.gap_ms + cmp.gap_ms if one else worst.gap_ms
    # One rank's gap is both (not all in its worst phase); two ranks': the worst's own.
    where = f" in input and compute ({inp.gap_ms:.1f} and {cmp.gap_ms:.1f} ms)" if one else None
    d = _yields(_straggler(STRAGGLER, worst.rank, _worst_phase(w.ready, worst.rank, phases),
                           gap, gap / w.step_ms, w.step_ms, w.ready, phases, w.spreads,
                           where), w)
    # Two ranks: the one not named is said (one rank: its gap already counts both).
    return d if one else _also(d, other, "input" if other is inp else "compute", "")


def _yields(d: Diagnosis | None, w: WindowStats) -> Diagnosis | None:
    """Of two causes, the larger cost is named first. A straggler yields to its own rank's
    periodic stall costing the job more (one rank, two symptoms: a garbage collector or
    a save that stalls it every N steps and slows its median step too; the stall's text
    says the gap). A straggler named below SKEW_ENTER (steady against its noise) also
    yields to a job-wide cause that costs the job more than twice its share (every
    rank's residual wait, its input, its periodic stalls). Otherwise one at SKEW_ENTER or
    more is named first whatever else holds."""
    if d is None:
        return d
    stall = _periodic_stall(w)
    if (stall is not None and stall.rank is not None and stall.rank == d.rank
            and (stall.gap_share or 0.0) > (d.gap_share or 0.0)):
        return None
    if (d.gap_share or 0.0) >= SKEW_ENTER:
        return d
    for other in (_input_bound, _periodic_stall, _wait_heavy):
        found = other(w)
        if found is not None and (found.gap_share or 0.0) > 2 * (d.gap_share or 0.0):
            return None
    return d


def _larger_gap(w: WindowStats) -> _Skew | None:
    """The larger of the input and the compute gap (ties: input); each straggler rule
    names only that one."""
    inp, cmp = w.input_gap, w.compute_gap
    if inp is None or cmp is None:
        return inp or cmp
    return inp if inp.gap_ms >= cmp.gap_ms else cmp


def _input_straggler(w: WindowStats) -> Diagnosis | None:
    s = w.input_gap
    if s is None or _larger_gap(w) is not s:
        return None
    return _also(_yields(_straggler(
        INPUT_STRAGGLER, s.rank, _worst_phase(w.ready, s.rank, INPUT_PHASES), s.gap_ms,
        s.share, w.step_ms, w.ready, INPUT_PHASES, w.spreads), w), w.compute_gap, "compute")


def _compute_straggler(w: WindowStats) -> Diagnosis | None:
    s = w.compute_gap
    if s is None or _larger_gap(w) is not s:
        return None
    return _also(_yields(_straggler(
        COMPUTE_STRAGGLER, s.rank, _worst_phase(w.ready, s.rank, w.compute), s.gap_ms,
        s.share, w.step_ms, w.ready, w.compute, w.spreads), w), w.input_gap, "input")


SMALLER_GAP = ", a smaller cost: named on its own once this gap is fixed"


def _also(d: Diagnosis | None, other: _Skew | None, what: str,
          tail: str = SMALLER_GAP) -> Diagnosis | None:
    """A straggler verdict beside a gap of the other kind that it does not name says it,
    so the record keeps what the label leaves out."""
    if d is None or other is None:
        return d
    return replace(d, summary=(
        f"{d.summary} Rank {other.rank} is also {other.gap_ms:.1f} ms behind the median "
        f"rank in {what} ({other.share:.0%} of the step{tail})."))


def _input_share(w: WindowStats) -> float:
    return 0.0 if w.untimed & set(INPUT_PHASES) else _share(w.ready, INPUT_PHASES)


def _input_bound(w: WindowStats) -> Diagnosis | None:
    share = _input_share(w)
    if not w.over(share, INPUT_BOUND_ENTER, INPUT_BOUND_EXIT, INPUT_BOUND):
        return None
    # Two job-wide causes at once (epoch-start stalls of a loader that is also slow
    # between them): the one that costs the job more is named, the other in its text.
    stall = _periodic_stall(w)
    if stall is not None and (stall.gap_share or 0.0) > share:
        return None
    phase = max(INPUT_PHASES, key=lambda p: median_of(w.ready.column(p)))
    return Diagnosis(
        INPUT_BOUND, None, phase, WARNING,
        f"Every rank spends about {share:.0%} of its {w.step_ms:.1f} ms step waiting for "
        f"input: speed up the input pipeline on all ranks (more DataLoader workers, "
        f"pin_memory, prefetching, cheaper preprocessing).",
        gap_share=share)


def _periodic_stall(w: WindowStats) -> Diagnosis | None:
    """PERIODIC STALL (periodic_stall) with the smaller causes it outweighs in its text;
    asked by several rules in one evaluation, computed once."""
    if "stall" not in w.memo:
        w.memo["stall"] = _periodic_stall_of(w)
    return w.memo["stall"]


def _periodic_stall_of(w: WindowStats) -> Diagnosis | None:
    d = periodic_stall(w.stalls, w.active, len(w.ranks))
    if d is None:
        return d
    share = _input_share(w)
    if INPUT_BOUND_EXIT <= share < (d.gap_share or 0.0):
        d = replace(d, summary=(
            f"{d.summary} Between the stalls every rank also spends about {share:.0%} of "
            f"its {w.step_ms:.1f} ms step waiting for input (INPUT-BOUND, a smaller cost)."))
    # The stalling rank also behind on its median step (_yields: the stall costs more).
    gaps = [(s, label) for s, label in ((w.input_gap, INPUT_STRAGGLER),
                                         (w.compute_gap, COMPUTE_STRAGGLER))
            if s is not None and s.rank == d.rank and SKEW_EXIT <= s.share < (d.gap_share or 0.0)]
    if gaps:
        s, label = max(gaps, key=lambda g: g[0].share)
        d = replace(d, summary=(
            f"{d.summary} Between the stalls rank {s.rank} is also {s.gap_ms:.1f} ms "
            f"({s.share:.0%} of the {w.step_ms:.1f} ms step) behind the median rank "
            f"({label}, a smaller cost)."))
    return d


def _timing_incomplete(w: WindowStats) -> Diagnosis | None:
    return _incomplete(w.ready, w.framework) if w.untimed else None


def _comm_bound(w: WindowStats) -> Diagnosis | None:
    share = _share(w.ready, (SYNC,))
    if not w.over(share, COMM_BOUND_ENTER, COMM_BOUND_EXIT, COMM_BOUND):
        return None
    # Only the wait the ranks' own work does not explain is the network's: per step, a
    # rank waits for the slowest rank's own work before any transfer can finish. Its
    # share is of the step the job would have with every rank at the median rank's own
    # work (cost.py's `imbalance` what-if): a spread that moves from
    # rank to rank (a busy host slowing each rank in turn, uneven batches) lengthens the
    # step with wait of its own, and two causes, each measured against a step the other
    # lengthens, would hide each other: a job waiting 60-78 % of its step read BALANCED.
    spread = w.spreads.of(INPUT_PHASES + w.compute)
    rest = None if spread is None else spread.unexplained_sync()
    moving_ms = None
    if spread is not None and rest is not None:
        moving = spread.excess_ms()
        # Step by step, then the median: a straggler's few slow steps left in the window
        # are not taken off every step's length.
        even = float(np.median(spread.job_ms - moving))
        own = median_of(rest) / even if even > 0 else share
        if not w.over(own, COMM_BOUND_ENTER, COMM_BOUND_EXIT, COMM_BOUND):
            return None
        # Said as a spread that moves only where no rank is behind on most steps (a
        # straggler's stretch in the window is not one), at its typical step's size.
        if spread.fixed_culprit() is None:
            moving_ms = float(np.median(moving))
    return comm_bound(w.ready, share, w.step_ms, w.preflight_busbw, moving_ms)


def _load_imbalance(w: WindowStats) -> Diagnosis | None:
    """The slowest rank changes from step to step and every rank waits for it: no rank is
    behind on most steps (the straggler rules asked that first), yet on a typical step
    the slowest ranks' own work is IMBALANCE_ENTER of the step above the median rank's."""
    if w.untimed or _share(w.ready, (SYNC, WAIT)) < SKEW_EXIT:
        return None  # the ranks wait for no one: nothing to spread
    phases = INPUT_PHASES + w.compute
    s = w.spreads.of(phases)
    if s is None:
        return None
    return load_imbalance(s, w.active, _median_cpu_wait(w.ready))


def _median_cpu_wait(t: Timings) -> tuple[float, float] | None:
    """The median rank's share of its ready time waited for a CPU core, and its ms of
    such waiting a step; None unless at least half the ranks were read."""
    waited, _, wait_ms = ready_waits(t)
    known = np.isfinite(waited) & np.isfinite(wait_ms)
    if not known.any() or 2 * int(known.sum()) < len(t):
        return None
    return median_of(waited[known]), median_of(wait_ms[known])


def _wait_heavy(w: WindowStats) -> Diagnosis | None:
    share = _share(w.ready, (WAIT,))
    if not w.over(share, WAIT_HEAVY_ENTER, WAIT_HEAVY_EXIT, WAIT_HEAVY):
        return None
    return Diagnosis(
        WAIT_HEAVY, None, WAIT, WARNING,
        f"About {share:.0%} of each {w.step_ms:.1f} ms step is outside the timed phases "
        f"on every rank: look for logging, checkpointing, validation, .item()/CPU syncs or "
        f"other work between optimizer steps.",
        gap_share=share)


def _balanced(w: WindowStats) -> Diagnosis | None:
    n = len(w.ready)
    return Diagnosis(
        BALANCED, None, None, INFO,
        f"{n} rank{'s' if n != 1 else ''} balanced at a median {w.step_ms:.1f} ms per "
        f"step; no rank stands out in input or compute.")


class Rule(NamedTuple):
    """A label, the rule that gives it, and how its culprit is priced: the name of one of
    cost.py's models of what the job would gain without it (cost.MODELS), None for a
    label with no culprit to take away (and no what-if)."""

    label: str
    judge: Callable[[WindowStats], Diagnosis | None]
    pricing: str | None = None


# Priority is position: the first rule that answers gives the label (docs/diagnosis.md,
# "Rules, in order"). Stragglers come before the job-wide labels: one slow rank makes
# every rank's step long, and that is the thing to fix first. A periodic stall is one
# cause of residual wait, named more precisely than WAIT-HEAVY; untimed phases withhold
# the verdicts that would read their time as wait. BALANCED always answers. HANG is not
# here: it is judged from progress, not from a window (hang.py).
RULES: tuple[Rule, ...] = (
    Rule(WARMUP, _warmup),
    Rule(STRAGGLER, _straggler_in_both, "straggler"),
    Rule(INPUT_STRAGGLER, _input_straggler, "straggler"),
    Rule(COMPUTE_STRAGGLER, _compute_straggler, "straggler"),
    Rule(INPUT_BOUND, _input_bound, "fleet_input"),
    Rule(PERIODIC_STALL, _periodic_stall, "stalls"),
    Rule(TIMING_INCOMPLETE, _timing_incomplete),
    Rule(LOAD_IMBALANCE, _load_imbalance, "imbalance"),
    Rule(COMM_BOUND, _comm_bound),
    Rule(WAIT_HEAVY, _wait_heavy, "residual_wait"),
    Rule(BALANCED, _balanced),
)
# label -> its pricing model, for the labels with a what-if.
PRICED: Mapping[str, str] = {r.label: r.pricing for r in RULES if r.pricing is not None}


def diagnose(ranks: Table, active: str | None = None,
             collectives_in_compute: bool = False, framework: str | None = None,
             recent: Recent = None,
             stalls: Sequence[StallFinding] | None = None,
             preflight_busbw: float | None = None, steps: Steps = None) -> Diagnosis:
    """Classify the window: the verdict of the first rule in RULES that gives one.
    `active` is the label currently shown: its own condition is tested with the lower
    exit threshold (hysteresis), every other with the enter one.
    `collectives_in_compute`: an FSDP job (see FSDP_COMPUTE_PHASES). `framework`: the
    training framework the agents saw, named in the hint when timing is incomplete.
    `recent`: the same ranks over their newest few steps (RECENT_S), or a function that
    gives them (asked only when a straggler gap holds on the window): a straggler the
    window still holds but those steps no longer show has recovered, and is not named.
    `stalls`: what each stalling rank's stall log says, over the whole run
    (stalls.StallBook.finding; periodic_stall).
    `preflight_busbw`: the all-reduce bus bandwidth `traceml netcheck` measured before
    training (GB/s), which COMM-BOUND's evidence compares against.
    `steps`: the ranks' windows lined up step by step (or a function that gives them,
    asked only when a rule needs them): a straggler must then be behind on most steps,
    not the top of a draw that moves (LOAD IMBALANCE), a clear one is named from its
    newest steps, and COMM-BOUND counts only the wait the ranks' own work does not
    explain (imbalance.py)."""
    w = WindowStats.of(ranks, active, collectives_in_compute, framework, recent, stalls,
                       preflight_busbw, steps)
    for rule in RULES:
        verdict = rule.judge(w)
        if verdict is not None:
            return verdict
    raise AssertionError("BALANCED, the last rule, always answers")


def comm_bound(ranks: Table, share: float, step_ms: float,
               preflight_busbw: float | None, moving_ms: float | None = None) -> Diagnosis:
    """COMM-BOUND, with the achieved bus bandwidth per rank where the gradient bytes are
    known: bytes all-reduced per step over the rank's exposed sync time. Part of each
    transfer overlaps backward, so this is an upper bound of what the slowest link did.
    `moving_ms`: what every rank waits on a typical step for whichever rank's own work
    is slowest on that step, where that rank moves; said where it is material (the wait
    is not all the network's, and "no rank is behind" alone would hide it)."""
    t = Timings.of(ranks)
    world = len(t)
    sync = t.column(SYNC)
    sync = np.where(np.isnan(sync), 0.0, sync)  # not measured: no exposed wait
    nb = t.comm_bytes
    known = (nb != 0) & (sync > 0) if world >= 2 else np.zeros(world, dtype=bool)
    gbps = nb[known] / (sync[known] / 1000.0) / 1e9 * bus_factor("all_reduce", world)
    sync_ms = median_of(sync)
    evidence = ""
    if len(gbps):
        nbytes = median_of(nb[nb != 0])
        slow = float(gbps.min())
        slow_rank = int(t.ranks[known][gbps == slow].min())
        mid = median_of(gbps)
        evidence = (f" DDP all-reduces {si_bytes(nbytes)} of gradients per step: about "
                    f"{mid:.3g} GB/s of bus bandwidth over the exposed wait (lowest: rank "
                    f"{slow_rank}, {slow:.3g} GB/s)")
        if preflight_busbw:
            evidence += (f", against {preflight_busbw:.3g} GB/s measured by the preflight "
                         f"({mid / preflight_busbw:.0%} of it)")
        evidence += "."
    moving = ""
    if moving_ms is not None and moving_ms >= MIN_GAP_MS and moving_ms >= SKEW_EXIT * step_ms:
        moving = (f" On a typical step about {moving_ms:.1f} ms of the wait is for whichever "
                  f"rank's own work is slowest on that step, a different rank from step to "
                  f"step (a busy host slowing each in turn, or uneven batches); the rest is "
                  f"the network's.")
    return Diagnosis(
        COMM_BOUND, None, SYNC, WARNING,
        f"Every rank spends about {share:.0%} of its {step_ms:.1f} ms step waiting in "
        f"collectives ({sync_ms:.1f} ms of exposed sync) and no rank is behind: the job is "
        f"communication-bound.{moving}{evidence} Try larger DDP buckets (bucket_cap_mb) and more "
        f"overlap (gradient accumulation with no_sync), find_unused_parameters=False, a "
        f"gradient compression hook (fp16/bf16, PowerSGD); check the interface the "
        f"backend uses (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME) and the links: traceml "
        f"netcheck (docs/network.md).",
        gap_share=share)


def load_imbalance(s: StepSpread, active: str | None,
                   cpu_wait: tuple[float, float] | None = None) -> Diagnosis | None:
    """LOAD IMBALANCE from the per-step comparison: the share of the step by which the
    slowest ranks (the p95 across ranks) exceed the median rank on a typical step, who
    was slowest how often against a fair share, and what every rank waiting for the
    slowest costs per step (the job with every rank at the median's own work).
    `cpu_wait`: the median rank's share of ready time and ms a step waited for a CPU
    core. Where that wait is CPU_WAIT_EXPLAINS of the spread or more, the host's
    scheduling (each step another rank loses its core) explains the spread as well as
    uneven data does: the host's advice leads, the data's is conditional."""
    job = float(np.median(s.job_ms))
    ordered = np.sort(s.own, axis=0)
    n = len(s.ranks)
    top = ordered[max(0, math.ceil(0.95 * n) - 1)]
    typical = float(np.median(top - s.medians()))
    share = typical / job if job > 0 else 0.0
    enter = IMBALANCE_EXIT if active == LOAD_IMBALANCE else IMBALANCE_ENTER
    if typical < MIN_GAP_MS or share < enter or s.fixed_culprit() is not None:
        return None  # one rank behind on most steps: a straggler's (or its old steps')
    loss = float(s.excess_ms().mean())
    shares = s.slowest_shares()
    order = np.lexsort((s.ranks, -shares))[:4]
    most = ", ".join(f"rank {int(s.ranks[i])} on {shares[i]:.0%}" for i in order)
    slowest = "the slowest rank" if s.top == 1 else f"among the slowest {s.top}"
    phase = s.widest_phase()
    where = ("own work (input and compute)" if set(INPUT_PHASES) <= set(s.phases)
             else "/".join(s.phases))
    balance = ("Balance the work per step, not per sample: batches of equal tokens "
               "(token-based batching), length bucketing across ranks rather than within "
               "each, pipeline stages of equal cost.")
    cpu = ""
    waited, wait_ms = cpu_wait if cpu_wait is not None else (0.0, float("nan"))
    if cpu_explains(wait_ms, typical):
        balance = (f"The ranks' training threads waited {wait_ms:.1f} ms of each step for a "
                   f"CPU core ({waited:.0%} of the time they were ready to run), as much as "
                   f"the spread: the host's scheduling, each step another rank losing its "
                   f"core, explains it as well as uneven data does. First {CPU_ADVICE}; if "
                   f"the spread stays, balance the work per step (batches of equal tokens, "
                   f"length bucketing across ranks).")
    elif waited >= IMBALANCE_CPU_WAIT:
        cpu = (f" The ranks' training threads waited for a CPU core {waited:.0%} of the "
               f"time they were ready to run: part of the spread may be the host's scheduling "
               f"({CPU_ADVICE}).")
    return Diagnosis(
        LOAD_IMBALANCE, None, phase, CRITICAL if share >= CRITICAL_SHARE else WARNING,
        f"The slowest rank changes from step to step: over the last {len(s.steps)} steps "
        f"{slowest} was {most} (a fair share is {s.fair:.0%}; a straggler would be "
        f"behind on most steps). On a typical step the slowest ranks do {typical:.1f} ms "
        f"more {where} than the median rank, {share:.0%} of the {job:.1f} ms step "
        f"(spread p95/median {s.spread():.2f}x), and every rank waits for them in its "
        f"collective: {loss:.1f} ms of every step on average. {balance}{cpu}",
        gap_ms=typical, gap_share=share, phases=tuple(s.phases))


def periodic_stall(findings: Sequence[StallFinding], active: str | None, reporting: int
                   ) -> Diagnosis | None:
    """PERIODIC STALL: a rank (or every rank) whose own work stalls with a period, still
    going on, costing the job at least STALL_SHARE_ENTER of its time since the stall log's
    oldest kept stall. Judged from the stall log, not the window: a checkpoint every 5,000
    steps fits in no window. The ranks that only waited for it stall too, in sync: they
    are the victims, not the cause (whatever their share of sync, COMM-BOUND comes after).
    `reporting`: the ranks that reported (every one stalling reads "every rank")."""
    enter = STALL_SHARE_EXIT if active == PERIODIC_STALL else STALL_SHARE_ENTER
    causes = [f for f in findings if f.periodic >= STALL_MIN_COUNT and f.period is not None
              and f.recent and f.span_share >= enter]
    if not causes:
        return None
    f = max(causes, key=lambda c: (c.span_share, c.lost_ms, -c.rank))
    alike = [c for c in causes if c.period == f.period
             and c.periodic_ms >= SAME_STALL_SHARE * f.periodic_ms]
    everyone = len(alike) == reporting > 1
    who = "Every rank" if everyone else f"Rank {f.rank}"
    waits = ("" if everyone else
             "; the other ranks wait for it in their next collective (their sync)")
    # The advice from the evidence (advice.py); the phase table's hint of where such a
    # stall usually comes from only when the evidence picks no cause.
    advice = advise(f, everyone, f.heartbeat)
    where = (f"in {f.phase}" if advice.cause is not None
             else STALL_HINTS.get(f.phase, f"in {f.phase}"))
    n = f.periodic_count
    lost_ms = n * f.periodic_ms
    return Diagnosis(
        PERIODIC_STALL, None if everyone else f.rank, f.phase, WARNING,
        f"{who} stalls every {f.period} steps ({n} times in the run, the last at step "
        f"{f.last_step}), about {f.periodic_ms:.0f} ms each, {where}{waits}: the job lost "
        f"{lost_ms / 1000:.1f} s, {f.span_share:.0%} of its time since step {f.first_step}. "
        f"{advice.text}",
        gap_ms=f.periodic_ms, gap_share=f.span_share, period=f.period)


def _incomplete(ranks: Table, framework: str | None) -> Diagnosis:
    """No verdict from phases that were not seen: say which, where and why instead."""
    where: dict[tuple[str, str], list[int]] = {}
    for rank, untimed in Timings.of(ranks).untimed.items():
        for u in untimed:
            where.setdefault((u.phase, u.why), []).append(rank)
    parts = [f"{phase} on rank{'s' if len(rs) > 1 else ''} {format_ranks(rs)} ({why})"
             for (phase, why), rs in sorted(where.items())]
    first = min(where)[0]
    under = f" under {framework}" if framework else ""
    return Diagnosis(
        TIMING_INCOMPLETE, None, first, WARNING,
        f"Timing incomplete{under}: could not time {'; '.join(parts)}. That time counts as "
        f"wait, so no straggler, balance or wait verdict is given from it: time the loop with "
        f"traceml_agent.phase() (docs/agent-api.md); docs/frameworks.md lists what each "
        f"framework exposes.")


_ADVICE = {
    INPUT_STRAGGLER: "check its input pipeline (uneven shards, rank-local preprocessing, "
                     "slow storage on its host)",
    COMPUTE_STRAGGLER: "check its model-side work (uneven input shapes, rank-local branches, "
                       "extra forward/backward/optimizer work, hooks that run on one rank)",
    STRAGGLER: "input and compute are both uneven; fix the phase with the largest gap first",
}


_NODE_ADVICE = {
    INPUT_STRAGGLER: "the host is the cause, not one rank: a slow storage path or network "
                     "mount, or a CPU busy with other work on that host",
    COMPUTE_STRAGGLER: "the host is the cause, not one rank: slower or throttled GPUs, a "
                       "different GPU model, or other jobs on that host",
    STRAGGLER: "the host is the cause, not one rank: compare its storage, CPUs and GPUs "
               "with the other nodes'",
}

def slow_node(ranks: Table, worst_rank: int, phases: Sequence[str],
              gap_ms: float) -> tuple[int, tuple[int, ...]] | None:
    """(node, its ranks) when the worst rank's whole node is behind and nobody else is."""
    t = Timings.of(ranks)
    if len(np.unique(t.node)) < 2:
        return None
    sums, has = t.group(phases)
    mid = median_of(sums[has])
    node = t.node[t.ranks == worst_rank][0]
    slow = set(t.ranks[has & (sums - mid >= NODE_MEMBER_SHARE * gap_ms)].tolist())
    members = set(t.ranks[t.node == node].tolist())
    if len(members) < 2 or slow != members:
        return None
    return int(node), tuple(sorted(members))


def _seen(spreads: Spreads | None, rank: int, gap: float, phases: Sequence[str]) -> str:
    """How long the evidence has been there, where the steps can be compared one by one:
    the culprit's newest steps in a row behind by half its gap, and its share of steps
    behind the others over the steps compared."""
    spread = None if spreads is None else spreads.of(phases)
    if spread is None:
        return ""
    n, secs = spread.seen_for(rank, gap)
    behind = spread.behind_share(rank) or 0.0
    seen = f"Seen for its last {n} steps ({secs:.1f} s); b" if n else "B"
    return f" {seen}ehind the other ranks on {behind:.0%} of the last {len(spread.steps)}."


def _straggler(label: str, rank: int, phase: str | None, gap: float, share: float,
               step_ms: float, ranks: Timings, phases: Sequence[str],
               spreads: Spreads | None = None, where: str | None = None) -> Diagnosis:
    """`where` the gap is spent, said in the text: in `phase` unless told."""
    severity = CRITICAL if share >= CRITICAL_SHARE else WARNING
    if where is None:
        where = f" in {phase}" if phase else ""
    host = ranks.hosts.get(rank, "")
    whole = slow_node(ranks, rank, phases, gap)
    if whole is not None:
        node, members = whole
        on_host = f", host {host}" if host else ""
        listed = ", ".join(str(m) for m in members)
        gpus = node_gpu_evidence(ranks, members) if label == COMPUTE_STRAGGLER else None
        cpus = node_cpu_evidence(ranks, members, gap)
        found = "".join(f"{e}; " for e in (gpus, cpus) if e)
        return Diagnosis(
            label, rank, phase, severity,
            f"Every rank on node {node} (ranks {listed}{on_host}) spends about {gap:.1f} ms "
            f"more{where} than the median rank, {share:.0%} of the {step_ms:.1f} ms step that "
            f"every rank waits for: {found}{_NODE_ADVICE[label]}.",
            gap_ms=gap, gap_share=share, node=node, node_ranks=members, phases=tuple(phases),
            cause=None if cpus is None else CORES)
    on_host = f" (host {host})" if host else ""
    health = gpu_evidence(ranks, rank) if label == COMPUTE_STRAGGLER else None
    advice = _ADVICE[label]
    if health is not None:  # the GPU first when it sets this rank apart, else beside
        text, distinct = health
        advice = f"{text}; {GPU_ADVICE}" if distinct else f"{advice}; {text}"
    wait = cpu_wait(ranks, rank, gap)
    cpu = wait.explains
    if cpu is not None:  # its cores explain the gap: said first, unless its GPU sets it
        # apart (a slow GPU's rank syncs longest, and a sync's spin adds to its CPU wait)
        if health is None:
            advice = cpu
        elif health[1]:
            advice = f"{advice}; {cpu}"
        else:
            advice = f"{cpu}; {health[0]}"
    elif not wait.read:
        advice = f"{advice}; {CPU_UNREAD}"
    elif wait.usual is not None:
        advice = (f"{advice}; but the host's cores are shared (the other ranks' training "
                  f"threads waited for one {wait.usual:.0%} of the time they were ready to "
                  f"run), and there a rank can fall behind with no more work of its own: "
                  f"give each rank cores of its own (taskset or numactl, OMP_NUM_THREADS) "
                  f"to tell")
    return Diagnosis(
        label, rank, phase, severity,
        f"Rank {rank}{on_host} spends {gap:.1f} ms more{where} than the median rank, "
        f"{share:.0%} of the {step_ms:.1f} ms step that every rank waits for: {advice}."
        f"{_seen(spreads, rank, gap, phases)}",
        gap_ms=gap, gap_share=share, phases=tuple(phases),
        cause=None if cpu is None else CORES)
