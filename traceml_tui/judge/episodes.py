"""Episodes dated by their evidence: the steps whose data made a label, not the
evaluation that flipped it.

A live label changes only after its window's medians moved and CONFIRM_TICKS evaluations
agreed: with 10 ms steps that is a hundred steps after the problem began, and a
problem that lasted 60 steps can be confirmed after it ended. So an episode with a
culprit is dated by the culprit's cost step by step (cost.Savings, over the ranks'
windows lined up by step): its first and last step are those of the newest run of
steps in which the culprit cost the job a material share of the step, and its lost
time is priced over those steps. Pure functions over arrays: no I/O, no clock.
"""

from __future__ import annotations

import warnings

import numpy as np

from .diagnosis import (
    INPUT_BOUND_EXIT,
    MIN_GAP_MS,
    PRICED,
    SKEW_EXIT,
    WAIT_HEAVY_EXIT,
    Diagnosis,
    compared_phases,
)
from .windows import AlignedSteps, nan_medians, rolling_median  # noqa: F401 (re-exported)

# A step is evidence of a label's culprit when the culprit cost the job at least this
# share of that step (and MIN_GAP_MS): the label's own exit threshold, read per step, so
# an episode spans the steps on which the label would still hold. By the label's pricing
# model (diagnosis.Rule.pricing): the labels priced alike share their exit threshold.
EVIDENCE_SHARE = {
    "straggler": SKEW_EXIT,
    "fleet_input": INPUT_BOUND_EXIT,
    "residual_wait": WAIT_HEAVY_EXIT,
    "stalls": 0.0,  # its pricing counts only stalled steps: each one is evidence
    "imbalance": SKEW_EXIT,  # the slowest rank's excess over the median, per step
}

# ... and at least this share of the gap the label was named with (the window's median):
# the edges of an episode are where its gap is half there, so a loaded machine's noisy
# step of a few milliseconds beside it is not taken for its start or its end.
EDGE_SHARE = 0.5
# The per-step cost is smoothed by a running median of this many steps before it is
# compared: on a loaded machine another rank's descheduled step paces the job now and
# then and the culprit's cost in it drops, which would split one episode in two; a median
# of 7 ignores up to 3 such steps and keeps a real change's edge where it is.
SMOOTH_STEPS = 7
# Steps without evidence that still join two runs of it into one episode: on a loaded
# machine a straggler's single step can come out short (the scheduler ran it first), and
# the label would not have left for it. A stall recurs with its period: any gap joins.
JOIN_GAP = 3
# Evidenced steps an episode needs: fewer are a few noisy steps, not what the medians saw.
MIN_EVIDENCE = 3
MIN_STALLS = 1  # each stall is a step the rule counted (it needs several in its window)


def _stalls(label: str) -> bool:
    return PRICED.get(label) == "stalls"


def evidence(label: str, job_ms: np.ndarray, saving_ms: np.ndarray,
             gap_ms: float | None = None) -> np.ndarray:
    """Per step, whether the culprit's cost in it (or a straggler's own gap, own_gap)
    is evidence of `label` (a bool array); `gap_ms`: the gap the label was named with
    (Diagnosis.gap_ms), for EDGE_SHARE."""
    share = EVIDENCE_SHARE.get(PRICED.get(label, ""))
    if share is None:
        return np.zeros(len(saving_ms), dtype=bool)
    edge = EDGE_SHARE * gap_ms if gap_ms and gap_ms > 0 and not _stalls(label) else 0.0
    floor = np.maximum(max(MIN_GAP_MS, edge), share * np.nan_to_num(job_ms))
    cost = np.nan_to_num(saving_ms)
    if not _stalls(label):  # a stall is one step: nothing to smooth
        cost = rolling_median(cost, SMOOTH_STEPS)
    return cost >= np.maximum(floor, 1e-9)


def own_gap(d: Diagnosis, data: AlignedSteps, fsdp: bool = False) -> np.ndarray | None:
    """Per aligned step, a straggler's own gap: its local work in the diagnosed group
    less the median of the other ranks' (a node: its ranks' median), in ms; what the
    label was named from, step by step. Unlike its cost (cost.Savings) it does not drop
    on the steps where another rank's stray delay paces the job. None for other labels."""
    group = compared_phases(d, fsdp) if PRICED.get(d.label) == "straggler" else None
    culprits = d.node_ranks if d.node is not None else (d.rank,)
    mask = np.isin(data.ranks, np.asarray([c for c in culprits if c is not None],
                                          dtype=np.int64))
    arrays = [data.phase_ms[p] for p in group or () if p in data.phase_ms]
    if not arrays or not mask.any() or mask.all():
        return None
    work = np.zeros_like(data.step_ms)
    for a in arrays:
        work += np.nan_to_num(a)
    work[np.isnan(data.step_ms)] = np.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN steps: no value
        return nan_medians(work[mask]) - nan_medians(work[~mask])


def span(label: str, steps: np.ndarray, hot: np.ndarray, after: int
         ) -> tuple[int, int] | None:
    """The newest run of evidence on steps after `after`, as (first, last) step numbers:
    evidenced steps joined across at most JOIN_GAP steps without (any gap for periodic
    stalls); None without a run of MIN_EVIDENCE evidenced steps (MIN_STALLS stalls)."""
    stall = _stalls(label)
    mask = hot & (steps > after)
    at = steps[mask]
    if len(at) == 0:
        return None
    if stall:
        return (int(at[0]), int(at[-1])) if len(at) >= MIN_STALLS else None
    runs: list[list[int]] = []  # [first, last, evidenced steps]
    for s in at.tolist():
        if runs and s - runs[-1][1] <= JOIN_GAP + 1:
            runs[-1][1] = s
            runs[-1][2] += 1
        else:
            runs.append([s, s, 1])
    for first, last, n in reversed(runs):
        if n >= MIN_EVIDENCE:
            return first, last
    return None


def last_evidence(label: str, steps: np.ndarray, hot: np.ndarray, after: int) -> int | None:
    """The last step of evidence after `after` (where a closing episode ends)."""
    found = span(label, steps, hot, after)
    return None if found is None else found[1]


def lost_ms(steps: np.ndarray, saving_ms: np.ndarray, first: int, last: int) -> float:
    """What the culprit cost over steps first..last (both included), in ms."""
    inside = (steps >= first) & (steps <= last)
    return float(np.nan_to_num(saving_ms[inside]).sum())
