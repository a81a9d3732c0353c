"""Node relays (traceml_tui/collect/relay.py): another node's ranks reach node 0's collector
through one relay process on their node, with the run's keys on both legs.

A real collector process and a real relay process (as `traceml run` starts them);
the "ranks" are DEALER sockets sending protocol messages, so the test can also
receive what the collector sends back to a rank through the relay.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import zmq

from jobs import free_ports, wait_for
from traceml_agent import keys, protocol
from traceml_agent.protocol import PHASES, Identity
from traceml_tui.collect.relay import RelayProcess
from traceml_tui.runfolder.summary_model import to_doc
from traceml_tui.view.client import ViewClient

SECRET = "ab" * 32


def _messages(rank: int, node: int, steps: range, seq0: int = 0) -> list[bytes]:
    ident = Identity(rank, 0, node, f"host{node}", 100 + rank, 2)
    records = [[s, time.time(), 10.0, 1.0, None, 2.0, 3.0, 1.0, 1.0, 2.0] for s in steps]
    out = [] if seq0 else [protocol.encode("hello", ident, 0, time.time(), run="relayed",
                                           device="cpu", env={})]
    return out + [protocol.encode("steps", ident, seq0 + 1, time.time(), phases=list(PHASES),
                                  records=records, dropped=0)]


def _rank_socket(ctx: zmq.Context, address: str, secret: str | None = SECRET) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    run_keys = keys.derive(secret or SECRET)
    if secret is None:  # a forger: its own key pair, the server's public key
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        sock.curve_serverkey = run_keys.server_public
    else:
        keys.secure_client(sock, run_keys)
    sock.connect(address)
    return sock


@pytest.fixture
def two_node_collector(tmp_path):
    """A collector for 2 ranks on 2 nodes; rank 1's node has its relay."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "TRACEML_SECRET": SECRET}
    proc = subprocess.Popen(
        [sys.executable, "-m", "traceml_tui", "collector", "--run-dir", str(run_dir),
         "--world-size", "2", "--nnodes", "2", "--nproc-per-node", "1", "--run-name",
         "relayed"], env=env, stderr=subprocess.PIPE, text=True)
    relay = None
    try:
        wait_for(lambda: (run_dir / "collector.json").exists(), 30, "the collector")
        info = json.loads((run_dir / "collector.json").read_text())
        relay = RelayProcess(info["ingest"], 1, SECRET, None, tmp_path / "relay.log")
        viewer = ViewClient(info["view"], timeout_s=5, secret=SECRET)
        yield info, relay, viewer, tmp_path / "relay.log"
        viewer.close()
    finally:
        if relay is not None:
            relay.stop()
        proc.terminate()
        proc.wait(timeout=30)


def _steps(viewer: ViewClient) -> list[int]:
    return [r["steps"] for r in to_doc(viewer.summary())["ranks"]]


def test_a_relayed_rank_is_seen_and_answered(two_node_collector):
    info, relay, viewer, log = two_node_collector
    ctx = zmq.Context()
    try:
        direct = _rank_socket(ctx, info["ingest"])
        relayed = _rank_socket(ctx, relay.address)
        forger = _rank_socket(ctx, relay.address, secret=None)
        for frame in _messages(0, 0, range(30)):
            direct.send(frame)
        for frame in _messages(1, 1, range(40)):
            relayed.send(frame)
        for frame in _messages(1, 1, range(40, 500), seq0=5):  # turned away by the relay
            forger.send(frame, zmq.NOBLOCK)
        wait_for(lambda: _steps(viewer) == [30, 40], 20, "both ranks' steps")
        doc = to_doc(viewer.summary())
        assert doc["relays"]["nodes"] == [1] and doc["relays"]["silent"] == []
        assert doc["relays"]["lost_batches"] == 0 and doc["relays"]["dropped"] == 0
        assert doc["collector"]["malformed"] == 0
        assert doc["ranks"][1]["host"] == "host1"

        # A deep-trace request for rank 1 goes back through the relay to its socket.
        reply = viewer.capture(ranks=[1], steps=3)
        assert reply.ok and 1 in reply.ranks, reply
        assert relayed.poll(10_000), "the capture request never reached the relayed rank"
        request = relayed.recv()
        assert protocol.decode_capture_request(request) == (reply.id, 3)

        # The relay keeps the rank's later messages flowing; the forger never got in.
        for frame in _messages(1, 1, range(40, 60), seq0=2):
            relayed.send(frame)
        wait_for(lambda: _steps(viewer) == [30, 60], 20, "rank 1's later steps")
    finally:
        ctx.destroy(linger=0)
    assert relay.stop() == 0
    text = log.read_text()
    assert "relay for node 1" in text and "dropped 0" in text, text


def test_a_lost_relay_is_reported_while_its_node_has_ranks(two_node_collector):
    info, relay, viewer, _ = two_node_collector
    ctx = zmq.Context()
    try:
        relayed = _rank_socket(ctx, relay.address)
        for frame in _messages(1, 1, range(10)):
            relayed.send(frame)
        wait_for(lambda: _steps(viewer)[1] == 10, 20, "rank 1's steps")
        view, _ = viewer.fetch()
        assert view.relays_silent == ()
        relay.proc.kill()
        relay.proc.wait()
        wait_for(lambda: to_doc(viewer.summary())["relays"]["silent"] == [1], 20,
                 "the relay's silence to be seen")
        wait_for(lambda: viewer.fetch()[0].relays_silent == (1,), 5, "the dashboard to say it")
    finally:
        ctx.destroy(linger=0)


# --- the relay binds what it reserves (issue 30, finding 9) ----------------------------


def test_the_relays_pipe_per_rank_is_the_collectors_bound():
    from traceml_tui.collect import collector, relay

    assert relay.LOCAL_HWM == collector.MAX_RECV_HWM


def _squat(port: int) -> socket.socket | None:
    """Another local user binding the relay's port first; None if it cannot."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", port))
        sock.listen(1)
        return sock
    except OSError:
        sock.close()
        return None


def test_the_relays_port_cannot_be_squatted_while_it_waits_for_the_secret(tmp_path):
    """The ranks are told the port at once; the relay waits for the secret (here from a
    store that never answers). Meanwhile nobody else can take the port, and a rank that
    connects early is served once the secret arrives."""
    secret_file = tmp_path / "secret.key"
    relay = RelayProcess("tcp://127.0.0.1:9", 1, None, f"127.0.0.1:{free_ports(1)}",
                         tmp_path / "relay.log", secret_file)
    try:
        squatter = _squat(relay.port)
        assert squatter is None, "another user bound the relay's port before the relay did"
        assert relay.proc.poll() is None and relay.failure() is None
        keys.write_secret_file(secret_file, SECRET)  # a shared folder's secret shows up
        wait_for(lambda: "relay for node 1: tcp://127.0.0.1:" in
                 (tmp_path / "relay.log").read_text(), 30, "the relay to start")
        assert relay.proc.poll() is None
    finally:
        assert relay.stop() == 0


def test_a_relay_that_cannot_start_is_said(tmp_path):
    """A relay that cannot start says why in one line (the launcher prints it on that
    node's terminal and in its last message)."""
    relay = RelayProcess("not-an-endpoint", 1, SECRET, None, tmp_path / "relay.log")
    wait_for(lambda: relay.proc.poll() is not None, 30, "the relay to give up")
    line = relay.failure()
    assert line is not None and "node 0 does not see this node's ranks" in line, line
    assert "relay:" in line


def test_a_node_whose_ranks_never_reported_leaves_the_record_incomplete(two_node_collector):
    """Node 1's relay could not start: node 0 sees only its own rank. The summary says
    the record is not complete, and which node is missing."""
    info, _relay, viewer, _ = two_node_collector
    ctx = zmq.Context()
    try:
        direct = _rank_socket(ctx, info["ingest"])
        for frame in _messages(0, 0, range(30)):
            direct.send(frame)
        wait_for(lambda: _steps(viewer)[:1] == [30], 20, "rank 0's steps")
        control = ctx.socket(zmq.REQ)
        keys.secure_client(control, keys.derive(SECRET))
        control.connect(info["control"])
        control.send_json({"op": "finish", "grace_s": 0.2, "torchrun_exit": 0})
        assert control.poll(20_000)
        reply = control.recv_json()
    finally:
        ctx.destroy(linger=0)
    assert reply["ok"] and "no rank of node(s) 1 ever reported" in reply["text"], reply
    doc = json.loads(open(reply["path"]).read())
    assert doc["complete"] is False and doc["run"]["nodes_never_seen"] == [1]
