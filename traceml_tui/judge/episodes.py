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

import numpy as np

from traceml_agent.vocab import (
    COMPUTE_STRAGGLER,
    INPUT_BOUND,
    INPUT_STRAGGLER,
    PERIODIC_STALL,
    STRAGGLER,
    WAIT_HEAVY,
)

from .diagnosis import INPUT_BOUND_EXIT, MIN_GAP_MS, SKEW_EXIT, WAIT_HEAVY_EXIT

# A step is evidence of a label's culprit when the culprit cost the job at least this
# share of that step (and MIN_GAP_MS): the label's own exit threshold, read per step, so
# an episode spans the steps on which the label would still hold.
EVIDENCE_SHARE = {
    INPUT_STRAGGLER: SKEW_EXIT,
    COMPUTE_STRAGGLER: SKEW_EXIT,
    STRAGGLER: SKEW_EXIT,
    INPUT_BOUND: INPUT_BOUND_EXIT,
    WAIT_HEAVY: WAIT_HEAVY_EXIT,
    PERIODIC_STALL: 0.0,  # its pricing counts only stalled steps: each one is evidence
}
# Steps without evidence that still join two runs of it into one episode: on a loaded
# machine a straggler's single step can come out short (the scheduler ran it first), and
# the label would not have left for it. A stall recurs with its period: any gap joins.
JOIN_GAP = 3
# Evidenced steps an episode needs: fewer are a few noisy steps, not what the medians saw.
MIN_EVIDENCE = 3
MIN_STALLS = 1  # each stall is a step the rule counted (it needs several in its window)


def evidence(label: str, job_ms: np.ndarray, saving_ms: np.ndarray) -> np.ndarray:
    """Per step, whether the culprit's cost in it is evidence of `label` (a bool array)."""
    share = EVIDENCE_SHARE.get(label)
    if share is None:
        return np.zeros(len(saving_ms), dtype=bool)
    floor = np.maximum(MIN_GAP_MS, share * np.nan_to_num(job_ms))
    return np.nan_to_num(saving_ms) >= np.maximum(floor, 1e-9)


def span(label: str, steps: np.ndarray, hot: np.ndarray, after: int
         ) -> tuple[int, int] | None:
    """The newest run of evidence on steps after `after`, as (first, last) step numbers:
    evidenced steps joined across at most JOIN_GAP steps without (any gap for periodic
    stalls); None without a run of MIN_EVIDENCE evidenced steps (MIN_STALLS stalls)."""
    stall = label == PERIODIC_STALL
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
