"""The end of a run, as `traceml run` prints it and exits with: one reply, built here.

Three places end a run: node 0's collector answering the launcher's finish request
(the normal end), the launcher itself when the collector is gone (it promotes the last
live snapshot), and a node other than 0 (which writes no summary). All three build
their reply with `summary_reply` or `node_reply`, so the exit code, the text and where
the record went are said the same way whoever ends the run.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from traceml_agent.vocab import SUMMARY_JSON
from traceml_tui.runfolder import summary_model as model
from traceml_tui.runfolder.layout import RunFolder

from .summary import render_text


class EndReply(msgspec.Struct, kw_only=True):
    """What the launcher prints and exits with (the collector sends it as JSON)."""

    exit_code: int | None
    text: str  # the text summary, or a node's own closing lines
    path: str | None = None  # where final_summary.json went; None: not written here
    failed_rank: int | None = None
    error: str | None = None  # why no summary was written
    incomplete: str | None = None  # why the record is incomplete (the collector was lost)
    node_done: bool = False  # a node other than 0: node 0 writes the summary
    ok: bool = True

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = msgspec.to_builtins(self)
        return out


def from_wire(obj: Any) -> EndReply | None:
    """The collector's reply to finish, validated; None if it is not one."""
    try:
        return msgspec.convert(obj, EndReply)
    except msgspec.ValidationError:
        return None


def summary_reply(run_dir: Path, doc: dict[str, Any] | model.Summary,
                  write: Callable[[], Path | None], note: str = "") -> EndReply:
    """Render the summary `doc`, write it by `write` (summary.write_summary, perhaps
    through the collector's reserved descriptors) and say where it went. A disk that
    cannot take it costs the file, never the record on the terminal."""
    s = doc if isinstance(doc, model.Summary) else model.from_doc(doc)
    reply = EndReply(exit_code=s.run.exit_code, failed_rank=s.run.failed_rank,
                     text=render_text(s) + note)
    try:
        reply.path = str(write() or RunFolder(Path(run_dir)).summary_json)
    except OSError as exc:
        reply.error = f"could not write {SUMMARY_JSON}: {exc}"
    return reply


def node_reply(exit_code: int | None, text: str, failed_rank: int | None = None) -> EndReply:
    """A node other than 0: its own exit code and lines, no summary of its own."""
    return EndReply(exit_code=exit_code, text=text, failed_rank=failed_rank, node_done=True)


def no_record(exit_code: int | None, text: str, error: str) -> EndReply:
    """Node 0 with nothing to write: the collector died before any snapshot."""
    return EndReply(exit_code=exit_code, text=text, error=error)
