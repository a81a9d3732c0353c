"""The terminal `traceml` was started from, as job control sees it.

A process may draw on a terminal only while its process group is the terminal's
foreground group: a background job (`traceml run ... &`, a command under `timeout`,
which runs it in a group of its own) that changes the terminal's modes is stopped by
the kernel with SIGTTOU, and everything in its group with it. So the dashboard runs
only when we own the foreground; otherwise `traceml run` goes headless by itself.
"""

from __future__ import annotations

import os
import sys
from typing import TextIO


def owns_foreground(stdin: TextIO | None = None, stdout: TextIO | None = None) -> bool:
    """True when stdin and stdout are a terminal whose foreground process group is ours."""
    stdin = sys.stdin if stdin is None else stdin
    stdout = sys.stdout if stdout is None else stdout
    try:
        fds = (stdin.fileno(), stdout.fileno())
        if not all(os.isatty(fd) for fd in fds):
            return False
        return all(os.tcgetpgrp(fd) == os.getpgrp() for fd in fds)
    except (OSError, ValueError, AttributeError):  # closed, detached or not a real file
        return False


def is_terminal(stream: TextIO) -> bool:
    try:
        return os.isatty(stream.fileno())
    except (OSError, ValueError, AttributeError):
        return False
