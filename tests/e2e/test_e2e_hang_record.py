"""End to end: the hang record (docs/hangs.md). Real `traceml run` jobs that hang, then
Ctrl-C: the summary keeps the hang as it was latched, with the stuck rank's stacks taken
on whichever node it ran."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

import netns
from jobs import (
    EXAMPLES,
    free_ports,
    kill_session,
    ptrace_allowed,
    spawn_traceml,
    validate_schema,
    wait_for,
)
from traceml_tui.judge.ingest import NATIVE_THREAD

pytestmark = pytest.mark.e2e

HERE = Path(__file__).resolve().parents[1] / "support"


def _live(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "live_snapshot.json").read_text())
    except (OSError, ValueError):
        return {}


def _stop(*procs: subprocess.Popen) -> list[str]:
    """Ctrl-C, as the user presses it on each node's terminal; their outputs."""
    for p in procs:
        p.send_signal(signal.SIGINT)
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=90)[0])
        except subprocess.TimeoutExpired:
            kill_session(p)
            outputs.append(p.communicate()[0])
    return outputs


def test_ctrl_c_waking_the_stuck_rank_leaves_the_latched_hang_in_the_summary(tmp_path):
    """Rank 1 sleeps inside `with traceml_agent.step()`; the others wait in all_reduce.
    Ctrl-C wakes it: leaving the `with` closes its step, and the ranks exit. The summary
    still says HANG rank 1, with the stack it had while stuck, not the aftermath."""
    out = tmp_path / "runs"
    job = spawn_traceml("run", str(HERE / "hang_wakes.py"), "--nproc-per-node", "3",
                        "--headless", "--out", str(out), "--run-name", "wakes",
                        "--hang-after", "3", "--", "--hang-rank", "1", "--hang-at-step", "20")
    run_dir = out / "wakes"
    try:
        wait_for(lambda: "1" in ((_live(run_dir).get("hang") or {}).get("stacks") or {}),
                 120, "HANG with rank 1's stack")
        live = _live(run_dir)
        assert live["live_diagnosis"]["label"] == "HANG" and live["hang"]["ranks"] == [1]
    finally:
        output = _stop(job)[0]
    doc = json.loads((run_dir / "final_summary.json").read_text())
    validate_schema(doc)
    steps = {r["rank"]: r["steps"] for r in doc["ranks"]}
    assert steps[1] > 20, steps  # the woken rank closed its step: the aftermath happened
    assert (doc["diagnosis"]["label"], doc["diagnosis"]["rank"]) == ("HANG", 1), output
    assert doc["hang"]["ranks"] == [1]
    assert "sleep_forever" in doc["hang"]["stacks"]["1"][0]["stack"]
    assert doc["timeline"][-1]["label"] == "HANG"
    assert "Diagnosis: HANG  rank 1" in output


@pytest.mark.skipif(shutil.which("py-spy") is None, reason="py-spy is not installed")
@pytest.mark.skipif(not ptrace_allowed(), reason="ptrace is forbidden here (Yama scope)")
def test_a_gil_stuck_ranks_flushed_steps_do_not_erase_the_hang(tmp_path):
    """Issue 39 item 8: rank 1 blocks in a C call holding the GIL, so its agent's sender
    cannot run: the steps it took since the last send wait in its queue (fast steps: tens
    of them). Ctrl-C wakes it and the queue is flushed; those steps were taken before the
    hang. The record used to drop HANG once more than 3 steps per rank came after it."""
    out = tmp_path / "runs"
    job = spawn_traceml("run", str(EXAMPLES / "ddp_toy.py"), "--nproc-per-node", "2",
                        "--headless", "--out", str(out), "--run-name", "gilflush",
                        "--hang-after", "3", "--", "--gil-hang-rank", "1", "--hang-at-step",
                        "300", "--batch", "4", "--dim", "8", "--steps", "100000")
    run_dir = out / "gilflush"
    try:
        wait_for(lambda: (hang := _live(run_dir).get("hang") or {}).get("ranks") == [1]
                 and "1" in (hang.get("stacks") or {}), 150, "HANG rank 1, with its stack")
    finally:
        output = _stop(job)[0]
    doc = json.loads((run_dir / "final_summary.json").read_text())
    validate_schema(doc)
    # Before: "HANG, every rank at step 300 in backward" (same collective), no rank named
    # and no stack of rank 1's, once its 10-20 queued steps had arrived.
    assert (doc["diagnosis"]["label"], doc["diagnosis"]["rank"]) == ("HANG", 1), output
    assert doc["hang"]["ranks"] == [1] and doc["hang"]["kind"] == "behind", doc["hang"]
    assert "block_in_c_holding_the_gil" in doc["hang"]["stacks"]["1"][-1]["stack"]
    assert doc["timeline"][-1]["label"] == "HANG"


@pytest.mark.skipif(shutil.which("py-spy") is None, reason="py-spy is not installed")
@pytest.mark.skipif(not ptrace_allowed(), reason="ptrace is forbidden here (Yama scope)")
@pytest.mark.parametrize("hosts", ["loopback", "netns"])
def test_a_rank_of_node_1_stuck_in_native_code_has_its_stacks_in_the_summary(tmp_path, hosts):
    """Two nodes of 2 ranks (on loopback, or each in its own network namespace with its
    own address, as separate hosts); rank 2 (node 1) blocks in a C call holding the GIL,
    so it sends nothing. Node 1's launcher dumps it with py-spy, asked by the collector
    through node 1's relay, and the stack reaches node 0's summary: Python and native
    frames."""
    out, port = tmp_path / "runs", free_ports(3)
    with contextlib.ExitStack() as stack:
        if hosts == "netns":
            if (why := netns.unavailable()) is not None:
                pytest.skip(why)
            nodes = stack.enter_context(netns.cluster(2))
            master = nodes[0].address
            wrap = [n.wrap for n in nodes]
            ifname = [n.interface for n in nodes]
        else:
            master, wrap, ifname = "127.0.0.1", [list, list], [None, None]

        def node(n: int) -> subprocess.Popen:
            env = {"TRACEML_SECRET": "cd" * 32}  # no handover: the job starts sooner
            if ifname[n]:
                env["GLOO_SOCKET_IFNAME"] = ifname[n]
            args = ("run", str(EXAMPLES / "ddp_toy.py"), "--nnodes", "2", "--node-rank",
                    str(n), "--nproc-per-node", "2", "--master-addr", master,
                    "--master-port", str(port), "--run-name", "native2", "--out", str(out),
                    "--headless", "--hang-after", "3", "--", "--gil-hang-rank", "2",
                    "--hang-at-step", "10", "--steps", "100000")
            return spawn_traceml(*args, env=env, wrapper=tuple(wrap[n]([])))

        def native(doc: dict) -> str:
            threads = ((doc.get("hang") or {}).get("stacks") or {}).get("2") or []
            return next((t["stack"] for t in threads if t["thread"] == NATIVE_THREAD), "")

        p0, p1 = node(0), node(1)
        run_dir = out / "native2"
        try:
            wait_for(lambda: "pause" in native(_live(run_dir)), 150, "rank 2's native stack")
        finally:
            outputs = _stop(p0, p1)
    doc = json.loads((run_dir / "final_summary.json").read_text())
    validate_schema(doc)
    assert (doc["diagnosis"]["label"], doc["hang"]["ranks"]) == ("HANG", [2]), outputs[0]
    stack = native(doc)
    assert "pause" in stack and "block_in_c_holding_the_gil" in stack, stack
    assert doc["collector"].get("stacks_refused", 0) == 0
    assert "block_in_c_holding_the_gil" in outputs[0]  # node 0's text summary shows it


def test_a_node_cut_off_reads_its_relay_lost_not_dead(tmp_path):
    """Two nodes, each in its own network namespace; node 1's link goes down mid-run:
    gloo stalls every rank, and node 1's ranks fall silent with their relay. The hang
    reads "node 1's relay lost", not a dead rank: their processes may well be alive."""
    if (why := netns.unavailable()) is not None:
        pytest.skip(why)
    out, port = tmp_path / "runs", free_ports(3)
    with netns.cluster(2) as nodes:
        procs = [spawn_traceml(
            "run", str(EXAMPLES / "ddp_toy.py"), "--nnodes", "2", "--node-rank", str(k),
            "--nproc-per-node", "2", "--master-addr", nodes[0].address, "--master-port",
            str(port), "--run-name", "cut", "--out", str(out), "--headless",
            "--hang-after", "8", "--", "--steps", "100000",
            env={"TRACEML_SECRET": "cd" * 32, "GLOO_SOCKET_IFNAME": nodes[k].interface},
            wrapper=tuple(nodes[k].wrap([]))) for k in (0, 1)]
        run_dir = out / "cut"
        try:
            wait_for(lambda: min((r.get("steps") or 0) for r in
                                 _live(run_dir).get("ranks") or [{}]) >= 10
                     and len(_live(run_dir).get("ranks") or []) == 4, 150, "steps from all")
            subprocess.run(["ip", "link", "set", f"{nodes[1].interface}p", "down"], check=True)
            wait_for(lambda: (_live(run_dir).get("hang") or {}).get("kind") is not None, 60,
                     "the hang")
        finally:
            outputs = _stop(*procs)
    doc = json.loads((run_dir / "final_summary.json").read_text())
    assert doc["hang"]["kind"] == "relay lost", doc["hang"]
    assert doc["hang"]["ranks"] == [2, 3]
    assert "node 1's relay lost" in doc["diagnosis"]["summary"], outputs[0][-2000:]
    assert "gone or frozen" not in doc["diagnosis"]["summary"]
