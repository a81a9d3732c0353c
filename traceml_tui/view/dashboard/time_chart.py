"""Time as a picture: the step time over the whole run, with the diagnosis episodes on
the same time axis.

Three series on a braille canvas (2 x 4 dots per cell): the median rank's step (what
the job pays), the worst rank's own work and the median rank's own work (input and
compute, no waits): a straggler is the gap between the last two, and the step follows
the worst. Below, one line of episodes coloured by severity, labelled where they fit.
Drawn from the view's bounded history (history.py), so the cost does not grow with
the run: a few milliseconds a frame.
"""

from __future__ import annotations

from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.strip import Strip
from textual.widget import Widget

from traceml_agent.vocab import CRITICAL, INFO, WARMUP, WARNING
from traceml_tui.viewmodel import RunView

from .cells import duration

# (dx, dy) -> the bit of a braille cell (U+2800 + bits).
DOTS = ((0x01, 0x02, 0x04, 0x40), (0x08, 0x10, 0x20, 0x80))
# Series: (history column, legend, style). Drawn in this order; a cell shared by
# several takes the style of the last (the worst rank is the one to see).
SERIES = ((2, "median rank's own work", "median own", "green"),
          (1, "step (median rank)", "step", "bright_white"),
          (3, "worst rank's own work", "worst own", "red"))
WIDE = 110  # from this width the legend spells the series out
SEVERITY_STYLE = {INFO: "green", WARNING: "yellow", CRITICAL: "red"}
Y_LABEL = 8  # columns for the y axis labels


def resample(points: tuple, column: int, t0: float, t_end: float, slots: int, worst: bool
              ) -> list[float | None]:
    """One series on `slots` equal time slots from t0 to t_end: mean per slot (max for
    the worst rank), carried over empty slots once it has started."""
    span = t_end - t0
    sums = [0.0] * slots
    counts = [0] * slots
    for p in points:
        v = p[column]
        if v is None:
            continue
        i = min(slots - 1, max(0, int((p[0] - t0) / span * slots))) if span > 0 else 0
        if worst:
            sums[i] = max(sums[i], v) if counts[i] else v
        else:
            sums[i] += v
        counts[i] += 1
    out: list[float | None] = []
    last = None
    for s, n in zip(sums, counts, strict=True):
        if n:
            last = s if worst else s / n
        out.append(last)
    return out


CURSOR_STYLE = "bold yellow"


def chart_lines(state: RunView, width: int, height: int, cursor: float | None = None
                ) -> list[Text]:
    """The chart as `height` lines of `width` cells: a legend, the canvas, the episodes;
    `cursor` (seconds since start): the time cursor's moment, drawn as a column."""
    points = state.history
    rows = max(1, height - 2)
    cols = max(4, width - Y_LABEL)
    if not points:
        return [Text("step time over the run: waiting for the first evaluated steps",
                     style="dim")] + [Text("")] * (height - 1)
    # From the first evaluated steps (launch and warm-up draw nothing) to now.
    t0 = points[0][0]
    t_end = max(points[-1][0], state.elapsed_s, t0 + 1e-9)
    series = [(resample(points, c, t0, t_end, 2 * cols, c == 3), style)
              for c, _, _, style in SERIES]
    top = max((v for s, _ in series for v in s if v is not None), default=0.0) * 1.05 or 1.0
    levels = 4 * rows
    grid: list[list[int]] = [[0] * cols for _ in range(rows)]
    owner: list[list[str]] = [[""] * cols for _ in range(rows)]
    for values, style in series:
        prev = None
        for x, v in enumerate(values):
            if v is None:
                prev = None
                continue
            level = min(levels - 1, int(v / top * levels))
            lo, hi = (level, level) if prev is None else (min(prev, level), max(prev, level))
            for lv in range(lo, hi + 1):  # join a jump to the previous slot: a line
                dy = levels - 1 - lv
                r, c = dy // 4, x // 2
                grid[r][c] |= DOTS[x % 2][dy % 4]
                owner[r][c] = style
            prev = level
    wide = width >= WIDE
    legend = Text("step time over the run " if wide else "over the run ", style="bold")
    for _, name, short, style in reversed(SERIES):
        legend.append("⣀⣀ ", style=style)
        legend.append(f"{name if wide else short}  ", style="dim")
    legend.append(f"{duration(t0)} - {duration(t_end)}", style="dim")
    at = None
    if cursor is not None:
        at = min(cols - 1, max(0, int((cursor - t0) / (t_end - t0) * cols)))
        legend.append(f"  ▼ {duration(cursor)}", style=CURSOR_STYLE)
    out = [legend]
    for r in range(rows):
        label = (f"{top:.0f} ms" if top >= 10 else f"{top:.1f} ms") if r == 0 else (
            "0" if r == rows - 1 else "")
        line = Text(label.rjust(Y_LABEL - 1) + "│", style="dim")
        chars = [chr(0x2800 + b) if b else " " for b in grid[r]]
        styles = owner[r]
        if at is not None:  # the cursor: a bar where the column is empty, yellow where not
            chars[at] = "│" if chars[at] == " " else chars[at]
            styles = [*styles[:at], CURSOR_STYLE, *styles[at + 1:]]
        append_runs(line, "".join(chars), styles)
        out.append(line)
    out.append(episode_line(state, cols, t0, t_end))
    return out[:height]


def episode_line(state: RunView, cols: int, t0: float, t_end: float) -> Text:
    """The diagnosis episodes on the chart's time axis: a bar per episode coloured by its
    severity, its label written at its start where it fits."""
    cells = [" "] * cols
    styles: list[str | None] = [None] * cols
    starts: list[tuple[int, int, str]] = []
    for start, end, label, severity in state.episodes:
        if label == WARMUP:
            continue
        span = t_end - t0
        if end is not None and end < t0:
            continue
        a = min(cols - 1, max(0, int((start - t0) / span * cols)))
        b = min(cols, max(a + 1, int(((t_end if end is None else end) - t0) / span * cols
                                     + 0.5)))
        for c in range(a, b):
            cells[c], styles[c] = "━", SEVERITY_STYLE.get(severity, "dim")
        starts.append((a, b, label))
    for a, b, label in starts:
        text = f" {label} "
        if b - a >= len(text) + 1:
            for i, ch in enumerate(text):
                cells[a + 1 + i] = ch
    line = Text("labels".rjust(Y_LABEL - 1) + "│", style="dim")
    append_runs(line, "".join(cells), [(f"bold {st}" if ch not in "━ " and st else st or "")
                                       for ch, st in zip(cells, styles, strict=True)])
    return line


def append_runs(line: Text, cells: str, styles: list[str]) -> None:
    """Append cells to a line, one span per run of one style (not one per cell)."""
    start = 0
    for i in range(1, len(cells) + 1):
        if i == len(cells) or styles[i] != styles[start]:
            line.append(cells[start:i], style=styles[start] or None)
            start = i


class TimeChart(Widget):
    """The chart widget, on the Line API: its lines are built once per state (a few
    hundred cells) and handed to Textual as strips, with no layout pass per frame."""

    DEFAULT_CSS = """
    TimeChart { height: 8; padding: 0 1; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._strips: list[Strip] = []
        self._state: RunView | None = None
        self._cursor: float | None = None
        self._drawn_for: tuple = ()

    def show(self, state: RunView, cursor: float | None = None) -> None:
        """Draw `state`'s history; `cursor`: the time cursor's moment on it, if any."""
        self._state, self._cursor = state, cursor
        self._rebuild()

    def on_resize(self) -> None:
        self._rebuild()

    def _rebuild(self) -> None:
        state = self._state
        width, height = max(20, self.content_size.width), max(3, self.content_size.height)
        if state is None:
            return
        key = (id(state.history), state.episodes, width, height, state.elapsed_s, self._cursor)
        if key == self._drawn_for:
            return
        self._drawn_for = key
        self._strips = [to_strip(line, width) for line in chart_lines(state, width, height,
                                                                     self._cursor)]
        self.refresh()

    def render_line(self, y: int) -> Strip:
        return self._strips[y] if y < len(self._strips) else Strip.blank(self.size.width)


_STYLES: dict[str, Style] = {}


def to_strip(text: Text, width: int) -> Strip:
    """A Text of single-line spans as a Strip, without a console render."""
    segments = []
    plain = text.plain
    spans = sorted(text.spans, key=lambda sp: sp.start)
    base = text.style if isinstance(text.style, str) else ""
    pos = 0
    for sp in spans:
        if sp.start > pos:
            segments.append(Segment(plain[pos:sp.start], _style(base)))
        segments.append(Segment(plain[sp.start:sp.end], _style(str(sp.style))))
        pos = max(pos, sp.end)
    if pos < len(plain):
        segments.append(Segment(plain[pos:], _style(base)))
    return Strip(segments).crop(0, width)


def _style(name: str) -> Style:
    style = _STYLES.get(name)
    if style is None:
        style = _STYLES[name] = Style.parse(name) if name and name != "None" else Style()
    return style
