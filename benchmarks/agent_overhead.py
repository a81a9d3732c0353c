"""Agent overhead per step, measured in-process: the same tiny DDP loop (tiny_ddp.py,
~1 ms/step on CPU, one rank, gloo) timed in interleaved blocks with the agent off and
on (zero-code mode, reporting to a real collector), so machine noise hits both alike.

    python benchmarks/agent_overhead.py --rounds 10 --steps 1000

Prints each round and the median per-step figures; the difference is the agent's cost,
including its sender thread's share of the CPU and the GIL.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def start_collector(run_dir: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "traceml_tui.collector", "--run-dir",
                             str(run_dir), "--world-size", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    info = run_dir / "collector.json"
    for _ in range(400):
        if info.exists():
            return proc, json.loads(info.read_text())["ingest"]
        time.sleep(0.05)
    proc.kill()
    raise SystemExit("collector did not start")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--warmup", type=int, default=500)
    args = p.parse_args()

    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29677"})
    import torch
    import torch.distributed as dist
    import traceml_agent
    from tiny_ddp import build, run_steps

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    parts = build()
    run_dir = Path(tempfile.mkdtemp(prefix="traceml-bench-"))
    collector, endpoint = start_collector(run_dir)
    try:
        run_steps(args.warmup, *parts)
        bare, agent = [], []
        for r in range(args.rounds):
            bare.append(run_steps(args.steps, *parts))
            traceml_agent.init(endpoint=endpoint, run_name="bench")
            run_steps(20, *parts)  # let the agent learn the root modules (first step)
            agent.append(run_steps(args.steps, *parts))
            traceml_agent.shutdown()
            print(f"round {r}: bare {bare[-1] * 1000:7.1f} us/step   agent "
                  f"{agent[-1] * 1000:7.1f} us/step   +{(agent[-1] - bare[-1]) * 1000:5.1f} us",
                  flush=True)
    finally:
        collector.terminate()
        collector.wait(10)
    b, a = statistics.median(bare), statistics.median(agent)
    diffs = sorted((x - y) * 1000 for x, y in zip(agent, bare, strict=True))
    print(json.dumps({
        "bare_us_per_step": round(b * 1000, 1), "agent_us_per_step": round(a * 1000, 1),
        "overhead_us_per_step_median": round(statistics.median(diffs), 1),
        "overhead_us_per_step_min_max": [round(diffs[0], 1), round(diffs[-1], 1)],
        "rounds": args.rounds, "steps_per_block": args.steps,
    }))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
