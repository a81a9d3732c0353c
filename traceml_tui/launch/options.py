"""A run's options and the one torchrun command line, shared by `traceml run` and
`traceml netcheck`: the run folder they make and the master port they take."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from traceml_tui.runfolder import folders
from traceml_tui.runfolder.layout import RunFolder

from . import ports

DEFAULT_MASTER_PORT = 29500  # torchrun's own default, for multi-node runs
WRITE_PROBE_BYTES = 64 << 10


class LaunchError(Exception):
    """A problem with the user's input or environment: printed as one line, no traceback."""


@dataclass
class RunOptions:
    script: Path
    script_args: list[str] = field(default_factory=list)
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    run_name: str | None = None
    out: Path = Path("traceml_runs")
    headless: bool = True
    command: list[str] = field(default_factory=list)
    hang_after: float | None = None
    nccl_debug: str | None = None  # --nccl-debug LEVEL (nccl_debug.py)
    preflight: bool = False  # --preflight: traceml netcheck before training (netcheck.py)
    # Multi-node: where node 0's collector listens (default: the master address, the
    # master port + 1; the view socket takes the port after that).
    collector_addr: str | None = None
    collector_port: int | None = None
    # Another node's ranks reach node 0 through a relay on their own node (relay.py):
    # one connection and one message per node per tick at node 0, not one per rank.
    relay: bool = True
    # Prometheus metrics on node 0 (metrics.py): the port, and the address it binds.
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    # torchrun's elastic options (docs/restarts.md): restarts of the whole group after a
    # failure, elastic membership (--nnodes MIN:MAX) and the rendezvous. None: torchrun's
    # default (no restart, a fixed number of nodes, its static rendezvous).
    max_restarts: int = 0
    min_nodes: int | None = None  # --nnodes MIN:MAX (nnodes is MAX)
    rdzv_backend: str | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def multinode(self) -> bool:
        return self.nnodes > 1

    def folder(self, run_dir: Path) -> RunFolder:
        """The run folder as this node writes it: its own logs per node when the nodes
        may share the folder."""
        return RunFolder(run_dir, self.node_rank if self.multinode else None)


def prepare_run_dir(opts: RunOptions) -> tuple[str, Path]:
    if opts.run_name:
        name = opts.run_name
        if "/" in name or name in (".", ".."):
            raise LaunchError(f"--run-name {name!r} must be a plain name, not a path")
        run_dir = opts.out / name
        if RunFolder(run_dir).summary_json.exists() or (
                opts.node_rank == 0 and RunFolder(run_dir).collector_json.exists()):
            raise LaunchError(f"run folder {run_dir} already holds a run; choose another "
                              f"--run-name or remove the folder")
    elif opts.multinode:
        raise LaunchError("a multi-node run needs the same --run-name on every node")
    else:
        stem = datetime.now().strftime(f"{opts.script.stem}-%Y%m%d-%H%M%S")
        name, n = stem, 1
        while (opts.out / name).exists():
            n += 1
            name = f"{stem}-{n}"
        run_dir = opts.out / name
    try:
        opts.out.mkdir(parents=True, exist_ok=True)
        try:
            folders.make_private_dir(run_dir)
            folders.pin_dir(run_dir)  # written through its descriptor from here on
            folders.make_private_dir(RunFolder(run_dir).logs)
        except PermissionError as exc:
            raise LaunchError(f"run folder {exc}: not using it (another user could read the "
                              f"run's secret or plant files there); choose another "
                              f"--run-name or --out") from None
        # A full disk accepts an empty file: write what a snapshot would need to start.
        probe = run_dir / f".write-test-{os.getpid()}"
        try:
            probe.write_bytes(b"\0" * WRITE_PROBE_BYTES)
        finally:
            probe.unlink(missing_ok=True)
    except OSError as exc:
        raise LaunchError(f"cannot write to run folder {run_dir}: {exc.strerror or exc}"
                          ) from None
    return name, run_dir


def master_port(opts: RunOptions) -> int:
    port = opts.master_port or (ports.free_ports() if not opts.multinode
                                else DEFAULT_MASTER_PORT)
    if opts.node_rank == 0 and not ports.is_free(port):  # torchrun's store listens here
        raise LaunchError(f"port {port} (torchrun's master port) is in use on this host; "
                          f"choose another --master-port")
    return port


def torchrun_command(opts: RunOptions, port: int, then: list[str]) -> list[str]:
    """torchrun with this run's nodes, ranks and rendezvous; `then` is what follows
    (its own flags, then the module every rank runs)."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc-per-node", str(opts.nproc_per_node),
        "--nnodes", nnodes_arg(opts), "--node-rank", str(opts.node_rank),
        "--master-addr", opts.master_addr, "--master-port", str(port),
        *elastic_args(opts), *then,
    ]


def nnodes_arg(opts: RunOptions) -> str:
    """torchrun's --nnodes: N, or MIN:MAX for elastic membership."""
    if opts.min_nodes is None or opts.min_nodes == opts.nnodes:
        return str(opts.nnodes)
    return f"{opts.min_nodes}:{opts.nnodes}"


def elastic_args(opts: RunOptions) -> list[str]:
    """torchrun's elastic flags the user gave (none by default: torchrun's own defaults)."""
    out = []
    if opts.max_restarts:
        out += ["--max-restarts", str(opts.max_restarts)]
    for flag, value in (("--rdzv-backend", opts.rdzv_backend),
                        ("--rdzv-endpoint", opts.rdzv_endpoint), ("--rdzv-id", opts.rdzv_id)):
        if value:
            out += [flag, value]
    return out
