"""The time cursor: which moment of the run the dashboard shows.

Frames are frozen views in time order. Live, the dashboard keeps the last ones it received
(`LiveFrames`, bounded by rows: a pause must not cost a wide job's viewer its memory); a
replay reads the record's keyframes (collect/replay.py). The cursor is an index into them,
or None for "live, the newest". Pure functions of times and episodes: no widgets here.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from collections.abc import Callable
from typing import Protocol

from traceml_tui.viewmodel import RunView

# Views a live dashboard keeps to pause on: 2 minutes at its 0.5 s refresh ...
LIVE_FRAMES = 240
# ... but no more rows than this in all (~200 bytes a row decoded: ~50 MB), so a
# 8,192-rank job keeps 30 views and a 16,384-rank one 15, and never fewer than MIN_FRAMES.
LIVE_ROW_BUDGET = 250_000
MIN_FRAMES = 8


class Frames(Protocol):
    def __len__(self) -> int: ...
    def view(self, index: int) -> RunView: ...
    def times(self) -> list[float]: ...
    def subjects(self) -> list[str]: ...


class Recorded(Frames, Protocol):
    """A record's frames, built once (in a worker thread) by `load`."""

    def load(self, progress: Callable[[int], None]) -> None: ...


class LiveFrames:
    """The last views received, oldest first, bounded by count and by rows."""

    def __init__(self, limit: int = LIVE_FRAMES) -> None:
        self.limit = limit
        self.views: deque[RunView] = deque(maxlen=limit)

    def push(self, view: RunView) -> int:
        """Keep `view`; how many of the oldest went to make room."""
        before = len(self.views)
        keep = min(self.limit, max(MIN_FRAMES, LIVE_ROW_BUDGET // max(1, len(view.rows))))
        if keep != self.views.maxlen:
            self.views = deque(self.views, maxlen=keep)
        self.views.append(view)
        return before + 1 - len(self.views)

    def __len__(self) -> int:
        return len(self.views)

    def view(self, index: int) -> RunView:
        return self.views[index]

    def times(self) -> list[float]:
        return [v.elapsed_s for v in self.views]

    def subjects(self) -> list[str]:
        return [subject(v) for v in self.views]


def subject(view: RunView) -> str:
    """What the banner names: a change of it is where an episode shows."""
    return f"{view.label}|{view.rank}|{view.node}"


def step_to(times: list[float], index: int, delta: int) -> int:
    return max(0, min(len(times) - 1, index + delta))


def changes(subjects: list[str]) -> list[int]:
    """The frames where the banner names something new (warm-up's first frame left out:
    it is the run's start, with < to go to)."""
    return [i for i in range(1, len(subjects)) if subjects[i] != subjects[i - 1]]


def next_episode(subjects: list[str], index: int) -> int | None:
    """The first frame of the next episode, as the banner showed it."""
    return next((i for i in changes(subjects) if i > index), None)


def previous_episode(subjects: list[str], index: int) -> int | None:
    """The first frame of the episode before the one at the cursor, or of this one if the
    cursor is past its first frame; the run's start before the first."""
    earlier = [i for i in changes(subjects) if i < index]
    return earlier[-1] if earlier else (0 if index > 0 else None)


def frame_at(times: list[float], t: float) -> int:
    """The last frame at or before t."""
    return max(0, bisect_right(times, t) - 1)
