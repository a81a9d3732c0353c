"""Dashboard frame time: CPU per refresh at 1,024 and 8,192 ranks, from simulated state.

One refresh is what the app does each tick: decode the collector's encoded RunView,
replace the state in every widget, and let Textual draw the screen (heat rows through
the Line API: only visible lines are rendered). Measured inside a real App under
run_test (a 160x50 terminal), CPU time of the UI thread's process, two alternating
states so no cache can serve a frame twice. For reference, a naive DataTable with one
row per rank whose every cell is updated each refresh.

    python benchmarks/dashboard_frame.py --ranks 1024 8192
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from traceml_tui.collect.canned import StaticSource, make_state, make_view, with_history  # noqa: E402
from traceml_tui.viewmodel import VIEW_PHASES, decode_view, encode_view  # noqa: E402


def _with_history(state):
    """A 10-minute time chart (its history at the 512-point bound), when the code under
    test keeps one (older code: none)."""
    try:
        return with_history(state, seconds=600.0, onset_s=200.0)
    except ModuleNotFoundError:
        return state


async def frame_times(world: int, frames: int, nodes_view: bool) -> list[float]:
    from traceml_tui.view.dashboard import DashboardApp

    states = [_with_history(make_state(world_size=world, nproc_per_node=8, steps=16,
                                       straggler=world // 3, seed=s)) for s in (1, 2)]
    payloads = [encode_view(make_view(st, 75.0 + i)) for i, st in enumerate(states)]
    app = DashboardApp(StaticSource(states[0]), refresh_s=3600)  # we drive the refreshes
    times = []
    async with app.run_test(size=(160, 50)) as pilot:
        await pilot.pause(0.2)
        app.nodes_only = nodes_view
        for i in range(frames):
            t0 = time.process_time()
            view = decode_view(payloads[i % 2])
            app.apply(view, None, "")
            await pilot.pause()  # let Textual lay out and draw the screen
            times.append((time.process_time() - t0) * 1000)
    return times


async def datatable_times(world: int, frames: int) -> list[float]:
    from textual.app import App
    from textual.widgets import DataTable

    states = [make_view(make_state(world_size=world, nproc_per_node=8, steps=16,
                                   straggler=world // 3, seed=s)) for s in (1, 2)]

    class Naive(App):
        def compose(self):
            yield DataTable()

    app = Naive()
    times = []
    async with app.run_test(size=(160, 50)) as pilot:
        table = app.query_one(DataTable)
        cols = [table.add_column(c, key=c) for c in ("rank", "step", *VIEW_PHASES)]
        for r in states[0].rows:
            table.add_row(r.rank, r.step_ms, *r.phase_ms, key=str(r.rank))
        await pilot.pause(0.2)
        for i in range(frames):
            t0 = time.process_time()
            for r in states[i % 2].rows:
                for c, v in zip(cols[1:], (r.step_ms, *r.phase_ms), strict=True):
                    table.update_cell(str(r.rank), c, f"{v:.2f}" if v is not None else "-")
            await pilot.pause()
            times.append((time.process_time() - t0) * 1000)
    return times


def describe(times: list[float]) -> dict[str, float]:
    s = sorted(times)
    return {"median_ms": round(statistics.median(s), 1), "p90_ms": round(s[int(0.9 * len(s))], 1),
            "max_ms": round(s[-1], 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ranks", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--frames", type=int, default=30)
    p.add_argument("--no-datatable", action="store_true")
    args = p.parse_args()
    for world in args.ranks:
        for nodes_view in (False, True):
            t = asyncio.run(frame_times(world, args.frames, nodes_view))
            view = "node view" if nodes_view else "rank rows"
            print(json.dumps({"ranks": world, "view": view, **describe(t[3:])}), flush=True)
        if not args.no_datatable and world <= 1024:
            t = asyncio.run(datatable_times(world, max(5, args.frames // 3)))
            print(json.dumps({"ranks": world, "view": "naive DataTable, every cell updated",
                              **describe(t[1:])}), flush=True)


if __name__ == "__main__":
    main()
