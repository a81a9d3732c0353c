"""Regenerate screenshots/replay.svg: the README's demo, after it ended, opened with
`traceml watch RUN_DIR` and walked to the episode where rank 2 straggles.

    python screenshots/make_replay.py

Runs `traceml run examples/straggler_demo.py --nproc-per-node=4 --headless` to its end
in a temporary folder, opens its record in the replay dashboard exactly as `traceml
watch` does (collect/replay.py, view/dashboard/replay_app.py), presses `<` (the start),
then `]` until the banner names the straggler and `→` twice, and saves the SVG.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from traceml_tui.collect.replay import Replay, open_record
from traceml_tui.view.dashboard.replay_app import ReplayApp

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SIZE = (150, 46)


async def shoot(run_dir: Path) -> None:
    rec = open_record(run_dir)
    app = ReplayApp(Replay(rec), rec.status, run_dir, rec.summary)
    async with app.run_test(size=SIZE) as pilot:
        while app.state is None:
            await pilot.pause(0.1)
        await pilot.press("less_than_sign")
        for _ in range(10):
            await pilot.press("right_square_bracket")
            await pilot.pause(0.1)
            if app.state.label == "INPUT STRAGGLER":
                break
        await pilot.press("right", "right")
        await pilot.pause(0.5)
        app.save_screenshot("replay.svg", str(HERE))


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "traceml_tui", "run",
                        str(ROOT / "examples" / "straggler_demo.py"), "--nproc-per-node=4",
                        "--headless", "--out", tmp, "--run-name", "demo"],
                       check=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                       stdout=subprocess.DEVNULL)
        asyncio.run(shoot(Path(tmp) / "demo"))
    print(HERE / "replay.svg")


if __name__ == "__main__":
    main()
