"""The suite leaks nothing: a process a test started that is still alive when the session
ends fails the run, named with the test that started it, and is killed.

Orphans are reparented to init and are no longer anyone's children, so every process a
test starts is marked instead: the session's id and the running test's id are put in
our environment, which every child inherits (through torchrun, tmux, `script`, a
collector in a session of its own). At the end /proc is read for the session's mark.
Children forked without exec keep their parent's original environment, so our own
descendants are also noted after each test. A process meant to outlive the session (a
system daemon a test starts, e.g. munged) is started without the mark (`unmarked_env`).
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import psutil
import pytest

SESSION_VAR = "TRACEML_TEST_SESSION"
TEST_VAR = "TRACEML_TEST_ID"
# Processes still winding down when the last test returns (a job's collector writing its
# record, a SIGTERMed daemon) get this long to go; a leak is one still there after it.
GRACE_VAR = "TRACEML_TEST_LEAK_GRACE_S"  # seconds, to change it (the leak check's own test)
LEAK_GRACE_S = float(os.environ.get(GRACE_VAR, "10"))
SESSION = uuid.uuid4().hex
_descendants: dict[tuple[int, float], str] = {}  # (pid, start time) -> the test it ran in
_current = ""


def unmarked_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """An environment without the leak mark, for a process meant to outlive the suite."""
    return {k: v for k, v in (os.environ if env is None else env).items()
            if k not in (SESSION_VAR, TEST_VAR)}


def pytest_configure(config: pytest.Config) -> None:
    os.environ[SESSION_VAR] = SESSION


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    global _current
    _current = item.nodeid
    os.environ[TEST_VAR] = item.nodeid  # before fixtures: what they start is the test's


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    """Our own descendants alive after this test (forked ones carry no mark)."""
    for proc in _children():
        key = (proc.pid, _started(proc))
        _descendants.setdefault(key, item.nodeid)


def _children() -> list[psutil.Process]:
    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def _started(proc: psutil.Process) -> float:
    try:
        return proc.create_time()
    except psutil.Error:
        return 0.0


def survivors() -> list[tuple[psutil.Process, str]]:
    """Live processes of this session other than pytest itself, with the test that
    started each ("?" if none is known)."""
    me = os.getpid()
    found: dict[int, tuple[psutil.Process, str]] = {}
    mark = f"{SESSION_VAR}={SESSION}".encode()
    proc_dir = Path("/proc")
    for entry in proc_dir.iterdir() if proc_dir.is_dir() else ():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:  # gone, or not ours to read (then not ours at all)
            continue
        if mark not in environ:
            continue
        test = next((v.split(b"=", 1)[1].decode(errors="replace") for v in environ
                     if v.startswith(f"{TEST_VAR}=".encode())), "?")
        try:
            found[int(entry.name)] = (psutil.Process(int(entry.name)), test)
        except psutil.Error:
            continue
    for proc in _children():
        if proc.pid not in found:
            found[proc.pid] = (proc, _descendants.get((proc.pid, _started(proc)), _current))
    live = []
    for proc, test in found.values():
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                live.append((proc, test))
        except psutil.Error:
            pass
    return live


def _describe(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())[:300] or proc.name()
    except psutil.Error:
        return "(gone)"


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    deadline = time.monotonic() + LEAK_GRACE_S
    left = survivors()
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = survivors()
    if not left:
        return
    lines = [f"{test}: pid {proc.pid}: {_describe(proc)}" for proc, test in
             sorted(left, key=lambda pt: (pt[1], pt[0].pid))]
    for proc, _ in left:  # nothing of ours may go on loading the machine
        try:
            proc.kill()
        except psutil.Error:
            pass
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("")
        reporter.write_sep("=", f"{len(lines)} process(es) left running by tests "
                                f"(killed)", red=True)
        for line in lines:
            reporter.write_line(line)
    if session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
