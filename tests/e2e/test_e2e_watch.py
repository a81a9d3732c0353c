"""End to end: `traceml watch` attaches to a real `traceml run` job and sees every rank;
quitting the viewer leaves the job running; a viewer whose terminal dies ends with it."""

from __future__ import annotations

import fcntl
import json
import os
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from jobs import EXAMPLES, kill_session, live_steps, traceml, wait_for
from traceml_tui.view.client import ViewClient, resolve_target
from traceml_tui.view.dashboard import DashboardApp

pytestmark = pytest.mark.e2e
FAULTY = Path(__file__).resolve().parents[1] / "support" / "faulty_ddp.py"


async def test_watch_a_real_run_sees_all_ranks_and_quitting_leaves_it_running(tmp_path):
    out = tmp_path / "runs"
    job = subprocess.Popen(
        [sys.executable, "-m", "traceml_tui", "run", str(EXAMPLES / "ddp_toy.py"),
         "--nproc-per-node", "3", "--headless", "--out", str(out), "--run-name", "w", "--",
         "--scenario", "forward", "--rank", "2", "--steps", "1000000"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    run_dir = out / "w"
    try:
        wait_for(lambda: live_steps(run_dir) >= 40, 120)
        address, found_dir, secret = resolve_target(None, out)  # `traceml watch`, no argument
        assert found_dir == run_dir
        app = DashboardApp(ViewClient(address, secret=secret), found_dir, refresh_s=0.2)
        async with app.run_test(size=(140, 44)) as pilot:
            for _ in range(100):
                await pilot.pause(0.1)
                if app.state is not None and app.state.label == "COMPUTE STRAGGLER":
                    break
            state = app.state
            assert state is not None
            assert [r.rank for r in state.rows] == [0, 1, 2]
            assert state.reporting == 3
            assert (state.label, state.rank) == ("COMPUTE STRAGGLER", 2)
            await pilot.press("q")
        before = live_steps(run_dir)
        wait_for(lambda: live_steps(run_dir) > before + 10, 30)  # the job goes on
        assert job.poll() is None
    finally:
        job.send_signal(signal.SIGINT)
        job.wait(60)
    assert (run_dir / "final_summary.json").exists()


@pytest.mark.parametrize(("target", "message"), [
    ("no/such/dir", "no such run folder"),
    (".", "not a traceml run folder"),
])
def test_watch_bad_targets_are_one_clear_line(tmp_path, target, message):
    proc = traceml("watch", target, cwd=tmp_path, timeout=60)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_watch_with_no_live_run(tmp_path):
    proc = traceml("watch", cwd=tmp_path, timeout=60)
    assert proc.returncode == 2
    assert "no live run" in proc.stderr


def test_watch_from_another_node_uses_the_address_node_0_advertised(tmp_path, monkeypatch):
    """On a shared run folder, collector.json's loopback view address is node 0's own: a
    viewer on another host must use the advertised one."""
    import json
    import socket

    from traceml_tui.view.client import resolve_target

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "collector.json").write_text(json.dumps({
        "view": "tcp://127.0.0.1:31744", "view_remote": "tcp://gpu01:31744",
        "host": "gpu01"}))
    monkeypatch.setattr(socket, "gethostname", lambda: "gpu02")
    assert resolve_target(str(run_dir))[0] == "tcp://gpu01:31744"
    monkeypatch.setattr(socket, "gethostname", lambda: "gpu01")
    assert resolve_target(str(run_dir))[0] == "tcp://127.0.0.1:31744"


# --- a viewer whose terminal dies -----------------------------------------------------

# The session leader of the test's pty, as a login shell would be. The kernel sends the
# hangup only to it (and to the foreground group when it exits); here it either ignores
# the hangup, as nohup or a CI runner does (and the viewer inherits that), or survives
# it, as a shell with a HUP trap or `traceml run` does (the viewer then gets none).
SESSION_LEADER = """
import fcntl, signal, subprocess, sys, termios
fcntl.ioctl(0, termios.TIOCSCTTY, 0)
if sys.argv[1] == "ignores":
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
else:
    signal.signal(signal.SIGHUP, lambda *_: None)
sys.exit(subprocess.call(sys.argv[2:]))
"""


@pytest.fixture
def canned_collector() -> Iterator[str]:
    """A collector's view socket serving canned states (no job, no key), a different one
    each poll, so the dashboard redraws its whole screen every refresh."""
    import zmq

    from traceml_tui.collect.canned import make_state, make_view
    from traceml_tui.viewmodel import encode_detail, encode_view

    views = [encode_view(make_view(make_state(world_size=64, nproc_per_node=8, seed=i,
                                              straggler=3 + 7 * i, extra_ms=10.0 + 9 * i)))
             for i in range(4)]
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REP)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve() -> None:
        n = 0
        while not stop.is_set():
            if sock.poll(100):
                sock.recv()
                sock.send_multipart([views[n % len(views)], encode_detail(None)])
                n += 1
        sock.close(0)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"tcp://127.0.0.1:{port}"
    stop.set()
    thread.join(5)


def _cpu_s(pid: int) -> float:
    """CPU seconds a process has used so far (user + system), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _gone(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


class Terminal:
    """The terminal program's side of a pty (its master), 200x60, read as fast as the
    viewer writes unless told to stop."""

    def __init__(self) -> None:
        self.master, self.slave = os.openpty()
        fcntl.ioctl(self.slave, termios.TIOCSWINSZ, struct.pack("HHHH", 60, 200, 0, 0))
        self.screen = bytearray()
        self.samples: list[int] = []

    def read(self, size: int = 65536) -> bool:
        """Reads what is there; True if anything was."""
        if not select.select([self.master], [], [], 0.05)[0]:
            return False
        self.screen.extend(os.read(self.master, size))
        return True

    def shows(self, text: bytes) -> bool:
        while self.read():
            pass
        return text in self.screen

    def full(self) -> bool:
        """Unread output stopped growing for longer than a refresh: the viewer is blocked
        writing into the pty (not reading it until then)."""
        pending = struct.unpack("i", fcntl.ioctl(self.master, termios.FIONREAD, b"\0" * 4))
        self.samples.append(pending[0])
        time.sleep(0.2)  # one sample per 0.2 s (the condition spans 0.8 s)
        return len(self.samples) > 4 and self.samples[-1] > 0 and len(set(self.samples[-5:])) == 1

    def mid_frame(self) -> bool:
        """Drains what is there, then takes the first small chunk of the next frame only."""
        while self.read():
            pass
        return self.read(512)

    def close_slave(self) -> None:
        """The viewer's side, once it has it."""
        if self.slave >= 0:
            os.close(self.slave)
            self.slave = -1

    def close(self) -> None:
        """The terminal program dies (the viewer's side too, if still ours)."""
        self.close_slave()
        if self.master >= 0:
            os.close(self.master)
            self.master = -1


def _hang_up_on_a_drawing_viewer(collector: str, leader: str, stalled: bool,
                                 env: dict[str, str], cwd: Path) -> str | None:
    """One round: what went wrong, or None."""
    term = Terminal()
    session = subprocess.Popen(
        [sys.executable, "-c", SESSION_LEADER, leader, sys.executable, "-m", "traceml_tui",
         "watch", collector],
        stdin=term.slave, stdout=term.slave, stderr=term.slave, start_new_session=True,
        env=env, cwd=cwd)
    term.close_slave()
    viewer: psutil.Process | None = None
    try:
        wait_for(lambda: term.shows(b"rank"), 60, "the dashboard to draw")
        children = psutil.Process(session.pid).children()
        assert len(children) == 1, children
        viewer = children[0]
        if stalled:
            wait_for(term.full, 30, "the viewer's writes to block on the full pty")
        else:
            wait_for(term.mid_frame, 10, "the next frame")
        cpu_before = last_cpu = _cpu_s(viewer.pid)
        term.close()  # the terminal program dies
        closed = time.monotonic()
        while not _gone(viewer) and time.monotonic() - closed < 5:
            try:
                last_cpu = _cpu_s(viewer.pid)
            except OSError:
                break
            time.sleep(0.05)
        took = time.monotonic() - closed
        spent = last_cpu - cpu_before
        if not _gone(viewer):
            return f"the viewer is alive {took:.1f} s after, having used {spent:.1f} s of CPU"
        if took > 2.0:
            return f"the viewer took {took:.1f} s to end"
        if spent > 0.5:
            return f"the viewer used {spent:.1f} s of CPU in the {took:.1f} s it took to end"
        code = session.wait(10)
        return None if code == 129 else f"exit code {code}, not 129"
    finally:
        term.close()
        for proc in (viewer, psutil.Process(session.pid) if session.poll() is None else None):
            try:
                if proc is not None:
                    proc.kill()
            except psutil.Error:
                pass
        session.wait(10)


@pytest.mark.alone  # gone within 2 s of the hangup: no other test's load beside it
def test_a_viewer_never_outlives_its_terminal(tmp_path, canned_collector):
    """The terminal (the pty's master, which the test holds as a terminal program does)
    is closed while the dashboard draws, 8 times: just after a frame began, and while
    the viewer is blocked writing into a full pty. However the session leader treats the
    hangup, every `traceml watch` is gone within 2 s, burning no core meanwhile (129)."""
    env = {k: v for k, v in os.environ.items() if k != "TRACEML_SECRET"}
    env["TERM"] = "xterm-256color"
    failures = []
    for round_ in range(8):
        leader, stalled = ("ignores", "survives")[round_ % 2], round_ % 4 >= 2
        failure = _hang_up_on_a_drawing_viewer(canned_collector, leader, stalled, env,
                                               tmp_path)
        if failure:
            failures.append(f"round {round_} (session leader {leader} the hangup, "
                            f"{'blocked writing' if stalled else 'mid-frame'}): {failure}")
    assert not failures, "\n".join(failures)


def test_a_run_whose_terminal_dies_without_a_hangup_goes_on_headless_and_ends(tmp_path):
    """`traceml run`'s own dashboard, its terminal closed mid-frame under a session leader
    that survives the hangup (so no SIGHUP reaches the launcher, which would stop the job):
    the viewer closes, the job goes on untouched as when the viewer quits, and the launcher
    ends with it (exit 0, complete record), its output in the run folder."""
    out = tmp_path / "runs"
    run_dir = out / "lost"
    env = {k: v for k, v in os.environ.items() if k != "TRACEML_SECRET"}
    env.update(TERM="xterm-256color", OMP_NUM_THREADS="1")
    term = Terminal()
    session = subprocess.Popen(
        [sys.executable, "-c", SESSION_LEADER, "survives", sys.executable, "-m", "traceml_tui",
         "run", str(FAULTY), "--nproc-per-node", "2", "--out", str(out), "--run-name", "lost",
         "--", "--steps", "500", "--step-ms", "20", "--quiet"],
        stdin=term.slave, stdout=term.slave, stderr=term.slave, start_new_session=True,
        env=env, cwd=tmp_path)
    term.close_slave()
    try:
        wait_for(lambda: term.shows(b"rank") and live_steps(run_dir) >= 20, 120,
                 "the dashboard to draw the job")
        wait_for(term.mid_frame, 10, "the next frame")
        term.close()
        summary = run_dir / "final_summary.json"
        wait_for(summary.exists, 120, "the job to end")
        try:
            code = session.wait(30)
        except subprocess.TimeoutExpired:
            raise AssertionError("the launcher is still running 30 s after its job ended") \
                from None
        assert code == 0
        doc = json.loads(summary.read_text())
        assert doc["complete"] is True
        assert [r["steps"] for r in doc["ranks"]] == [500, 500]
        assert "viewer closed; the job goes on" in (run_dir / "launcher.log").read_text()
    finally:
        term.close()
        if session.poll() is None:
            kill_session(session)  # the job, its collector and the launcher
            session.wait(10)
