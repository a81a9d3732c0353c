"""The per-rank windows as the collector kept them before numpy (pure Python rings), kept
as the reference the vectorised windows (traceml_tui/judge/windows.py) are checked against."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from traceml_tui.judge.windows import Quantiles, sorted_quantiles

NAN = float("nan")


class Ring:
    """A fixed-size ring of floats; NaN marks 'not measured'."""

    __slots__ = ("data", "pos", "count", "size")

    def __init__(self, size: int) -> None:
        self.data = array("d", [NAN]) * size
        self.pos = 0
        self.count = 0
        self.size = size

    def append(self, value: float) -> None:
        self.data[self.pos] = value
        self.pos = (self.pos + 1) % self.size
        if self.count < self.size:
            self.count += 1

    def last(self, n: int) -> list[float]:
        """The newest n values, oldest first."""
        n = min(n, self.count)
        if n <= 0:
            return []
        start = (self.pos - n) % self.size
        if start + n <= self.size:
            return self.data[start : start + n].tolist()
        return self.data[start:].tolist() + self.data[: self.pos].tolist()


class RankWindow:
    """The last N steps of one rank: step time and each phase."""

    __slots__ = ("size", "step_ms", "phases", "t_end")

    def __init__(self, size: int) -> None:
        self.size = size
        self.step_ms = Ring(size)
        self.t_end = Ring(size)
        self.phases: dict[str, Ring] = {}

    def append(self, step_ms: float, t_end: float, phase_names: Sequence[str],
               phase_ms: Sequence[float | None]) -> None:
        # A phase this rank reports for the first time starts with NaN history,
        # so every ring stays aligned with step_ms.
        for name in phase_names:
            if name not in self.phases:
                ring = Ring(self.size)
                for _ in range(self.step_ms.count):
                    ring.append(NAN)
                self.phases[name] = ring
        self.step_ms.append(step_ms)
        self.t_end.append(t_end)
        seen = set()
        for name, value in zip(phase_names, phase_ms, strict=False):
            self.phases[name].append(NAN if value is None else value)
            seen.add(name)
        for name, ring in self.phases.items():
            if name not in seen:
                ring.append(NAN)

    @property
    def count(self) -> int:
        return self.step_ms.count

    def seen(self, names: Sequence[str], last: int | None = None) -> dict[str, int]:
        """Of the newest `last` steps (default: the whole window), on how many each named
        phase was measured."""
        n = self.count if last is None else min(last, self.count)
        out = {}
        for name in names:
            ring = self.phases.get(name)
            out[name] = 0 if ring is None else sum(1 for v in ring.last(n) if v == v)
        return out

    def stats(
        self, last: int | None = None
    ) -> tuple[Quantiles | None, dict[str, Quantiles | None]]:
        """Step and phase quantiles over the newest `last` steps (default: the whole window).

        A phase seen on at least one step of the window counts 0 on the steps where
        it did not occur (it was hooked and took no time there); a phase never seen
        is None: not measured, never a made-up 0.
        """
        # Rings hold only finite values or NaN (the protocol rejects infinities), so a
        # NaN test is the whole filter; this runs for every rank on every snapshot.
        n = self.count if last is None else min(last, self.count)
        steps = self.step_ms.last(n)
        step = sorted_quantiles(sorted(v for v in steps if v == v))
        phases: dict[str, Quantiles | None] = {}
        for name, ring in self.phases.items():
            values = [v for v in ring.last(n) if v == v]
            if values:
                values.extend([0.0] * (n - len(values)))
                values.sort()
                phases[name] = sorted_quantiles(values)
            else:
                phases[name] = None
        return step, phases
