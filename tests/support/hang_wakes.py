"""A gloo job on the agent's explicit API whose stuck rank wakes on Ctrl-C, for
tests/e2e/test_e2e_hang_record.py.

Rank --hang-rank sleeps forever inside `with traceml_agent.step()` at --hang-at-step
while the others wait for it in an all_reduce. Ctrl-C wakes it: the KeyboardInterrupt
leaves the `with`, which closes the step (the step count moves after the hang), and the
ranks exit: the aftermath a hang record must not be taken for.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import traceml_agent


def sleep_forever() -> None:
    while True:
        time.sleep(0.5)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=1_000_000)
    p.add_argument("--hang-rank", type=int, default=1)
    p.add_argument("--hang-at-step", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    traceml_agent.init()
    rank = dist.get_rank()
    w = torch.zeros(64)
    for step in range(args.steps):
        with traceml_agent.step():
            with traceml_agent.phase("forward"):
                time.sleep(0.01)
                if rank == args.hang_rank and step == args.hang_at_step:
                    sleep_forever()
            with traceml_agent.phase("sync"):
                dist.all_reduce(w)
    traceml_agent.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
