"""A compact distribution across all ranks, one line per figure: a long tail, a few slow
ranks or two clusters show at 8,192 ranks in a line, where rows would need pages.

Bars are counts of ranks per bin between the fastest and the slowest rank, on a log
scale so that a single rank among thousands still shows (▁); a gap is an empty bin.
"""

from __future__ import annotations

import math

from rich.text import Text
from textual.strip import Strip
from textual.widget import Widget

from traceml_tui.viewmodel import VIEW_PHASES, RunView, own_work

from .time_chart import to_strip

BARS = "▁▂▃▄▅▆▇█"
MIN_SPREAD = 0.10
LABEL = 11  # columns for the figure's name


def histogram(values: list[float], bins: int) -> str:
    """Bars for `values` in `bins` equal bins from min to max, log-scaled counts."""
    if not values:
        return ""
    lo, hi = min(values), max(values)
    # A spread under MIN_SPREAD of the median is noise: those ranks share the first bin
    # instead of being stretched over the whole line.
    mid = sorted(values)[len(values) // 2]
    hi = max(hi, lo + MIN_SPREAD * abs(mid))
    if hi - lo < 1e-9:
        counts = [0] * bins
        counts[0] = len(values)
    else:
        counts = [0] * bins
        scale = bins / (hi - lo)
        for v in values:
            counts[min(bins - 1, int((v - lo) * scale))] += 1
    top = math.log1p(max(counts))
    return "".join(" " if not n else BARS[min(len(BARS) - 1, int(math.log1p(n) / top *
                                                                   (len(BARS) - 1)))]
                   for n in counts)


def quantile(sorted_vals: list[float], q: float) -> float:
    return sorted_vals[min(len(sorted_vals) - 1, max(0, math.ceil(q * len(sorted_vals)) - 1))]


def line(name: str, values: list[float], width: int) -> Text:
    text = Text(f"{name[:LABEL - 1]:<{LABEL}}", style="bold")
    if not values:
        return text.append("no ranks measured yet", style="dim")
    vals = sorted(values)
    stats = (f" {vals[0]:.1f} - {vals[-1]:.1f} ms  p50 {quantile(vals, 0.5):.1f}  "
             f"p99 {quantile(vals, 0.99):.1f}  ({len(vals)} ranks)")
    bins = max(8, min(60, width - LABEL - len(stats) - 2))
    text.append("│", style="dim")
    text.append(histogram(vals, bins), style="yellow")
    text.append("│", style="dim")
    return text.append(stats, style="dim")


def figures(state: RunView) -> list[tuple[str, list[float]]]:
    """What the lines show: every rank's step, then the diagnosed phase (or, without
    one, each rank's own work: its input and compute, no waits)."""
    rows = [r for r in state.rows if r.step_ms is not None]
    out = [("step", [r.step_ms for r in rows if r.step_ms is not None])]
    if state.phase in VIEW_PHASES:
        i = VIEW_PHASES.index(state.phase)
        out.append((state.phase, [v for r in rows if (v := r.phase_ms[i]) is not None]))
    else:
        out.append(("own work", [own_work(r.phase_ms) or 0.0 for r in rows]))
    return out


class Distribution(Widget):
    """Two lines on the Line API, rebuilt once per state."""

    DEFAULT_CSS = """
    Distribution { height: 2; padding: 0 1; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._strips: list[Strip] = []

    def show(self, state: RunView) -> None:
        width = max(30, self.content_size.width)
        self._strips = [to_strip(line(name, values, width), width)
                        for name, values in figures(state)]
        self.refresh()

    def render_line(self, y: int) -> Strip:
        return self._strips[y] if y < len(self._strips) else Strip.blank(self.size.width)
