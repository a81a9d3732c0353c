"""The run's timeline: its episodes (each label shown, and when), what each one's culprit
cost, the live what-if of the label on display, and the time chart's history.

RunState (state.py) decides what is shown; the timeline records it. An episode with a
culprit is dated by its evidence (episodes.py), so opening or closing one reads the
ranks' windows lined up by step: the state hands a reader of them in (`Aligned`), and
the timeline never sees a rank. Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import replace

import numpy as np

from traceml_agent.vocab import LOCAL_PHASES, WARMUP_STEPS

from . import cost, episodes
from . import diagnosis as dx
from .history import History, StepClock, point
from .snapshot import Episode
from .timings import Timings
from .windows import AlignedSteps, nan_medians

LIVE_STEPS = dx.LIVE_WINDOW_STEPS
MAX_EPISODES = 500

# The ranks' windows lined up by step: (the newest steps wanted, whether the values the
# evaluation's refresh gathered may serve) -> the data, None when no step is common.
Aligned = Callable[[int, bool], AlignedSteps | None]


class Timeline:
    """Episodes, their cost and the history of one attempt of a run (bounded)."""

    def __init__(self, started_at: float, window_steps: int) -> None:
        self.started_at = started_at
        self.window_steps = window_steps
        self.episodes: deque[Episode] = deque(maxlen=MAX_EPISODES)
        self.history = History()  # step and own work over the run, for the time chart
        self.clock = StepClock()  # when each step was taken (episodes dated by steps)
        self.live_since = started_at
        # The newest step counted into the open episode's lost time (cost.py), the open
        # episode's diagnosis, and the live what-if of the label on display.
        self.lost_mark = -1
        self.episode_dx: dx.Diagnosis | None = None
        self.what_if: cost.WhatIf | None = None
        # What the what-if was last computed for (label, rank, node, phase), and how many
        # evaluations ago: past ~2,000 ranks it is refreshed on a slower cadence.
        self.what_if_key: tuple[object, ...] | None = None
        self.what_if_age = 0
        self.cause_wins = 0  # evaluations in a row the shown cause differed from the open one

    # A sequence of its episodes, oldest first.
    def __len__(self) -> int:
        return len(self.episodes)

    def __iter__(self) -> Iterator[Episode]:
        return iter(self.episodes)

    def __getitem__(self, i: int) -> Episode:
        return self.episodes[i]

    def close_attempt(self, newest: int, t: float) -> tuple[Episode, ...]:
        """torchrun restarted the group: the open episode closes at the attempt's last
        step, and the attempt's episodes are handed back for its record (attempts.py).
        The next attempt numbers its steps from 0 again: its episodes, cost marks and
        step clock start afresh; the history (time since the run began) goes on."""
        last = self.episodes[-1] if self.episodes else None
        if last is not None and last.end is None:
            self.episodes[-1] = last.closed(min(self.clock.time_of(newest, t), t),
                                            max(last.start_step, newest))
        kept = tuple(self.episodes)
        self.episodes.clear()
        self.episode_dx, self.lost_mark = None, -1
        self._drop_what_if()
        self.clock = StepClock()
        return kept

    # --- each evaluation ----------------------------------------------------------------

    def add_history(self, now: float, timings: Timings) -> None:
        """The tick's point of the time chart, from the ranks past warm-up."""
        past = timings.select((timings.steps >= dx.MIN_STEPS) & ~np.isnan(timings.step_ms))
        if len(past):
            own, has = past.group(LOCAL_PHASES)
            self.history.add(point(now - self.started_at, past.step_ms, own[has]))

    def count_cost(self, shown: dx.Diagnosis, newest: int, ranks: int, read: Aligned,
                   fsdp: bool) -> None:
        """What the shown problem cost in the steps taken since the last evaluation (step
        by step, cost.py), added to the open episode; and its live what-if over the newest
        LIVE_STEPS steps, computed afresh every cost.what_if_every evaluations (each one
        below ~2,000 ranks; between, only the fresh steps are read, and the view says how
        often it is refreshed). Steps that left the window uncounted (evaluation backed off
        longer than a window) are counted at the mean of the counted ones."""
        last = self.episodes[-1] if self.episodes else None
        if last is None or last.end is not None or shown.label not in cost.COSTED_LABELS:
            self._drop_what_if()
            return
        fresh = newest - self.lost_mark
        every = cost.what_if_every(ranks, LIVE_STEPS)
        key = (shown.label, shown.rank, shown.node, shown.phase)
        self.what_if_age += 1
        due = key != self.what_if_key or self.what_if_age >= every
        if due:
            self.what_if_key, self.what_if_age = key, 0
            want = max(LIVE_STEPS, fresh)
        elif fresh > 0:
            want = max(cost.MIN_STEPS, fresh)  # as many as the what-if's read would count
        else:
            return  # nothing taken since, and the what-if is recent enough
        data = read(cost.steps_to_read(ranks, self.window_steps, want), True)
        saved = None if data is None else cost.savings(shown, data, fsdp)
        if data is None or saved is None:
            if due:
                self.what_if = None
            return
        if due:
            self.what_if = cost.summarize(shown, saved, LIVE_STEPS, every, ranks)
        lost_ms, counted = saved.lost_ms_after(self.lost_mark)
        end = int(saved.steps[-1])
        missed = max(0, end - self.lost_mark - counted)
        if counted:
            lost_ms += missed * lost_ms / counted
        self.lost_mark = max(self.lost_mark, end)
        if lost_ms > 0:
            self.episodes[-1] = replace(last, lost_s=(last.lost_s or 0.0) + lost_ms / 1000.0)

    def _drop_what_if(self) -> None:
        """No live what-if; the next one is computed at once."""
        self.what_if, self.what_if_key = None, None

    # --- episodes -----------------------------------------------------------------------

    def cause_changed(self, shown: dx.Diagnosis) -> bool:
        """Whether the shown label, about the open episode's culprit, has held another
        cause (Diagnosis.cause) for CAUSE_CONFIRM_TICKS evaluations in a row: a rank slowed
        first by its own work, then by its cores (or the other way) is two episodes,
        each with its advice. A cause that comes and goes with the CPU wait's noise is not."""
        opened = self.episode_dx
        if opened is None or opened.subject != shown.subject or opened.cause == shown.cause:
            self.cause_wins = 0
            return False
        self.cause_wins += 1
        return self.cause_wins >= dx.CAUSE_CONFIRM_TICKS

    def evidence(self, d: dx.Diagnosis, ranks: int, read: Aligned, fsdp: bool
                 ) -> tuple[cost.Savings, np.ndarray, np.ndarray] | None:
        """What `d`'s culprit cost step by step over the ranks' windows (as far as
        cost.steps_to_read lets a large job read back), and the steps that are its
        evidence (episodes.py): (savings, steps, evidence)."""
        if d.label not in cost.COSTED_LABELS or not ranks:
            return None
        data = read(cost.steps_to_read(ranks, self.window_steps, self.window_steps), False)
        saved = None if data is None else cost.savings(d, data, fsdp)
        if data is None or saved is None:
            return None
        gap = episodes.own_gap(d, data, fsdp)
        if gap is None:
            hot = episodes.evidence(d.label, saved.job_ms, saved.saving_ms, d.gap_ms)
            return saved, saved.steps, hot
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN steps: no value
            job = nan_medians(data.step_ms)
        return saved, data.steps, episodes.evidence(d.label, job, gap, d.gap_ms)

    def new_episode(self, d: dx.Diagnosis, now: float, newest: int, attempt: int,
                    ranks: int, read: Aligned, fsdp: bool) -> None:
        """Close the open episode and open one for `d`. An episode with a culprit is
        dated by its evidence (episodes.py): it starts at the first step of the newest
        run of steps in which the culprit cost the job a material share, and the open
        one ends at its last such step; the lost time is priced over exactly those
        steps. Episodes the new one's evidence covers whole (the COMM-BOUND its victims
        showed while the straggler was not yet confirmed) were its own symptom: they go,
        and one it covers in part ends where it begins."""
        step = max(0, newest)
        last = self.episodes[-1] if self.episodes else None
        floor = WARMUP_STEPS - 1  # new evidence starts after every dated episode's end
        if last is not None and last.end is None:
            end_step = step
            if last.dated and self.episode_dx is not None:
                end_step = self._close_dated(last, self.episode_dx, step, ranks, read, fsdp)
            end = self.clock.time_of(end_step, now) if last.dated else now
            self.episodes[-1] = replace(last.closed(min(end, now), end_step),
                                        cleared_step=newest)
        for e in self.episodes:
            if e.dated or e.label == dx.HANG:
                floor = max(floor, e.end_step if e.end_step is not None else step)
        start, dated, lost, mark = step, False, None, newest
        seen = None if d.label == dx.HANG else self.evidence(d, ranks, read, fsdp)
        if seen is not None:
            saved, steps, hot = seen
            found = episodes.span(d.label, steps, hot, floor)
            if found is not None:
                # Priced from its first step to the newest step every rank has sent.
                start, dated, mark = found[0], True, int(saved.steps[-1])
                lost = episodes.lost_ms(saved.steps, saved.saving_ms, start, mark) / 1000.0
        if not dated and d.label != dx.HANG:
            self._drop_symptom()
            cause = self.episodes[-1] if self.episodes else None
            if cause is not None and cause.dated and cause.end_step is not None:
                # After a dated episode, what follows starts where its evidence ended.
                start = min(step, cause.end_step + 1)
        if dated or start < step:
            # Only evidence that reaches back covers earlier episodes: a label named on
            # the newest step (a HANG: no step since) leaves the one before it whole.
            self._fold(start)
        self.live_since = now
        self.lost_mark = mark
        self.episode_dx = d
        self.cause_wins = 0
        at = self.clock.time_of(start, now) if start != step else now
        self.episodes.append(Episode(d.label, d.rank, d.phase, d.severity, min(at, now), None,
                                     start, None, d.summary, d.node, lost_s=lost or None,
                                     dated=dated, named_step=newest, attempt=attempt))

    def reopen(self, label: str, since: float | None) -> None:
        """The newest episode of `label` that began at `since` is open to the end again,
        and the episodes after it go: a hang the run's stop ended (state.py,
        keep_latched_hang) is the record's last word, not its aftermath."""
        self._drop_what_if()
        kept = list(self.episodes)
        starts = [i for i, ep in enumerate(kept) if ep.label == label and ep.start == since]
        if starts:
            for _ in range(len(kept) - starts[-1] - 1):
                self.episodes.pop()
            self.episodes[-1] = replace(self.episodes[-1], end=None, end_step=None)

    def _close_dated(self, e: Episode, d: dx.Diagnosis, step: int, ranks: int,
                     read: Aligned, fsdp: bool) -> int:
        """Where the open dated episode `e` ends: its last step of evidence (the newest
        step if it has left the window), with its lost time brought to exactly its steps
        (evaluations counted it up to the last one's newest step)."""
        seen = self.evidence(d, ranks, read, fsdp)
        if seen is None:
            return step
        saved, steps, hot = seen
        end = episodes.last_evidence(d.label, steps, hot, e.start_step - 1)
        if end is None:
            return step
        mark = self.lost_mark
        extra = (episodes.lost_ms(saved.steps, saved.saving_ms, mark + 1, end)
                 - episodes.lost_ms(saved.steps, saved.saving_ms, end + 1, mark))
        if extra:
            self.episodes[-1] = replace(self.episodes[-1], lost_s=max(
                0.0, (self.episodes[-1].lost_s or 0.0) + extra / 1000.0))
        return end

    def _drop_symptom(self) -> None:
        """The episode just closed goes when it had no culprit of its own, was named
        from a window (LIVE_STEPS) mostly made of the dated episode's steps before it,
        and left once that window could hold none of them (LIVE_STEPS, plus the delay
        with which the live label left the dated episode): the COMM-BOUND a straggler's
        victims still show in their window after the straggler was cleared is that
        episode's evidence, not a label of its own. One that lasted longer stays."""
        if len(self.episodes) < 2:
            return
        sym, cause = self.episodes[-1], self.episodes[-2]
        if (sym.dated or sym.label == dx.HANG or not cause.dated or cause.end_step is None
                or sym.named_step is None or sym.cleared_step is None):
            return
        lag = max(0, (cause.cleared_step or cause.end_step) - cause.end_step)
        if (sym.named_step - LIVE_STEPS // 2 <= cause.end_step
                and sym.cleared_step - sym.named_step <= LIVE_STEPS + lag):
            self.episodes.pop()

    def _fold(self, start: int) -> None:
        """Episodes wholly on or after `start` that are not dated (nor a hang) go: the
        new episode's evidence covers them. The one before ends before `start`."""
        while (self.episodes and not self.episodes[-1].dated
               and self.episodes[-1].label != dx.HANG
               and self.episodes[-1].start_step >= start):
            self.episodes.pop()
        last = self.episodes[-1] if self.episodes else None
        if last is not None and last.end_step is not None and last.end_step >= start:
            end_step = max(last.start_step, start - 1)
            end = last.end if last.end is None else min(
                last.end, self.clock.time_of(end_step, last.end))
            self.episodes[-1] = replace(last, end=end, end_step=end_step)
