"""The dashboard on a run's record, read-only: the same widgets, fed from keyframes.

`traceml watch RUN_DIR` on a run that is over opens this. The record (collect/replay.py
builds it; the view only reads its `Recorded` frames) is read in a worker thread, with the
progress in the banner; then the dashboard opens at the run's end (its verdict) and the
time cursor walks back through it. Nothing here talks to a collector: no deep trace, no
stopping; the export writes the record's own summary.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from rich.text import Text
from textual import work
from textual.binding import Binding

from traceml_agent.requests import CaptureReply
from traceml_tui.runfolder.summary_model import Summary, from_doc
from traceml_tui.viewmodel import RankDetail, RunView

from . import cursor as cur
from .app import DashboardApp
from .banner import Banner


class RecordSource:
    """The ViewSource of a record: its summary for the export, nothing live."""

    def __init__(self, summary: dict[str, Any] | None) -> None:
        self.doc = summary

    def fetch(self, pinned: int | None) -> tuple[RunView, RankDetail | None]:
        raise RuntimeError("a record has no live view")

    def summary(self) -> Summary:
        if self.doc is None:
            raise RuntimeError("this run has no summary (its collector died)")
        return from_doc(self.doc)

    def capture(self, ranks: list[int] | None = None, steps: int = 5) -> CaptureReply:
        return CaptureReply(ok=False, error="a record cannot be traced: the run is over")

    def close(self) -> None:
        pass


FOOTER = ("cursor(-1)", "cursor(1)", "episode(-1)", "episode(1)")


class ReplayApp(DashboardApp):
    """The dashboard on a record: `status` is how the run ended, in one line."""

    TITLE = "traceml (record)"
    # The dashboard's keys, the time cursor's in the footer (a record is there to walk);
    # a deep trace and Ctrl-C have nothing to act on.
    BINDINGS = [dataclasses.replace(b, show=b.action in FOOTER or (
        b.show and b.action != "trace")) for b in DashboardApp.BINDINGS
        if isinstance(b, Binding)]

    def __init__(self, record: cur.Recorded, status: str, run_dir: Path | None = None,
                 summary: dict[str, Any] | None = None) -> None:
        super().__init__(RecordSource(summary), run_dir)
        self.record = record
        self.status = status
        self.source_note = ""
        self.loaded = False

    def on_mount(self) -> None:
        super().on_mount()  # its poll worker ends at once: see _poll
        self.query_one(Banner).update(Text("reading the record...", style="bold"))
        self._load()

    def _poll(self) -> None:
        """No collector to poll: the frames come from the record."""

    # Its own group: an exclusive worker would cancel the (empty) poll worker's group,
    # and this one with it before it ran.
    @work(thread=True, group="replay", name="replay")
    def _load(self) -> None:
        try:
            self.record.load(lambda n: self.call_from_thread(self._progress, n))
        except Exception as exc:  # an unreadable record: say so, keep the app up to quit
            self.call_from_thread(self._failed, str(exc))
            return
        self.call_from_thread(self._loaded)

    def _progress(self, records: int) -> None:
        self.query_one(Banner).update(Text(f"reading the record: {records:,} step records...",
                                           style="bold"))

    def _failed(self, reason: str) -> None:
        self.query_one(Banner).update(Text(f"cannot read the record: {reason}", style="bold"))

    def _loaded(self) -> None:
        self.frames = self.record
        self.loaded = True
        n = len(self.record)
        if not n:
            self.query_one(Banner).update(Text(
                f"no step records in this run's step log ({self.status})", style="bold"))
            return
        self.newest = self.record.view(n - 1)
        self.show_frame(n - 1)

    def show_frame(self, index: int | None) -> None:
        """A record has no live: `l` and the end are its last keyframe."""
        if not len(self.frames):
            return
        super().show_frame(len(self.frames) - 1 if index is None else index)

    def moment_note(self) -> str:
        if self.state is None or self.cursor is None:
            return self.status
        n = len(self.frames)
        where = ("end" if self.cursor == n - 1 else f"view {self.cursor + 1}/{n}")
        return f"record at step {self.state.steps} ({where})  {self.status}"

    def action_trace(self) -> None:
        self.notify("a record cannot be traced: the run is over")

    def action_stop_job(self) -> None:
        self.notify("a record: there is no job to stop; q closes the viewer", timeout=5)
