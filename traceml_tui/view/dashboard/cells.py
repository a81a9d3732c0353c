"""Formatting and heat levels shared by the dashboard's widgets (pure functions)."""

from __future__ import annotations

# A cell's heat is its gap to the median rank as a share of the median step:
# the same yardstick the diagnosis uses (docs/diagnosis.md), so red means "costs the
# whole job this share of every step".
HEAT_LEVELS = (0.02, 0.05, 0.10)


def heat(value: float | None, median: float | None, step: float | None) -> int:
    """0 (at or below the median rank) to 3 (a gap of 10% of the step or more)."""
    if value is None or median is None or not step:
        return 0
    share = (value - median) / step
    level = 0
    for threshold in HEAT_LEVELS:
        if share >= threshold:
            level += 1
    return level


def ms(value: float | None, width: int = 7) -> str:
    if value is None:
        return "-".rjust(width)
    if value >= 10_000:
        return f"{value / 1000:.1f}s".rjust(width)
    if value >= 100:
        return f"{value:.0f}".rjust(width)
    return f"{value:.1f}".rjust(width) if value >= 10 else f"{value:.2f}".rjust(width)


def duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{(seconds % 3600) // 60:02d}m"


SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: tuple[float, ...] | list[float], width: int) -> str:
    vals = list(values)[-width:]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    span = (hi - lo) or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int((v - lo) / span * (len(SPARK) - 1)))]
                   for v in vals)
