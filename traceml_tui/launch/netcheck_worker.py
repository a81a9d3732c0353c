"""One rank of `traceml netcheck`, started by torchrun on every node (netcheck.py).

In order: everybody came up (within a timeout that names who did not), each node's
network facts, a sweep of four collectives over sizes, each pair of nodes alone, and
barrier times per rank. Rank 0 writes RUN_DIR/netcheck.json and prints progress lines.
The arithmetic is in judge/bandwidth.py; what the figures mean is in docs/network.md.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from traceml_tui.judge import bandwidth as nm
from traceml_tui.judge.windows import median

OUT_ENV = "TRACEML_NETCHECK_OUT"
TIMEOUT_ENV = "TRACEML_NETCHECK_TIMEOUT"
SIZES = (4 << 10, 64 << 10, 1 << 20, 8 << 20)  # latency ... bandwidth, bounded for CPU
PAIR_BYTES = 4 << 20
OP_BUDGET_S = 1.5  # per op and size: enough iterations for a stable mean, bounded
MAX_ITERS = 20
BARRIERS = 20
KEY = "traceml-netcheck/"
IB_COUNTERS = ("symbol_error", "link_downed", "port_rcv_errors", "port_xmit_discards",
               "link_error_recovery")


def say(rank: int, text: str) -> None:
    if rank == 0:
        print(f"[netcheck] {text}", flush=True)


# --- who came up ------------------------------------------------------------------------


def rendezvous(rank: int, world: int, nproc: int, timeout_s: float) -> list[str] | None:
    """Every rank's host through torchrun's own store, or None after the timeout (rank 0
    then says which nodes and ranks are missing and tells the others to stop)."""
    import torch.distributed as dist

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timedelta(seconds=timeout_s))
    store.set(f"{KEY}rank/{rank}", socket.gethostname())
    keys = [f"{KEY}rank/{r}" for r in range(world)]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if store.check([f"{KEY}abort"]):
            return None
        if store.check(keys):
            return [store.get(k).decode() for k in keys]
        time.sleep(0.2)
    if rank == 0:
        missing = [r for r in range(world) if not store.check([keys[r]])]
        nodes = sorted({r // nproc for r in missing})
        present = {r // nproc: store.get(keys[r]).decode() for r in range(world)
                   if r not in missing}
        store.set(f"{KEY}abort", "1")
        write({"healthy": False, "missing": {"nodes": nodes, "ranks": missing},
               "present": {str(k): v for k, v in sorted(present.items())}})
        say(0, f"not every rank came up within {timeout_s:.0f} s: missing node"
               f"{'s' if len(nodes) > 1 else ''} {', '.join(map(str, nodes))} (ranks "
               f"{', '.join(map(str, missing[:16]))}); present: "
               + ", ".join(f"node {k} ({h})" for k, h in sorted(present.items())))
    return None


# --- facts of this node -------------------------------------------------------------------


def interface_facts() -> dict[str, Any]:
    """The interface the backend will use, its MTU and speed, and InfiniBand ports."""
    import psutil

    wanted = (os.environ.get("NCCL_SOCKET_IFNAME") or os.environ.get("GLOO_SOCKET_IFNAME")
              or "").split(",")[0].lstrip("^=")
    name = wanted or _route_interface(os.environ.get("MASTER_ADDR", "127.0.0.1"))
    stats = psutil.net_if_stats().get(name or "")
    facts: dict[str, Any] = {
        "host": socket.gethostname(), "interface": name,
        "from": "NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME" if wanted else "route to master",
        "mtu": stats.mtu if stats else None,
        "speed_mbps": stats.speed if stats and stats.speed > 0 else None,
        "up": bool(stats.isup) if stats else None, "infiniband": _infiniband()}
    return facts


def _route_interface(addr: str) -> str | None:
    import psutil

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((addr, 9))  # no packet is sent: the kernel picks the route
            local = s.getsockname()[0]
    except OSError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == local for a in addrs):
            return name
    return None


def _infiniband() -> list[dict[str, Any]]:
    root = Path("/sys/class/infiniband")
    ports = []
    for port in sorted(root.glob("*/ports/*")) if root.is_dir() else []:
        entry: dict[str, Any] = {"port": f"{port.parent.parent.name}/{port.name}"}
        try:
            entry["state"] = (port / "state").read_text().strip()
            entry["rate"] = (port / "rate").read_text().strip()
        except OSError:
            pass
        for counter in IB_COUNTERS:
            try:
                entry[counter] = int((port / "counters" / counter).read_text())
            except (OSError, ValueError):
                continue
        ports.append(entry)
    return ports


# --- measurements ---------------------------------------------------------------------


def timed(run: Any, device_sync: Any, agree: Any, budget_s: float = OP_BUDGET_S) -> float:
    """Mean seconds per call after one warm-up, over as many calls as fit `budget_s`
    (1 to MAX_ITERS). Every rank must make the same number of calls, or the collective
    deadlocks: the count comes from the slowest rank's warm-up (`agree`: a MAX over the
    ranks taking part)."""
    start = time.perf_counter()
    run()
    device_sync()
    warm = agree(time.perf_counter() - start)
    n = max(1, min(MAX_ITERS, int(budget_s / max(warm, 1e-6))))
    start = time.perf_counter()
    for _ in range(n):
        run()
    device_sync()
    return (time.perf_counter() - start) / n


def slowest(dist: Any, seconds: float, torch: Any, device: Any, group: Any = None) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def sweep(dist: Any, torch: Any, device: Any, world: int, rank: int, sync: Any
          ) -> dict[str, list[dict[str, float]]]:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    out: dict[str, list[dict[str, float]]] = {op: [] for op in nm.OPS}
    for nbytes in SIZES:
        n = max(world, nbytes // 4 // world * world)  # float32 elements, divisible by world
        full = torch.ones(n, device=device)
        part = torch.ones(n // world, device=device)
        runs = {  # bound now: the lambdas run within this turn of the loop
            "all_reduce": lambda full=full: dist.all_reduce(full),
            "all_gather": lambda full=full, part=part: gather(full, part),
            "reduce_scatter": lambda full=full, part=part: scatter(part, full),
            "broadcast": lambda full=full: dist.broadcast(full, 0),
        }
        for op in nm.OPS:
            dist.barrier()
            agree = lambda x: slowest(dist, x, torch, device)  # noqa: E731
            seconds = slowest(dist, timed(runs[op], sync, agree), torch, device)
            alg, bus = nm.bandwidths(op, n * 4, seconds, world)
            out[op].append({"bytes": n * 4, "time_us": round(seconds * 1e6, 1),
                            "algbw_gbps": round(alg, 4), "busbw_gbps": round(bus, 4)})
            say(rank, f"{op:<14} {nm.human_bytes(n * 4):>9}: {seconds * 1e6:10.0f} us  "
                      f"algbw {alg:7.3f} GB/s  busbw {bus:7.3f} GB/s")
    return out


def pairs(dist: Any, torch: Any, device: Any, nnodes: int, nproc: int, rank: int, sync: Any
          ) -> dict[str, float]:
    """Each pair of nodes alone (one rank each), in turn: its all_reduce busbw."""
    plan = nm.node_pairs(nnodes)
    groups = [dist.new_group([a * nproc, b * nproc]) for a, b in plan]  # all ranks, in order
    n = PAIR_BYTES // 4
    mine: dict[str, float] = {}
    for (a, b), group in zip(plan, groups, strict=True):
        if rank in (a * nproc, b * nproc):
            t = torch.ones(n, device=device)
            agree = lambda x, g=group: slowest(dist, x, torch, device, g)  # noqa: E731
            seconds = timed(lambda g=group, t=t: dist.all_reduce(t, group=g), sync, agree)
            seconds = agree(seconds)
            _, bus = nm.bandwidths("all_reduce", n * 4, seconds, 2)
            if rank == a * nproc:
                mine[f"{a}-{b}"] = bus
        dist.barrier()
        say(rank, f"pair of nodes {a} and {b}: done ({len(mine)} measured here)")
    return mine


def barrier_ms(dist: Any) -> float:
    waits = []
    for _ in range(BARRIERS):
        t0 = time.perf_counter()
        dist.barrier()
        waits.append((time.perf_counter() - t0) * 1e3)
    return median(waits, empty=0.0)


def write(doc: dict[str, Any]) -> None:
    """Atomically, 0600, in the run folder (the summary's writer)."""
    from traceml_tui.runfolder.folders import write_atomic

    write_atomic(Path(os.environ[OUT_ENV]), json.dumps(doc, indent=1))


def main() -> int:
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local, nproc = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    nnodes = world // nproc
    timeout_s = float(os.environ.get(TIMEOUT_ENV, "120"))
    started = time.monotonic()
    hosts = rendezvous(rank, world, nproc, timeout_s)
    if hosts is None:
        return 3
    say(rank, f"{world} ranks on {nnodes} node{'s' if nnodes > 1 else ''} came up")
    gpu = torch.cuda.is_available() and torch.cuda.device_count() >= nproc
    if gpu:
        torch.cuda.set_device(local)
    device = torch.device("cuda", local) if gpu else torch.device("cpu")
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    dist.init_process_group("nccl" if gpu else "gloo", timeout=timedelta(seconds=timeout_s))
    facts = [None] * world
    dist.all_gather_object(facts, interface_facts() if local == 0 else None)
    nodes = [facts[k * nproc] for k in range(nnodes)]
    say(rank, "nodes: " + "; ".join(f"{k} {f['host']} {f['interface']} mtu {f['mtu']}"
                                    for k, f in enumerate(nodes)))
    collectives = sweep(dist, torch, device, world, rank, sync)
    mine = pairs(dist, torch, device, nnodes, nproc, rank, sync) if nnodes > 1 else {}
    measured = [None] * world
    dist.all_gather_object(measured, (mine, barrier_ms(dist)))
    if rank == 0:
        pair_gbps = {tuple(int(x) for x in k.split("-")): v
                     for m, _ in measured for k, v in m.items()}
        slow = nm.slow_nodes(pair_gbps, [f["host"] for f in nodes])
        mtu = nm.mtu_mismatch({k: f["mtu"] for k, f in enumerate(nodes)})
        write({
            "healthy": not slow and mtu is None, "backend": "nccl" if gpu else "gloo",
            "world_size": world, "nnodes": nnodes, "nproc_per_node": nproc,
            "nodes": [{"node": k, **f} for k, f in enumerate(nodes)],
            "mtu_mismatch": mtu, "collectives": collectives,
            "pairs": [{"nodes": list(k), "busbw_gbps": round(v, 4)}
                      for k, v in sorted(pair_gbps.items())],
            "slow": [s.to_json() for s in slow],
            "barrier_ms": [{"rank": r, "median_ms": round(m[1], 3)}
                           for r, m in enumerate(measured)],
            "wall_s": round(time.monotonic() - started, 1),
        })
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
