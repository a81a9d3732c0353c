"""Per-rank heat rows: a Line API widget that only draws the lines on screen.

Each row is one rank (or, in node view, one node): step time and every phase, each
cell coloured by how far it is from the median rank (`cells.heat`), plus CPU or GPU
utilisation and memory. Rows are grouped by node. With 8,192 ranks only the ~40
visible lines are rendered per refresh; strips are cached until the next state.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.segment import Segment
from rich.style import Style
from textual.binding import Binding
from textual.geometry import Size
from textual.message import Message
from textual.reactive import reactive
from textual.scroll_view import ScrollView
from textual.strip import Strip

from traceml_agent.vocab import SHORT_NAMES
from traceml_tui.viewmodel import (
    FAILED,
    STALE,
    STOPPED,
    VIEW_PHASES,
    WAITING,
    RankRow,
    RunView,
    node_rows,
)

from .cells import heat, ms
from .ordering import WORST, subject_node, subject_ranks, worst_first, worst_nodes

# "worst" (the default): the diagnosis subject first, then the ranks furthest from the
# median rank (ordering.py).
SORT_KEYS = (WORST, "rank", "step", *VIEW_PHASES)
CELL = 8


def header_text(device: str) -> str:
    util, mem = ("gpu%", "gpu MB") if device == "cuda" else ("cpu%", "rss MB")
    phases = "".join(SHORT_NAMES[p].rjust(CELL) for p in VIEW_PHASES)
    return f"{'rank':>6} {'host':<12} {'state':<7}{'steps':>7}{'step':>8}{phases}{util:>6}{mem:>8}"


@dataclass(frozen=True, slots=True)
class NodeLine:
    """A node: a group header (worst is None) or, in node view, the node's worst value
    per column as one pseudo-row."""

    node: int
    host: str
    ranks: int
    worst: RankRow | None = None


Line = RankRow | NodeLine


def sort_rows(rows: tuple[RankRow, ...], key: str, reverse: bool) -> list[RankRow]:
    if key == "rank":
        return sorted(rows, key=lambda r: r.rank, reverse=reverse)
    idx = VIEW_PHASES.index(key) if key in VIEW_PHASES else None

    def value(r: RankRow) -> float:
        v = r.step_ms if idx is None else r.phase_ms[idx]
        return -1.0 if v is None else v

    # Descending by default for times: the slowest first is what a user sorts for.
    return sorted(rows, key=lambda r: (value(r), -r.rank), reverse=not reverse)


def matches(row: RankRow, text: str) -> bool:
    """Filter: a rank ("3"), a range ("4-7"), a status ("stale") or part of a host name."""
    text = text.strip()
    if not text:
        return True
    if text.isdigit():
        return row.rank == int(text)
    lo, _, hi = text.partition("-")
    if lo.isdigit() and hi.isdigit():
        return int(lo) <= row.rank <= int(hi)
    return text == row.status or text in row.host


def node_lines(state: RunView, rows: list[RankRow], filtered: bool,
               worst: bool = False) -> list[Line]:
    """Node view: the collector's per-node rows, or this viewer's own over a filter.
    `worst`: the subject's node first and expanded into its ranks, then the nodes
    furthest from the median rank."""
    nodes = list(state.node_rows if state.node_rows and not filtered else node_rows(rows))
    if not worst:
        return [NodeLine(row.node, row.host, count, row) for count, row in nodes]
    lines: list[Line] = []
    expand = subject_node(state)
    for count, row in worst_nodes(nodes, state):
        lines.append(NodeLine(row.node, row.host, count, row))
        if row.node == expand:
            lines.extend(worst_first([r for r in rows if r.node == expand], state))
    return lines


class HeatTable(ScrollView, can_focus=True):
    """The rows, under their column header (line 0, which scrolls sideways with them and
    stays on top). The app owns the pinned rank and binds it in (`pinned`); the table
    asks to pin with a message."""

    COMPONENT_CLASSES = {
        "heat-table--cursor", "heat-table--pinned", "heat-table--node", "heat-table--dim",
        "heat-table--heat-1", "heat-table--heat-2", "heat-table--heat-3",
        "heat-table--stale", "heat-table--failed", "heat-table--header",
    }
    DEFAULT_CSS = """
    HeatTable { height: 1fr; }
    HeatTable > .heat-table--header { text-style: bold; background: $panel; }
    HeatTable > .heat-table--cursor { background: $accent 40%; }
    HeatTable > .heat-table--pinned { text-style: bold; color: $text-accent; }
    HeatTable > .heat-table--node { color: $text-muted; text-style: bold; }
    HeatTable > .heat-table--dim { color: $text-muted; }
    HeatTable > .heat-table--heat-1 { color: $warning 70%; }
    HeatTable > .heat-table--heat-2 { color: $warning; text-style: bold; }
    HeatTable > .heat-table--heat-3 {
        color: $text-error; background: $error 25%; text-style: bold;
    }
    HeatTable > .heat-table--stale { color: $text-warning; background: $warning 20%; }
    HeatTable > .heat-table--failed { color: $text-error; text-style: bold; }
    """
    BINDINGS = [
        Binding("down,j", "move(1)", "Down", show=False),
        Binding("up,k", "move(-1)", "Up", show=False),
        Binding("pagedown", "move(20)", "Page down", show=False),
        Binding("pageup", "move(-20)", "Page up", show=False),
        Binding("home", "move(-1000000)", "First", show=False),
        Binding("end", "move(1000000)", "Last", show=False),
        Binding("enter,p", "pin", "Pin", tooltip="Pin the rank under the cursor (again: unpin)"),
    ]

    class PinRequested(Message):
        def __init__(self, rank: int) -> None:
            super().__init__()
            self.rank = rank

    pinned: reactive[int | None] = reactive(None)  # bound from the app

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.lines: list[Line] = []
        self.cursor = 0
        self.state: RunView | None = None
        self.header = header_text("cpu")
        self.subject: frozenset[int] = frozenset()  # the ranks the diagnosis names
        self.subject_node: int | None = None
        self._cache: dict[tuple, Strip] = {}

    # --- state in ----------------------------------------------------------------

    def show(self, state: RunView, sort_key: str = "rank", reverse: bool = False,
             filter_text: str = "", nodes_only: bool = False) -> None:
        """Replace everything shown with a new state (called once per tick)."""
        cursor_key = self._key(self.lines[self.cursor]) if self.cursor < len(self.lines) else None
        rows = [r for r in state.rows if matches(r, filter_text)]
        lines: list[Line] = []
        self.subject = subject_ranks(state)
        self.subject_node = subject_node(state)
        if nodes_only:
            lines.extend(node_lines(state, rows, bool(filter_text.strip()), sort_key == WORST))
        elif sort_key == WORST:  # one order across nodes: no node headers
            lines.extend(worst_first(rows, state))
        else:
            groups: dict[int, list[RankRow]] = {}
            for r in rows:
                groups.setdefault(r.node, []).append(r)
            for node, members in sorted(groups.items()):
                if state.nnodes > 1 or len(groups) > 1:
                    lines.append(NodeLine(node, members[0].host, len(members)))
                lines.extend(sort_rows(tuple(members), sort_key, reverse))
        self.state = state
        self.lines = lines
        self._cache.clear()
        self.header = header_text(state.device)
        self.virtual_size = Size(len(self.header) + 2, len(lines) + 1)  # + the header
        self._place_cursor(cursor_key)
        self.refresh()

    @staticmethod
    def _key(line: Line) -> tuple[str, int]:
        """What the cursor is on, across states: a rank, or a node's line."""
        return ("rank", line.rank) if isinstance(line, RankRow) else ("node", line.node)

    def _place_cursor(self, key: tuple[str, int] | None) -> None:
        """Keep the cursor on the same rank or node line; else on the same position."""
        for i, line in enumerate(self.lines):
            if self._key(line) == key:
                self.cursor = i
                return
        self.cursor = min(self.cursor, max(0, len(self.lines) - 1))

    @property
    def cursor_rank(self) -> int | None:
        if 0 <= self.cursor < len(self.lines):
            line = self.lines[self.cursor]
            if isinstance(line, RankRow):
                return line.rank
            return line.worst.rank if line.worst is not None else None
        return None

    def go_to(self, rank: int) -> bool:
        for i, line in enumerate(self.lines):
            if isinstance(line, RankRow) and line.rank == rank:
                self._set_cursor(i)
                return True
        return False

    def watch_pinned(self) -> None:
        self._cache.clear()
        self.refresh()

    # --- actions -----------------------------------------------------------------

    def action_move(self, delta: int) -> None:
        if self.lines:
            self._set_cursor(max(0, min(len(self.lines) - 1, self.cursor + delta)))

    def action_pin(self) -> None:
        rank = self.cursor_rank
        if rank is not None:
            self.post_message(self.PinRequested(rank))

    def _set_cursor(self, index: int) -> None:
        old, self.cursor = self.cursor, index
        self._cache.clear()
        self.refresh_line(old - self.scroll_offset.y + 1)
        self.refresh_line(index - self.scroll_offset.y + 1)
        self.scroll_to_region_if_needed(index)

    def scroll_to_region_if_needed(self, index: int) -> None:
        top, height = self.scroll_offset.y, self.size.height - 1  # under the header
        if index < top:
            self.scroll_to(y=index, animate=False)
        elif index >= top + height:
            self.scroll_to(y=index - height + 1, animate=False)

    # --- drawing -----------------------------------------------------------------

    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        width = self.size.width
        if y == 0:  # the header: on top whatever the rows' scroll, sideways with them
            return Strip([Segment(self.header.ljust(self.virtual_size.width),
                                  self._style("header"))]).crop(scroll_x, scroll_x + width)
        index = scroll_y + y - 1
        if index >= len(self.lines) or self.state is None:
            return Strip.blank(width)
        line = self.lines[index]
        key = (index, index == self.cursor, width, scroll_x)
        strip = self._cache.get(key)
        if strip is None:
            strip = self._draw(line, index == self.cursor).crop(scroll_x, scroll_x + width)
            self._cache[key] = strip
        return strip

    def _style(self, name: str) -> Style:
        return self.get_component_rich_style(f"heat-table--{name}", partial=True)

    def _draw(self, line: Line, at_cursor: bool) -> Strip:
        state = self.state
        assert state is not None
        base = self._style("cursor") if at_cursor else Style()
        if isinstance(line, NodeLine) and line.worst is None:
            host = line.host or "not reporting yet"
            label = f"── node {line.node} · {host} · {line.ranks} rank(s) "
            return Strip([Segment(label.ljust(self.virtual_size.width, "─"),
                                  base + self._style("node"))])
        row = line.worst if isinstance(line, NodeLine) else line
        assert row is not None
        segs: list[Segment] = []
        pinned = isinstance(line, RankRow) and row.rank == self.pinned
        name = f"node {line.node}" if isinstance(line, NodeLine) else f"{row.rank}"
        culprit = (line.node == self.subject_node if isinstance(line, NodeLine)
                   else row.rank in self.subject)
        marker = "●" if pinned else "▶" if culprit else " "
        segs.append(Segment(f"{marker}{name:>5} ", base + (
            self._style("pinned") if pinned else self._style("heat-3") if culprit
            else Style())))
        segs.append(Segment(f"{row.host[:12]:<12} ", base + self._style("dim")))
        status_style = {STALE: "stale", FAILED: "failed", WAITING: "dim",
                        STOPPED: "dim"}.get(row.status)
        segs.append(Segment(f"{row.status:<7}", base + (self._style(status_style)
                                                         if status_style else Style())))
        segs.append(Segment(f"{row.steps:>7}", base))
        step_heat = heat(row.step_ms, state.median_step_ms, state.median_step_ms)
        segs.append(self._cell(row.step_ms, step_heat, base))
        for i, value in enumerate(row.phase_ms):
            level = heat(value, state.median_phase_ms[i], state.median_step_ms)
            segs.append(self._cell(value, level, base))
        util, mem = ((row.gpu_util, row.gpu_mem_mb) if state.device == "cuda"
                     else (row.cpu_pct, row.rss_mb))
        segs.append(Segment("-".rjust(6) if util is None else f"{util:>6.0f}", base))
        segs.append(Segment("-".rjust(8) if mem is None else f"{mem:>8.0f}", base))
        return Strip(segs)

    def _cell(self, value: float | None, level: int, base: Style) -> Segment:
        style = base + self._style(f"heat-{level}") if level else base
        return Segment(ms(value, CELL), style)
