"""How long a problem takes to reach the banner: a straggler's onset, and a hang.

Real 4-rank `traceml run` jobs (benchmarks/latency_job.py, CPU, gloo). The problem
starts at a known step, after the diagnosis has settled on BALANCED, and the rank
that injects it writes the moment by its own clock (time.time(), same host). This
script watches the collector's view socket as a dashboard does (ViewClient.fetch(),
what the banner draws), every 0.1 s, and takes the first moment the banner shows
the expected label on the expected rank. Latency = that moment - the onset.

    python benchmarks/latency.py                # 3 of each: straggler, hang, hang --hang-after 3
    python benchmarks/latency.py --reps 5 --kinds straggler

What the figures consist of (see benchmarks/README.md):
  straggler  the live window is each rank's last 32 steps (state.LIVE_STEPS): its median
             moves once 17 slow steps are in; + up to one 0.1 s agent send batch; + the
             0.5 s evaluation tick; + CONFIRM_TICKS = 2 winning ticks before the label
             changes; + this script's 0.1 s poll. A dashboard adds its own 0.5 s refresh.
  hang       the threshold, max(10 s, 20 median steps) by default (--hang-after overrides),
             counted from the last step any rank closed; + the 0.5 s evaluation tick;
             + the poll. The run with --hang-after 3 shows the part that is not threshold.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from traceml_tui.view.client import (  # noqa: E402
    ViewClient,
    ViewUnavailable,
    WatchTargetError,
    resolve_target,
)
from traceml_tui.viewmodel import RunView  # noqa: E402

JOB = ROOT / "benchmarks" / "latency_job.py"
WORLD = 4
POLL_S = 0.1
FROM_STEP = 150
STRAGGLER_RANK, HANG_RANK = 2, 1
GIVE_UP_S = 90.0


@dataclass
class Sample:
    kind: str
    latency_s: float | None  # None: not shown within GIVE_UP_S
    step_ms: float | None  # median step before the onset, as the view showed it
    label_at_onset: str
    step_ms_at_banner: float | None  # median step when the banner showed it


def _kill_tree(proc: subprocess.Popen) -> None:
    try:
        parent = psutil.Process(proc.pid)
        victims = [*parent.children(recursive=True), parent]
    except psutil.NoSuchProcess:
        return
    for p in victims:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def _fetch(client: ViewClient) -> RunView | None:
    try:
        return client.fetch()[0]
    except ViewUnavailable:
        return None


def measure(kind: str, hang_after: float | None, work: Path, rep: int) -> Sample:
    """One job: start it, wait for the onset the rank writes, poll the banner."""
    name = f"{kind}-{rep}" + ("" if hang_after is None else f"-after{hang_after:g}")
    onset_file = work / f"{name}.onset"
    target = STRAGGLER_RANK if kind == "straggler" else HANG_RANK
    expected = "COMPUTE STRAGGLER" if kind == "straggler" else "HANG"
    inject = ("--straggler-rank" if kind == "straggler" else "--hang-rank", str(target))
    cmd = [sys.executable, "-m", "traceml_tui", "run", str(JOB), "--nproc-per-node", str(WORLD),
           "--headless", "--out", str(work), "--run-name", name]
    if hang_after is not None:
        cmd += ["--hang-after", str(hang_after)]
    cmd += ["--", *inject, "--from-step", str(FROM_STEP), "--onset-file", str(onset_file)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    run_dir = work / name
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                address, _, secret = resolve_target(str(run_dir))
                break
            except WatchTargetError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"{name}: the collector never came up") from None
                time.sleep(POLL_S)
        client = ViewClient(address, secret=secret)
        onset: float | None = None
        before: RunView | None = None  # the last view before the onset
        at_onset: RunView | None = None
        while True:
            polled = time.monotonic()
            view = _fetch(client)
            seen_at = time.time()
            if onset is None and onset_file.exists():
                onset = float(onset_file.read_text())
                at_onset = before
            if view is not None and onset is None:
                before = view
            if view is not None and onset is not None:
                if view.label == expected and view.rank == target:
                    latency = seen_at - onset
                    break
                if seen_at - onset > GIVE_UP_S:
                    latency = None
                    break
            if proc.poll() is not None:
                raise RuntimeError(f"{name}: the job ended (exit {proc.returncode}) first")
            time.sleep(max(0.0, POLL_S - (time.monotonic() - polled)))
        client.close()
        return Sample(kind if hang_after is None else f"{kind} --hang-after {hang_after:g}",
                      latency, None if at_onset is None else at_onset.median_step_ms,
                      "?" if at_onset is None else at_onset.label,
                      None if view is None else view.median_step_ms)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                _kill_tree(proc)
                proc.wait(10)
        shutil.rmtree(run_dir, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--kinds", nargs="+", default=["straggler", "hang", "hang-after-3"],
                   choices=["straggler", "hang", "hang-after-3"])
    args = p.parse_args()
    print(f"$ python benchmarks/latency.py --reps {args.reps} --kinds {' '.join(args.kinds)}")
    print(f"{WORLD} ranks of benchmarks/latency_job.py under traceml run, CPU/gloo, "
          f"{os.cpu_count()} cores; the problem starts at step {FROM_STEP}; banner polled "
          f"every {POLL_S} s through the view socket", flush=True)
    results: dict[str, list[Sample]] = {}
    with tempfile.TemporaryDirectory(prefix="traceml-latency-") as tmp:
        for kind in args.kinds:
            for rep in range(args.reps):
                if kind == "hang-after-3":
                    s = measure("hang", 3.0, Path(tmp), rep)
                else:
                    s = measure(kind, None, Path(tmp), rep)
                results.setdefault(s.kind, []).append(s)
                lat = "not shown" if s.latency_s is None else f"{s.latency_s:6.2f} s"
                extra = "" if s.step_ms_at_banner is None else (
                    f", {s.step_ms_at_banner:.1f} ms at the banner")
                step = "?" if s.step_ms is None else f"{s.step_ms:.1f} ms"
                print(f"  {s.kind:<22} rep {rep}: {lat}  (median step {step} before the "
                      f"onset{extra}; banner at onset: {s.label_at_onset})", flush=True)
    print()
    for kind, samples in results.items():
        lats = [s.latency_s for s in samples if s.latency_s is not None]
        missed = len(samples) - len(lats)
        if lats:
            print(f"{kind:<22} median {statistics.median(lats):6.2f} s, range "
                  f"{min(lats):.2f}-{max(lats):.2f} s over {len(lats)} run(s)"
                  + (f", {missed} not shown within {GIVE_UP_S:.0f} s" if missed else ""))
        else:
            print(f"{kind:<22} never shown within {GIVE_UP_S:.0f} s")


if __name__ == "__main__":
    main()
