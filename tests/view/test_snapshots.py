"""SVG snapshot tests of every screen (pytest-textual-snapshot) on canned, fixed-clock
states: what a user sees, compared with the reviewed pictures in tests/view/__snapshots__.
After an intended change of the look: pytest tests/view/test_snapshots.py --snapshot-update,
then look at the new SVGs before committing them."""

from __future__ import annotations

import pytest

from traceml_agent.findings import Finding
from traceml_agent.protocol import CollRow
from traceml_tui.collect.canned import StaticSource, make_hang_state, make_state, with_history
from traceml_tui.view.dashboard import DashboardApp
from traceml_tui.viewmodel import DeepTraceView

WIDE = (150, 46)
NARROW = (80, 24)


def app_of(state) -> DashboardApp:
    source = StaticSource(state)
    if getattr(state, "capture_view", None) is not None:
        source.capture_view = state.capture_view
    return DashboardApp(source, refresh_s=0.05)


def after(*keys: str):
    """Wait for the first state, then press `keys`, then let the screen settle."""
    async def run_before(pilot) -> None:
        for _ in range(200):
            if pilot.app.state is not None:
                break
            await pilot.pause(0.05)
        await pilot.pause(0.2)
        if keys:
            await pilot.press(*keys)
            await pilot.pause(0.3)
    return run_before


def straggler():
    return with_history(make_state(straggler=2, phase="dataloader"))


def slow_node_1024():
    return with_history(make_state(world_size=1024, nproc_per_node=8, steps=16, straggler=333,
                                   phase="forward", hosts="node"))


def three_nodes_with_a_finding():
    found = Finding("accumulation-without-no-sync", "warning", (0, 1, 2, 3),
                    "4 backward passes per optimizer step each allreduced all gradients",
                    "Run forward and backward of every micro-batch but the last inside "
                    "`with model.no_sync():`.")
    return make_state(world_size=6, nproc_per_node=2, straggler=2, also_slow=(3,),
                      silent_nodes=(2,), findings=(found,))


def deep_trace():
    """The straggler with an analysed deep trace (read with T)."""
    state = straggler()
    state.capture_view = DeepTraceView(
        3, 5, (2, 5), {"2": "worst", "5": "median"}, {"2": "done", "5": "done"}, {}, {},
        "Deep trace 3: 5 profiled steps, rank 2 (worst) beside rank 5 (median)\n\n"
        "metric                      rank 2   rank 5    delta\n"
        "dataloader per step (ms)     30.31     0.30   +30.01\n"
        "forward per step (ms)         1.02     1.03    -0.01\n"
        "top CPU ops of rank 2: time.sleep (collate_fn) 30.2 ms/step\n",
        "/runs/demo/traces/capture3.json")
    return state


def with_collectives():
    """The straggler, its sync split by collective (read with o): a metrics all-gather on
    a second group beside DDP's all-reduce."""
    state = straggler()
    rows = [CollRow("r0-7", "all_gather", "none", 10, 10_485_760, 23.0),
            CollRow("world", "all_reduce", "backward", 10, 40_960_000, 14.5),
            CollRow("world", "broadcast_coalesced", "forward", 10, 26_000, 0.4)]
    for rank in range(state.world_size):
        state.collectives.add(rank, rows)
    return state


CASES = [
    ("straggler", straggler, WIDE, ()),
    ("straggler-narrow", straggler, NARROW, ()),
    ("straggler-pinned", straggler, WIDE, ("g", "5", "enter")),
    ("scale-1024-node-view", slow_node_1024, WIDE, ()),
    ("slow-node-and-silent-node", three_nodes_with_a_finding, WIDE, ()),
    ("setup-checks", three_nodes_with_a_finding, WIDE, ("c",)),
    ("help", straggler, WIDE, ("question_mark",)),
    ("hang-with-stack", make_hang_state, WIDE, ()),
    ("deep-trace", deep_trace, WIDE, ("T",)),
    ("collectives", with_collectives, WIDE, ("o",)),
]


@pytest.mark.parametrize(("name", "make", "size", "keys"), CASES, ids=[c[0] for c in CASES])
def test_screen(snap_compare, name, make, size, keys):
    assert snap_compare(app_of(make()), terminal_size=size, run_before=after(*keys))
