"""What `traceml run` shows and reads of the job while it runs headless.

Progress lines from the collector's live snapshot, a tee of torchrun's stderr that
keeps its last lines, and torchrun's own report of the rank that failed first.
"""

from __future__ import annotations

import collections
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

from traceml_agent.sanitize import clean_line
from traceml_tui.runfolder import folders
from traceml_tui.runfolder.layout import RunFolder
from traceml_tui.runfolder.summary_model import (
    MAX_SUMMARY_BYTES,
    NotASummary,
    Summary,
    decode,
    read_bounded,
)

STATUS_EVERY_S = 10.0


_ROOT_CAUSE = re.compile(
    r"Root Cause \(first observed failure\):.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)",
    re.S)


def parse_root_cause(text: str) -> tuple[int, int] | None:
    """torchrun's own record of the first rank that failed: (rank, exit code), where a
    negative exit code is the signal that killed it. The only witness when a rank is
    killed outright: it sends no goodbye, while the survivors report errors of their own."""
    match = _ROOT_CAUSE.search(text)
    return (int(match.group(1)), int(match.group(2))) if match else None


def read_summary(path: Path) -> tuple[Summary, int]:
    """A summary or snapshot of our run folder and its mtime (ns), read through the run
    folder's pinned descriptor (folders.read_bytes), never by path; NotASummary says why
    not in one line."""
    data, mtime = read_bounded(path, lambda p: folders.read_bytes(p, MAX_SUMMARY_BYTES))
    return decode(data, str(path)), mtime


class Progress:
    """Headless progress: a line when the live diagnosis changes, and every STATUS_EVERY_S."""

    def __init__(self, run_dir: Path) -> None:
        self.path = RunFolder(run_dir).live
        self.last_key: tuple | None = None
        self.last_print = time.monotonic()
        self.mtime = 0
        self.doc: Summary | None = None

    def poll(self) -> None:
        # The file changes every few seconds: parse it only when it did. Read through the
        # run folder's pinned descriptor: after a swap of a shared --out, the path is
        # another user's folder, and these lines would be theirs.
        try:
            if folders.mtime_ns(self.path) != self.mtime:
                self.doc, self.mtime = read_summary(self.path)
        except (OSError, NotASummary):
            return
        doc = self.doc
        if doc is None or doc.live_diagnosis is None:
            return
        d = doc.live_diagnosis
        key = (d.label, d.rank, doc.failure is not None)
        now = time.monotonic()
        if key != self.last_key or now - self.last_print >= STATUS_EVERY_S:
            run = doc.run
            who = f" rank {d.rank}" if d.rank is not None else ""
            # A rank that failed leads the line (failures first), as in the summary.
            lead = "" if doc.failure is None else f"{doc.failure.summary} · "
            print(clean_line(f"[traceml] {lead}step {run.steps} · {run.ranks_reporting}/"
                             f"{run.world_size} ranks · {d.label}{who}: {d.summary}"),
                  file=sys.stderr, flush=True)
            self.last_key, self.last_print = key, now


class Tee:
    """Copies a child's stream to our stderr line by line, keeping the last lines."""

    def __init__(self, stream: Any) -> None:
        self.lines: collections.deque[str] = collections.deque(maxlen=400)
        self.thread = threading.Thread(target=self._run, args=(stream,), daemon=True)
        self.thread.start()

    def _run(self, stream: Any) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace")
            self.lines.append(line)
            sys.stderr.write(line)
            sys.stderr.flush()

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)


def read_tail(path: Path, limit: int = 64_000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            return f.read().decode(errors="replace")
    except OSError:
        return ""
