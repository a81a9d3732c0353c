"""The device a GPU test job's rank trains on, chosen one way for every job here.

cuda:LOCAL_RANK modulo the GPUs this process sees (so that a one-GPU box runs every rank
of a job, sharing the device), made the current device; or the CPU where a job is run on
it. Jobs import it by name: a script's own folder is first on its path."""

from __future__ import annotations

import os

import torch


def rank_device(kind: str = "cuda") -> torch.device:
    if kind == "cpu":
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device
