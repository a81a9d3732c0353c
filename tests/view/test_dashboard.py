"""The dashboard through Textual's Pilot, fed canned collector states at a fixed clock."""

from __future__ import annotations

import json
import time

import pytest
from textual.widgets import Static

from traceml_tui.collect.canned import StaticSource, make_state
from traceml_tui.view.dashboard import DashboardApp
from traceml_tui.view.dashboard.banner import Banner
from traceml_tui.view.dashboard.heat_table import HeatTable
from traceml_tui.view.dashboard.rank_panel import RankPanel
from traceml_tui.view.dashboard.screens import HelpScreen, PromptScreen
from traceml_tui.view.dashboard.status_bar import StatusBar
from traceml_tui.viewmodel import DeepTraceView

SIZE = (140, 44)


def text_of(widget) -> str:
    """What a Static shows, as plain text."""
    from rich.console import Console

    console = Console(width=200, record=True, file=open("/dev/null", "w"))
    console.print(widget.content)
    return console.export_text()


def panel_text(app, selector: str) -> str:
    return text_of(app.query_one(selector, RankPanel))


async def started(app, pilot) -> None:
    """Wait until the first state has been drawn."""
    await until(pilot, lambda: app.state is not None, "no state arrived")


async def until(pilot, condition, what: str, timeout_s: float = 30.0) -> None:
    """Wait for a condition, not for a fixed time (a busy CI machine is slow: 10 s was
    not enough for a table's layout once, with the machine's cores oversubscribed)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(what)
        await pilot.pause(0.05)


async def test_banner_and_worst_panel_show_what_the_state_says():
    app = DashboardApp(StaticSource(make_state(straggler=2, phase="dataloader")),
                       refresh_s=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await started(app, pilot)
        banner = text_of(app.query_one(Banner))
        assert "INPUT STRAGGLER" in banner and "rank 2" in banner and "dataloader" in banner
        assert app.query_one(Banner).has_class("-critical")
        worst = panel_text(app, "#worst")
        assert "rank 2" in worst and "dataloader" in worst and "30." in worst
        assert "ranks 8/8" in text_of(app.query_one(StatusBar))
        # What it costs: the canned straggler adds 30 ms to a ~6 ms step.
        cost_line = next(line for line in banner.splitlines() if "costs" in line)
        assert "of every step" in cost_line and "faster without it" in cost_line, banner
        share = int(cost_line.split("costs ")[1].split("%")[0])
        assert 75 <= share <= 90, cost_line
        assert "without it:" in " ".join(worst.split()) and "ms/step" in worst, worst


async def test_pin_with_cursor_and_enter_then_unpin():
    app = DashboardApp(StaticSource(make_state()), refresh_s=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await started(app, pilot)
        table = app.query_one(HeatTable)
        await pilot.press("down", "down", "down")  # the fourth line, in worst-first order
        rank = table.cursor_rank
        assert rank == table.lines[3].rank
        await pilot.press("enter")
        await until(pilot, lambda: app.pinned == rank, f"rank {rank} was not pinned")
        assert app.query_one("#pinned", RankPanel).display
        assert f"rank {rank}" in panel_text(app, "#pinned")
        await pilot.press("enter")  # the same rank again: unpin
        assert app.pinned is None
        assert not app.query_one("#pinned", RankPanel).display


async def test_w_jumps_to_the_worst_rank_and_pins_it():
    app = DashboardApp(StaticSource(make_state(straggler=6, phase="forward")), refresh_s=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await started(app, pilot)
        await pilot.press("w")
        await until(pilot, lambda: app.pinned == 6, "the worst rank was not pinned")
        assert app.query_one(HeatTable).cursor_rank == 6
        assert "rank 6" in panel_text(app, "#pinned")


async def test_g_types_a_rank_number_and_rejects_nonsense():
    app = DashboardApp(StaticSource(make_state()), refresh_s=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await started(app, pilot)
        await pilot.press("g")
        assert isinstance(app.screen, PromptScreen)
        await pilot.press("5", "enter")
        await until(pilot, lambda: app.pinned == 5, "rank 5 was not pinned")
        await pilot.press("g", "9", "9", "enter")  # no rank 99 in an 8-rank run
        await pilot.pause(0.2)
        assert app.pinned == 5


async def test_sort_puts_the_slowest_rank_first():
    app = DashboardApp(StaticSource(make_state(world_size=4, nproc_per_node=4, straggler=1,
                                               phase="forward")), refresh_s=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await started(app, pilot)
        table = app.query_one(HeatTable)
        # Worst first by default: the straggler leads, marked.
        assert "sort: worst" in text_of(app.query_one(StatusBar))
        assert table.lines[0].rank == 1 and table.render_line(1).text.startswith("▶")
        await pilot.press("s")
        assert [r.rank for r in table.lines] == [0, 1, 2, 3]
        for _ in range(4):  # rank -> step -> dataloader -> h2d -> forward
            await pilot.press("s")
        assert "sort: forward" in text_of(app.query_one(StatusBar))
        assert table.lines[0].rank == 1


async def test_filter_shows_matching_ranks_only():
    app = DashboardApp(StaticSource(make_state()), refresh_s=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await started(app, pilot)
        await pilot.press("slash")
        for ch in "4-5":
            await pilot.press(ch)
        await pilot.press("enter")

        def shown() -> list[int]:
            return [line.rank for line in app.query_one(HeatTable).lines
                    if hasattr(line, "rank")]

        await until(pilot, lambda: shown() == [4, 5], "the filter did not apply")


async def test_stale_ranks_are_shown_as_such():
    app = DashboardApp(StaticSource(make_state(stale=(7,))), refresh_s=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await started(app, pilot)
        assert "stale: 7" in text_of(app.query_one(StatusBar))
        row = next(r for r in app.query_one(HeatTable).lines if getattr(r, "rank", -1) == 7)
        assert row.status == "stale"


async def test_export_writes_a_summary_shaped_json_and_says_where(tmp_path):
    app = DashboardApp(StaticSource(make_state()), run_dir=tmp_path, refresh_s=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await started(app, pilot)
        await pilot.press("e")
        for _ in range(40):
            await pilot.pause(0.05)
            if list((tmp_path / "snapshots").glob("snapshot-*.json")):
                break
        files = list((tmp_path / "snapshots").glob("snapshot-*.json"))
        assert len(files) == 1
        doc = json.loads(files[0].read_text())
        from jobs import validate_schema

        validate_schema(doc)
        assert doc["diagnosis"]["label"] == "INPUT STRAGGLER"
        await until(pilot, lambda: any(str(files[0]) in str(n.message)
                                       for n in app._notifications), "no notification")
        await pilot.press("v")
        await until(pilot, lambda: bool(list((tmp_path / "snapshots").glob("dashboard-*.svg"))),
                    "no screenshot saved")


async def test_help_lists_every_key_and_q_quits():
    app = DashboardApp(StaticSource(make_state()), refresh_s=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await started(app, pilot)
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        listed = {key for key, _ in app.screen.keys}
        assert {"q", "w", "g", "s", "slash", "n", "e", "v", "enter,p"} <= listed
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)
        await pilot.press("q")
    assert app.return_code == 0


async def test_a_lost_collector_is_said_not_hidden():
    class Flaky(StaticSource):
        def fetch(self, pinned):
            if self.fetches >= 2:
                self.fetches += 1
                raise ConnectionError("gone")
            return super().fetch(pinned)

    app = DashboardApp(Flaky(make_state()), refresh_s=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await started(app, pilot)
        await until(pilot, lambda: "collector not answering" in text_of(app.query_one(StatusBar)),
                    "the status bar never said the collector was lost")
        assert "INPUT STRAGGLER" in text_of(app.query_one(Banner))  # last state kept


@pytest.mark.parametrize("world", [300])
async def test_many_ranks_open_in_node_view_and_n_drills_in(world):
    app = DashboardApp(StaticSource(make_state(world_size=world, nproc_per_node=4, steps=12)),
                       refresh_s=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await started(app, pilot)
        table = app.query_one(HeatTable)
        # One line per node; the straggler's node (rank 2: node 0) leads, expanded.
        nodes = [x for x in table.lines if not hasattr(x, "rank")]
        assert len(nodes) == world // 4 and nodes[0].node == 0
        assert [x.rank for x in table.lines[1:5]][0] == 2
        assert sorted(x.rank for x in table.lines[1:5]) == [0, 1, 2, 3]
        await pilot.press("n")
        assert len([x for x in table.lines if hasattr(x, "rank")]) == world


async def test_node_view_shows_each_nodes_worst_and_follows_the_filter():
    """Node lines come from the collector's per-node rows (one computation for every
    viewer); a filter makes the viewer aggregate just the ranks it keeps."""
    state = make_state(world_size=16, nproc_per_node=4, steps=12, straggler=6)
    app = DashboardApp(StaticSource(state), refresh_s=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await started(app, pilot)
        table = app.query_one(HeatTable)
        await pilot.press("n")
        view = table.state
        # Worst first: the straggler's node 1 leads and shows its ranks, rank 6 first.
        assert view.node_rows
        assert [getattr(x, "node", None) for x in table.lines[:1]] == [1]
        assert [x.rank for x in table.lines[1:5]][0] == 6
        nodes = [x for x in table.lines if not hasattr(x, "rank")]
        assert [x.node for x in nodes][0] == 1 and sorted(x.node for x in nodes) == [0, 1, 2, 3]
        node1 = [r for r in view.rows if r.node == 1]
        assert nodes[0].ranks == 4
        assert nodes[0].worst.step_ms == max(r.step_ms for r in node1)
        app.filter_text = "4-5"
        app.redraw()
        nodes = [x for x in table.lines if not hasattr(x, "rank")]
        assert [(x.node, x.ranks) for x in nodes] == [(1, 2)]
        assert nodes[0].worst.step_ms == max(r.step_ms for r in node1[:2])
        assert table.render_line(0).text.split()[:2] == ["rank", "host"]  # the header
        assert table.render_line(1).text.split()[:3] == ["▶node", "1", "node001"]


async def test_ctrl_c_stops_the_job_under_traceml_run_and_never_in_watch():
    stopped = []
    app = DashboardApp(StaticSource(make_state()), refresh_s=0.05,
                       stop_job=lambda: stopped.append(True))
    async with app.run_test(size=SIZE) as pilot:
        await started(app, pilot)
        await pilot.press("ctrl+c")
        assert stopped == [True]
    watcher = DashboardApp(StaticSource(make_state()), refresh_s=0.05)
    async with watcher.run_test(size=SIZE) as pilot:
        await started(watcher, pilot)
        await pilot.press("ctrl+c")  # a viewer only: nothing to stop, and it stays open
        await pilot.pause(0.1)
        assert watcher.is_running


async def test_a_slow_node_and_a_silent_node_are_named():
    """Two nodes of a three-node job report; node 1's ranks are all slow in input."""
    slow_node = make_state(world_size=6, nproc_per_node=2, straggler=2, also_slow=(3,),
                           silent_nodes=(2,))
    app = DashboardApp(StaticSource(slow_node), refresh_s=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await started(app, pilot)
        banner = " ".join(text_of(app.query_one(Banner)).split())
        status = text_of(app.query_one(StatusBar))
        assert "INPUT STRAGGLER" in banner and "node 1" in banner
        assert "Every rank on node 1 (ranks 2, 3" in banner
        assert "ranks 4/6" in status and "nodes 2/3 (waiting for node 2)" in status
        table = app.query_one(HeatTable)

        def rows() -> list[str]:
            return [table.render_line(y).text for y in range(1, table.size.height)]

        # Worst first: node 1's ranks lead, marked; node 2's show they are waiting (once
        # the table has laid out every row: a loaded machine renders it a frame later).
        await until(pilot, lambda: sum("waiting" in t for t in rows()) == 2,
                    "node 2's ranks shown waiting")
        texts = rows()
        assert [x.rank for x in table.lines[:2]] == [2, 3]
        assert texts[0].startswith("▶") and texts[1].startswith("▶")
        assert sum("waiting" in t for t in texts) == 2
        await pilot.press("s")  # by rank, grouped by node
        texts = [table.render_line(y).text for y in range(table.size.height)]
        assert any("node 2 · not reporting yet · 2 rank(s)" in t for t in texts)


async def test_setup_checks_are_counted_and_c_shows_evidence_and_fix():
    from traceml_agent.findings import Finding
    from traceml_tui.view.dashboard.screens import ChecksScreen

    found = Finding("no-distributed-sampler", "critical", (0, 1),
                    "DataLoader without a DistributedSampler: every rank reads all 512 samples",
                    "Pass sampler=DistributedSampler(dataset) to the DataLoader.")
    app = DashboardApp(StaticSource(make_state(world_size=4, findings=(found,))),
                       refresh_s=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await started(app, pilot)
        assert "setup checks: 1 (c)" in text_of(app.query_one(StatusBar))
        await pilot.press("c")
        await until(pilot, lambda: isinstance(app.screen, ChecksScreen), "no checks screen")
        screen = app.screen
        shown = " ".join(text_of(w) for w in screen.query(Static))
        assert "no-distributed-sampler" in shown and "rank(s) 0, 1" in shown
        assert "every rank reads all 512 samples" in shown
        assert "DistributedSampler(dataset)" in shown
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(app.screen, ChecksScreen),
                    "the checks screen stayed")


async def test_t_asks_for_a_deep_trace_of_the_pinned_rank_and_T_reads_it():
    from traceml_tui.view.dashboard.screens import TraceScreen

    source = StaticSource(make_state())
    app = DashboardApp(source, refresh_s=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await started(app, pilot)
        await pilot.press("t")  # nothing pinned: the worst and the median rank
        await until(pilot, lambda: len(source.captures) == 1, "no capture asked")
        app.pin(5)
        await pilot.press("t")
        await until(pilot, lambda: len(source.captures) == 2, "no second capture asked")
        assert source.captures == [(None, 5), ([5], 5)]
        await pilot.press("T")  # nothing analysed yet: said, no screen
        await pilot.pause(0.1)
        assert not isinstance(app.screen, TraceScreen)
        capture = DeepTraceView(2, 5, (2, 5), {"2": "median", "5": "pinned"},
                              {"2": "done", "5": "done"}, {}, {},
                              "Deep trace 2: 5 steps\ndataloader_us_per_step  30000  300",
                              "/run/traces/capture2.json")
        source.capture_view = capture  # the collector's next view carries the analysis
        await until(pilot, lambda: "trace 2 ready (T)" in text_of(app.query_one(StatusBar)),
                    "the trace was not announced")
        await pilot.press("T")
        await until(pilot, lambda: isinstance(app.screen, TraceScreen), "no trace screen")
        shown = " ".join(text_of(w) for w in app.screen.query(Static))
        assert "dataloader_us_per_step" in shown


async def test_remote_strings_that_look_like_markup_are_shown_as_they_are():
    """A host name is whatever a rank says: Rich markup in it is text, never styling
    or a link (control characters are already stripped on receipt)."""
    app = DashboardApp(StaticSource(make_state(straggler=2, hosts="[link=x]h[/]")),
                       refresh_s=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await started(app, pilot)
        assert "[link=x]h[/]000" in panel_text(app, "#worst")


async def test_run_ended_marks_the_state_finished_and_says_so():
    """`traceml run` calls run_ended when the job is over; the viewer stays, and the banner
    says the run ended with its exit code (the view model is immutable: a new state)."""
    app = DashboardApp(StaticSource(make_state()), refresh_s=3600)
    async with app.run_test(size=SIZE) as pilot:
        await started(app, pilot)
        app.run_ended(3, "/runs/x/final_summary.json")
        assert app.state.finished and app.state.exit_code == 3
        await until(pilot, lambda: "run ended (exit code 3)" in text_of(app.query_one(Banner)),
                    "the banner does not say the run ended")


async def test_a_view_that_lands_while_widgets_are_gone_is_skipped():
    """A refresh that arrives while the app tears its screen down (quit) finds no
    widgets: it is skipped, never an exception that ends the viewer with a traceback."""
    app = DashboardApp(StaticSource(make_state()), refresh_s=3600)
    async with app.run_test(size=SIZE) as pilot:
        await started(app, pilot)
        await app.query_one(StatusBar).remove()
        app.redraw()
        app.lost("collector gone")


async def test_the_column_header_stays_on_top_and_scrolls_sideways_with_the_rows():
    app = DashboardApp(StaticSource(make_state(world_size=64, nproc_per_node=8, steps=12)),
                       refresh_s=0.05)
    async with app.run_test(size=(80, 40)) as pilot:
        await started(app, pilot)
        table = app.query_one(HeatTable)
        await until(pilot, lambda: table.max_scroll_y >= 10, "the table was not laid out")
        assert table.render_line(0).text.split()[:2] == ["rank", "host"]
        assert table.max_scroll_x >= 20, table.max_scroll_x  # wider than 80 columns

        def scrolled() -> bool:  # layout passes of the first frames may reset it: again
            table.scroll_to(x=20, y=10, animate=False, immediate=True)
            return tuple(table.scroll_offset) == (20, 10)

        await until(pilot, scrolled, "the table did not scroll")
        header = table.render_line(0).text
        assert "rank" not in header and "opt" in header, header  # sideways with the rows
        full = table._draw(table.lines[10], False).text  # the 11th line, unscrolled
        assert table.render_line(1).text.rstrip() == full[20:20 + table.size.width].rstrip()
        # The header's columns still sit over the row's: "opt" ends where its value ends.
        line = table.render_line(1).text
        end = header.index(" opt") + len(" opt")
        assert line[end - 1] != " " and line[end] == " ", (header, line)
