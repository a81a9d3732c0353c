"""Slurm: the step's variables become the node flags, so one srun line works on every node."""

from __future__ import annotations

import pytest

from traceml_tui.launch.slurm import PORT_BASE, PORT_SPAN, SlurmError, expand_hostlist, from_env


@pytest.mark.parametrize("text, hosts", [
    ("gpu01", ["gpu01"]),
    ("gpu[01-03,07],login1", ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]),
    ("a[8-10]-ib", ["a8-ib", "a9-ib", "a10-ib"]),
    ("n[1,3],m[009-011]", ["n1", "n3", "m009", "m010", "m011"]),
    ("10.0.0.5,10.0.0.6", ["10.0.0.5", "10.0.0.6"]),
])
def test_expand_hostlist(text, hosts):
    assert expand_hostlist(text) == hosts


def test_a_broken_hostlist_is_an_error_in_words():
    with pytest.raises(SlurmError, match="host list"):
        expand_hostlist("gpu[a-b]")


STEP = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_NNODES": "4",
        "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "gpu[07-10]", "SLURM_TASKS_PER_NODE": "1(x4)"}


@pytest.mark.parametrize("extra, field, value", [
    ({}, "nnodes", 4),
    ({}, "node_rank", 2),
    ({}, "master_addr", "gpu07"),
    ({}, "master_port", PORT_BASE + 4242 % PORT_SPAN),
    ({}, "gpus_per_node", None),
    ({"SLURM_GPUS_ON_NODE": "8"}, "gpus_per_node", 8),
    ({"SLURM_GPUS_PER_NODE": "a100:4"}, "gpus_per_node", 4),
    ({"SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NODELIST": "gpu[09-10]"}, "nnodes", 2),
    ({"SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NODELIST": "gpu[09-10]"}, "master_addr",
     "gpu09"),
])
def test_step_variables(extra, field, value):
    step = from_env({**STEP, **extra})
    assert getattr(step, field) == value


def test_outside_srun_slurm_is_ignored():
    """In the sbatch script itself only the first node runs: not a multi-node step."""
    assert from_env({k: v for k, v in STEP.items() if k != "SLURM_STEP_ID"}) is None
    assert from_env({}) is None


def test_several_tasks_per_node_are_refused_with_the_fix():
    with pytest.raises(SlurmError, match="--ntasks-per-node=1"):
        from_env({**STEP, "SLURM_STEP_TASKS_PER_NODE": "4(x4)"})
