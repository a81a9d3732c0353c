"""Deep trace on demand: torch.profiler over the next N steps, asked for from the dashboard.

The collector sends a request down the agent's own connection; the sender thread
hands it to a `Capturer`. The profiler is started and stopped in the training
thread, at step boundaries (the recorder calls `on_step_end` after each step it
closes): a capture never cuts a step in half and never restarts the job. Never while a
CUDA graph is being captured (the profiler's start and stop are CUDA calls, which would
invalidate it): they wait for the first step boundary after it. Exporting
the trace file happens on a thread of its own, so the training thread pays for the
profiler only during the N captured steps. Events go back through a queue the
sender thread drains ("started", "done" with the file, "failed" with why).

Never raises into user code: a failure is reported as a "failed" event.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from pathlib import Path
from typing import Any

from . import vocab
from .recorder import capturing

TRACES_DIR = vocab.TRACES_DIR


class Capturer:
    def __init__(self, rank: int, run_dir: str | None, torch: Any, rec: Any) -> None:
        self.rank = rank
        self.rec = rec  # its step_listener is set only while a capture is asked or running
        self.run_dir = run_dir
        self.torch = torch
        self.events: deque[dict[str, Any]] = deque(maxlen=64)  # for the sender thread
        self._pending: tuple[int, int] | None = None  # (capture id, steps), set by sender
        self._prof: Any = None
        self._id = 0
        self._left = 0
        self._busy = False  # from a request until its file is written
        self._step_span: Any = None
        self._step_no = 0

    # --- sender thread --------------------------------------------------------------

    def request(self, capture_id: int, steps: int) -> bool:
        """Accept a capture of the next `steps` steps; False (refused) while one runs."""
        if self._busy or not 1 <= steps <= vocab.MAX_CAPTURE_STEPS:
            return False
        self._busy = True
        self._pending = (capture_id, steps)
        self.rec.step_listener = self.on_step_end  # off the step path the rest of the time
        return True

    # --- training thread ------------------------------------------------------------

    def on_step_end(self) -> None:
        """After each step: start a requested capture, or count down a running one."""
        try:
            self._on_step_end()
        except Exception as exc:  # never into the training loop
            self._prof = None
            self.rec.step_listener = None
            self._finish(self._id, "failed", error=f"capture failed: {exc!r}")

    def _on_step_end(self) -> None:
        if capturing():  # the profiler's start and stop are CUDA calls: after the capture
            return
        if self._prof is not None:
            self._end_step_span()
            self._left -= 1
            if self._left <= 0:
                self._stop()
            else:
                self._begin_step_span()
            return
        pending = self._pending
        if pending is not None:
            self._pending = None
            self._start(*pending)

    def _start(self, capture_id: int, steps: int) -> None:
        try:
            profiler = self.torch.profiler
            activities = [profiler.ProfilerActivity.CPU]
            if self.torch.cuda.is_initialized():  # the script uses CUDA (no CUDA call)
                activities.append(profiler.ProfilerActivity.CUDA)
            prof = profiler.profile(activities=activities)
            prof.start()
        except Exception as exc:
            self.rec.step_listener = None
            self._finish(capture_id, "failed", error=f"could not start the profiler: {exc!r}")
            return
        self._prof, self._id, self._left = prof, capture_id, steps
        self._step_no = 0
        self._begin_step_span()
        self.events.append({"capture_id": capture_id, "state": "started", "steps": steps,
                            "path": None, "error": None})

    def _begin_step_span(self) -> None:
        """A "ProfilerStep#N" span per step, as torch.profiler's own schedule records them:
        the analysis (and Perfetto's users) find the steps by these names."""
        try:
            span = self.torch.profiler.record_function(f"ProfilerStep#{self._step_no}")
            span.__enter__()
            self._step_span = span
            self._step_no += 1
        except Exception:
            self._step_span = None

    def _end_step_span(self) -> None:
        span, self._step_span = self._step_span, None
        if span is not None:
            try:
                span.__exit__(None, None, None)
            except Exception:
                pass

    def _stop(self) -> None:
        prof, capture_id = self._prof, self._id
        self._prof = None
        self.rec.step_listener = None
        # Stopping can take longer than the hang threshold on a GPU (CUPTI flushes its
        # buffers): the heartbeat says the pause is the agent's own.
        self.rec.agent_busy = "deep trace stopping"
        try:
            prof.stop()
        except Exception as exc:
            self._finish(capture_id, "failed", error=f"the profiler did not stop: {exc!r}")
            return
        finally:
            self.rec.agent_busy = None
        threading.Thread(target=self._export, args=(prof, capture_id),
                         name="traceml-capture", daemon=True).start()

    # --- export thread --------------------------------------------------------------

    def _export(self, prof: Any, capture_id: int) -> None:
        try:
            folder = Path(self.run_dir or ".") / TRACES_DIR
            path = folder / f"capture{capture_id}-rank{self.rank}.json"
            _export_private(prof, Path(self.run_dir or "."), path.name)
        except Exception as exc:
            self._finish(capture_id, "failed", error=f"could not write the trace: {exc!r}")
            return
        self._finish(capture_id, "done", path=str(path.resolve()))

    def _finish(self, capture_id: int, state: str, path: str | None = None,
                error: str | None = None) -> None:
        self.events.append({"capture_id": capture_id, "state": state, "steps": 0, "path": path,
                            "error": error})
        self._busy = False


_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)


def _export_private(prof: Any, run_dir: Path, name: str) -> None:
    """The trace into RUN_DIR/traces/NAME without following a link anywhere: the folders
    opened with O_NOFOLLOW, the profiler's file written in a fresh 0700 folder of ours
    (mkdir fails on anything planted) reached through the descriptor (/proc/self/fd,
    where there is one), then renamed into traces/: the collector never reads half a
    trace, and a swap of a shared run folder cannot send the trace elsewhere."""
    run_fd = os.open(run_dir, _DIR)
    try:
        try:
            os.mkdir(TRACES_DIR, 0o700, dir_fd=run_fd)
        except FileExistsError:
            pass
        dir_fd = os.open(TRACES_DIR, _DIR, dir_fd=run_fd)
    finally:
        os.close(run_fd)
    scratch = f".{name}.tmp{os.getpid()}"
    try:
        os.mkdir(scratch, 0o700, dir_fd=dir_fd)
        try:
            through = f"/proc/self/fd/{dir_fd}"
            base = through if os.path.isdir(through) else str(run_dir / TRACES_DIR)
            prof.export_chrome_trace(f"{base}/{scratch}/{name}")
            scratch_fd = os.open(scratch, _DIR, dir_fd=dir_fd)
            try:  # nobody else can write in our fresh 0700 scratch folder
                os.chmod(name, 0o600, dir_fd=scratch_fd)  # the user's own, as every file
                os.replace(name, name, src_dir_fd=scratch_fd, dst_dir_fd=dir_fd)
            finally:
                os.close(scratch_fd)
        finally:
            _remove_scratch(dir_fd, scratch)
    finally:
        os.close(dir_fd)


def _remove_scratch(dir_fd: int, scratch: str) -> None:
    try:
        fd = os.open(scratch, _DIR, dir_fd=dir_fd)
    except OSError:
        return
    try:
        for left in os.listdir(fd):  # a failed export's partial file
            os.unlink(left, dir_fd=fd)
    except OSError:
        pass
    finally:
        os.close(fd)
    try:
        os.rmdir(scratch, dir_fd=dir_fd)
    except OSError:
        pass
