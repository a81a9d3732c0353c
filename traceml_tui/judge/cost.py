"""What a diagnosed problem costs the job, and the step time the job would have without it.

Pure functions over per-step data (no I/O, no clocks), like diagnosis.py: the collector
passes the diagnosis and the ranks' windows lined up step by step
(`windows.AlignedSteps`) and gets a `WhatIf` back. docs/diagnosis.md ("What it costs")
gives the model and its limits.

The model is the synchronous data-parallel step: in every step each rank does its local
work (input, then forward, backward and optimizer) and the collectives make every rank
wait for the last one to arrive. So the job's step is paced by the slowest rank's local
work, step by step, and a culprit costs the job what that pace would lose if the culprit
did only what the median of the other ranks does: per step,

    saving = max over ranks of local work
             - max(max over the other ranks of local work,
                   the culprit's local work with its gap in the diagnosed phases removed)

(another slow rank keeps pacing the job, so fixing one of two stragglers gains nothing).
That saving is then checked against what the others are measured to pay: their exposed
collective wait (sync) beyond the culprit's own. Extra work that overlaps communication
is paid by nobody, and the estimate says so instead of promising it.

Each model of what a culprit costs is a pricing function in `MODELS` (at the end, below
the functions), by name; a rule of diagnosis.RULES names the model its label is priced by,
so `PRICING` (label -> function) and the labels with a what-if (`COSTED_LABELS`) derive
from the rules: a new label priced by an existing model is its word and its rule.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from traceml_agent.vocab import COMPUTE_PHASES, INPUT_PHASES, SYNC, WAIT

from .diagnosis import (
    FSDP_COMPUTE_PHASES,
    PRICED,
    Diagnosis,
    compared_phases,
)
from .stalls import STALL_FACTOR, STALL_MIN_MS
from .windows import AlignedSteps, nan_medians

# Rank-steps the model reads at most per estimate: a what-if over 1,024 ranks' whole
# 512-step windows took ~80 ms of the collector's one core, for a figure that 64 recent
# steps give as well. Small jobs still read their whole window (128 ranks x 512 steps).
VALUE_BUDGET = 65536
# Steps the estimate needs before it is given: fewer and one slow step moves it.
MIN_STEPS = 8
# The estimate is weak when the others' measured wait covers less than this share of
# the culprit's extra work on the critical path: the rest overlapped communication (or
# the model's picture of the step does not hold), so the saving is uncertain.
PAID_SHARE_WEAK = 0.7
# A what-if saving below this share of the step is not promised as a speedup.
MIN_SAVING_SHARE = 0.01


@dataclass(frozen=True, slots=True)
class WhatIf:
    """The job without its culprit: the step it has now and would have, per step on
    average over `steps` steps, and how the figure was reached."""

    label: str
    culprit: str  # "rank", "node", "phase" (on every rank) or "stalls"
    rank: int | None
    node: int | None
    phase: str | None
    steps: int
    now_ms: float  # the job's step now: the median rank's, averaged over the steps
    step_ms: float  # the step without the culprit
    excess_ms: float  # the culprit's extra work on the critical path, per step
    paid_ms: float | None  # of it, what the others wait for it in sync (None: not measured)
    weak: str | None  # why the estimate may be off; None when the measurements agree
    reasoning: str

    @property
    def saving_ms(self) -> float:
        return self.now_ms - self.step_ms

    @property
    def share(self) -> float:
        """The culprit's share of every step."""
        return self.saving_ms / self.now_ms if self.now_ms > 0 else 0.0

    @property
    def speedup(self) -> float:
        return self.now_ms / self.step_ms if self.step_ms > 0 else 1.0

    def to_json(self) -> dict:
        return {"label": self.label, "culprit": self.culprit, "rank": self.rank,
                "node": self.node, "phase": self.phase, "steps": self.steps,
                "now_step_ms": round(self.now_ms, 3), "step_ms": round(self.step_ms, 3),
                "saving_ms": round(self.saving_ms, 3), "share": round(self.share, 4),
                "speedup": round(self.speedup, 3), "excess_ms": round(self.excess_ms, 3),
                "paid_ms": None if self.paid_ms is None else round(self.paid_ms, 3),
                "weak": self.weak, "reasoning": self.reasoning}


@dataclass(frozen=True, slots=True)
class Savings:
    """Per aligned step: its number, the job's step (median rank) and what the culprit
    cost in it (ms)."""

    steps: np.ndarray
    job_ms: np.ndarray
    saving_ms: np.ndarray
    excess_ms: np.ndarray
    paid_ms: np.ndarray | None
    culprit: str
    weak: str | None
    why: str  # the part of the reasoning that names the mechanism

    def tail(self, n: int) -> Savings:
        """The newest n steps."""
        return Savings(self.steps[-n:], self.job_ms[-n:], self.saving_ms[-n:],
                       self.excess_ms[-n:], None if self.paid_ms is None else self.paid_ms[-n:],
                       self.culprit, self.weak, self.why)

    def lost_ms_after(self, step: int) -> tuple[float, int]:
        """What the culprit cost in the steps after `step`: (ms, steps counted)."""
        newer = self.steps > step
        return float(self.saving_ms[newer].sum()), int(newer.sum())


def _group(data: AlignedSteps, phases: Sequence[str]) -> np.ndarray | None:
    """Per rank and step, the sum of the measured phases of a group (an unmeasured phase
    adds nothing); None when no rank measured any of them."""
    arrays = [data.phase_ms[p] for p in phases if p in data.phase_ms]
    if not arrays:
        return None
    total = np.zeros_like(data.step_ms)
    for a in arrays:
        total += np.where(np.isnan(a), 0.0, a)  # times are finite (protocol): NaN only
    total[np.isnan(data.step_ms)] = np.nan  # a step not received, not a step of no work
    return total


def savings(d: Diagnosis, data: AlignedSteps, fsdp: bool = False) -> Savings | None:
    """Step by step, what the diagnosed problem costs the job; None for a label without a
    culprit to remove (balanced, comm-bound, hang, ...) or too few common steps."""
    price = PRICING.get(d.label)
    if price is None or data.step_ms.shape[1] < MIN_STEPS or len(data.ranks) == 0:
        return None
    with warnings.catch_warnings():
        # numpy's nan-reductions warn on all-NaN slices: here those are simply no value.
        warnings.simplefilter("ignore", RuntimeWarning)
        out = price(d, data, fsdp, nan_medians(data.step_ms))
    if out is None:
        return None
    keep = ~np.isnan(out.job_ms) & ~np.isnan(out.saving_ms)
    if int(keep.sum()) < MIN_STEPS:
        return None
    return Savings(out.steps[keep], out.job_ms[keep], out.saving_ms[keep],
                   out.excess_ms[keep], None if out.paid_ms is None else out.paid_ms[keep],
                   out.culprit, out.weak, out.why)


def what_if(d: Diagnosis, data: AlignedSteps, fsdp: bool = False) -> WhatIf | None:
    """The job's step without the culprit of `d`, averaged over the aligned steps."""
    s = savings(d, data, fsdp)
    return None if s is None else summarize(d, s)


def summarize(d: Diagnosis, s: Savings, last: int | None = None, every: int = 1,
              ranks: int = 0) -> WhatIf | None:
    """The what-if from the per-step savings (of the newest `last` steps, or all);
    `every` > 1: it is computed afresh only every so many evaluations (what_if_every)
    of a job of `ranks` ranks, and says so."""
    if last is not None:
        s = s.tail(last)
    if len(s.steps) < MIN_STEPS:
        return None
    now = float(s.job_ms.mean())
    saving = float(s.saving_ms.mean())
    if s.culprit == "stalls" and d.period and d.gap_ms is not None:
        # The stall log's mean stall once a period, over the run, in place of the stalls
        # these steps happen to hold (a 32-step window holds none of a checkpoint every
        # 500 steps, or one: fifteen times its cost).
        saving = d.gap_ms / d.period
        now = float((s.job_ms - s.saving_ms).mean()) + saving
    if now <= 0 or saving < MIN_SAVING_SHARE * now:
        return None
    excess = (saving if s.culprit == "stalls" and d.period
              else float(s.excess_ms.mean()))
    paid = None if s.paid_ms is None else float(s.paid_ms.mean())
    text = s.why
    if paid is not None and s.culprit in ("rank", "node"):
        text += (f": its extra work on the critical path is {excess:.1f} ms per step and the "
                 f"other ranks wait {paid:.1f} ms more than it in sync")
    if every > 1:
        text += f"; at {ranks:,} ranks refreshed every {every} evaluations"
    return WhatIf(d.label, s.culprit, d.rank if s.culprit in ("rank", "stalls") else None,
                  d.node if s.culprit == "node" else None, d.phase, int(len(s.steps)), now,
                  now - saving, excess, paid, s.weak, text + ".")


def steps_to_read(ranks: int, window: int, wanted: int) -> int:
    """How many aligned steps to read for `wanted` of them: at most the window, and at
    most VALUE_BUDGET values over all ranks (but never fewer than MIN_STEPS x 4)."""
    return max(1, min(window, wanted, max(4 * MIN_STEPS, VALUE_BUDGET // max(1, ranks))))


def what_if_every(ranks: int, live_steps: int) -> int:
    """Every how many evaluations the live what-if is computed afresh: each one while its
    `live_steps` steps of every rank fit VALUE_BUDGET (2,048 ranks at 32 steps), past that
    as often as the budget allows on average (16,384 ranks: every 8th). Between, the lost
    time is still counted every evaluation, from only the steps taken since (Timeline):
    the what-if is a mean over dozens of steps and moves slowly, the count is a sum."""
    return max(1, -(-ranks * live_steps // VALUE_BUDGET))


def job_step_ms(data: AlignedSteps) -> float | None:
    """The job's mean step over the aligned steps: per step the median rank's (in a
    synchronous job every rank's step is about the same), averaged. What a run measured,
    comparable with a what-if's `step_ms`."""
    if data.step_ms.shape[1] == 0:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        per_step = nan_medians(data.step_ms)
    per_step = per_step[~np.isnan(per_step)]
    return float(per_step.mean()) if len(per_step) else None


def _compute(fsdp: bool) -> tuple[str, ...]:
    return FSDP_COMPUTE_PHASES if fsdp else COMPUTE_PHASES


def _straggler(d: Diagnosis, data: AlignedSteps, fsdp: bool, job: np.ndarray
               ) -> Savings | None:
    culprits = d.node_ranks if d.node is not None else (d.rank,)
    mask = np.isin(data.ranks, np.asarray(culprits, dtype=np.int64))
    if not mask.any() or mask.all():
        return None
    group = compared_phases(d, fsdp)
    local = _group(data, INPUT_PHASES + _compute(fsdp))
    gap = _group(data, group)
    if local is None or gap is None:
        return None
    # "The median rank" is the median of the other ranks: with half the ranks on a slow
    # node, the median of all of them sits halfway between the two groups.
    median_gap = nan_medians(gap[~mask])
    fixed = local[mask] - np.maximum(0.0, gap[mask] - median_gap)
    pace = np.nanmax(local, axis=0)
    pace_fixed = np.fmax(np.nanmax(local[~mask], axis=0), np.nanmax(fixed, axis=0))
    excess = np.maximum(0.0, pace - pace_fixed)
    who = (f"node {d.node} (ranks {', '.join(map(str, culprits))})" if d.node is not None
           else f"rank {d.rank}")
    what = "/".join(group)
    why = f"{who} doing the median rank's {what}"
    weak = None
    if fsdp:
        weak = ("FSDP: forward and backward hold collectives, so only the gap in "
                f"{what} is counted")
    sync = data.phase_ms.get(SYNC)
    paid = None
    saving = excess
    if sync is not None and not np.all(np.isnan(sync[~mask])) and not np.all(np.isnan(sync[mask])):
        # A rank arriving last waits only for the collective itself: the others' wait
        # beyond the culprit's own is what they pay for it. Both are noisy measures of
        # one delay, so the check scales the steps' excess by the ratio of the totals
        # (a per-step minimum of two noisy figures would be biased low).
        paid = np.maximum(0.0, nan_medians(sync[~mask]) - np.nanmin(sync[mask], axis=0))
        mean_excess, mean_paid = float(np.nanmean(excess)), float(np.nanmean(paid))
        if mean_excess > 0:
            saving = excess * min(1.0, mean_paid / mean_excess)
        if weak is None and mean_excess > 0 and mean_paid < PAID_SHARE_WEAK * mean_excess:
            weak = (f"the others wait only {mean_paid:.1f} of the culprit's {mean_excess:.1f} "
                    f"ms extra in sync: the rest overlaps communication or runs off the "
                    f"critical path, so only what they wait is counted")
    elif weak is None:
        weak = "no sync phase measured: what the others wait for the culprit is not checked"
    return Savings(data.steps, job, saving, excess, paid,
                   "node" if d.node is not None else "rank", weak, why)


def _input_bound(d: Diagnosis, data: AlignedSteps, fsdp: bool, job: np.ndarray
                 ) -> Savings | None:
    """Input slow on every rank: the job's pace with input taking no time."""
    local = _group(data, INPUT_PHASES + _compute(fsdp))
    gone = _group(data, INPUT_PHASES)
    if local is None or gone is None:
        return None
    pace = np.nanmax(local, axis=0)
    excess = np.maximum(0.0, pace - np.nanmax(local - gone, axis=0))
    return Savings(data.steps, job, excess, excess, None, "phase",
                   "assumes the work can be fully overlapped (an upper bound)",
                   "input on every rank fully overlapped with compute "
                   "(prefetched by DataLoader workers)")


def _wait_heavy(d: Diagnosis, data: AlignedSteps, fsdp: bool, job: np.ndarray
                ) -> Savings | None:
    """Residual wait on every rank: the step without it (the median rank's)."""
    wait = data.phase_ms.get(WAIT)
    if wait is None:
        return None
    saving = nan_medians(wait)
    return Savings(data.steps, job, saving, saving, None, "phase",
                   "assumes that work can move off the critical path (an upper bound)",
                   "the time outside the timed phases taken off every step")


def _stalls(d: Diagnosis, data: AlignedSteps, fsdp: bool, job: np.ndarray) -> Savings | None:
    """Periodic stalls: each step at least STALL_FACTOR times the typical one costs the
    job its excess over the typical step (the culprit's own steps when one rank stalls;
    the others wait for it in their next collective, which must not count twice). Step
    by step, so the lost time summed over the steps is the stalls' excess, and each
    stall is its episode's evidence (episodes.py); the what-if's average takes the run's
    rate instead (summarize)."""
    if d.rank is not None:
        row = np.flatnonzero(data.ranks == d.rank)
        if len(row) == 0:
            return None
        steps_ms = data.step_ms[row[0]]
        who = f"rank {d.rank}'s stalls"
    else:
        steps_ms = job
        who = "every rank's stalls"
    typical = float(nan_medians(steps_ms[:, None])[0])
    threshold = max(STALL_FACTOR * typical, typical + STALL_MIN_MS)
    excess = np.where(steps_ms >= threshold, steps_ms - typical, 0.0)
    if d.period and d.gap_ms is not None:
        who += f" (about {d.gap_ms:.0f} ms every {d.period} steps)"
    return Savings(data.steps, job, excess, excess, None, "stalls", None,
                   f"{who} gone")


def _imbalance(d: Diagnosis, data: AlignedSteps, fsdp: bool, job: np.ndarray
               ) -> Savings | None:
    """Imbalance that moves: in each step every rank waits for the slowest rank's own
    work; with the work per step balanced every rank would do the median rank's, so the
    job would gain the slowest rank's excess over the median in that step."""
    local = _group(data, INPUT_PHASES + _compute(fsdp))
    if local is None:
        return None
    excess = np.nanmax(local, axis=0) - nan_medians(local)
    return Savings(data.steps, job, excess, excess, None, "phase", None,
                   "every rank doing the median rank's own work on each step (balanced "
                   "batches)")


# The models of what a culprit costs, by the name a rule gives (diagnosis.Rule.pricing):
# its culprit taken away, step by step. A straggler (a rank or a node, its gap in the
# phases it was compared on), input on every rank, residual wait on every rank, stalls.
Pricing = Callable[[Diagnosis, AlignedSteps, bool, np.ndarray], Savings | None]
MODELS: Mapping[str, Pricing] = {
    "straggler": _straggler,
    "fleet_input": _input_bound,
    "residual_wait": _wait_heavy,
    "stalls": _stalls,
    "imbalance": _imbalance,
}
# How each costed label is priced; the others (balanced, comm-bound, hang, timing
# incomplete, warm-up) have no culprit whose work could be taken away, and no what-if.
PRICING: Mapping[str, Pricing] = {label: MODELS[model] for label, model in PRICED.items()}
COSTED_LABELS = frozenset(PRICING)
