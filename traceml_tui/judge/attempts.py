"""The attempts of a job that torchrun restarts (`--max-restarts`): each one's record.

Under torchrun's elastic agent a rank that fails makes torchrun stop the whole group and
start it again; every worker of the new group is a new process whose step numbers start
again at 0, and whose environment says which attempt it is (TORCHELASTIC_RESTART_COUNT,
sent in its hello). Without a record per attempt the run's record would keep only the
last one: the first attempt's steps, the rank that failed and its exception gone, and a
timeline episode running from one attempt's step 39 to the next one's step 0.

`AttemptBook` holds what RunState needs for that: when a hello names a newer attempt,
RunState closes the current attempt here (its steps per rank, its last verdict, its
episodes, the ranks that failed with their exit code and error) and opens the next one.
Numbers are 1-based (torchrun's restart count + 1): "attempt 1" is the first. Pure state,
no clock: times come in from the caller (hellos' and goodbyes' own times, the
evaluation's wall time).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .diagnosis import Diagnosis
from .snapshot import Episode

# Attempts kept whole: the first (what failed first) and the newest ones. A job restarted
# thousands of times (a crash loop under a high --max-restarts) keeps a bounded record;
# the attempts between are counted (`dropped`).
MAX_ATTEMPTS_KEPT = 16
# Episodes kept of a closed attempt (its newest): a closed attempt's timeline is history.
MAX_ATTEMPT_EPISODES = 100
# How long after a rank's failure hang detection waits for the restarted group to step,
# while restarts remain: torchrun stops the survivors, waits for its rendezvous and starts
# every worker again (imports, model build, process group) before the first step. A new
# group that never steps in this long is a hang again.
RESTART_WAIT_S = 300.0


@dataclass(frozen=True, slots=True)
class RankEnd:
    """A rank that ended an attempt with a non-zero exit: its goodbye."""

    rank: int
    exit_code: int
    error: str | None
    step: int  # the step it was in (its steps taken before it, numbered from 0)
    at: float  # its goodbye's time (the rank's clock): who failed first


@dataclass(frozen=True, slots=True)
class Attempt:
    number: int  # 1-based: torchrun's restart count + 1
    started_at: float | None  # its first hello's time (None: before the collector heard)
    ended_at: float | None  # None: the attempt still running (the last one)
    rank_steps: tuple[tuple[int, int], ...]  # (rank, steps) of the ranks it heard from
    verdict: Diagnosis | None  # the live verdict when it ended
    episodes: tuple[Episode, ...]
    failures: tuple[RankEnd, ...]  # first failure first
    # From its first failure to the next attempt's first step: what the restart cost
    # (None: not restarted, or the next attempt never stepped).
    restart_s: float | None = None
    # (rank, step) of its ranks that ended without a goodbye: killed by a signal (SIGKILL,
    # the OOM killer), or stopped by torchrun after another rank failed (its SIGTERM ends
    # a Python process without a word). Which of them came first cannot be told.
    silent: tuple[tuple[int, int], ...] = ()

    @property
    def steps(self) -> int:
        return sum(n for _, n in self.rank_steps)


class AttemptBook:
    def __init__(self, max_restarts: int = 0) -> None:
        self.max_restarts = max_restarts
        self.number = 1  # the current attempt
        self.named = False  # a hello named its attempt (the job runs under torchrun's agent)
        self.started_at: float | None = None
        self.failures: dict[int, RankEnd] = {}  # the current attempt's
        self.failed_mono: float | None = None  # its first failure (collector's clock)
        self.kept: list[Attempt] = []  # closed attempts: the first and the newest
        self.dropped = 0  # closed attempts not kept
        self.waiting = False  # a new attempt started and has not stepped yet
        self.opened_mono = 0.0  # when it started (collector's clock)

    # --- what the ranks say -----------------------------------------------------------

    def rises(self, attempt: int | None) -> bool:
        """A hello naming a newer attempt than the current one: the group restarted."""
        return self.named and attempt is not None and attempt + 1 > self.number

    def hello(self, attempt: int | None, t: float) -> None:
        if attempt is None:
            return
        if not self.named:  # the first hello to name one (a collector that came late)
            self.named, self.number = True, attempt + 1
        if self.started_at is None and attempt + 1 == self.number:
            self.started_at = t

    def goodbye(self, rank: int, exit_code: int | None, error: str | None, step: int,
                t: float, mono: float) -> None:
        """A rank of the current attempt ended; a failure is kept (bounded: one per rank)."""
        if not exit_code or rank in self.failures:
            return
        self.failures[rank] = RankEnd(rank, exit_code, error, max(0, step), t)
        if self.failed_mono is None:
            self.failed_mono = mono

    # --- attempts ---------------------------------------------------------------------

    def close(self, attempt: int, t: float, mono: float, rank_steps: dict[int, int],
              verdict: Diagnosis | None, episodes: tuple[Episode, ...],
              silent: tuple[tuple[int, int], ...] = ()) -> None:
        """The current attempt ends (a hello named `attempt`, 0-based, at `t`; `mono`: the
        collector's clock): kept, and the next one opens."""
        done = self._attempt(rank_steps, verdict, episodes, ended_at=t)
        done = replace(done, episodes=done.episodes[-MAX_ATTEMPT_EPISODES:], silent=silent)
        self.kept.append(done)
        if len(self.kept) > MAX_ATTEMPTS_KEPT:  # the first stays: what failed first
            del self.kept[1]
            self.dropped += 1
        self.number, self.started_at = attempt + 1, t
        self.failures, self.failed_mono = {}, None
        self.waiting, self.opened_mono = True, mono

    def resumed(self, now: float) -> None:
        """The new attempt took its first step (at wall time `now`): the restart's cost,
        from the closed attempt's first failure (or its end, when nothing failed)."""
        self.waiting = False
        last = self.kept[-1] if self.kept else None
        if last is None:
            return
        since = min((f.at for f in last.failures), default=last.ended_at)
        if since is not None:
            self.kept[-1] = replace(last, restart_s=max(0.0, now - since))

    def restarting(self, mono_now: float) -> bool:
        """Hang detection waits: a rank failed and torchrun restarts the group (restarts
        remain), or the restarted group has not stepped yet, for RESTART_WAIT_S at most."""
        if self.failed_mono is not None:
            return (self.number - 1 < self.max_restarts
                    and mono_now - self.failed_mono < RESTART_WAIT_S)
        return self.waiting and mono_now - self.opened_mono < RESTART_WAIT_S

    def attempts(self, rank_steps: dict[int, int], verdict: Diagnosis | None,
                 episodes: tuple[Episode, ...]) -> tuple[Attempt, ...]:
        """Every kept attempt, the current one last (given its steps, verdict and episodes);
        empty when no hello named an attempt (not under torchrun's elastic agent)."""
        if not self.named:
            return ()
        return (*self.kept, self._attempt(rank_steps, verdict, episodes, ended_at=None))

    def _attempt(self, rank_steps: dict[int, int], verdict: Diagnosis | None,
                 episodes: tuple[Episode, ...], ended_at: float | None) -> Attempt:
        failures = tuple(sorted(self.failures.values(), key=lambda f: (f.at, f.rank)))
        return Attempt(self.number, self.started_at, ended_at, tuple(sorted(rank_steps.items())),
                       verdict, episodes, failures)
