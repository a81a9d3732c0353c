"""The run's step time over time, bounded whatever the run's length: what the dashboard's
time chart draws.

One point per evaluation tick: the median rank's step, and the own work (input and
compute, no waits) of the median rank and of the worst rank. When MAX_POINTS are kept,
neighbours merge in pairs and later points each cover twice as many ticks, so a run of
any length keeps its whole span, at a grain that coarsens as it grows.
"""

from __future__ import annotations

import numpy as np

from .windows import finite_median

MAX_POINTS = 512
# (seconds since the run started, median step, median own work, worst own work), in ms.
Point = tuple[float, float | None, float | None, float | None]


def _mean(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return a if b is None else b
    return (a + b) / 2.0


def _max(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return a if b is None else b
    return max(a, b)


def merge(a: Point, b: Point) -> Point:
    """Two neighbouring points as one: the typical values averaged, the worst kept."""
    return (a[0], _mean(a[1], b[1]), _mean(a[2], b[2]), _max(a[3], b[3]))


class History:
    def __init__(self, max_points: int = MAX_POINTS) -> None:
        self.max_points = max_points
        self.points: list[Point] = []
        self.stride = 1  # ticks per point
        self._pending: Point | None = None
        self._pending_n = 0

    def add(self, point: Point) -> None:
        self._pending = point if self._pending is None else merge(self._pending, point)
        self._pending_n += 1
        if self._pending_n < self.stride:
            return
        self.points.append(self._pending)
        self._pending, self._pending_n = None, 0
        if len(self.points) >= self.max_points:
            pts = self.points
            self.points = [merge(pts[i], pts[i + 1]) if i + 1 < len(pts) else pts[i]
                           for i in range(0, len(pts), 2)]
            self.stride *= 2

    def view(self) -> tuple[Point, ...]:
        return tuple(self.points) + ((self._pending,) if self._pending is not None else ())


def point(elapsed_s: float, steps: np.ndarray, own: np.ndarray) -> Point:
    """A tick's point from every rank's live step time and own work (ms)."""
    return (round(elapsed_s, 2), finite_median(steps), finite_median(own),
            float(own.max()) if len(own) else None)


class StepClock:
    """When each step was taken, bounded: one (step, time) mark per evaluation, thinned
    by dropping every other mark once MAX_POINTS are kept (the newest always stays). An
    episode dated by its steps (episodes.py) is placed on the time axis through it, so
    the time chart draws it where the timeline says."""

    def __init__(self, max_marks: int = MAX_POINTS) -> None:
        self.max_marks = max_marks
        self.marks: list[tuple[int, float]] = []

    def mark(self, step: int, at: float) -> None:
        if step < 0 or (self.marks and step <= self.marks[-1][0]):
            return
        self.marks.append((step, at))
        if len(self.marks) >= self.max_marks:
            self.marks = self.marks[-1::-2][::-1]

    def time_of(self, step: int, default: float) -> float:
        """The time of `step`, interpolated between the marks around it; `default`
        before the first mark, the last mark's time past it."""
        marks = self.marks
        if not marks:
            return default
        if step <= marks[0][0]:
            return marks[0][1]
        lo, hi = 0, len(marks) - 1
        if step >= marks[hi][0]:
            return marks[hi][1]
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if marks[mid][0] <= step:
                lo = mid
            else:
                hi = mid
        (s0, t0), (s1, t1) = marks[lo], marks[hi]
        return t0 + (t1 - t0) * (step - s0) / (s1 - s0)
