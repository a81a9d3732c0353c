"""Reading a Slurm job step's variables, so one `srun traceml run ...` line works.

Under `srun --ntasks-per-node=1 traceml run train.py`, every node runs one
`traceml run`; each must know how many nodes there are, which one it is, which
host is node 0 (torchrun's master and our collector) and how many GPUs it has.
Slurm says all of that in the environment of each task. torchrun stays the
process launcher: this module only fills in its flags.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

# A port per job, so two jobs sharing a node do not collide: torchrun's usual 29500
# plus the job id modulo this span.
PORT_BASE, PORT_SPAN = 29500, 10_000


class SlurmError(ValueError):
    """Slurm variables that cannot describe a traceml run: one line for the user."""


@dataclass(frozen=True, slots=True)
class SlurmStep:
    job_id: str
    nnodes: int
    node_rank: int
    master_addr: str
    gpus_per_node: int | None
    master_port: int


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list, e.g. "gpu[01-03,07],login1" -> gpu01 gpu02 gpu03 gpu07
    login1. Zero padding is kept; one bracket group per name (what Slurm writes)."""
    hosts: list[str] = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", text):
        match = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", item)
        if not match:
            hosts.append(item)
            continue
        prefix, ranges, suffix = match.groups()
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise SlurmError(f"cannot read the Slurm host list {text!r}")
            for n in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{n:0{len(lo)}d}{suffix}")
    return hosts


def _int(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name, "").strip()
    match = re.match(r"(\d+)", value)  # "4", "4(x2)" (SLURM_TASKS_PER_NODE style)
    return int(match.group(1)) if match else None


def _gpus(environ: Mapping[str, str]) -> int | None:
    on_node = _int(environ, "SLURM_GPUS_ON_NODE")
    if on_node:
        return on_node
    per_node = environ.get("SLURM_GPUS_PER_NODE", "")  # "4", "a100:4", "gpu:a100:4"
    match = re.search(r"(\d+)\s*$", per_node)
    return int(match.group(1)) if match else None


def from_env(environ: Mapping[str, str]) -> SlurmStep | None:
    """The job step this process runs in, or None outside `srun` (in an sbatch script
    itself only node 0 runs: treating that as multi-node would wait forever)."""
    if "SLURM_JOB_ID" not in environ or "SLURM_STEP_ID" not in environ:
        return None
    job_id = environ["SLURM_JOB_ID"]
    nnodes = _int(environ, "SLURM_STEP_NUM_NODES") or _int(environ, "SLURM_NNODES")
    node_rank = _int(environ, "SLURM_NODEID")
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST", "")
    if nnodes is None or node_rank is None or not nodelist:
        raise SlurmError("running under srun but SLURM_NNODES, SLURM_NODEID or "
                         "SLURM_JOB_NODELIST is missing")
    tasks = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE", "1")
    if (_int({"x": tasks}, "x") or 1) > 1:
        raise SlurmError(f"srun started {tasks} tasks per node; traceml run starts the ranks "
                         f"itself: use srun --ntasks-per-node=1")
    hosts = expand_hostlist(nodelist)
    port = PORT_BASE + int(job_id) % PORT_SPAN if job_id.isdigit() else PORT_BASE
    return SlurmStep(job_id, nnodes, node_rank, hosts[0], _gpus(environ), port)
