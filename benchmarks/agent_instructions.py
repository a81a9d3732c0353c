"""The agent's per-step cost as a deterministic instruction count (valgrind's callgrind).

Wall time on this VM drifts 20-40 %; instructions do not. The tiny loop of
tiny_ddp.py runs N steps with the agent and again without it. Each variant runs at two
lengths, so the fixed costs (interpreter start, imports, learning the roots) cancel:

    per step = (instr(long) - instr(short)) / (long - short)
    agent    = per step (agent) - per step (bare)

Two scopes of "agent":
  default   the hooks and recorder on the step path (the setup checks' observer
            included), no sender thread: the training thread's own cost.
  --whole   the whole agent as `traceml run` starts it (traceml_agent.init(): hooks,
            recorder, checks, the sender thread, CURVE encryption in libzmq's I/O
            thread), reporting to a CURVE sink in this process (not under valgrind).

The sender works by the clock (a batch every 0.1 s, a heartbeat and a system sample
every second); under callgrind a step takes ~100x its native time, so a batch holds ~1
step instead of ~150 and the sender's per-message costs land on every step.
`--cadence-scale 100` multiplies its intervals so a batch holds as many steps as it
would natively; both figures are worth quoting. Python's full garbage collections run on
whichever thread allocates when they are due (the sender's included), ~6.5M
instructions each in this process: where they fall moves a two-length difference by
~20k/step, so compare runs paired in one session, and read the per-thread files
(`--profile`) to see which thread paid.

By default the model is not wrapped in DDP and no process group exists (gloo's threads
once made two identical runs differ by 35k instructions/step). `--ddp` measures the DDP
loop (one rank, gloo); `--profile` shows gloo's own threads apart (~15.6k/step).

    python benchmarks/agent_instructions.py            # needs valgrind
    python benchmarks/agent_instructions.py --agent OLD_CHECKOUT/agent   # older code
    python benchmarks/agent_instructions.py --ddp --whole --short 100 --long 400
    python benchmarks/agent_instructions.py --ddp --whole --only hooks --profile DIR
        # then: callgrind_annotate --inclusive=yes DIR/callgrind.hooks.400-01 (thread 1)
    python benchmarks/agent_instructions.py --ddp --whole --profile DIR --by-function 25
        # per thread (training, sender, libzmq I/O, gloo) and per function, per step

With --profile the summary splits each variant's per-step figure by thread (callgrind's
--separate-threads files, matched by creation order between the two lengths and told
apart by what they run); --by-function N lists each thread's N functions whose
exclusive instructions per step moved most between the variants (callgrind_annotate).
Functions are C-level: the agent's Python runs inside _PyEval_EvalFrameDefault.

Each run takes 2-5 minutes under callgrind on this 2-core box (importing torch is
most of it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
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
if {hooks!r} and {whole!r}:
    sys.path.insert(0, {pkg!r})
    import traceml_agent
    from traceml_agent import transport
    for name in ("SEND_INTERVAL_S", "MAX_SEND_INTERVAL_S", "HEARTBEAT_INTERVAL_S",
                 "SYS_INTERVAL_S", "LARGE_SYS_INTERVAL_S", "STACK_MIN_S",
                 "STACK_REFRESH_S"):  # --cadence-scale (a slow start is not a stall)
        setattr(transport, name, getattr(transport, name) * {scale!r})
    assert traceml_agent.init({endpoint!r}, secret={secret!r})
elif {hooks!r}:
    sys.path.insert(0, {pkg!r})
    from collections import deque
    import traceml_agent.hooks as hooks
    from traceml_agent.checks import StepObserver
    from traceml_agent.recorder import Recorder
    out = deque(maxlen=100_000)
    hooks.install(Recorder(out), torch, print, StepObserver(0, 1))
parts = build(ddp={ddp!r})
print("ms_per_step", run_steps({steps}, *parts))
if {hooks!r} and {whole!r}:
    traceml_agent.shutdown(0)
if {ddp!r}:
    dist.destroy_process_group()
'''


class Sink:
    """The collector's end for --whole: a CURVE ROUTER in this process (not under
    valgrind) that reads and drops every message, so the agent's sends never back up."""

    def __init__(self) -> None:
        import zmq

        sys.path.insert(0, str(HERE.parent))
        from agent import keys  # the same key derivation as the collector's

        self.secret = keys.new_secret()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.curve_server = True
        self.sock.curve_secretkey = keys.derive(self.secret).server_secret
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.messages = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._drain, daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        while not self.stop.is_set():
            if self.sock.poll(100):
                self.sock.recv_multipart()
                self.messages += 1

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.sock.close(0)
        self.ctx.term()


STEP_MS: list[float] = []  # wall ms per step of each run, under callgrind


def count(steps: int, hooks: bool, agent: Path, port: int, ddp: bool,
          sink: Sink | None = None, profile: Path | None = None,
          scale: float = 1.0) -> int:
    """Instructions of one run (every thread). With `sink`, the whole agent (init():
    hooks, recorder, checks, sender thread, CURVE) reports to it; without, the hooks and
    recorder only. With `profile`, callgrind's files (one per thread) are kept there."""
    with tempfile.TemporaryDirectory() as tmp:
        pkg = Path(tmp) / "pkg"
        pkg.mkdir()
        (pkg / "traceml_agent").symlink_to(agent.resolve())  # import it from that folder
        code = WORKLOAD.format(bench=str(HERE), port=str(port), hooks=hooks, pkg=str(pkg),
                               steps=steps, ddp=ddp, whole=sink is not None,
                               endpoint=sink.endpoint if sink else "",
                               secret=sink.secret if sink else "", scale=scale)
        out = Path(tmp) / "callgrind.out"
        if profile is not None:
            profile.mkdir(parents=True, exist_ok=True)
            out = profile / f"callgrind.{'hooks' if hooks else 'bare'}.{steps}"
        # A fixed hash seed: set and dict orders (and so instruction counts) repeat.
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
        env.pop("TRACEML_ENDPOINT", None)
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
               "--collect-atstart=yes"]
        if profile is not None:
            cmd.append("--separate-threads=yes")
        proc = subprocess.run([*cmd, sys.executable, "-c", code],
                              capture_output=True, text=True, env=env)
        match = re.search(r"Collected : (\d+)", proc.stderr)
        if proc.returncode != 0 or not match:
            raise SystemExit(f"callgrind run failed:\n{proc.stderr[-2000:]}")
        ms = re.search(r"ms_per_step ([\d.]+)", proc.stdout)
        STEP_MS.append(float(ms.group(1)) if ms else float("nan"))
        return int(match.group(1))


def thread_files(profile: Path, variant: str, steps: int) -> dict[str, Path]:
    """A run's per-thread callgrind files, named by their role."""
    out: dict[str, Path] = {}
    for f in sorted(profile.glob(f"callgrind.{variant}.{steps}-*")):
        # The functions it ran ("fn=(id) name" names each function once).
        text = " ".join(re.findall(r"^fn=\(\d+\) (\S+)", f.read_text(errors="replace"),
                                   re.M)).lower()
        if f.name.endswith("-01"):
            role = "main"
        elif "gloo::" in text:
            role = "gloo"
        elif "_pyeval_evalframedefault" in text:
            role = "sender"  # the one other Python thread: the agent's (traceml-sender)
        elif "zmq::" in text or "sodium" in text:
            role = "zmq-io"  # libzmq's I/O thread: CURVE encryption, the socket
        else:
            role = "other"
        n = sum(1 for r in out if r.split("#")[0] == role)
        out[f"{role}#{n}" if n else role] = f
    return out


def _total(f: Path) -> int:
    match = re.search(r"^(?:summary|totals): (\d+)", f.read_text(errors="replace"), re.M)
    return int(match.group(1)) if match else 0


def _gc(f: Path) -> int:
    """Instructions in Python's garbage collections (gc_collect_main, inclusive)."""
    text = subprocess.run(["callgrind_annotate", "--threshold=100", "--inclusive=yes", str(f)],
                          capture_output=True, text=True).stdout
    match = re.search(r"^\s*([\d,]+) \([^)]*\)\s+\S*gcmodule\.c:gc_collect_main ", text, re.M)
    return int(match.group(1).replace(",", "")) if match else 0


def by_thread(profile: Path, variant: str, short: int, long: int) -> dict[str, float]:
    """Per step, by thread; "main-gc" is the training thread without its garbage
    collections (a full one is ~6.5M instructions: at 500 steps of difference, one more
    or fewer in a run moves the thread's figure by ~13k/step), "all-gc" every thread
    without them (a collection runs on whichever thread allocates when it is due)."""
    a, b = thread_files(profile, variant, short), thread_files(profile, variant, long)
    out = {role: (_total(b[role]) - (_total(a[role]) if role in a else 0)) / (long - short)
           for role in b}
    if "main" in a and "main" in b:
        out["main-gc"] = out["main"] - (_gc(b["main"]) - _gc(a["main"])) / (long - short)
        gc = sum(_gc(b[r]) - (_gc(a[r]) if r in a else 0) for r in b) / (long - short)
        out["all-gc"] = sum(v for r, v in out.items() if r != "main-gc") - gc
    return out


def functions(f: Path) -> dict[str, int]:
    """Exclusive instructions by function (callgrind_annotate)."""
    text = subprocess.run(["callgrind_annotate", "--threshold=100", "--inclusive=no", str(f)],
                          capture_output=True, text=True).stdout
    out: dict[str, int] = {}
    for line in text.splitlines():
        m = re.match(r"\s*([\d,]+) \([^)]*\)\s+(.*)", line)
        if m and "PROGRAM TOTALS" not in line:
            name = re.sub(r"\s*\[.*\]$", "", m.group(2))
            name = re.sub(r"^.*?/Python-3[.\d]*/", "", re.sub(r"'\d+$", "", name))
            out[name] = out.get(name, 0) + int(m.group(1).replace(",", ""))
    return out


def per_step_functions(profile: Path, variant: str, role: str, short: int,
                       long: int) -> dict[str, float]:
    a = thread_files(profile, variant, short).get(role)
    b = thread_files(profile, variant, long).get(role)
    if b is None:
        return {}
    fa, fb = functions(a) if a else {}, functions(b)
    return {k: (fb.get(k, 0) - fa.get(k, 0)) / (long - short) for k in set(fa) | set(fb)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--agent", type=Path, default=HERE.parent / "agent",
                   help="the agent folder measured (default: this checkout's)")
    p.add_argument("--port", type=int, default=29_811,
                   help="the gloo store's port (and port + 1): two runs at once need two")
    p.add_argument("--short", type=int, default=100)
    p.add_argument("--long", type=int, default=600)
    p.add_argument("--ddp", action="store_true",
                   help="wrap the model in DDP under a one-rank gloo group (noisier)")
    p.add_argument("--whole", action="store_true",
                   help="the whole agent: init() with its sender thread and CURVE, "
                        "reporting to a sink in this process")
    p.add_argument("--cadence-scale", type=float, default=1.0,
                   help="with --whole: the sender's intervals times this, e.g. callgrind's "
                        "slowdown, so a batch holds as many steps as it would natively")
    p.add_argument("--only", choices=("bare", "hooks"),
                   help="measure one variant only (e.g. hooks of two checkouts)")
    p.add_argument("--profile", type=Path,
                   help="keep callgrind's files (one per thread) in this folder, for "
                        "callgrind_annotate --inclusive=yes; the summary splits by thread")
    p.add_argument("--by-function", type=int, default=0, metavar="N",
                   help="with --profile: each thread's N functions that moved most")
    args = p.parse_args()
    port = args.port
    result = {}
    sink = Sink() if args.whole else None
    variants = (False, True) if args.only is None else (args.only == "hooks",)
    try:
        for hooks in variants:
            use = sink if hooks else None
            short = count(args.short, hooks, args.agent, port, args.ddp, use, args.profile,
                          args.cadence_scale)
            long = count(args.long, hooks, args.agent, port + 1, args.ddp, use, args.profile,
                         args.cadence_scale)
            per_step = (long - short) / (args.long - args.short)
            result["hooks" if hooks else "bare"] = per_step
            print(f"{'hooks' if hooks else 'bare ':5}  {short:>14,} / {long:>14,} "
                  f"instructions -> {per_step:,.0f} per step", flush=True)
    finally:
        if sink is not None:
            sink.close()
    summary = {"agent": str(args.agent), "ddp": args.ddp, "whole": args.whole,
               "cadence_scale": args.cadence_scale, "steps": [args.short, args.long],
               "ms_per_step_under_callgrind": [round(ms, 1) for ms in STEP_MS]}
    summary.update({f"{k}_per_step": round(v) for k, v in result.items()})
    if len(result) == 2:
        agent = result["hooks"] - result["bare"]
        summary.update(agent_per_step=round(agent), agent_share=round(agent / result["bare"], 4))
    if sink is not None:
        summary["messages_received"] = sink.messages
    if args.profile is not None:
        threads = {v: by_thread(args.profile, v, args.short, args.long)
                   for v in ("bare", "hooks") if v in result}
        summary["per_thread"] = {v: {r: round(x) for r, x in t.items()}
                                 for v, t in threads.items()}
        if len(threads) == 2:
            roles = sorted(set(threads["bare"]) | set(threads["hooks"]))
            summary["agent_per_thread"] = {r: round(threads["hooks"].get(r, 0)
                                                    - threads["bare"].get(r, 0)) for r in roles}
    print(json.dumps(summary))
    if args.profile is not None and args.by_function:
        for role in sorted(thread_files(args.profile, "hooks", args.long)):
            hooks = per_step_functions(args.profile, "hooks", role, args.short, args.long)
            bare = (per_step_functions(args.profile, "bare", role, args.short, args.long)
                    if "bare" in result else {})
            diff = {k: hooks.get(k, 0) - bare.get(k, 0) for k in set(hooks) | set(bare)}
            print(f"--- {role}: per step, hooks - bare ({sum(diff.values()):,.0f} in all)")
            for name, v in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:args.by_function]:
                print(f"{v:10,.0f}  {name[:120]}")


if __name__ == "__main__":
    main()
