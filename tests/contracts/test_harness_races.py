"""The test harness's own races (issue 42, item 8): a process listed, then gone before it
is signalled or asked its state, is success for a teardown, never a test's error (a green
fresh-clone run once ended with `psutil.NoSuchProcess` in test_terminal's fixture)."""

from __future__ import annotations

import subprocess
import sys

import psutil

from jobs import alive, kill_all


def _gone() -> psutil.Process:
    """A process listed while it ran, which has ended and been reaped since."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)
    listed = psutil.Process(proc.pid)
    proc.stdin.close()
    proc.wait(30)
    return listed


def test_killing_a_process_that_ended_since_it_was_listed_is_not_an_error():
    gone = _gone()
    kill_all([gone])  # raised psutil.NoSuchProcess as `proc.kill()`
    assert not alive(gone)


def test_a_live_process_is_alive_then_killed():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        listed = psutil.Process(proc.pid)
        assert alive(listed)
        kill_all([listed])
        assert proc.wait(30) == -9
        assert not alive(listed)
    finally:
        proc.kill()
        proc.wait()
