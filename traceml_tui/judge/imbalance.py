"""Who is slowest, step by step: one rank that is always behind, or imbalance that moves.

The window rules compare each rank's median over its window. A rank behind on most steps
moves its median; so does a streak of a random draw when the slowest rank changes from
step to step (length-bucketed batches: each step another rank gets the long sequences).
On such a 4-rank job the rules named one rank COMPUTE STRAGGLER from an early streak and
the run ended COMM-BOUND: the others' wait for whichever rank was slowest read as the
network's, and the user would have chased a healthy rank, then a healthy network.

So the rules also read the ranks' windows lined up step by step (windows.AlignedSteps):
on each step, how far each rank's own work (a group of local phases; sync is left out,
as everywhere) is from the other ranks' median; how often a rank is behind (a fixed
culprit is behind on almost every step, any rank of a moving imbalance on about half);
how much the job loses per step to whichever rank is slowest; and how noisy the gaps
are from step to step. Pure functions over arrays: no I/O, no clock.
docs/diagnosis.md ("Fixed culprit or moving imbalance") gives the thresholds' reasons.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from traceml_agent.vocab import SYNC

from .windows import AlignedSteps, nan_medians, rolling_median

# Steps the comparison needs: fewer, and a share of steps says little (the rules' own
# MIN_STEPS; a fixed culprit's streak needs as many).
MIN_STEPS = 8
# A fixed culprit is behind the other ranks' median on more steps than the average rank
# is, by at least BEHIND_LEAD of the steps, and by BEHIND_Z standard deviations of
# the rank's share over the steps read (a binomial's at most, 0.5 / sqrt(steps); the
# median of the other ranks' shares moves far less). In an imbalance
# that moves every rank is behind about as often as the others (about half the steps),
# a fixed culprit on almost all of them: a lead of 0.3 is met by a rank whose gap equals
# the gaps' step-to-step noise (behind on 84 %, the others on about 45 %).
BEHIND_LEAD = 0.30
BEHIND_HOLD = 0.20  # while the straggler is shown: a noisier stretch does not drop it
BEHIND_Z = 2.5
BEHIND_Z_HOLD = 1.5
# Up to this many ranks each rank is compared with the median of the others; beyond, with
# the median of all (one rank moves it by nothing, and a loop per rank would cost).
EXACT_OTHERS = 64
# A gap between the exit and the enter share (6-10 % of the step) is named when it is
# measured steady: at least NOISE_Z standard errors of its median (from the gaps'
# step-to-step spread) and the rank a fixed culprit. The share alone decided before, so
# one straggler's 9 % read BALANCED on a quiet machine and COMPUTE STRAGGLER on a busy
# one; what tells a real gap from noise is the noise, which is measured here.
NOISE_Z = 4.0
# A clear straggler is named from its newest steps before the window's medians move:
# the same rank the slowest on each of the newest STREAK_STEPS steps, behind the other
# ranks' median by STREAK_SHARE of the job's step on every one of them. A streak must
# last STREAK_MIN_S too: a descheduled rank on a busy host loses a few fast steps in a
# row, and with fast steps the window's medians name a straggler within a second anyway.
STREAK_STEPS = 8
STREAK_SHARE = 0.25
STREAK_MIN_S = 2.0
# ... and on every one of those steps by at least this: half of STREAK_SHARE. A rank the
# slowest on every step and a quarter of the step behind on a typical one is the clear
# straggler; requiring the quarter on every step let one neighbour's slow step (a core
# lost to a busy process for 85 ms of a 460 ms step) restart the count: named 15 steps
# after its onset, not 8 (fresh-clone run 46, beside a CPU hog).
STREAK_FLOOR = 0.125
# Steps short of half the gap that do not end the run of evidence a straggler's age is
# counted over (episodes.py's JOIN_GAP: on a noisy job one step comes out short).
SEEN_JOIN = 3
SEEN_SMOOTH = 7  # and after a running median of 7 steps (episodes.py's SMOOTH_STEPS)
# The ranks counted "the slowest" on a step: the slowest one up to 4 ranks, the slowest
# quarter beyond (at thousands of ranks the single slowest of each step is noise).
SLOWEST_QUARTER = 4
# A step's spread: the p95 of the ranks' own work over its median (nearest rank).
SPREAD_Q = 0.95


def _steady_columns(data: AlignedSteps) -> np.ndarray:
    """The steps every rank measured (a step some rank did not send says nothing)."""
    return ~np.isnan(data.step_ms).any(axis=0)


def own_work(data: AlignedSteps, phases: Sequence[str]) -> np.ndarray | None:
    """Per rank and step, the sum of a group's measured phases (an unmeasured phase adds
    nothing); None when no rank measured any of them."""
    arrays = [data.phase_ms[p] for p in phases if p in data.phase_ms]
    if not arrays:
        return None
    total = np.zeros_like(data.step_ms)
    for a in arrays:
        total += np.nan_to_num(a)
    return total


@dataclass(frozen=True, slots=True)
class StepSpread:
    """Every rank's own work in a group of phases, step by step, over the steps every
    rank measured, and what the rules read of it."""

    phases: tuple[str, ...]
    ranks: np.ndarray  # (n,) rank numbers, one per row
    steps: np.ndarray  # (T,) step numbers, oldest first
    own: np.ndarray  # (n, T) own work (ms)
    job_ms: np.ndarray  # (T,) the median rank's step
    sync: np.ndarray | None = field(repr=False)  # (n, T) exposed collective wait (ms)
    # The aligned phases and the steps kept of them: `per_phase` is read by one rule
    # only, and copying every phase of every rank each evaluation was ~2 % of the
    # collector's CPU at 16,384 ranks.
    _phase_ms: Mapping[str, np.ndarray] = field(repr=False, compare=False)
    _keep: np.ndarray = field(repr=False, compare=False)
    # What the rules asked already (medians, a rank's gaps, who is behind): each is a
    # sort of (ranks, steps) values, asked by several rules of one evaluation.
    _memo: dict[object, np.ndarray] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def of(cls, data: AlignedSteps, phases: Sequence[str]) -> StepSpread | None:
        if len(data.ranks) < 2:
            return None
        keep = _steady_columns(data)
        if int(keep.sum()) < MIN_STEPS:
            return None
        own = own_work(data, phases)
        if own is None:
            return None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            job = nan_medians(data.step_ms[:, keep])
        sync = data.phase_ms[SYNC][:, keep] if SYNC in data.phase_ms else None
        return cls(tuple(phases), data.ranks, data.steps[keep], own[:, keep], job, sync,
                   data.phase_ms, keep)

    def per_phase(self) -> dict[str, np.ndarray]:
        """Each measured phase of the group: phase -> (n, T) ms (unmeasured: 0)."""
        return {p: np.nan_to_num(self._phase_ms[p][:, self._keep]) for p in self.phases
                if p in self._phase_ms}

    # --- per step ------------------------------------------------------------------

    def medians(self) -> np.ndarray:
        """Per step, the median rank's own work."""
        if "medians" not in self._memo:
            self._memo["medians"] = nan_medians(self.own)
        return self._memo["medians"]

    def excess_ms(self) -> np.ndarray:
        """Per step, what the slowest rank's own work exceeds the median rank's by: what
        every rank waits for in that step's collective (the job's loss to imbalance,
        with every rank at the median's own work)."""
        return self.own.max(axis=0) - self.medians()

    def gaps(self, row: int) -> np.ndarray:
        """Per step, one rank's own work less the median of the other ranks' (past
        EXACT_OTHERS ranks, the median of all: one rank moves it by nothing)."""
        key = ("gaps", row)
        if key not in self._memo:
            others = (self.medians() if len(self.ranks) > EXACT_OTHERS
                      else nan_medians(np.delete(self.own, row, axis=0)))
            self._memo[key] = self.own[row] - others
        return self._memo[key]

    def behind(self) -> np.ndarray:
        """Per rank and step, whether its own work exceeds the other ranks' median (past
        EXACT_OTHERS ranks, the median of all: one rank moves it by nothing)."""
        if "behind" not in self._memo:
            n = len(self.ranks)
            self._memo["behind"] = (self.own > self.medians()[None, :] if n > EXACT_OTHERS
                                    else np.stack([self.gaps(i) > 0 for i in range(n)]))
        return self._memo["behind"]

    def row(self, rank: int) -> int | None:
        hit = np.flatnonzero(self.ranks == rank)
        return int(hit[0]) if len(hit) else None

    # --- who is slowest ----------------------------------------------------------

    @property
    def top(self) -> int:
        """How many ranks count as the slowest on a step (SLOWEST_QUARTER)."""
        n = len(self.ranks)
        return 1 if n <= SLOWEST_QUARTER else math.ceil(n / 4)

    @property
    def fair(self) -> float:
        """The share of steps a rank is among the slowest when nothing sets it apart."""
        return self.top / len(self.ranks)

    def slowest_shares(self) -> np.ndarray:
        """Per rank, the share of steps on which it was among the `top` slowest, ties to
        all of them; a step whose slowest is no slower than its median counts for none."""
        n = len(self.ranks)
        kth = np.partition(self.own, n - self.top, axis=0)[n - self.top]
        hot = (self.own >= kth[None, :]) & (self.own > self.medians()[None, :])
        return hot.sum(axis=1) / len(self.steps)

    def behind_share(self, rank: int, last: int | None = None) -> float | None:
        """The share of steps (of the newest `last`) on which the rank's own work exceeds
        the others' median."""
        i = self.row(rank)
        if i is None:
            return None
        behind = self.gaps(i) > 0
        return float(behind[-(last or len(behind)):].mean())

    def fixed(self, rank: int, holding: bool = False) -> bool:
        """Whether the rank is a fixed culprit: behind the others' median on a share of
        the steps that exceeds the average rank's share by BEHIND_LEAD (BEHIND_HOLD
        while its label is shown) and by chance's margin over that many steps; over all
        the steps compared or over their newer half (a straggler that began mid-window
        moves the window's median once it holds half of it). In an imbalance that moves,
        every rank is behind about as often as the others."""
        i = self.row(rank)
        if i is None:
            return False
        lead, z = (BEHIND_HOLD, BEHIND_Z_HOLD) if holding else (BEHIND_LEAD, BEHIND_Z)
        behind = self.behind()
        n = len(self.steps)
        for last in (n, max(MIN_STEPS, n // 2)):
            shares = behind[:, -last:].mean(axis=1)
            # The average includes the rank itself: its lead over the others' average is
            # n/(n-1) times this, and that is what BEHIND_LEAD bounds.
            scale = (len(shares) - 1) / len(shares)
            if shares[i] - float(shares.mean()) >= max(lead * scale, z * 0.5 / math.sqrt(last)):
                return True
        return False

    def fixed_culprit(self) -> int | None:
        """The rank behind the others most often, where it is a fixed culprit (`fixed`):
        then the spread is one straggler's, not an imbalance that moves."""
        shares = self.behind().mean(axis=1)
        top = int(self.ranks[np.lexsort((self.ranks, -shares))[0]])
        return top if self.fixed(top) else None

    def steady(self, rank: int, gap_ms: float) -> bool:
        """Whether a gap is NOISE_Z standard errors of the median of the rank's per-step
        gaps (1.2533 x the gaps' robust sd / sqrt(steps): the median's standard error)."""
        i = self.row(rank)
        if i is None:
            return False
        d = self.gaps(i)
        mad = float(np.median(np.abs(d - np.median(d))))
        se = 1.2533 * 1.4826 * mad / math.sqrt(len(d))
        return gap_ms >= NOISE_Z * se

    def seen_for(self, rank: int, gap_ms: float) -> tuple[int, float]:
        """How long the rank has been behind: its newest run of steps behind by at least
        half the gap (after a running median of SEEN_SMOOTH steps), a stretch of up to
        SEEN_JOIN steps short of it not ending it: (steps, seconds of the job's steps)."""
        i = self.row(rank)
        if i is None or not gap_ms > 0:
            return 0, 0.0
        hot = rolling_median(self.gaps(i), SEEN_SMOOTH) >= 0.5 * gap_ms
        start, cold = len(hot), 0
        for j in range(len(hot) - 1, -1, -1):
            if hot[j]:
                start, cold = j, 0
            else:
                cold += 1
                if cold > SEEN_JOIN:
                    break
        n = len(hot) - start
        return n, float(self.job_ms[start:].sum()) / 1000.0

    def streak(self) -> tuple[int, float] | None:
        """(rank, gap ms): the rank the slowest on each of its newest steps, behind the
        others' median by STREAK_SHARE of the job's step on a typical one and STREAK_FLOOR
        on every one, for at least STREAK_STEPS steps and STREAK_MIN_S seconds; None
        otherwise."""
        job = float(np.median(self.job_ms))
        if not job > 0:
            return None
        need = max(STREAK_STEPS, math.ceil(STREAK_MIN_S * 1000.0 / job))
        if need > len(self.steps):
            return None
        newest = self.own[:, -need:]
        who = np.argmax(newest, axis=0)
        if not (who == who[0]).all():
            return None
        i = int(who[0])
        gaps = self.gaps(i)[-need:]
        with np.errstate(divide="ignore", invalid="ignore"):  # a 0 ms step: no share
            share = gaps / self.job_ms[-need:]
        # A quarter of the step on a typical one of them and half that on every one: a
        # bystander's own slow step (descheduled on a busy host) narrows one step's gap
        # and, required on every step, restarted the count (fresh-clone run 46).
        if not ((share >= STREAK_FLOOR).all() and float(np.median(share)) >= STREAK_SHARE):
            return None
        return int(self.ranks[i]), float(np.median(gaps))

    # --- the job-wide picture ----------------------------------------------------

    def spread(self) -> float:
        """The median over steps of p95/median of the ranks' own work (1.0: even)."""
        n = len(self.ranks)
        ordered = np.sort(self.own, axis=0)
        p95 = ordered[max(0, math.ceil(SPREAD_Q * n) - 1)]
        mid = self.medians()
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(mid > 0, p95 / mid, np.nan)
        ratio = ratio[np.isfinite(ratio)]
        return float(np.median(ratio)) if len(ratio) else 1.0

    def widest_phase(self) -> str | None:
        """The phase of the group in which the slowest rank of each step is furthest from
        the median, on average: where the imbalance is."""
        who = np.argmax(self.own, axis=0)
        cols = np.arange(len(self.steps))
        best, most = None, -math.inf
        for p, ms in self.per_phase().items():
            extra = float((ms[who, cols] - nan_medians(ms)).mean())
            if extra > most:
                best, most = p, extra
        return best

    def unexplained_sync(self) -> np.ndarray | None:
        """Per rank, the mean of its exposed collective wait (sync) beyond what it waited
        for the slowest rank's own work in each step: what the network, not the other
        ranks' work, holds it for. None where sync was not measured."""
        if self.sync is None:
            return None
        explained = self.own.max(axis=0)[None, :] - self.own
        return np.maximum(0.0, np.nan_to_num(self.sync) - explained).mean(axis=1)


class Spreads:
    """The per-step comparisons of one evaluation, built when a rule first asks (an
    evaluation whose rules never need them gathers nothing) and kept for the others."""

    __slots__ = ("_source", "_data", "_made")

    def __init__(self, source: AlignedSteps | Callable[[], AlignedSteps | None] | None) -> None:
        self._source = source
        self._data: AlignedSteps | None = None
        self._made: dict[tuple[str, ...], StepSpread | None] = {}

    def data(self) -> AlignedSteps | None:
        if callable(self._source):
            self._source = self._source()
        return self._source

    def of(self, phases: Sequence[str]) -> StepSpread | None:
        key = tuple(phases)
        if key not in self._made:
            data = self.data()
            self._made[key] = None if data is None else StepSpread.of(data, key)
        return self._made[key]
