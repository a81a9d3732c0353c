"""`traceml netcheck`: its arithmetic as a table (nccl-tests' formulas, the localisation
rule), a real one-node check, a node that never comes up, and an emulated three-node
cluster with one node's link shaped (namespaces on a bridge; skipped where the machine
forbids them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

import netns
from jobs import free_ports, traceml
from traceml_tui.judge import bandwidth as nm

GB = 1e9


@pytest.mark.parametrize("op, world, factor", [
    ("all_reduce", 8, 2 * 7 / 8), ("all_reduce", 2, 1.0), ("all_gather", 4, 3 / 4),
    ("reduce_scatter", 4, 3 / 4), ("broadcast", 16, 1.0), ("all_reduce", 1, 0.0),
])
def test_bus_bandwidth_follows_nccl_tests(op, world, factor):
    alg, bus = nm.bandwidths(op, int(2 * GB), 1.0, world)
    assert alg == pytest.approx(2.0) and bus == pytest.approx(2.0 * factor)


FAST, SLOW = 1.0, 0.1
HOSTS4 = ["a", "b", "c", "d"]


def pairs_with(slow: set[int], n: int, fast: float = FAST, slow_gbps: float = SLOW):
    return {(a, b): slow_gbps if {a, b} & slow else fast for a, b in nm.node_pairs(n)}


@pytest.mark.parametrize("what, gbps, hosts, slow", [
    ("one slow node of three", pairs_with({2}, 3), HOSTS4[:3], [2]),
    ("one slow node of four", pairs_with({1}, 4), HOSTS4, [1]),
    ("all fast", pairs_with(set(), 4), HOSTS4, []),
    ("all equally slow is no outlier", pairs_with({0, 1, 2, 3}, 4), HOSTS4, []),
    ("a link at half speed is within the rule", pairs_with({2}, 3, slow_gbps=0.5),
     HOSTS4[:3], []),
    ("two nodes cannot say which end", pairs_with({1}, 2), HOSTS4[:2], []),
    ("a slow node among twenty (neighbour pairs)", pairs_with({7}, 20),
     [f"h{k}" for k in range(20)], [7]),
])
def test_the_slow_node_is_named_from_its_pairs(what, gbps, hosts, slow):
    found = nm.slow_nodes(gbps, hosts)
    assert [s.node for s in found] == slow, what
    for s in found:
        assert s.host == hosts[s.node] and s.ratio < nm.SLOW_RATIO


def test_pairs_are_all_pairs_up_to_16_nodes_then_two_neighbours_each():
    assert nm.node_pairs(3) == [(0, 1), (0, 2), (1, 2)]
    assert len(nm.node_pairs(16)) == 120
    big = nm.node_pairs(100)
    assert len(big) <= 200 and all(sum(k in p for p in big) >= 2 for k in range(100))


def test_an_mtu_mismatch_is_flagged():
    assert nm.mtu_mismatch({0: 1500, 1: 1500, 2: 1500}) is None
    text = nm.mtu_mismatch({0: 9000, 1: 1500, 2: 1500})
    assert text.startswith("MTU mismatch: node 0 use 9000, the others 1500")


def _doc(out, name):
    return json.loads((out / name / "netcheck.json").read_text())


@pytest.mark.e2e
def test_one_node_sweeps_every_collective_and_is_healthy(tmp_path):
    out = tmp_path / "runs"
    proc = traceml("netcheck", "--nproc-per-node", "2", "--out", str(out), "--run-name", "nc")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = _doc(out, "nc")
    assert doc["healthy"] and doc["slow"] == [] and doc["backend"] == "gloo"
    for op in nm.OPS:
        rows = doc["collectives"][op]
        assert len(rows) == 4 and all(r["busbw_gbps"] > 0 and r["time_us"] > 0 for r in rows)
    assert "[netcheck] all_reduce" in proc.stdout  # progress while it runs
    assert "healthy: no slow node or link" in proc.stdout
    assert oct((out / "nc" / "netcheck.json").stat().st_mode & 0o777) == "0o600"


@pytest.mark.e2e
def test_a_node_that_never_comes_up_is_named(tmp_path):
    out = tmp_path / "runs"
    t0 = time.monotonic()
    proc = traceml("netcheck", "--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "1",
                   "--master-port", str(free_ports(1)), "--run-name", "alone",
                   "--out", str(out), "--timeout", "5")
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert time.monotonic() - t0 < 60
    assert "missing node(s) 1 (ranks 1)" in proc.stdout, proc.stdout
    assert _doc(out, "alone")["missing"] == {"nodes": [1], "ranks": [1]}


def _announce(tmp_path, job: subprocess.Popen, timeout_s: float, node_rank: int = 1,
              port: int | None = None):
    from traceml_tui.launch import netcheck
    from traceml_tui.launch.options import RunOptions

    opts = RunOptions(script=tmp_path / "x.py", nnodes=2, node_rank=node_rank)
    t0 = time.monotonic()
    present = netcheck.nodes_came_up(opts, port or free_ports(1), timeout_s, tmp_path, job)
    return present, time.monotonic() - t0


def test_a_check_that_ended_before_the_announcement_is_not_a_missing_node(tmp_path):
    """Fresh-clone run 49: on a loaded machine the 3-node check ran and ended (healthy)
    before each node's announcer reached torchrun's store, and every node said "missing".
    Once this node's torchrun has ended, its exit status speaks, not the store."""
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    present, took = _announce(tmp_path, ended, timeout_s=30.0)
    assert present is None and took < 15.0, (present, took)


def test_node_0_waiting_for_an_announcement_stops_when_its_check_ends(tmp_path):
    """Node 0 reached the store and waits for node 1's announcement; its torchrun ends
    (the check ran: every node came up): its exit status speaks, not the wait."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    port = free_ports(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    threading.Timer(1.0, job.kill).start()
    try:
        present, took = _announce(tmp_path, job, timeout_s=30.0, node_rank=0, port=port)
    finally:
        job.kill()
        job.wait()
        del store
    assert present is None and took < 15.0, (present, took)


def test_a_store_that_never_listens_while_torchrun_runs_is_node_0_missing(tmp_path):
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        present, took = _announce(tmp_path, running, timeout_s=3.0)
    finally:
        running.kill()
        running.wait()
    assert present == {} and took < 15.0, (present, took)


NO_NETNS = netns.unavailable()


def _cluster_netcheck(tmp_path, slow):
    with netns.cluster(3, slow=slow) as nodes:
        procs = [subprocess.Popen(
            n.wrap([sys.executable, "-m", "traceml_tui", "netcheck", "--nnodes", "3",
                    "--node-rank", str(n.index), "--nproc-per-node", "1", "--master-addr",
                    nodes[0].address, "--master-port", "29861", "--run-name", "nc",
                    "--out", str(tmp_path / f"node{n.index}"), "--timeout", "60"]),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "GLOO_SOCKET_IFNAME": n.interface}) for n in nodes]
        outs = [p.communicate(timeout=300)[0] for p in procs]
    return [p.returncode for p in procs], outs, _doc(tmp_path / "node0", "nc")


@pytest.mark.e2e
@pytest.mark.alone  # link bandwidths, measured
@pytest.mark.skipif(NO_NETNS is not None, reason=f"no emulated cluster: {NO_NETNS}")
def test_a_shaped_link_names_exactly_that_node(tmp_path):
    codes, outs, doc = _cluster_netcheck(tmp_path, slow={2: "200mbit"})
    assert codes[0] == 1, outs[0][-3000:]  # unhealthy
    assert [(s["node"], s["host"]) for s in doc["slow"]] == [(2, "node2")], doc["pairs"]
    assert [n["host"] for n in doc["nodes"]] == ["node0", "node1", "node2"]
    assert "UNHEALTHY: node 2 (node2) is slow" in outs[0]
    pairs = {tuple(p["nodes"]): p["busbw_gbps"] for p in doc["pairs"]}
    assert pairs[(0, 2)] < 0.03 and pairs[(1, 2)] < 0.03  # 200 Mbit/s = 0.025 GB/s
    assert pairs[(0, 1)] > 4 * pairs[(0, 2)]


@pytest.mark.e2e
@pytest.mark.alone  # link bandwidths, measured
@pytest.mark.skipif(NO_NETNS is not None, reason=f"no emulated cluster: {NO_NETNS}")
def test_an_unshaped_cluster_is_healthy(tmp_path):
    codes, outs, doc = _cluster_netcheck(tmp_path, slow=None)
    assert codes == [0, 0, 0], outs[0][-3000:]
    assert doc["healthy"] and doc["slow"] == []


@pytest.mark.e2e
@pytest.mark.alone  # link bandwidths, measured
@pytest.mark.skipif(NO_NETNS is not None, reason=f"no emulated cluster: {NO_NETNS}")
def test_a_balanced_job_behind_a_shaped_link_is_comm_bound_with_its_busbw(tmp_path):
    """The issue's cluster: 3 nodes x 1 rank, node 2's link at 200 Mbit/s, the plain DDP
    example with --preflight. It read BALANCED; it is COMM-BOUND, with the achieved bus
    bandwidth beside the preflight's, and the preflight names node 2."""
    examples = netns.__file__.rsplit("/tests/", 1)[0] + "/examples/ddp_toy.py"
    with netns.cluster(3, slow={2: "200mbit"}) as nodes:
        procs = [subprocess.Popen(
            n.wrap([sys.executable, "-m", "traceml_tui", "run", examples, "--nnodes", "3",
                    "--node-rank", str(n.index), "--nproc-per-node", "1", "--master-addr",
                    nodes[0].address, "--master-port", "29851", "--run-name", "cb",
                    "--out", str(tmp_path / f"node{n.index}"), "--headless", "--preflight",
                    "--", "--steps", "120"]),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "GLOO_SOCKET_IFNAME": n.interface}) for n in nodes]
        outs = [p.communicate(timeout=400)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs[0][-3000:]
    doc = json.loads((tmp_path / "node0" / "cb" / "final_summary.json").read_text())
    d = doc["diagnosis"]
    assert (d["label"], d["rank"], d["phase"]) == ("COMM-BOUND", None, "sync"), d
    comm = doc["comm"]
    assert comm["sync_share"] >= 0.5
    assert 0.005 < comm["busbw_gbps"] < 0.03, comm  # 200 Mbit/s is 0.025 GB/s
    assert 0.5 < comm["busbw_gbps"] / comm["preflight_busbw_gbps"] < 1.5, comm
    assert [s["node"] for s in doc["preflight"]["slow"]] == [2]
    assert "GB/s of bus bandwidth over the exposed wait" in d["summary"]
    assert "measured by the preflight" in d["summary"]
    assert "Preflight (traceml netcheck): UNHEALTHY: node 2 (node2) slow" in outs[0]
