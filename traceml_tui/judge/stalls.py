"""The stall log: every rank's stalled steps over the whole run, whatever the window size.

A window holds 512 steps at small scale and 32 at 16,384 ranks (windows.window_steps_for):
a checkpoint every 200 steps leaves two stalls in it, one every 5,000 none, and a rule
that needs a rhythm inside the window never sees them. Stalls are rare events: they need
no window. `StallBook.add` is called on receipt of each stalled step (state.py compares
each record with the rank's stall threshold, one comparison per record); `StallBook.
findings` gives, per rank, the period and the time lost, which diagnosis.periodic_stall
judges and the summary's `stalls` section lists.

Memory, bounded per rank (docs/diagnosis.md, "Periodic stalls"): a rank's own stalls (a
phase other than `sync`) are kept newest-first up to STALL_LOG_KEEP in three numpy arrays
of 13 bytes per stall (step int64, excess float32, phase uint8), about 3.6 KB for a full
log; every stall, kept or not, is also counted with its excess, so the run's lost time is
exact after the oldest are dropped. A victim's stalls (the `sync` that waited for another
rank's stall) are only counted: at 16,384 ranks every rank but one is a victim of a
checkpoint, and their copies would say nothing the stalling rank's log does not. A rank
that never stalled costs nothing (no log); one that was only a victim about 100 bytes.
Worst case, every rank stalling on its own (evaluation on all ranks): 16,384 x 3.6 KB,
about 60 MB.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from traceml_agent.protocol import Heartbeat
from traceml_agent.vocab import SYNC, WAIT

# Periodic stalls are invisible to medians: a few stalled steps in a window of many move
# no median, yet each costs the whole job its length. A step is a stall when it takes at
# least STALL_FACTOR times the rank's typical (median) step and STALL_MIN_MS more: a
# doubled step is far outside a healthy job's step-to-step noise (a few percent), and the
# floor keeps timer noise of sub-millisecond steps out.
STALL_FACTOR = 2.0
STALL_MIN_MS = 5.0

# Own stalls kept per rank, newest: enough for a period to be measured from many gaps,
# and, at 10,000-step periods, a record of 2.5 million steps.
STALL_LOG_KEEP = 256
# A period needs at least this many stalls, and at least PERIOD_SHARE of the gaps between
# the kept ones within PERIOD_TOLERANCE (at least one step) of their median gap, which
# is at least MIN_PERIOD steps: a stretch of consecutive slow steps is a straggler's
# business, scheduler hiccups have no rhythm, and one stray hiccup (or one stall under
# the threshold, which doubles a gap) does not break a checkpoint's.
STALL_MIN_COUNT = 3
PERIOD_TOLERANCE = 0.2
PERIOD_SHARE = 0.75
MIN_PERIOD = 2
# A rhythm is still going while its rank's newest step is at most this many periods past
# its newest stall: a checkpoint every 200 steps that stopped 600 steps ago is over.
RECENT_PERIODS = 2.0
# A checkpoint's stalls are alike, and the scheduler's hiccups between them (a few tens of
# ms on a busy host) are smaller but break the rhythm of the whole set: when all the kept
# stalls have no period, the ones at least MAJOR_SHARE of the typical larger stall (the
# median, 75th and 90th percentile of their excess, in turn) are tried alone.
MAJOR_SHARE = 0.5
MAJOR_QUANTILES = (50, 75, 90)
# On a starved host the hiccups can outnumber the checkpoints ten to one (40 of 100 ms
# beside four 1 s ones, fresh-clone run 24): no quantile reaches the checkpoints. So the
# stalls above each break in their sizes (the next smaller under MAJOR_SHARE of the one
# above it, at least STALL_MIN_COUNT above) are tried alone too, the largest breaks first,
# at most MAX_BREAKS of them: a few fits per new stall.
MAX_BREAKS = 4
# Distinct phase names a log can code (a run has at most 24, state.MAX_RUN_PHASES).
MAX_PHASE_CODES = 255


def period(steps: np.ndarray | list[int]) -> int | None:
    """The period of recurring steps (ascending), when they recur regularly (PERIOD_*)."""
    fit = _fit(steps)
    return None if fit is None else fit[0]


def _fit(steps: np.ndarray | list[int]) -> tuple[int, float] | None:
    """(period, share of the gaps that keep it) when the steps recur regularly."""
    if len(steps) < STALL_MIN_COUNT:
        return None
    gaps = np.diff(np.asarray(steps, dtype=np.int64)).astype(np.float64)
    mid = float(np.median(gaps))
    if mid < MIN_PERIOD:
        return None
    share = float((np.abs(gaps - mid) <= max(1.0, PERIOD_TOLERANCE * mid)).mean())
    return (round(mid), share) if share >= PERIOD_SHARE else None


def rhythm(steps: np.ndarray, excess: np.ndarray) -> tuple[int, np.ndarray] | None:
    """The period of the kept stalls and which of them keep it (MAJOR_SHARE): all of them,
    or the larger ones when smaller hiccups fall between, whichever recur the more
    regularly (then the more of them); None without a rhythm. A hiccup between two
    checkpoints can pass the tolerance on the whole set with a wrong period (stalls at
    201, 401, 541, 601, 801: gaps 200, 140, 60, 200, median 170)."""
    every = np.ones(len(steps), bool)
    fit = _fit(steps)
    if fit is not None and fit[1] == 1.0:
        return fit[0], every  # every gap keeps it: nothing more regular to find
    best = None if fit is None else (fit[1], len(steps), fit[0], every)
    if len(excess) > STALL_MIN_COUNT:
        for floor in _floors(excess):
            keep = excess >= floor
            fit = _fit(steps[keep])
            n = int(keep.sum())
            if fit is not None and (best is None or (fit[1], n) > best[:2]):
                best = (fit[1], n, fit[0], keep)
    return None if best is None else (best[2], best[3])


def _floors(excess: np.ndarray) -> list[float]:
    """Excess floors that set the larger stalls apart from the smaller: MAJOR_SHARE of
    the MAJOR_QUANTILES, and each of the MAX_BREAKS widest breaks in their sizes."""
    floors = [float(f) for f in MAJOR_SHARE * np.percentile(excess, MAJOR_QUANTILES)]
    desc = np.sort(excess)[::-1]
    above, below = desc[STALL_MIN_COUNT - 1:-1], desc[STALL_MIN_COUNT:]
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(above > 0, below / above, 1.0)
    breaks = np.nonzero(ratio < MAJOR_SHARE)[0]
    widest = breaks[np.argsort(ratio[breaks], kind="stable")][:MAX_BREAKS]
    return floors + [float(above[i]) for i in widest]


@dataclass(frozen=True, slots=True)
class StallFinding:
    """One rank's stall record, as the rule and the summary read it. `kept_*`: over the
    kept (newest) own stalls; `count`, `lost_ms`: over the whole run."""

    rank: int
    count: int  # own stalls over the run
    lost_ms: float  # their excess over the rank's typical step, summed over the run
    kept: int  # of them, still in the log (the newest)
    period: int | None  # steps between them, None when they have no rhythm
    periodic: int  # of the kept stalls, those that keep the period (rhythm)
    periodic_ms: float  # their mean excess (of all kept stalls without a period)
    phase: str  # the phase holding most of them (`wait`: outside every phase)
    first_step: int  # the oldest of them
    last_step: int  # the newest of them
    span_share: float  # their excess after the oldest, over the time since it
    recent: bool  # the rhythm still goes on (RECENT_PERIODS)
    victim_count: int  # steps it waited in sync for another rank's stall
    victim_ms: float
    # The rank's newest heartbeat, the agent's evidence for the advice (advice.py): its
    # garbage-collection pauses and its DataLoader. None where not attached.
    heartbeat: Heartbeat | None = None

    @property
    def mean_ms(self) -> float:
        return self.lost_ms / self.count if self.count else 0.0

    @property
    def periodic_count(self) -> int:
        """The periodic stalls over the run: exact while the log dropped none, else their
        share of the kept ones applied to every stall counted."""
        if self.kept == self.count or not self.kept:
            return self.periodic
        return round(self.periodic * self.count / self.kept)


class _Shape(NamedTuple):
    """What a log's kept stalls say until the next stall (StallLog.shape)."""

    period: int | None
    periodic: int  # the stalls that keep it (all kept ones without a period)
    periodic_ms: float  # their mean excess
    phase: int  # the code of the phase most of them grew in
    first: int  # the oldest one's step
    last: int  # the newest one's step
    after_ms: float  # the excess of all but the oldest


class StallLog:
    """One rank's stalls (module docstring: what is kept, and its bytes)."""

    __slots__ = ("_step", "_excess", "_phase", "_next", "kept", "count", "lost_ms",
                 "victim_count", "victim_ms", "_shape", "_dirty")

    def __init__(self) -> None:
        self._step: np.ndarray | None = None  # allocated at the first own stall
        self._excess: np.ndarray | None = None
        self._phase: np.ndarray | None = None
        self._next = 0  # ring position of the next stall
        self.kept = 0
        self.count = 0
        self.lost_ms = 0.0
        self.victim_count = 0
        self.victim_ms = 0.0
        self._shape: _Shape | None = None
        self._dirty = False

    def add(self, step: int, excess_ms: float, code: int) -> None:
        if self._step is None or self._excess is None or self._phase is None:
            self._step = np.zeros(STALL_LOG_KEEP, np.int64)
            self._excess = np.zeros(STALL_LOG_KEEP, np.float32)
            self._phase = np.zeros(STALL_LOG_KEEP, np.uint8)
        i = self._next
        self._step[i], self._excess[i], self._phase[i] = step, excess_ms, code
        self._next = (i + 1) % STALL_LOG_KEEP
        self.kept = min(STALL_LOG_KEEP, self.kept + 1)
        self.count += 1
        self.lost_ms += excess_ms
        self._dirty = True

    def ordered(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The kept stalls, oldest first: (steps, excess ms, phase codes)."""
        if self._step is None or self._excess is None or self._phase is None:
            empty = np.zeros(0)
            return empty.astype(np.int64), empty.astype(np.float32), empty.astype(np.uint8)
        if self.kept < STALL_LOG_KEEP:
            return (self._step[:self.kept], self._excess[:self.kept],
                    self._phase[:self.kept])
        order = np.roll(np.arange(STALL_LOG_KEEP), -self._next)
        return self._step[order], self._excess[order], self._phase[order]

    def shape(self) -> _Shape:
        """The kept stalls' rhythm and its stalls, recomputed only after a new stall: an
        evaluation at 16,384 stalling ranks then costs a few attribute reads per rank."""
        if self._dirty or self._shape is None:
            steps, excess, codes = self.ordered()
            found = rhythm(steps, excess)
            every = None if found is None else found[0]
            if found is not None:  # the periodic ones: a checkpoint's, without the hiccups
                keep = found[1]
                steps, excess, codes = steps[keep], excess[keep], codes[keep]
            self._shape = _Shape(every, len(steps), float(excess.mean()),
                                 int(np.argmax(np.bincount(codes))), int(steps[0]),
                                 int(steps[-1]), float(excess[1:].sum()))
            self._dirty = False
        return self._shape

    @property
    def nbytes(self) -> int:
        arrays = (self._step, self._excess, self._phase)
        return sum(a.nbytes for a in arrays if a is not None)


class StallBook:
    """Every rank's stall log, and the phase names their codes stand for."""

    def __init__(self) -> None:
        self.logs: dict[int, StallLog] = {}
        self.stalling: set[int] = set()  # the ranks with own stalls (findings reads these)
        self.names: list[str] = []
        self._codes: dict[str, int] = {}

    def add(self, rank: int, step: int, excess_ms: float, phase: str) -> None:
        """One stalled step of `rank`: logged when its own work grew, counted when it only
        waited in sync (a victim)."""
        log = self.logs.get(rank)
        if log is None:
            log = self.logs[rank] = StallLog()
        if phase == SYNC:
            log.victim_count += 1
            log.victim_ms += excess_ms
            return
        code = self._codes.get(phase)
        if code is None:
            if len(self.names) >= MAX_PHASE_CODES:
                return  # unreachable with state.MAX_RUN_PHASES; bounded regardless
            code = self._codes[phase] = len(self.names)
            self.names.append(phase)
        log.add(step, excess_ms, code)
        self.stalling.add(rank)

    def forget(self, rank: int) -> None:
        """A restarted rank numbers its steps afresh: its old stalls are another process's."""
        self.logs.pop(rank, None)
        self.stalling.discard(rank)

    def finding(self, rank: int, typical_ms: float | None, last_step: int
                ) -> StallFinding | None:
        """What the log of `rank` says, given its typical step now and its newest step;
        None without own stalls or a typical step."""
        log = self.logs.get(rank)
        if log is None or log.count == 0 or typical_ms is None or not typical_ms > 0:
            return None
        sh = log.shape()
        span_ms = max(0, last_step - sh.first) * typical_ms + sh.after_ms
        recent = sh.period is not None and last_step - sh.last <= RECENT_PERIODS * sh.period
        return StallFinding(rank, log.count, log.lost_ms, log.kept, sh.period, sh.periodic,
                            sh.periodic_ms, self.names[sh.phase], sh.first, sh.last,
                            sh.after_ms / span_ms if span_ms > 0 else 0.0, recent,
                            log.victim_count, log.victim_ms)

    def nbytes(self) -> int:
        """The logs' array bytes (the bound the docstring states, measured)."""
        return sum(log.nbytes for log in self.logs.values())


@dataclass(frozen=True, slots=True)
class Stall:
    """One stalled step of one rank: how much longer than typical, and the phase that
    holds most of that excess ("sync" on a rank that only waited for another)."""

    step: int
    excess_ms: float
    phase: str


def stall_threshold(typical_ms: float | None) -> float | None:
    """The step time from which a step of this rank is a stall (None: not yet known)."""
    if typical_ms is None or not typical_ms > 0:
        return None
    return max(STALL_FACTOR * typical_ms, typical_ms + STALL_MIN_MS)


def stall_thresholds(typical_ms: np.ndarray) -> np.ndarray:
    """`stall_threshold` of many ranks' typical steps at once (NaN: not yet known)."""
    with np.errstate(invalid="ignore"):
        known = typical_ms > 0
    return np.where(known, np.maximum(STALL_FACTOR * typical_ms, typical_ms + STALL_MIN_MS),
                    np.nan)


def stall_of(step: int, step_ms: float, typical_ms: float, names: Sequence[str],
             values: Sequence[float | None], typical: Mapping[str, float | None]) -> Stall:
    """The stall in one step: its excess over the typical step, and the phase whose time
    grew the most over its own median (an unmeasured phase grows by nothing)."""
    best, grew = WAIT, float("-inf")
    for name, value in zip(names, values, strict=False):
        if value is None:
            continue
        extra = value - (typical.get(name) or 0.0)
        if extra > grew:
            best, grew = name, extra
    return Stall(step, step_ms - typical_ms, best)
