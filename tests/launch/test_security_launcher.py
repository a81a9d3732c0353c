"""The launcher's own doors (issue 30: findings 3, 4, 8, 9 and two of 11), tried as an
attacker would: a key holder (any rank, any script of the job) asking the collector to
end the record or naming someone else's process for a ptrace; a local user squatting
the relay's port or swapping a shared --out; the run's secret in torchrun's store.

Real processes and real sockets: the collector as `traceml run` starts it, the relay as
its own process, torchrun's TCPStore.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq
from key_holder import rank_socket

from jobs import EXAMPLES, wait_for
from traceml_agent import keys, protocol
from traceml_agent.protocol import PHASES, Identity
from traceml_agent.requests import Finish
from traceml_tui.launch import launcher, options
from traceml_tui.runfolder import folders

SECRET = "cd" * 32


def _opts(**kw) -> options.RunOptions:
    return options.RunOptions(script=EXAMPLES / "ddp_toy.py", **kw)


def _rank_socket(ctx: zmq.Context, address: str) -> zmq.Socket:
    """A key holder: the run's client keys, as every rank has them."""
    return rank_socket(ctx, address, SECRET)


def _request(ctx: zmq.Context, address: str, request: dict) -> dict:
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    keys.secure_client(sock, keys.derive(SECRET))
    sock.connect(address)
    try:
        sock.send_json(request)
        assert sock.poll(10_000), f"no reply to {request}"
        return sock.recv_json()
    finally:
        sock.close()


def _rank_messages(rank: int, pid: int, steps: range, seq: int) -> list[bytes]:
    ident = Identity(rank, 0, 0, "host0", pid, 1)
    records = [[s, time.time(), 10.0, 1.0, None, 2.0, 3.0, 1.0, 1.0, 2.0] for s in steps]
    out = [protocol.encode("hello", ident, 0, time.time(), run="sec", device="cpu", env={})]
    return out + [protocol.encode("steps", ident, seq, time.time(), phases=list(PHASES),
                                  records=records, dropped=0)]


@pytest.fixture
def collector(tmp_path):
    """Node 0's collector for one rank, started by the launcher's own function."""
    run_dir = tmp_path / "run"
    folders.make_private_dir(run_dir)
    proc, info, key = launcher.start_collector(run_dir, "sec", _opts(), time.time(), SECRET, 0)
    ctx = zmq.Context()
    try:
        yield run_dir, proc, info, key, ctx
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)
        ctx.destroy(linger=0)


# --- finding 8: finish only from the launcher ------------------------------------------


def test_a_key_holders_finish_is_refused_and_counted_while_the_rank_trains(collector):
    run_dir, proc, info, key, ctx = collector
    rank = _rank_socket(ctx, info["ingest"])
    # The rank's process: below the launcher (this test), as the collector checks.
    rank_proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    for m in _rank_messages(0, rank_proc.pid, range(5), 1):
        rank.send(m)
    # A key holder (the secret is in every rank's environment) asks to end the record.
    for forged in ({"op": "finish", "grace_s": 0, "exit_code": 0},
                   {"op": "finish", "grace_s": 0, "exit_code": 0, "key": "0" * 64},
                   {"op": "native_stack", "rank": 0, "pid": 4242, "text": "fake"}):
        reply = _request(ctx, info["control"], forged)
        assert reply["ok"] is False and "not the launcher" in reply["error"], reply
    for m in _rank_messages(0, rank_proc.pid, range(5, 10), 2)[1:]:  # it trains on
        rank.send(m)
    assert proc.poll() is None and not (run_dir / "final_summary.json").exists()
    # The launcher's finish, with the key it gave the collector on stdin, is accepted.
    request = Finish(torchrun_exit=0, command=["t"], ended_at=time.time(), grace_s=0.5)
    reply = launcher._finish(info["control"], request, proc, SECRET, key)
    assert reply is not None and reply.ok is True, reply
    doc = json.loads((run_dir / "final_summary.json").read_text())
    assert doc["complete"] is True and doc["ranks"][0]["steps"] == 10
    assert doc["collector"]["control_refused"] == 3
    rank.close()
    rank_proc.kill()
    rank_proc.wait()


def test_the_control_key_is_nowhere_a_rank_can_read(collector):
    run_dir, proc, _info, key, _ctx = collector
    environ = Path(f"/proc/{proc.pid}/environ").read_bytes()
    cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
    assert key.encode() not in environ and key.encode() not in cmdline
    for f in run_dir.rglob("*"):
        if f.is_file():
            assert key.encode() not in f.read_bytes(), f


def test_a_collector_without_its_key_on_stdin_does_not_start(tmp_path):
    done = subprocess.run([sys.executable, "-m", "traceml_tui.collect.collector", "--run-dir",
                           str(tmp_path / "r"), "--world-size", "1", "--control-key-stdin"],
                          input="short\n", capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "64 hex characters" in done.stderr


# --- finding 4: ptrace only of our own children ----------------------------------------


def _sleeper_under_a_fake_torchrun() -> tuple[subprocess.Popen, int]:
    """A stand-in for the torchrun the launcher started, with one child (a 'rank')."""
    fake = subprocess.Popen([sys.executable, "-c", "import subprocess; p = subprocess.Popen("
                             "['sleep', '300']); print(p.pid, flush=True); p.wait()"],
                            stdout=subprocess.PIPE, text=True)
    assert fake.stdout is not None
    return fake, int(fake.stdout.readline())


def test_a_forged_hello_naming_an_unrelated_process_gets_no_dump(tmp_path):
    """Rank 0's hello names a process of the owner's that is not part of the run; rank 1's
    names a real child of "torchrun". Both go silent (a dead hang, past 7 s: 5 s of
    silence first): only rank 1 is dumped; rank 0's request
    is refused and counted in the summary."""
    import threading

    from traceml_tui.launch.native_stacks import NativeStackWatcher, control_sender

    run_dir = tmp_path / "run"
    folders.make_private_dir(run_dir)
    proc, info, key = launcher.start_collector(run_dir, "sec", _opts(nproc_per_node=2,
                                               hang_after=7.0), time.time(), SECRET, 0)
    unrelated = subprocess.Popen(["sleep", "300"])  # the owner's, not the run's
    torchrun, rank_pid = _sleeper_under_a_fake_torchrun()
    calls = tmp_path / "py-spy-calls"
    py_spy = tmp_path / "py-spy"
    py_spy.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\necho 'Thread 1: pause (libc.so.6)'\n")
    py_spy.chmod(0o700)
    ctx = zmq.Context()
    stop = threading.Event()
    try:
        socks = []
        for rank, pid in ((0, unrelated.pid), (1, rank_pid)):
            ident = Identity(rank, rank, 0, "host0", pid, 2)
            sock = _rank_socket(ctx, info["ingest"])
            records = [[s, time.time(), 10.0, 1.0, None, 2.0, 3.0, 1.0, 1.0, 2.0]
                       for s in range(20)]
            sock.send(protocol.encode("hello", ident, 0, time.time(), run="sec", device="cpu",
                                      env={}))
            sock.send(protocol.encode("steps", ident, 1, time.time(), phases=list(PHASES),
                                      records=records, dropped=0))
            socks.append(sock)  # then silence: both ranks hang
        watcher = NativeStackWatcher(run_dir, 0, control_sender(info["control"], SECRET, key),
                                     stop, torchrun.pid, py_spy=str(py_spy))
        watcher.start()
        wait_for(lambda: watcher.refused == 1 and calls.exists(), 60, "the hang's dumps")
        request = Finish(torchrun_exit=0, ended_at=time.time(), grace_s=0.0,
                         extra={"native_stack_refused": watcher.refused})
        stop.set()
        reply = launcher._finish(info["control"], request, proc, SECRET, key)
        assert reply is not None and reply.ok, reply
        for s in socks:
            s.close()
    finally:
        stop.set()
        for p in (unrelated, torchrun, proc):
            p.kill()
            p.wait(timeout=30)
        subprocess.run(["kill", str(rank_pid)], capture_output=True)
        ctx.destroy(linger=0)
    dumped = calls.read_text().split("\n")
    assert dumped == [f"dump --native --pid {rank_pid}", ""], dumped  # never the unrelated
    doc = json.loads((run_dir / "final_summary.json").read_text())
    assert doc["run"]["native_stack_refused"] == 1


# --- finding 3: the secret never travels in the clear -----------------------------------


@pytest.fixture
def store():
    """torchrun's store, as node 0's torchrun runs it (a real TCPStore), and an `until`
    that says when 'torchrun' ended."""
    import threading
    from datetime import timedelta

    from torch.distributed import TCPStore

    from jobs import free_ports

    port = free_ports(1)
    master = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=10))
    ended = threading.Event()
    yield master, port, ended
    ended.set()


def _carries(master, *names: str) -> list[str]:
    return [n for n in names if master.check([n])]


def _node_opts(k: int) -> options.RunOptions:
    return _opts(nnodes=2, node_rank=k, nproc_per_node=1, run_name="sec")


def test_with_a_shared_folder_the_store_carries_nothing(tmp_path, store, monkeypatch):
    from traceml_agent import handover

    master, port, ended = store
    monkeypatch.delenv("TRACEML_SECRET", raising=False)
    monkeypatch.setenv(handover.SHARED_WAIT_ENV, "30")
    shared = tmp_path / "sec"
    folders.make_private_dir(shared)
    # Node 1 first, before node 0 made the secret: it finds no file yet and waits.
    assert launcher.run_secret(_node_opts(1), shared) is None
    node1 = launcher._Handover(_node_opts(1), port, ended.is_set, shared, None)
    secret = launcher.run_secret(_node_opts(0), shared)
    node0 = launcher._Handover(_node_opts(0), port, ended.is_set, shared, secret)
    wait_for(lambda: node0.outcome == "shared", 25, "node 0 to see the folder shared")
    assert node1.outcome == "shared" and node1.wait_secret(1) == secret
    assert _carries(master, handover.SECRET_KEY, handover.RUN_DIR_KEY) == []
    assert secret not in "".join(master.get(k).decode() for k in ("traceml/shared/1",))


def test_with_traceml_secret_the_store_carries_nothing(tmp_path, store, monkeypatch):
    from traceml_agent import handover

    master, port, ended = store
    monkeypatch.setenv("TRACEML_SECRET", SECRET)
    torchrun = subprocess.Popen(["sleep", "30"])
    try:
        for k in (0, 1):
            run_dir = tmp_path / f"node{k}"
            folders.make_private_dir(run_dir)
            node = launcher._Node("tcp://x:1", "tcp://x:2", SECRET)
            launcher._start_handover(_node_opts(k), node, run_dir, port, torchrun)
            assert node.handover is None
        time.sleep(0.5)  # nothing is running that could write: a short look suffices
        assert _carries(master, handover.SECRET_KEY, handover.RUN_DIR_KEY) == []
    finally:
        torchrun.kill()
        torchrun.wait()


def test_without_either_the_secret_goes_through_the_store_and_both_nodes_say_so(
        tmp_path, store, monkeypatch, capfd):
    from traceml_agent import handover

    master, port, ended = store
    monkeypatch.delenv("TRACEML_SECRET", raising=False)
    monkeypatch.setenv(handover.SHARED_WAIT_ENV, "1")
    dirs = [tmp_path / "node0" / "sec", tmp_path / "node1" / "sec"]  # no shared folder
    for d in dirs:
        d.parent.mkdir()
        folders.make_private_dir(d)
    secret = launcher.run_secret(_node_opts(0), dirs[0])
    assert launcher.run_secret(_node_opts(1), dirs[1]) is None
    # Someone on the network writes a proof of their own for node 1: checked, refused.
    master.set("traceml/shared/1", "0" * 64)
    node0 = launcher._Handover(_node_opts(0), port, ended.is_set, dirs[0], secret)
    node1 = launcher._Handover(_node_opts(1), port, ended.is_set, dirs[1], None)
    assert node1.wait_secret(30) == secret
    wait_for(lambda: node0.outcome == "store", 10, "node 0 to publish")
    assert node1.outcome == "store"
    err = capfd.readouterr().err
    warnings = [ln for ln in err.splitlines() if "as private as the master port" in ln]
    assert len(warnings) == 2, err  # one line on each node's terminal
    assert all("TRACEML_SECRET on every node, or use a shared --out" in w for w in warnings)
    assert "node(s) 1 did not show the shared run folder" in warnings[0] + warnings[1]


def test_a_secret_planted_in_the_store_is_said_on_both_nodes(tmp_path, store, monkeypatch,
                                                            capfd):
    """Issue 42, 7c: anyone at the master port writes a secret of theirs before node 0
    publishes; node 1 takes it, and its ranks never report. Both nodes now say so in one
    line, with the remedy."""
    from traceml_agent import handover

    master, port, ended = store
    monkeypatch.delenv("TRACEML_SECRET", raising=False)
    monkeypatch.setenv(handover.SHARED_WAIT_ENV, "2")
    dirs = [tmp_path / "node0" / "sec", tmp_path / "node1" / "sec"]  # no shared folder
    for d in dirs:
        d.parent.mkdir()
        folders.make_private_dir(d)
    secret = launcher.run_secret(_node_opts(0), dirs[0])
    planted = "ab" * 32
    master.set(handover.SECRET_KEY, planted)  # the attacker, first
    node1 = launcher._Handover(_node_opts(1), port, ended.is_set, dirs[1], None)
    assert node1.wait_secret(30) == planted  # it cannot tell, yet
    node0 = launcher._Handover(_node_opts(0), port, ended.is_set, dirs[0], secret)
    wait_for(lambda: node0.outcome == "store", 15, "node 0 to publish")

    def said() -> list[str]:
        said.err += capfd.readouterr().err  # type: ignore[attr-defined]
        return [ln for ln in said.err.splitlines()  # type: ignore[attr-defined]
                if "wrote a secret of theirs" in ln]

    said.err = ""  # type: ignore[attr-defined]
    wait_for(lambda: len(said()) == 2, 15, "both nodes to say the secret was planted")
    lines = said()
    assert any(ln.startswith("[traceml] node 0: another secret was there before node 0's")
               for ln in lines), lines
    assert any(ln.startswith("[traceml] node 1: the run's secret changed after this node "
                             "read it") for ln in lines), lines
    assert all("TRACEML_SECRET on every node, or use a shared --out" in ln for ln in lines)
    assert planted not in "".join(lines) and secret not in "".join(lines)
    # The attacker rewrites it after node 0 published: node 0 says that too, once.
    master.set(handover.SECRET_KEY, planted)
    wait_for(lambda: len(said()) == 3, 15, "node 0 to see its secret rewritten")
    assert said()[-1].startswith("[traceml] node 0: the run's secret was rewritten")


# --- finding 11: a shared --out is used through the verified folder's descriptor --------


def test_a_run_folder_swapped_for_a_link_after_start_does_not_redirect_the_record(collector):
    """Another user swaps OUT/NAME for a symbolic link to a folder of theirs after the
    collector checked it: the snapshots and the final summary still go to the folder
    that was checked, nothing to the link's target."""
    run_dir, proc, info, key, _ctx = collector
    attacker = run_dir.parent / "attacker"
    attacker.mkdir()
    moved = run_dir.parent / "moved"
    wait_for(lambda: (run_dir / "live_snapshot.json").exists(), 30, "a first snapshot")
    run_dir.rename(moved)
    run_dir.symlink_to(attacker)
    first = (moved / "live_snapshot.json").stat().st_mtime_ns
    wait_for(lambda: (moved / "live_snapshot.json").stat().st_mtime_ns != first, 30,
             "the next snapshot, written into the checked folder")
    request = Finish(torchrun_exit=0, ended_at=time.time(), grace_s=0.0)
    reply = launcher._finish(info["control"], request, proc, SECRET, key)
    assert reply is not None and reply.ok, reply
    assert (moved / "final_summary.json").exists() and (moved / "final_summary.txt").exists()
    assert list(attacker.iterdir()) == []


def test_writes_below_a_pinned_folder_never_follow_a_link(tmp_path):
    run_dir = tmp_path / "run"
    folders.make_private_dir(run_dir)
    folders.pin_dir(run_dir)
    (run_dir / "traces").mkdir(mode=0o700)
    folders.write_atomic(run_dir / "traces" / "capture1.txt", "ours")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run_dir / "traces").rename(run_dir / "traces.old")
    (run_dir / "traces").symlink_to(elsewhere)
    with pytest.raises(OSError):
        folders.write_atomic(run_dir / "traces" / "capture2.txt", "redirected?")
    assert list(elsewhere.iterdir()) == []
    assert (run_dir / "traces.old" / "capture1.txt").read_text() == "ours"


def test_a_deep_trace_is_never_written_through_a_swapped_run_folder(tmp_path):
    """The rank's trace export (the capture temp file): into the real traces folder
    while the run folder is ours, refused once it has been swapped for a link."""
    from types import SimpleNamespace

    from traceml_agent.capture import Capturer

    class Profile:  # what torch's profiler does with the path it is given
        def export_chrome_trace(self, path: str) -> None:
            with open(path, "w") as f:
                f.write('{"traceEvents": []}')

    run_dir = tmp_path / "run"
    folders.make_private_dir(run_dir)
    capturer = Capturer(0, str(run_dir), None, SimpleNamespace(agent_busy=None))
    capturer._export(Profile(), 1)
    assert capturer.events[-1]["state"] == "done", capturer.events
    written = run_dir / "traces" / "capture1-rank0.json"
    assert written.read_text() == '{"traceEvents": []}'
    assert oct(written.stat().st_mode & 0o777) == "0o600"
    assert [p.name for p in (run_dir / "traces").iterdir()] == [written.name]  # no scratch

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run_dir.rename(tmp_path / "moved")
    run_dir.symlink_to(elsewhere)
    capturer._export(Profile(), 2)
    assert capturer.events[-1]["state"] == "failed", capturer.events
    assert list(elsewhere.iterdir()) == []


# --- issue 42, 7g: node 0's collector ports on a multi-node run are fixed -------------------
