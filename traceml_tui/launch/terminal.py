"""The terminal `traceml` was started from, as job control sees it.

A process may draw on a terminal only while its process group is the terminal's
foreground group: a background job (`traceml run ... &`, a command under `timeout`,
which runs it in a group of its own) that changes the terminal's modes is stopped by
the kernel with SIGTTOU, and everything in its group with it. So the dashboard runs
only when we own the foreground; otherwise `traceml run` goes headless by itself.

A viewer must also end with its terminal. The kernel's hangup signal reaches only the
session leader and the foreground group, and only if nobody ignores it (nohup, a CI
runner, a wrapper that traps it): otherwise a viewer whose terminal died keeps going,
its output thread dead on EIO, its UI thread blocked on the full output queue, and
Textual's input thread spinning a core on a descriptor that reads EOF forever.
`exit_with_terminal` ends such a viewer from a thread of its own.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
from collections.abc import Callable
from typing import TextIO

HANGUP_EXIT = 128 + signal.SIGHUP  # 129: what a shell reports for a process a hangup ended
# How often the watchdog also asks the terminal directly (tcgetpgrp, fstat); a hangup
# itself wakes it at once (poll() reports POLLHUP/POLLERR/POLLNVAL without being asked).
WATCHDOG_CHECK_S = 0.5


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


def exit_with_terminal(fds: tuple[int, ...] = (0, 1, 2),
                       on_lost: Callable[[], None] | None = None,
                       default_hangup: bool = True) -> threading.Thread:
    """A viewer never outlives its terminal: a daemon thread that needs nothing from the
    event loop watches the terminal descriptors among `fds`; on a hangup, an error or a
    descriptor gone it calls `on_lost` (default: leave at once with HANGUP_EXIT,
    restoring nothing: there is no terminal to restore, and any cleanup could block on
    it). With `default_hangup`, SIGHUP also gets the kernel's default action back (death,
    whatever the threads are doing, even if our parent ignored it); `traceml run` keeps
    its own handler. Call from the main thread before the app starts."""
    if default_hangup:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
    # Only descriptors that are a terminal we can ask (our controlling one) are watched.
    ttys = tuple(fd for fd in dict.fromkeys(fds) if _isatty(fd) and _alive(fd))
    thread = threading.Thread(target=_watch, args=(ttys, on_lost or _hard_exit),
                              name="traceml-terminal-watchdog", daemon=True)
    thread.start()
    return thread


def _watch(fds: tuple[int, ...], on_lost: Callable[[], None]) -> None:
    poller = select.poll()
    for fd in fds:
        poller.register(fd, 0)  # hangup, error and invalid descriptor are always reported
    while fds:
        if poller.poll(WATCHDOG_CHECK_S * 1000) or not all(map(_alive, fds)):
            on_lost()
            return


def _alive(fd: int) -> bool:
    """A hung-up terminal answers its ioctls with EIO; a closed descriptor with EBADF."""
    try:
        os.fstat(fd)
        os.tcgetpgrp(fd)
        return True
    except OSError:
        return False


def _hard_exit() -> None:
    os._exit(HANGUP_EXIT)


def _isatty(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False
