"""The run's secret and CURVE: a peer without the run's keys changes nothing.

A real collector process with a secret; a legitimate agent-shaped sender with the
run's keys; forged senders that know the collector's address (and even its public
key) but not the secret. Only the legitimate data may reach the record.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from jobs import wait_for
from traceml_agent import keys, protocol
from traceml_agent.protocol import PHASES, Identity
from traceml_tui.runfolder.summary_model import to_doc
from traceml_tui.view.client import ViewClient, ViewUnavailable

SECRET = "ab" * 32


def test_keys_derive_from_the_secret_alone():
    a, b = keys.derive(SECRET), keys.derive(SECRET)
    other = keys.derive("cd" * 32)
    assert a == b and a.server_public != other.server_public
    assert len({a.server_public, a.client_public, a.server_secret, a.client_secret}) == 4
    assert zmq.curve_public(a.client_secret) == a.client_public


@pytest.mark.parametrize("bad", ["", "abc", "zz" * 32, "ab" * 31])
def test_a_malformed_secret_is_refused_in_words(bad):
    with pytest.raises(keys.SecretError, match="64 hex characters"):
        keys.check_secret(bad)


def test_the_secret_file_is_private_and_never_overwritten(tmp_path):
    path = tmp_path / keys.SECRET_FILE
    assert keys.write_secret_file(path, SECRET)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert not keys.write_secret_file(path, "cd" * 32)  # a second node reads, never rewrites
    assert keys.read_secret_file(path) == SECRET


def test_load_secret_prefers_the_explicit_file_then_the_environment(tmp_path, monkeypatch):
    (tmp_path / keys.SECRET_FILE).write_text("11" * 32)
    monkeypatch.delenv("TRACEML_SECRET", raising=False)
    assert keys.load_secret(tmp_path) == "11" * 32
    monkeypatch.setenv("TRACEML_SECRET", "22" * 32)
    assert keys.load_secret(tmp_path) == "22" * 32
    explicit = tmp_path / "other.key"
    explicit.write_text("33" * 32)
    assert keys.load_secret(tmp_path, explicit) == "33" * 32
    monkeypatch.delenv("TRACEML_SECRET")
    assert keys.load_secret(tmp_path / "nowhere") is None


def test_collector_refuses_the_network_without_a_secret(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRACEML_SECRET"}
    proc = subprocess.run([sys.executable, "-m", "traceml_tui", "collector", "--run-dir",
                           str(tmp_path), "--world-size", "2", "--bind", "0.0.0.0"],
                          capture_output=True, text=True, timeout=30, env=env)
    assert proc.returncode == 2 and "without authentication" in proc.stderr
    assert "Traceback" not in proc.stderr


# --- a live collector with a secret ----------------------------------------------------------


@pytest.fixture
def secured(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "traceml_tui", "collector", "--run-dir", str(run_dir),
         "--world-size", "2", "--run-name", "secured"],
        env={**os.environ, "TRACEML_SECRET": SECRET}, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (run_dir / "collector.json").exists(), 30, "the collector")
        yield run_dir, json.loads((run_dir / "collector.json").read_text())
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _steps(rank: int, n: int) -> list[bytes]:
    ident = Identity(rank, rank, 0, "host", 100 + rank, 2)
    records = [[s, time.time(), 10.0, 1.0, None, 2.0, 3.0, 1.0, 1.0, 2.0] for s in range(n)]
    return [protocol.encode("hello", ident, 0, time.time(), run="secured", device="cpu", env={}),
            protocol.encode("steps", ident, 1, time.time(), phases=list(PHASES),
                            records=records, dropped=0)]


def _dealer(ctx: zmq.Context, address: str, client: tuple[bytes, bytes] | None,
            server_public: bytes | None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if client is not None:
        sock.curve_publickey, sock.curve_secretkey = client
        sock.curve_serverkey = server_public
    sock.connect(address)
    return sock


def test_a_forged_client_without_the_keys_changes_nothing(secured):
    run_dir, info = secured
    run_keys = keys.derive(SECRET)
    ctx = zmq.Context()
    try:
        # Forgers: one with a key pair of its own (it even knows the server's public key),
        # one with no encryption at all. Each claims to be rank 1 and sends 50 steps.
        forged = [_dealer(ctx, info["ingest"], zmq.curve_keypair(), run_keys.server_public),
                  _dealer(ctx, info["ingest"], None, None)]
        for sock in forged:
            for frame in _steps(1, 50):
                sock.send(frame, zmq.NOBLOCK)
        good = _dealer(ctx, info["ingest"], (run_keys.client_public, run_keys.client_secret),
                       run_keys.server_public)
        for frame in _steps(0, 20):
            good.send(frame)
        viewer = ViewClient(info["view"], timeout_s=5, secret=SECRET)

        def rank0_arrived() -> bool:
            ranks = to_doc(viewer.summary())["ranks"]
            return ranks[0]["steps"] == 20

        wait_for(rank0_arrived, 20, "the legitimate steps")
        time.sleep(1.5)  # the forgers had as long as the legitimate sender, and more
        doc = to_doc(viewer.summary())
        assert [r["steps"] for r in doc["ranks"]] == [20, 0]
        counters = doc["collector"]
        assert counters["messages"] == 2 and counters["malformed"] == 0
        assert counters["rejected_peers"] >= 1  # the forger with a key pair was turned away

        # A viewer without the keys gets nothing either.
        thief = ViewClient(info["view"], timeout_s=1.5)
        with pytest.raises(ViewUnavailable, match="TRACEML_SECRET"):
            thief.fetch()
        thief.close()
        # Nor can it ask the control socket to end the run.
        control = _dealer(ctx, info["control"], zmq.curve_keypair(), run_keys.server_public)
        control.send_multipart([b"", json.dumps({"op": "finish"}).encode()])
        time.sleep(1.0)
        assert not (Path(run_dir) / "final_summary.json").exists()
        viewer.close()
    finally:
        ctx.destroy(linger=0)


def test_a_viewer_with_the_run_folder_attaches(secured):
    from traceml_tui.view.client import resolve_target

    run_dir, _ = secured
    (run_dir / keys.SECRET_FILE).write_text(SECRET + "\n")
    env_secret = os.environ.pop("TRACEML_SECRET", None)
    try:
        address, _, secret = resolve_target(str(run_dir))
    finally:
        if env_secret is not None:
            os.environ["TRACEML_SECRET"] = env_secret
    client = ViewClient(address, timeout_s=5, secret=secret)
    view, _ = client.fetch()
    client.close()
    assert view.run_name == "secured" and view.world_size == 2
