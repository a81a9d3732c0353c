"""How often the verdict is right, run after run, on a quiet machine and beside a CPU hog
(issue 39, item 6: verdicts that hold under noise).

Each case is a real `traceml run` of examples/ddp_toy.py (torchrun, gloo, CPU) with a
known fault; a run is right when its final_summary.json says what the fault is:

  accumulate   gradient accumulation (4 micro-batches, no_sync on the first 3), rank 1's
               forward 3 ms slower per micro-batch (+12 ms on a ~110 ms step): COMPUTE
               STRAGGLER rank 1
  transient    rank 1 +21 ms of forward on steps 40-99 of a sync-heavy 4-rank job (a
               ~15 ms step, 1.5x): an episode COMPUTE STRAGGLER rank 1 filed on 40-99
               (within 5 steps each side)
  moving       every step the ranks' extra forward spread 0-100 ms in a fresh order:
               LOAD IMBALANCE
  even         every rank 25 ms of device-like compute, nothing injected: BALANCED

    python benchmarks/repeated_verdicts.py --runs 5 [--cases accumulate,transient]

With --hog, one busy process spins beside each run (a neighbour on one of the cores).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOY = ROOT / "examples" / "ddp_toy.py"

CASES: dict[str, tuple[int, tuple[str, ...]]] = {
    "accumulate": (4, ("--scenario", "forward", "--rank", "1", "--delay-ms", "3",
                       "--compute-ms", "25", "--accumulate", "4", "--steps", "150")),
    "transient": (4, ("--scenario", "forward", "--rank", "1", "--delay-ms", "21",
                      "--from-step", "40", "--to-step", "99", "--dim", "1024",
                      "--steps", "160")),
    "moving": (4, ("--scenario", "moving", "--delay-ms", "100", "--compute-ms", "5",
                   "--steps", "150")),
    "even": (3, ("--scenario", "compute-all", "--delay-ms", "25", "--steps", "150")),
}


def right(case: str, doc: dict) -> tuple[bool, str]:
    """Whether the record says what the fault is, and what it said."""
    d = doc["diagnosis"]
    said = f"{d['label']} rank {d['rank']}"
    if case == "accumulate":
        return (d["label"], d["rank"]) == ("COMPUTE STRAGGLER", 1), said
    if case == "moving":
        return d["label"] == "LOAD IMBALANCE", said
    if case == "even":
        return d["label"] == "BALANCED", said
    eps = [e for e in doc["timeline"] if e["label"] == "COMPUTE STRAGGLER" and e["rank"] == 1]
    said = "; ".join(f"{e['label']} {e['rank']} {e['start_step']}-{e['end_step']}"
                     for e in doc["timeline"])
    ok = any(abs(e["start_step"] - 40) <= 5 and e["end_step"] is not None
             and abs(e["end_step"] - 99) <= 5 for e in eps)
    return ok, said


def run(case: str, out: Path) -> tuple[bool, str, float]:
    nproc, args = CASES[case]
    t0 = time.monotonic()
    proc = subprocess.run(["traceml", "run", str(TOY), "--nproc-per-node", str(nproc),
                           "--headless", "--out", str(out), "--run-name", case, "--", *args],
                          capture_output=True, text=True, timeout=600)
    took = time.monotonic() - t0
    summary = out / case / "final_summary.json"
    if proc.returncode or not summary.exists():
        return False, f"exit {proc.returncode}: {proc.stderr[-300:]}", took
    ok, said = right(case, json.loads(summary.read_text()))
    return ok, said, took


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--hog", action="store_true", help="a busy process beside each run")
    args = p.parse_args()
    cases = [c for c in args.cases.split(",") if c]
    for c in cases:
        if c not in CASES:
            sys.exit(f"error: unknown case {c!r} (choose from {', '.join(CASES)})")
    where = "beside a CPU hog" if args.hog else "quiet"
    for case in cases:
        hits = 0
        for i in range(args.runs):
            hog = (subprocess.Popen([sys.executable, "-c", "while True: pass"])
                   if args.hog else None)
            try:
                with tempfile.TemporaryDirectory() as tmp:
                    ok, said, took = run(case, Path(tmp))
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
            hits += ok
            print(f"{case:<11} {where:<17} run {i + 1}: {'right' if ok else 'WRONG'} "
                  f"({took:.0f} s) {said}", flush=True)
        print(f"{case:<11} {where:<17} {hits} of {args.runs} right", flush=True)


if __name__ == "__main__":
    main()
