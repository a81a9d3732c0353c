"""The agent's per-step cost as a deterministic instruction count (valgrind's callgrind).

Wall time on this VM drifts 20-40 %; instructions do not. The tiny loop of
tiny_ddp.py runs N steps with the agent's hooks and recorder on the
step path (the setup checks' observer included, no sender thread: it runs off the
training thread) and again without them. Each variant runs at two lengths, so the
fixed costs (interpreter start, imports, learning the roots) cancel:

    per step = (instr(600 steps) - instr(100 steps)) / 500
    agent    = per step (hooks) - per step (bare)

By default the model is not wrapped in DDP and no process group exists: gloo's
threads wait for each other for a varying number of instructions (two identical
DDP runs differed by 35k instructions/step), which would drown the agent's ~50k.
`--ddp` measures the DDP loop (one rank, gloo) as well, with that noise.

    python benchmarks/agent_instructions.py            # needs valgrind
    python benchmarks/agent_instructions.py --agent OLD_CHECKOUT/agent   # older code
    python benchmarks/agent_instructions.py --ddp     # DDP + gloo, noisier

Each of the four runs takes about a minute under callgrind.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

WORKLOAD = r'''
import os, sys
sys.path.insert(0, {bench!r})
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT={port!r}, RANK="0", WORLD_SIZE="1")
import torch, torch.distributed as dist
torch.set_num_threads(1)
if {ddp!r}:
    dist.init_process_group("gloo")
from tiny_ddp import build, run_steps
if {hooks!r}:
    sys.path.insert(0, {pkg!r})
    from collections import deque
    import traceml_agent.hooks as hooks
    from traceml_agent.checks import StepObserver
    from traceml_agent.recorder import Recorder
    out = deque(maxlen=100_000)
    hooks.install(Recorder(out), torch, print, StepObserver(0, 1))
parts = build(ddp={ddp!r})
run_steps({steps}, *parts)
if {ddp!r}:
    dist.destroy_process_group()
'''


def count(steps: int, hooks: bool, agent: Path, port: int, ddp: bool) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        pkg = Path(tmp) / "pkg"
        pkg.mkdir()
        (pkg / "traceml_agent").symlink_to(agent.resolve())  # import it from that folder
        code = WORKLOAD.format(bench=str(HERE), port=str(port), hooks=hooks, pkg=str(pkg),
                               steps=steps, ddp=ddp)
        out = Path(tmp) / "callgrind.out"
        # A fixed hash seed: set and dict orders (and so instruction counts) repeat.
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
        proc = subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
             "--collect-atstart=yes", sys.executable, "-c", code],
            capture_output=True, text=True, env=env)
        match = re.search(r"Collected : (\d+)", proc.stderr)
        if proc.returncode != 0 or not match:
            raise SystemExit(f"callgrind run failed:\n{proc.stderr[-2000:]}")
        return int(match.group(1))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--agent", type=Path, default=HERE.parent / "agent",
                   help="the agent folder measured (default: this checkout's)")
    p.add_argument("--short", type=int, default=100)
    p.add_argument("--long", type=int, default=600)
    p.add_argument("--ddp", action="store_true",
                   help="wrap the model in DDP under a one-rank gloo group (noisier)")
    args = p.parse_args()
    port = 29_811
    result = {}
    for hooks in (False, True):
        short = count(args.short, hooks, args.agent, port, args.ddp)
        long = count(args.long, hooks, args.agent, port + 1, args.ddp)
        per_step = (long - short) / (args.long - args.short)
        result["hooks" if hooks else "bare"] = per_step
        print(f"{'hooks' if hooks else 'bare ':5}  {short:>14,} / {long:>14,} instructions "
              f"-> {per_step:,.0f} per step", flush=True)
    agent = result["hooks"] - result["bare"]
    print(json.dumps({"agent": str(args.agent), "ddp": args.ddp,
                      "bare_per_step": round(result["bare"]),
                      "hooks_per_step": round(result["hooks"]),
                      "agent_per_step": round(agent),
                      "agent_share": round(agent / result["bare"], 4)}))


if __name__ == "__main__":
    main()
