"""Agent overhead per step, measured in-process: the same tiny DDP loop (tiny_ddp.py,
~1 ms/step on CPU, one rank, gloo) timed in interleaved blocks with the agent off and
on (zero-code mode, reporting to a real collector), so machine noise hits both alike.

    python benchmarks/agent_overhead.py --rounds 40 --steps 400

Prints each round and the median per-step figures; the difference is the agent's cost,
including its sender thread's share of the CPU and the GIL. Two clocks: wall time (what
the job feels) and process CPU time over all threads (the agent's work, sender thread
included; steadier than wall time when other processes share the cores).
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
    proc = subprocess.Popen([sys.executable, "-m", "traceml_tui.collect.collector", "--run-dir",
                             str(run_dir), "--world-size", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    info = run_dir / "collector.json"
    for _ in range(400):
        if info.exists():
            return proc, json.loads(info.read_text())["ingest"]
        time.sleep(0.05)
    proc.kill()
    raise SystemExit("collector did not start")


def timed(n: int, parts) -> tuple[float, float]:
    """(wall us/step, process CPU us/step) for n steps."""
    from tiny_ddp import run_steps

    c0 = time.process_time()
    wall_ms = run_steps(n, *parts)
    return wall_ms * 1000.0, (time.process_time() - c0) * 1e6 / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--warmup", type=int, default=500)
    args = p.parse_args()

    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29677"})
    import torch
    import torch.distributed as dist
    from tiny_ddp import build, run_steps

    import traceml_agent

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    parts = build()
    run_dir = Path(tempfile.mkdtemp(prefix="traceml-bench-"))
    collector, endpoint = start_collector(run_dir)
    try:
        run_steps(args.warmup, *parts)
        bare, agent = [], []
        for r in range(args.rounds):
            bare.append(timed(args.steps, parts))
            traceml_agent.init(endpoint=endpoint, run_name="bench")
            run_steps(20, *parts)  # let the agent learn the root modules (first step)
            agent.append(timed(args.steps, parts))
            traceml_agent.shutdown()
            print(f"round {r:2d}: wall bare {bare[-1][0]:6.1f} agent {agent[-1][0]:6.1f} us/step"
                  f"   cpu bare {bare[-1][1]:6.1f} agent {agent[-1][1]:6.1f} us/step", flush=True)
    finally:
        collector.terminate()
        collector.wait(10)

    def summary(i: int) -> dict:
        diffs = sorted(a[i] - b[i] for a, b in zip(agent, bare, strict=True))
        q1, q3 = diffs[len(diffs) // 4], diffs[(3 * len(diffs)) // 4]
        return {"bare_us": round(statistics.median(x[i] for x in bare), 1),
                "agent_us": round(statistics.median(x[i] for x in agent), 1),
                "overhead_us_median": round(statistics.median(diffs), 1),
                "overhead_us_iqr": [round(q1, 1), round(q3, 1)]}

    print(json.dumps({"wall_per_step": summary(0), "cpu_per_step": summary(1),
                      "rounds": args.rounds, "steps_per_block": args.steps}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
