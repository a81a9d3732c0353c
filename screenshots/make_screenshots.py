"""Regenerate the README's dashboard screenshots from a real run of the straggler demo.

    python screenshots/make_screenshots.py

Starts `traceml run examples/straggler_demo.py --nproc-per-node=4` (headless, in the
background), attaches the dashboard to its collector exactly as `traceml watch` does,
saves SVGs after a few key presses (a deep trace included), then stops the job with
Ctrl-C (SIGINT). The large-scale, multi-node and setup-check pictures use simulated
states (canned, fixed clock).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from traceml_tui.collect.canned import StaticSource, make_state, with_history  # noqa: E402
from traceml_tui.view.client import ViewClient, resolve_target  # noqa: E402
from traceml_tui.view.dashboard import DashboardApp  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SIZE = (150, 46)


def _steps(run_dir: Path) -> int:
    try:
        return json.loads((run_dir / "live_snapshot.json").read_text())["run"]["steps"]
    except (OSError, ValueError, KeyError):
        return 0


async def shoot_live(run_dir: Path) -> None:
    address, _, secret = resolve_target(str(run_dir))
    app = DashboardApp(ViewClient(address, secret=secret), run_dir, refresh_s=0.3)
    async with app.run_test(size=SIZE) as pilot:
        for _ in range(100):
            await pilot.pause(0.2)
            if app.state is not None and app.state.label == "INPUT STRAGGLER":
                break
        await pilot.pause(1.0)
        app.save_screenshot("dashboard.svg", str(HERE))
        await pilot.press("g", "1", "enter")  # pin rank 1 (a rank waiting in sync)
        await pilot.pause(1.0)
        app.save_screenshot("pinned.svg", str(HERE))
        await pilot.press("question_mark")
        await pilot.pause(0.3)
        app.save_screenshot("help.svg", str(HERE))
        await pilot.press("escape", "w", "t")  # deep trace: the worst rank and the median
        for _ in range(150):
            await pilot.pause(0.2)
            cap = app.state.capture if app.state else None
            if cap and cap.get("text"):
                break
        await pilot.press("T")
        await pilot.pause(0.5)
        app.save_screenshot("deep-trace.svg", str(HERE))


async def shoot_scale() -> None:
    state = with_history(make_state(world_size=1024, nproc_per_node=8, steps=16,
                                    straggler=333, phase="forward"))
    app = DashboardApp(StaticSource(state), refresh_s=0.2)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause(1.0)
        app.save_screenshot("nodes-1024.svg", str(HERE))


async def shoot_nodes() -> None:
    """Three nodes of two ranks: node 1 slow as a whole, node 2 not started yet, and a
    setup finding (canned, fixed clock)."""
    from traceml_agent.checks import Finding

    found = Finding("accumulation-without-no-sync", "warning", (0, 1, 2, 3),
                    "4 backward passes per optimizer step each allreduced all gradients "
                    "(3 steps in a row): 3 of every 4 allreduces wasted",
                    "Run forward and backward of every micro-batch but the last inside "
                    "`with model.no_sync():`.")
    state = with_history(make_state(world_size=6, nproc_per_node=2, straggler=2,
                                    also_slow=(3,), silent_nodes=(2,), findings=(found,)))
    app = DashboardApp(StaticSource(state), refresh_s=0.2)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause(1.0)
        app.save_screenshot("multinode.svg", str(HERE))
        await pilot.press("c")
        await pilot.pause(0.3)
        app.save_screenshot("checks.svg", str(HERE))


def main() -> None:
    out = Path(tempfile.mkdtemp(prefix="traceml-shots-"))
    job = subprocess.Popen(
        [sys.executable, "-m", "traceml_tui", "run", str(ROOT / "examples/straggler_demo.py"),
         "--nproc-per-node=4", "--headless", "--out", str(out), "--run-name", "straggler-demo",
         "--", "--steps", "100000"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    run_dir = out / "straggler-demo"
    try:
        deadline = time.monotonic() + 120
        while _steps(run_dir) < 60:
            if time.monotonic() > deadline or job.poll() is not None:
                raise SystemExit("the demo did not start; see " + str(run_dir))
            time.sleep(0.5)
        asyncio.run(shoot_live(run_dir))
    finally:
        job.send_signal(signal.SIGINT)
        job.wait(60)
    asyncio.run(shoot_scale())
    asyncio.run(shoot_nodes())
    for name in ("dashboard.svg", "pinned.svg", "help.svg", "deep-trace.svg", "nodes-1024.svg",
                 "multinode.svg", "checks.svg"):
        print(HERE / name)


if __name__ == "__main__":
    main()
