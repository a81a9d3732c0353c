"""Per-step overhead: bare torchrun vs the peer tool traceml-ai 0.5.0 vs ours, interleaved.

Every variant runs the same workload, benchmarks/tiny_ddp.py (one DDP rank on CPU,
gloo), which prints its own mean ms/step over the timed steps. Variants run in
rounds (order shuffled per round, fixed seed) so the VM's drift hits all of them
alike; the figure that matters is the paired difference against the bare run of
the same round.

Variants:
  bare       python -m torch.distributed.run ... tiny_ddp.py                (system python)
  bare_pv    the same with the peer venv's python (control: same torch, other site-packages)
  peer_zero  traceml-ai `traceml run` on the UNMODIFIED script (what its launcher does
             for a plain loop: system/process samplers only, it records 0 steps)
  peer_step  traceml-ai `traceml run` on tiny_ddp.py with its documented plain-PyTorch
             instrumentation: traceml.init(mode="auto") + `with traceml.trace_step(model):`
             around each step (a wrapper, below; tiny_ddp.py itself is not changed)
  ours       python -m traceml_tui run tiny_ddp.py --headless (unmodified script)

Usage (needs /tmp/peer-venv with torch==2.13.0 and traceml-ai==0.5.0):
    python benchmarks/peer_compare.py --rounds 10 --steps 3000 --json /tmp/peer_compare.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKLOAD = HERE / "tiny_ddp.py"
PEER_PY = "/tmp/peer-venv/bin/python"
PEER_CLI = "/tmp/peer-venv/bin/traceml"
WORK = Path("/tmp/peer_compare")

# traceml-ai's documented plain-PyTorch integration, applied to tiny_ddp.py without
# editing it: same loop, same perf_counter timing, each step inside trace_step(model).
PEER_WRAPPER = """\
import sys
sys.path.insert(0, {bench_dir!r})
import traceml_ai as traceml
import tiny_ddp
import time

traceml.init(mode="auto")

def run_steps(n, loader, model, opt, loss_fn):
    done = 0
    t0 = time.perf_counter()
    while done < n:
        for x, y in loader:
            with traceml.trace_step(model):
                loss = loss_fn(model(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            done += 1
            if done >= n:
                break
    return (time.perf_counter() - t0) * 1000.0 / n

tiny_ddp.run_steps = run_steps
tiny_ddp.main()
"""

JSON_RE = re.compile(r'\{"ms_per_step":[^}]*\}')


def commands(variant: str, steps: int, port: int, tag: str) -> list[str]:
    args = ["--steps", str(steps)]
    if variant in ("bare", "bare_pv"):  # the same bare run; bare_pv in the peer's venv
        python = sys.executable if variant == "bare" else PEER_PY
        return [python, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                "--master-port", str(port), str(WORKLOAD), *args]
    if variant in ("peer_zero", "peer_step"):
        script = WORKLOAD if variant == "peer_zero" else WORK / "tiny_ddp_traceml_ai.py"
        return [
            PEER_CLI,
            "run",
            str(script),
            "--nproc-per-node",
            "1",
            "--master-port",
            str(port),
            "--aggregator-port",
            str(port + 1),
            "--logs-dir",
            str(WORK / "peer_logs"),
            "--run-name",
            tag,
            "--args",
            *args,
        ]
    if variant == "ours":
        return [
            sys.executable,
            "-m",
            "traceml_tui",
            "run",
            str(WORKLOAD),
            "--headless",
            "--master-port",
            str(port),
            "--out",
            str(WORK / "ours_runs"),
            "--run-name",
            tag,
            "--",
            *args,
        ]
    raise ValueError(variant)


def run_one(variant: str, steps: int, port: int, tag: str, timeout: float) -> dict:
    cmd = commands(variant, steps, port, tag)
    t0 = time.monotonic()
    try:
        p = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=str(WORK),
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        raw = e.stdout or ""
        rc, out, err = "timeout", raw.decode() if isinstance(raw, bytes) else raw, ""
    wall = time.monotonic() - t0
    (WORK / "logs").mkdir(exist_ok=True)
    (WORK / "logs" / f"{tag}.out").write_text(out)
    (WORK / "logs" / f"{tag}.err").write_text(err)
    m = JSON_RE.findall(out)
    ms = json.loads(m[-1])["ms_per_step"] if m else None
    return {"variant": variant, "tag": tag, "rc": rc, "ms_per_step": ms, "wall_s": round(wall, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--variants", default="bare,bare_pv,peer_zero,peer_step,ours")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument(
        "--budget-s", type=float, default=1500.0, help="start no new round after this many seconds"
    )
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", default=str(WORK / "results.json"))
    a = ap.parse_args()

    if WORK.exists():
        shutil.rmtree(WORK)
    WORK.mkdir(parents=True)
    (WORK / "tiny_ddp_traceml_ai.py").write_text(PEER_WRAPPER.format(bench_dir=str(HERE)))
    variants = a.variants.split(",")
    rng = random.Random(a.seed)
    rows: list[dict] = []
    t_start = time.monotonic()
    port = 29600
    for r in range(a.rounds):
        if time.monotonic() - t_start > a.budget_s:
            print(f"budget reached after {r} rounds", flush=True)
            break
        order = variants[:]
        rng.shuffle(order)
        for v in order:
            port += 2
            res = run_one(v, a.steps, port, f"r{r}_{v}", a.timeout)
            res["round"] = r
            rows.append(res)
            print(json.dumps(res), flush=True)
    Path(a.json).write_text(json.dumps(rows, indent=1))
    report(rows, variants)


def report(rows: list[dict], variants: list[str]) -> None:
    by = {(x["round"], x["variant"]): x for x in rows}
    rounds = sorted({x["round"] for x in rows})
    print(
        "\n| round | "
        + " | ".join(f"{v} ms" for v in variants)
        + " | "
        + " | ".join(f"{v}-bare µs" for v in variants if v != "bare")
        + " |"
    )
    print("|" + "---|" * (1 + len(variants) * 2 - 1))
    diffs: dict[str, list[float]] = {v: [] for v in variants if v != "bare"}
    for r in rounds:
        b = by.get((r, "bare"), {}).get("ms_per_step")
        cells = []
        for v in variants:
            ms = by.get((r, v), {}).get("ms_per_step")
            cells.append(f"{ms:.3f}" if ms is not None else "fail")
        dcells = []
        for v in variants:
            if v == "bare":
                continue
            ms = by.get((r, v), {}).get("ms_per_step")
            if ms is None or b is None:
                dcells.append("-")
                continue
            d = (ms - b) * 1000.0
            diffs[v].append(d)
            dcells.append(f"{d:+.1f}")
        print(f"| {r} | " + " | ".join(cells) + " | " + " | ".join(dcells) + " |")
    print(
        "\n| variant | n | median ms/step | median paired Δ vs bare (µs/step)"
        " | min Δ | max Δ | median wall s |"
    )
    print("|---|---|---|---|---|---|---|")
    for v in variants:
        ms = [x["ms_per_step"] for x in rows if x["variant"] == v and x["ms_per_step"] is not None]
        walls = [x["wall_s"] for x in rows if x["variant"] == v]
        med = f"{statistics.median(ms):.3f}" if ms else "-"
        mw = f"{statistics.median(walls):.1f}" if walls else "-"
        if v == "bare":
            print(f"| {v} | {len(ms)} | {med} | (reference) | | | {mw} |")
        else:
            d = diffs[v]
            if d:
                print(
                    f"| {v} | {len(ms)} | {med} | {statistics.median(d):+.1f}"
                    f" | {min(d):+.1f} | {max(d):+.1f} | {mw} |"
                )
            else:
                print(f"| {v} | {len(ms)} | {med} | - | - | - | {mw} |")


if __name__ == "__main__":
    main()
