"""`traceml netcheck`: the network guide's check, in one command, on every node.

The same launch flags as `traceml run` (and the same Slurm detection), run on every
node like training. torchrun starts netcheck_worker.py in every rank; node 0's rank 0
writes RUN_DIR/netcheck.json and this prints it as a table. Exit status: 0 healthy,
1 a slow node or an MTU mismatch, 3 ranks missing, 2 a usage error.
`traceml run --preflight` calls `check` before training in the run's own folder.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from traceml_agent.sanitize import clean_line
from traceml_agent.vocab import NETCHECK_JSON
from traceml_tui.judge import bandwidth as nm
from traceml_tui.runfolder import folders
from traceml_tui.runfolder.layout import RunFolder

from .netcheck_worker import OUT_ENV, TIMEOUT_ENV
from .options import LaunchError, RunOptions, master_port, prepare_run_dir, torchrun_command

NODE_KEY = "traceml-netcheck/node/"


def torchrun(opts: RunOptions, port: int) -> list[str]:
    return torchrun_command(opts, port, ["-m", "traceml_tui.launch.netcheck_worker"])


# How long one attempt to reach torchrun's store waits: between attempts the announcer
# looks whether torchrun has already ended (a job of 3 s can end before a loaded machine
# has imported torch here, and its store with it).
CONNECT_TRY_S = 2.0


def nodes_came_up(opts: RunOptions, port: int, timeout_s: float, run_dir: Path,
                  job: subprocess.Popen) -> dict[int, str] | None:
    """Every node's `traceml netcheck` announces its host in torchrun's store; node 0
    waits for all of them. torchrun's own rendezvous would wait for a missing node for
    many minutes without a word: this names it. Returns the nodes present when one is
    missing (node 0 also writes that down), else None: also once this node's torchrun
    (`job`) has ended, whose exit status then says what happened (every node came up
    for a check that ran: fresh-clone run 49's healthy cluster read "missing" on all
    three nodes when the check ended before their announcements reached its store)."""
    from datetime import timedelta

    import torch.distributed as dist

    deadline = time.monotonic() + timeout_s
    store = None
    while store is None:  # the client waits for node 0's torchrun to listen
        try:
            store = dist.TCPStore(opts.master_addr, port, is_master=False,
                                  timeout=timedelta(seconds=CONNECT_TRY_S))
        except Exception:
            if job.poll() is not None:
                return None
            if time.monotonic() >= deadline:
                return {}
            time.sleep(0.2)  # an error at once (a bad address) is not a reason to spin
    try:
        store.set(f"{NODE_KEY}{opts.node_rank}", socket.gethostname())
        if opts.node_rank != 0:
            return None
        keys = [f"{NODE_KEY}{k}" for k in range(opts.nnodes)]
        while time.monotonic() < deadline:
            if store.check(keys) or job.poll() is not None:
                return None
            time.sleep(0.2)
        present = {k: store.get(keys[k]).decode() for k in range(opts.nnodes)
                   if store.check([keys[k]])}
    except Exception:  # the store went with its torchrun: the job's exit status says why
        return None
    missing = [k for k in range(opts.nnodes) if k not in present]
    ranks = [r for k in missing for r in range(k * opts.nproc_per_node,
                                                (k + 1) * opts.nproc_per_node)]
    folders.write_atomic(RunFolder(run_dir).netcheck, json.dumps(
        {"healthy": False, "missing": {"nodes": missing, "ranks": ranks},
         "present": {str(k): h for k, h in present.items()}}, indent=1))
    return present


def check(opts: RunOptions, run_dir: Path, port: int, timeout_s: float = 120.0
          ) -> tuple[int, dict[str, Any] | None]:
    """Run the check on this node; (exit status, node 0's result or None elsewhere)."""
    out = RunFolder(run_dir.resolve()).netcheck
    env = {**os.environ, OUT_ENV: str(out), TIMEOUT_ENV: str(timeout_s),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.Popen(torchrun(opts, port), env=env, start_new_session=True)
    try:
        if opts.nnodes > 1 and nodes_came_up(opts, port, timeout_s, run_dir, proc) is not None:
            _stop(proc)
            if opts.node_rank != 0:
                print(f"traceml netcheck: node 0 ({opts.master_addr}:{port}) did not come up "
                      f"within {timeout_s:.0f} s", file=sys.stderr)
                return 3, None
            try:
                return 3, json.loads(out.read_text())
            except (OSError, ValueError):  # its own torchrun never listened
                print(f"traceml netcheck: this node's torchrun did not listen on "
                      f"{opts.master_addr}:{port} within {timeout_s:.0f} s", file=sys.stderr)
                return 3, None
        proc.wait()
    except BaseException:
        _stop(proc)
        raise
    if opts.node_rank != 0:
        return (0 if proc.returncode == 0 else 3), None
    try:
        doc = json.loads(out.read_text())
    except (OSError, ValueError):
        return 3, None
    if "missing" in doc:
        return 3, doc
    return (0 if doc.get("healthy") else 1), doc


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def render(doc: dict[str, Any], path: Path) -> str:
    if "missing" in doc:
        miss = doc["missing"]
        return (f"traceml netcheck: not every rank came up within the timeout: missing node(s) "
                f"{', '.join(map(str, miss['nodes']))} (ranks "
                f"{', '.join(map(str, miss['ranks'][:16]))}); results: {path}\n")
    lines = [f"traceml netcheck: {doc['world_size']} ranks on {doc['nnodes']} node(s), "
             f"{doc['backend']}, {doc['wall_s']:.0f} s", "",
             f"{'node':>4}  {'host':<16} {'interface':<12} {'mtu':>6} {'speed':>10}  infiniband"]
    for n in doc["nodes"]:
        speed = f"{n['speed_mbps']} Mb/s" if n.get("speed_mbps") else "-"
        ib = ", ".join(f"{p['port']} {p.get('state', '?')}" for p in n["infiniband"]) or "-"
        lines.append(f"{n['node']:>4}  {n['host'][:16]:<16} {str(n['interface'])[:12]:<12} "
                     f"{str(n['mtu']):>6} {speed:>10}  {ib}")
    lines += ["", f"{'collective':<15}{'size':>9}{'time us':>12}{'algbw GB/s':>12}"
                  f"{'busbw GB/s':>12}"]
    for op, rows in doc["collectives"].items():
        for r in rows:
            lines.append(f"{op:<15}{nm.human_bytes(r['bytes']):>9}{r['time_us']:>12.0f}"
                         f"{r['algbw_gbps']:>12.3f}{r['busbw_gbps']:>12.3f}")
    if doc["pairs"]:
        lines += ["", "pairs of nodes alone, all_reduce of "
                  f"{nm.human_bytes(4 << 20)} (busbw GB/s):"]
        lines += [f"  nodes {p['nodes'][0]}-{p['nodes'][1]}: {p['busbw_gbps']:.3f}"
                  for p in doc["pairs"]]
    lines.append("")
    if doc.get("mtu_mismatch"):
        lines.append(f"UNHEALTHY: {doc['mtu_mismatch']}")
    for s in doc["slow"]:
        lines.append(f"UNHEALTHY: node {s['node']} ({s['host']}) is slow, {s['ratio']:.0%} "
                     f"of the median: {s['why']}")
    if doc["healthy"]:
        lines.append("healthy: no slow node or link, MTUs agree")
    elif doc["nnodes"] < 3 and not doc["slow"]:
        lines.append("(with fewer than 3 nodes a slow pair cannot say which end is slow)")
    lines.append(f"results: {path}")
    # Host names and interfaces came from every node (through torchrun's store and
    # the ranks): printed as text, never as terminal control.
    return "\n".join(map(clean_line, lines)) + "\n"


def main(opts: RunOptions, timeout_s: float) -> int:
    try:
        _, run_dir = prepare_run_dir(opts)
        port = master_port(opts)
    except LaunchError as exc:
        print(f"traceml netcheck: error: {exc}", file=sys.stderr)
        return 2
    status, doc = check(opts, run_dir, port, timeout_s)
    if doc is not None:
        print(render(doc, RunFolder(run_dir).netcheck), end="")
    elif opts.node_rank != 0:
        print(f"traceml netcheck: node {opts.node_rank} done (exit {status}); node 0 "
              f"({opts.master_addr}) prints the results and keeps {NETCHECK_JSON}")
    else:
        print("traceml netcheck: no result was written (see the ranks' errors above)",
              file=sys.stderr)
    return status
