"""The traceml dashboard: a viewer of a collector's state, never the collector itself.

A worker thread polls the source (a collector's view socket, or canned states in
tests) every REFRESH_S and hands each frozen RunView to the UI thread with
`call_from_thread`, which waits for the UI to take it: updates coalesce by
construction, and the screen renders on that fixed tick, never per sample.
State flows down (the pinned rank lives here and is bound into the table and the
panels); events flow up (the table announces cursor moves and pin requests).
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from msgspec.structs import replace
from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.css.query import NoMatches
from textual.reactive import reactive
from textual.widgets import Footer

from traceml_agent.requests import CaptureReply
from traceml_tui.runfolder.folders import write_atomic
from traceml_tui.runfolder.layout import RunFolder
from traceml_tui.runfolder.summary_model import Summary, encode
from traceml_tui.viewmodel import RankDetail, RunView

from . import cursor as cur
from .banner import Banner
from .distribution import Distribution
from .heat_table import SORT_KEYS, HeatTable
from .rank_panel import RankPanel
from .screens import ChecksScreen, CollectivesScreen, HelpScreen, PromptScreen, TraceScreen
from .status_bar import StatusBar
from .time_chart import TimeChart

REFRESH_S = 0.5
# Each refresh allocates one row object per rank; with thousands of ranks the default
# GC thresholds (700, 10, 10) run full collections every few frames (p90 frame time
# 138 ms at 8,192 ranks, 35 ms with these). The viewer's objects are acyclic: a higher
# first threshold only delays work refcounting does anyway. Viewer process only.
GC_THRESHOLDS = (20_000, 50, 100)
# Above this many ranks the table opens in node view (one line per node, worst values),
# and `n` drills into ranks.
NODE_VIEW_ABOVE = 256
# Up to this many lines the table takes only what it needs and the chart the rest.
FEW_LINES = 12
SMALL_ROWS = 36  # a terminal shorter than this shows no worst-rank panel
TRACE_STEPS = 5  # steps a deep trace profiles: enough to average, small enough to read


class ViewSource(Protocol):
    def fetch(self, pinned: int | None) -> tuple[RunView, RankDetail | None]: ...
    def summary(self) -> Summary: ...
    def capture(self, ranks: list[int] | None = None, steps: int = 5) -> CaptureReply: ...
    def close(self) -> None: ...


class DashboardApp(App[None]):
    """State flows down as reactives: a new view, the pinned rank, the sort, the filter
    and the node view each redraw what depends on them when they change (the pinned rank
    is bound into the table with data_bind); events flow up as messages."""

    CSS_PATH = "dashboard.tcss"
    TITLE = "traceml"
    BINDINGS = [
        # Short descriptions fit the footer in 80 columns; the help screen (?) gives
        # each key's tooltip.
        Binding("q", "quit", "Quit", tooltip="Quit the viewer (the job goes on)"),
        Binding("w", "worst", "Worst", tooltip="Pin the worst rank"),
        Binding("g", "goto", "Go to", show=False, tooltip="Go to a rank and pin it"),
        Binding("u", "unpin", "Unpin", show=False),
        Binding("s", "sort(1)", "Sort", tooltip="Next sort key (worst first, rank, step, "
                                                  "each phase)"),
        Binding("S", "sort(-1)", "Sort (previous key)", show=False),
        Binding("r", "reverse", "Reverse sort", show=False),
        Binding("slash", "filter", "Filter", tooltip="Filter: a rank, a range (4-7), a state "
                                                     "or part of a host name"),
        Binding("n", "nodes", "Nodes", tooltip="Node view / rank view"),
        Binding("c", "checks", "Checks", tooltip="Setup checks: evidence and fix"),
        Binding("o", "collectives", "Collectives", show=False,
                tooltip="Which collective on which group took the sync time"),
        Binding("t", "trace", "Trace", tooltip="Deep trace of the pinned (else worst) rank"),
        Binding("T", "show_trace", "Last deep trace", show=False),
        Binding("e", "export", "Export JSON", show=False,
                tooltip="Export the summary so far as JSON"),
        Binding("v", "save_svg", "Save SVG", show=False, tooltip="Save a screenshot (SVG)"),
        # The time cursor (cursor.py). Priority: the table would scroll sideways on the
        # arrows. Start and end are < and >, as home and end move the table's cursor.
        # Not in the live footer (it keeps its keys); the replay's shows them.
        Binding("left", "cursor(-1)", "Back", key_display="←", priority=True, show=False,
                tooltip="Time cursor: one view back (live: pause there)"),
        Binding("right", "cursor(1)", "Forward", key_display="→", priority=True, show=False,
                tooltip="Time cursor: one view forward"),
        Binding("left_square_bracket", "episode(-1)", "Prev episode", key_display="[",
                show=False, tooltip="Time cursor: the previous episode's start"),
        Binding("right_square_bracket", "episode(1)", "Next episode", key_display="]",
                show=False, tooltip="Time cursor: the next episode's start"),
        Binding("less_than_sign", "cursor_start", "Start", key_display="<", show=False,
                tooltip="Time cursor: the first view (a record: its start)"),
        Binding("greater_than_sign", "cursor_end", "End", key_display=">", show=False,
                tooltip="Time cursor: the newest view (a record: its end)"),
        Binding("l", "live", "Live", show=False,
                tooltip="Back to live (a record: its end)"),
        Binding("question_mark", "help", "Help", tooltip="Every key"),
        # Textual binds Ctrl-C to a quit hint; under `traceml run` it stops the job.
        Binding("ctrl+c", "stop_job", "Stop the job", show=False, priority=True),
    ]

    state: reactive[RunView | None] = reactive(None, always_update=True, init=False)
    pinned: reactive[int | None] = reactive(None, init=False)
    sort_index: reactive[int] = reactive(0, init=False)
    reverse: reactive[bool] = reactive(False, init=False)
    filter_text: reactive[str] = reactive("", init=False)
    nodes_only: reactive[bool | None] = reactive(None, init=False)  # None: by world size

    def __init__(self, source: ViewSource, run_dir: Path | None = None,
                 refresh_s: float = REFRESH_S,
                 stop_job: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.source = source
        self.run_dir = run_dir
        self.refresh_s = refresh_s
        self.stop_job = stop_job
        self.pinned_detail: RankDetail | None = None
        self.source_note = "connecting..."
        self.ended_note = ""
        self.stopping = threading.Event()  # ends the poll thread's wait at once on quit
        # The time cursor: the frames it moves over (live: the last views received) and
        # its index, None while live. `newest` is the newest view (the chart's whole run).
        self.frames: cur.Frames = cur.LiveFrames()
        self.cursor: int | None = None
        self.newest: RunView | None = None
        self.newest_detail: RankDetail | None = None

    def compose(self) -> ComposeResult:
        yield Banner("waiting for the first state...", id="banner")
        yield StatusBar(id="status")
        yield Distribution(id="distribution")
        yield HeatTable(id="table").data_bind(DashboardApp.pinned)
        yield TimeChart(id="chart")
        with Horizontal(id="panels"):
            yield RankPanel("worst rank vs median", id="worst")
            yield RankPanel("pinned rank", id="pinned")
        yield Footer(show_command_palette=False)

    def on_mount(self) -> None:
        self._gc_thresholds = gc.get_threshold()
        gc.set_threshold(*GC_THRESHOLDS)
        self.query_one(HeatTable).focus()
        self.query_one("#pinned", RankPanel).display = False
        self.run_worker(self._poll, thread=True, exclusive=True, name="poll")

    # --- data in (worker thread) -------------------------------------------------

    def _poll(self) -> None:
        from textual.worker import get_current_worker

        worker = get_current_worker()
        while not worker.is_cancelled and not self.stopping.is_set():
            started = time.monotonic()
            try:
                view, detail = self.source.fetch(self.pinned)
                self.call_from_thread(self.apply, view, detail, "")
            except Exception as exc:  # the collector is gone or slow: say so, keep trying
                self.call_from_thread(self.lost, str(exc))
            self.stopping.wait(max(0.0, self.refresh_s - (time.monotonic() - started)))

    # --- state down (UI thread) --------------------------------------------------

    def apply(self, view: RunView, detail: RankDetail | None, note: str) -> None:
        """Replace the whole shown state with a new frozen one."""
        seen = self.state.capture if self.state else None
        self.source_note = note
        evicted = self.frames.push(view) if isinstance(self.frames, cur.LiveFrames) else 0
        self.newest, self.newest_detail = view, detail
        if self.nodes_only is None:  # set quietly: the new state redraws below
            self.set_reactive(DashboardApp.nodes_only, view.world_size > NODE_VIEW_ABOVE)
        if self.cursor is not None:  # paused on a moment: the job goes on, the view stays
            self.cursor = max(0, self.cursor - evicted)  # indices move as old views go
            self.redraw()
            return
        self.pinned_detail = detail
        self.state = view  # redraws (watch_state)
        cap = view.capture
        if cap is not None and cap.text and not (seen is not None and seen.text
                                                  and seen.id == cap.id):
            self.notify(f"deep trace {cap.id} analysed: press T to read it"
                        + (f" (saved in {cap.saved})" if cap.saved else ""),
                        title="deep trace", timeout=15)

    def _view_changed(self) -> None:
        self.redraw()

    watch_state = watch_pinned = watch_sort_index = watch_reverse = _view_changed
    watch_filter_text = watch_nodes_only = _view_changed

    def lost(self, reason: str) -> None:
        self.source_note = "collector not answering, retrying" if not self.ended_note else ""
        try:
            if self.state is not None:
                self.query_one(StatusBar).show(self.state, self._view_note(), self.source_note)
            else:
                self.query_one(Banner).update(Text(f"waiting for the collector... ({reason})"))
        except NoMatches:  # the screen is being torn down (quit): nothing left to show
            pass

    def run_ended(self, exit_code: int | None, summary_path: str) -> None:
        """Called by `traceml run` when the job is over; the viewer stays until quit."""
        self.ended_note = f"run ended, exit code {exit_code}: {summary_path}"
        self.notify(self.ended_note, title="traceml", timeout=30)
        if self.state is not None:
            self.state = replace(self.state, finished=True, exit_code=exit_code)

    def terminal_lost(self) -> None:
        """From any thread (a hangup handler, the terminal watchdog): the terminal is gone.
        Textual's output thread dies on its first EIO and the UI thread then blocks for
        ever on the full output queue, so whatever is queued from now on is thrown away;
        then the app exits (its own writes on the way out are thrown away too)."""
        writer = getattr(self._driver, "_writer_thread", None)
        queue = getattr(writer, "_queue", None)
        if queue is not None:
            threading.Thread(target=_discard, args=(queue,), name="traceml-discard",
                             daemon=True).start()
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self.exit)

    def on_resize(self) -> None:
        self.redraw()

    def _fit(self, table: HeatTable) -> None:
        """A few ranks take the lines they need and the chart the rest; many ranks take
        the space and the chart what the terminal can spare (4 lines in 80x24)."""
        rows = self.size.height
        chart = self.query_one(TimeChart)
        base = 4 if rows < SMALL_ROWS else 6 if rows < 46 else 9
        few = len(table.lines) <= FEW_LINES
        sizes = ((f"{max(5, len(table.lines))}", "1fr") if few else ("1fr", f"{base}"))
        if (str(table.styles.height), str(chart.styles.height)) != sizes:
            table.styles.height, chart.styles.height = sizes
            chart.styles.min_height = base
        # Under SMALL_ROWS lines the worst-rank panel does not fit beside the rest: the banner
        # names the rank and its gap; a pinned rank's panel still shows.
        worst = self.query_one("#worst", RankPanel)
        if worst.display != (rows >= SMALL_ROWS):
            worst.display = rows >= SMALL_ROWS

    def redraw(self) -> None:
        try:
            self._draw()
        except NoMatches:  # a view that lands while the app quits finds no widgets: skip it
            pass

    def _draw(self) -> None:
        state = self.state
        if state is None:
            return
        self.query_one(Banner).show(state)
        self.query_one(StatusBar).show(state, self._view_note(), self.source_note)
        self.query_one(Distribution).show(state)
        # Off live, the chart draws the whole run known so far with the cursor on it.
        whole = self.newest if self.cursor is not None and self.newest is not None else state
        self.query_one(TimeChart).show(whole, None if self.cursor is None else state.elapsed_s)
        table = self.query_one(HeatTable)
        table.show(state, SORT_KEYS[self.sort_index], self.reverse, self.filter_text,
                   bool(self.nodes_only))
        self._fit(table)
        worst_title = ("worst rank vs median" if state.rank is None
                       else f"{state.label.lower()}: rank {state.rank} vs median")
        self.query_one("#worst", RankPanel).show(state.worst, worst_title, state.cost)
        pinned = self.query_one("#pinned", RankPanel)
        pinned.display = self.pinned is not None
        if self.pinned is not None:
            detail = self.pinned_detail if (
                self.pinned_detail and self.pinned_detail.rank == self.pinned) else None
            pinned.show(detail, f"pinned: rank {self.pinned} vs median")

    def _view_note(self) -> str:
        parts = [f"sort: {SORT_KEYS[self.sort_index]}{' ↑' if self.reverse else ''}"]
        if self.filter_text:
            parts.append(f"filter: {self.filter_text}")
        if self.nodes_only:
            parts.append("node view")
        if self.pinned is not None:
            parts.append(f"pinned: {self.pinned}")
        if self.ended_note:
            parts.append(self.ended_note)
        moment = self.moment_note()
        if moment:
            parts.insert(0, moment)
        return "  ".join(parts)

    def moment_note(self) -> str:
        """Where the time cursor is, when it is not live."""
        if self.cursor is None or self.state is None:
            return ""
        return f"paused at step {self.state.steps} (l: live)"

    # --- events up ---------------------------------------------------------------

    def on_heat_table_pin_requested(self, message: HeatTable.PinRequested) -> None:
        self.pin(None if message.rank == self.pinned else message.rank)

    def pin(self, rank: int | None) -> None:
        self.pinned = rank  # bound into the table; redraws the panels

    # --- actions -----------------------------------------------------------------

    def action_worst(self) -> None:
        state = self.state
        rank = None if state is None else (state.rank if state.rank is not None else (
            state.worst.rank if state.worst else None))
        if rank is None:
            self.notify("no worst rank yet")
            return
        self.nodes_only = False
        self.query_one(HeatTable).go_to(rank)
        self.pin(rank)

    def action_goto(self) -> None:
        def chosen(text: str | None) -> None:
            if text is None:
                return
            if not text.strip().isdigit():
                self.notify(f"not a rank number: {text!r}", severity="warning")
                return
            rank = int(text)
            if self.state is None or not 0 <= rank < self.state.world_size:
                self.notify(f"no rank {rank} in this run", severity="warning")
                return
            self.nodes_only, self.filter_text = False, ""
            self.query_one(HeatTable).go_to(rank)
            self.pin(rank)

        self.push_screen(PromptScreen("Go to rank (number):"), chosen)

    def action_unpin(self) -> None:
        self.pin(None)

    def action_sort(self, step: int) -> None:
        self.sort_index = (self.sort_index + step) % len(SORT_KEYS)

    def action_reverse(self) -> None:
        self.reverse = not self.reverse

    def action_filter(self) -> None:
        def chosen(text: str | None) -> None:
            if text is not None:
                self.filter_text = text.strip()

        self.push_screen(PromptScreen("Filter (rank, 4-7, stale, host):", self.filter_text),
                         chosen)

    def action_nodes(self) -> None:
        self.nodes_only = not self.nodes_only

    # --- the time cursor (cursor.py) ---------------------------------------------

    def show_frame(self, index: int | None) -> None:
        """Show the frame at `index` (None: live, the newest view)."""
        if index is None:
            self.cursor = None
            if self.newest is not None:
                self.pinned_detail = self.newest_detail
                self.state = self.newest
            return
        self.cursor = index
        self.pinned_detail = None  # the pinned panel's detail is the collector's, of now
        self.state = self.frames.view(index)

    def _at(self) -> int | None:
        """The cursor's index, live counted as the newest frame; None with no frames."""
        n = len(self.frames)
        if not n:
            return None
        return n - 1 if self.cursor is None else min(self.cursor, n - 1)

    def action_cursor(self, delta: int) -> None:
        at = self._at()
        if at is None:
            self.notify("no views to move through yet")
            return
        self.show_frame(cur.step_to(self.frames.times(), at, delta))

    def action_episode(self, direction: int) -> None:
        at = self._at()
        if at is None:
            return
        subjects = self.frames.subjects()
        index = (cur.next_episode(subjects, at) if direction > 0
                 else cur.previous_episode(subjects, at))
        if index is None:
            self.notify("no later episode" if direction > 0 else "no earlier episode")
            return
        self.show_frame(index)

    def action_cursor_start(self) -> None:
        if len(self.frames):
            self.show_frame(0)

    def action_cursor_end(self) -> None:
        if len(self.frames):
            self.show_frame(len(self.frames) - 1)

    def action_live(self) -> None:
        self.show_frame(None)

    def action_checks(self) -> None:
        self.push_screen(ChecksScreen(self.state.checks if self.state else ()))

    def action_collectives(self) -> None:
        self.push_screen(CollectivesScreen(self.state.collectives if self.state else ()))

    def action_help(self) -> None:
        keys = [(b.key_display or b.key, b.tooltip or b.description) for b in self.BINDINGS
                if isinstance(b, Binding) and b.action != "stop_job"]
        keys += [(b.key, b.tooltip or b.description) for b in HeatTable.BINDINGS
                 if isinstance(b, Binding)]
        if self.stop_job is not None:
            keys.append(("ctrl+c", "Stop the training job (SIGINT), summary is written"))
        self.push_screen(HelpScreen(keys))

    def action_stop_job(self) -> None:
        if self.stop_job is None:  # a `traceml watch` viewer: it never stops the job
            self.notify("this viewer cannot stop the job; q closes the viewer", timeout=5)
            return
        self.stop_job()
        self.notify("stopping the job (SIGINT); the summary follows", timeout=10)

    def screenshot_dir(self) -> Path:
        if self.run_dir is not None:
            return RunFolder(self.run_dir).screenshots
        return Path.cwd()

    def action_trace(self) -> None:
        """Profile the next TRACE_STEPS steps on the pinned rank (or the worst one) and
        the median rank, without restarting anything."""
        ranks = None if self.pinned is None else [self.pinned]
        self.run_worker(lambda: self._trace(ranks), thread=True, name="trace")

    def _trace(self, ranks: list[int] | None) -> None:
        try:
            reply = self.source.capture(ranks, TRACE_STEPS)
        except Exception as exc:
            self.call_from_thread(self.notify, f"deep trace not started: {exc}",
                                  severity="error")
            return
        if reply.ok:
            who = ", ".join(map(str, reply.ranks))
            self.call_from_thread(self.notify, f"capturing {reply.steps} steps on rank(s) "
                                  f"{who}; T shows the analysis", title="deep trace")
        else:
            self.call_from_thread(self.notify, str(reply.error), title="deep trace",
                                  severity="warning")

    def action_show_trace(self) -> None:
        capture = self.state.capture if self.state else None
        if capture is None or not capture.text:
            self.notify("no deep trace analysed yet: press t to take one")
            return
        self.push_screen(TraceScreen(capture))

    def action_export(self) -> None:
        self.run_worker(self._export, thread=True, name="export")

    def _export(self) -> None:
        try:
            doc = self.source.summary()
            folder = self.screenshot_dir()
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / datetime.now().strftime("snapshot-%Y%m%d-%H%M%S-%f.json")
            write_atomic(path, encode(doc, indent=2).decode() + "\n")
            self.call_from_thread(self.notify, f"snapshot written to {path}", title="export")
        except Exception as exc:
            self.call_from_thread(self.notify, f"export failed: {exc}", severity="error")

    def action_save_svg(self) -> None:
        folder = self.screenshot_dir()
        try:
            folder.mkdir(parents=True, exist_ok=True)
            name = datetime.now().strftime("dashboard-%Y%m%d-%H%M%S-%f.svg")
            path = self.save_screenshot(name, str(folder))
            self.notify(f"screenshot saved to {path}", title="screenshot")
        except OSError as exc:
            self.notify(f"screenshot failed: {exc}", severity="error")

    def on_unmount(self) -> None:
        self.stopping.set()
        gc.set_threshold(*self._gc_thresholds)
        try:
            self.source.close()
        except Exception:
            pass


def _discard(queue: Any) -> None:
    """Empties Textual's output queue, writing nothing, until its end mark (None), which
    is put back for the output thread if that one is still alive to wait for it."""
    while queue.get() is not None:
        pass
    queue.put(None)
