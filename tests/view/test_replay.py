"""The dashboard on a record (issue 41, items 1 and 2), without real jobs: a deterministic
record written with the real step-log writer, replayed through the collector's judge;
the cursor's keys on it and on a live dashboard (pause, back to live); the SVG snapshots
of the replay screen inside the straggler's episode and after it. The real jobs (ended,
crashed, collector killed, the README's demo) are tests/e2e/test_e2e_replay.py's."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from traceml_agent.vocab import PHASES
from traceml_tui.collect.canned import StaticSource, make_state, make_view, with_history
from traceml_tui.collect.replay import Replay, ReplayError, open_record
from traceml_tui.runfolder.layout import RunFolder
from traceml_tui.runfolder.step_log import StepLogWriter
from traceml_tui.view.client import RunIsOver, WatchTargetError, resolve_target
from traceml_tui.view.dashboard import DashboardApp
from traceml_tui.view.dashboard import cursor as cur
from traceml_tui.view.dashboard.replay_app import ReplayApp
from traceml_tui.view.dashboard.status_bar import StatusBar

T0 = 1_700_000_000.0
# Per PHASES order (dataloader, h2d, forward, backward, sync, optimizer, wait): 100 ms.
BASE = (5.0, None, 30.0, 50.0, 5.0, 8.0, 2.0)
SLOW = (2, 40, 100)  # rank 2 loads 60 ms slower from step 40 to step 99


def write_record(run_dir: Path, world: int = 4, steps: int = 160, summary: bool = True,
                 slow: tuple[int, int, int] = SLOW) -> Path:
    """A run folder as a collector leaves it: the step log (its real writer, batches of
    5 steps per rank as agents send them) and, with `summary`, final_summary.json."""
    run_dir.mkdir(mode=0o700, parents=True)
    rank_slow, start, end = slow
    t = T0 + 2.0
    with StepLogWriter(RunFolder(run_dir).step_log) as log:
        for first in range(0, steps, 5):
            for rank in range(world):
                for s in range(first, first + 5):
                    extra = 60.0 if rank == rank_slow and start <= s < end else 0.0
                    waits = 60.0 if rank != rank_slow and start <= s < end else 0.0
                    ms = list(BASE)
                    ms[0] = (ms[0] or 0.0) + extra
                    ms[4] = (ms[4] or 0.0) + waits
                    step_ms = sum(v for v in ms if v is not None)
                    log.append(rank, s, t + (s - first) * step_ms / 1000, step_ms, PHASES, ms)
            t += 5 * (0.16 if start <= first < end else 0.1)
    if summary:
        doc = {"complete": True, "failure": None,
               "run": {"name": "replayed", "world_size": world, "nnodes": 1,
                       "started_at": "2023-11-14T22:13:20+00:00",
                       "ended_at": "2023-11-14T22:13:45+00:00", "exit_code": 0,
                       "steps": steps},
               "ranks": [{"rank": r, "node": 0, "host": "node000", "device": "cpu"}
                         for r in range(world)]}
        RunFolder(run_dir).summary_json.write_text(json.dumps(doc))
    return run_dir


@pytest.fixture(scope="module")
def record(tmp_path_factory) -> Path:
    return write_record(tmp_path_factory.mktemp("replay") / "run")


def loaded(run_dir: Path) -> Replay:
    replay = Replay(open_record(run_dir))
    replay.load()
    return replay


def test_the_replay_is_the_judges_view_at_each_keyframe(record):
    replay = loaded(record)
    assert replay.records == 4 * 160
    views = [replay.view(i) for i in range(len(replay))]
    labels = [v.label for v in views]
    # Warm-up, then the straggler named as the live collector names it, then its end.
    assert labels[0] == "WARMUP"
    assert "INPUT STRAGGLER" in labels
    during = next(v for v in views if v.label == "INPUT STRAGGLER")
    assert during.rank == 2 and during.phase == "dataloader"
    assert during.worst is not None and during.worst.rank == 2
    last = views[-1]
    assert last.finished and last.exit_code == 0
    # Ended, not stale: the step log has no goodbyes, the summary says how each ended.
    assert last.stale == () and {r.status for r in last.rows} == {"done"}
    assert last.label != "INPUT STRAGGLER"
    episode = next(e for e in last.episodes if e[2] == "INPUT STRAGGLER")
    assert episode[1] is not None  # closed: the straggler stopped
    assert [v.elapsed_s for v in views] == sorted(v.elapsed_s for v in views)
    assert replay.record.status == "ended at step 160, exit 0"


def test_the_columns_reader_reads_what_read_steps_reads(tmp_path):
    """The replay reads the log as columns (no object per record): the same records, in
    the same order, single records and a relay's columns mixed, None as NaN."""
    import numpy as np

    from traceml_tui.runfolder.step_log import read_columns, read_steps

    other = ("forward", "backward")
    with StepLogWriter(tmp_path / "steps") as log:
        log.append(0, 1, T0, 10.0, PHASES, BASE)
        log.append(1, 1, T0, 11.0, other, (1.0, None))
        log.append_columns(other, np.array([2, 3]), np.array([1, 1]), np.array([T0, T0]),
                           np.array([12.0, 13.0]), np.array([[1.0, np.nan], [2.0, 3.0]]))
        log.append(0, 2, T0 + 1, 10.0, PHASES, BASE)
    want = [(s.rank, s.step, s.t_end, s.step_ms, s.phases, s.phase_ms)
            for s in read_steps(tmp_path / "steps")]
    got = [(int(c.rank[i]), int(c.step[i]), float(c.t_end[i]), float(c.step_ms[i]),
            c.phases, tuple(None if v != v else float(v) for v in c.values[i]))
           for c in read_columns(tmp_path / "steps") for i in range(len(c))]
    assert got == want and len(got) == 5


def test_keyframes_are_bounded_and_thinned(record, monkeypatch):
    from traceml_tui.collect import replay as rp

    monkeypatch.setattr(rp, "MAX_KEYFRAMES", 6)
    replay = loaded(record)
    # Thinned to half past twice the bound (banner changes come on top of the regular
    # frames), the end frame added.
    assert 3 <= len(replay) <= 2 * 6 + 1
    assert replay.view(len(replay) - 1).finished


def test_steps_only_when_the_collector_died(tmp_path):
    run = write_record(tmp_path / "orphan", summary=False)
    replay = loaded(run)
    assert replay.record.status == "the collector died: steps only, no summary"
    assert not replay.view(len(replay) - 1).finished


def test_a_hang_is_the_summarys_own_on_the_last_keyframe(tmp_path):
    """The step log cannot show a silence: the summary's HANG leads the run's end."""
    run = write_record(tmp_path / "hung")
    doc = json.loads(RunFolder(run).summary_json.read_text())
    doc["diagnosis"] = {"label": "HANG", "rank": 3, "phase": "sync", "severity": "critical",
                        "summary": "Rank 3 stopped stepping 40 s ago in sync.", "node": None}
    RunFolder(run).summary_json.write_text(json.dumps(doc))
    replay = loaded(run)
    last = replay.view(len(replay) - 1)
    assert (last.label, last.rank, last.summary) == (
        "HANG", 3, "Rank 3 stopped stepping 40 s ago in sync.")
    assert replay.view(len(replay) - 2).label != "HANG"  # before the end: the steps' own


@pytest.mark.parametrize(("verdict", "shown"), [
    # The whole run's verdict differs from the last window's: the record's word ends it.
    ({"label": "INPUT STRAGGLER", "rank": 2, "phase": "dataloader", "severity": "warning",
      "summary": "Rank 2 was behind from step 40 to 80.\x1b]52;c;x\x07", "node": None},
     ("INPUT STRAGGLER", 2, "Rank 2 was behind from step 40 to 80.]52;c;x")),
    # The same verdict as the last evaluation: the live frame stays (with its cost line).
    (None, None),
])
def test_the_last_keyframe_gives_the_records_verdict(tmp_path, verdict, shown):
    """Opening a record gives one answer to "what was wrong": the summary's, at its end;
    the keyframes before it are the steps' own evaluations."""
    run = write_record(tmp_path / "run")
    doc = json.loads(RunFolder(run).summary_json.read_text())
    replay = loaded(run)
    live = replay.view(len(replay) - 2)
    doc["diagnosis"] = verdict or {"label": live.label, "rank": live.rank,
                                   "summary": "the whole run's words", "severity": "info"}
    RunFolder(run).summary_json.write_text(json.dumps(doc))
    replay = loaded(run)
    last = replay.view(len(replay) - 1)
    if shown is None:
        assert (last.label, last.summary) == (live.label, live.summary)
        return
    assert live.label != shown[0]
    assert (last.label, last.rank, last.summary.replace("\ufffd", "")) == shown


@pytest.mark.parametrize(("sample", "read"), [
    ({"cpu_pct": 98.0, "rss_mb": 900.0, "thread_cpu_pct": 60.0, "cpu_wait_pct": 2.0}, True),
    (None, False),  # an older record without samples: the replay cannot say
    ({"cpu_pct": 98.0, "thread_cpu_pct": 60.0, "cpu_wait_pct": 500.0}, False),  # not a share
])
def test_the_last_keyframe_judges_with_the_records_last_samples(tmp_path, sample, read):
    """A replay used to say of the run's straggler that its CPU wait "was not read" at
    the end, where the record (judged with the ranks' samples) said nothing of the kind:
    the step log keeps no samples. The last keyframe now takes each rank's last sample
    from the summary, validated as the wire's; one out of bounds is not taken."""
    run = write_record(tmp_path / "run", steps=160, slow=(2, 40, 1000))
    doc = json.loads(RunFolder(run).summary_json.read_text())
    for r in doc["ranks"]:
        if sample is not None:
            r["sys"] = dict(sample)
    RunFolder(run).summary_json.write_text(json.dumps(doc))
    replay = loaded(run)
    before, last = replay.view(len(replay) - 2), replay.view(len(replay) - 1)
    assert (before.label, before.rank) == (last.label, last.rank) == ("INPUT STRAGGLER", 2)
    assert "was not read" in before.summary  # no samples before the end
    assert ("was not read" not in last.summary) is read, last.summary
    rss = {row.rank: row.rss_mb for row in last.rows}
    assert (rss[2] == 900.0) is (sample is not None and "rss_mb" in sample)


def test_a_folder_not_ones_own_is_refused_in_one_line(tmp_path):
    run = write_record(tmp_path / "shared")
    os.chmod(run, 0o777)  # anyone could have written its record
    with pytest.raises(ReplayError, match="not opening it"):
        open_record(run)


def test_watch_sends_an_ended_or_orphaned_run_to_its_record(tmp_path, record):
    with pytest.raises(RunIsOver):
        resolve_target(str(record))
    orphan = write_record(tmp_path / "orphan", summary=False)
    RunFolder(orphan).collector_json.write_text(json.dumps(
        {"pid": 2**22 + 7, "host": __import__("socket").gethostname(), "view": "tcp://x"}))
    with pytest.raises(RunIsOver):
        resolve_target(str(orphan))
    # With no folder named, a dead collector's run is not "the newest live run".
    with pytest.raises(WatchTargetError, match="no live run") as refused:
        resolve_target(None, tmp_path)
    assert f"its record opens with: traceml watch {orphan}" in str(refused.value)


@pytest.mark.parametrize("subjects, index, nxt, prev", [
    (["W", "A", "A", "B", "B"], 0, 1, None),
    (["W", "A", "A", "B", "B"], 2, 3, 1),
    (["W", "A", "A", "B", "B"], 3, None, 1),
    (["W", "A", "A", "B", "B"], 4, None, 3),
    (["W", "W"], 1, None, 0),
])
def test_episode_moves(subjects, index, nxt, prev):
    assert cur.next_episode(subjects, index) == nxt
    assert cur.previous_episode(subjects, index) == prev


def test_live_frames_are_bounded_by_rows():
    frames = cur.LiveFrames(limit=5)
    view = make_view(make_state(world_size=4))
    evicted = [frames.push(view) for _ in range(7)]
    assert len(frames) == 5 and evicted == [0] * 5 + [1, 1]
    wide = cur.LiveFrames()
    wide_view = make_view(make_state(world_size=64, steps=4))
    rows_budget = cur.LIVE_ROW_BUDGET
    cur.LIVE_ROW_BUDGET = 64 * 10
    try:
        for _ in range(20):
            wide.push(wide_view)
    finally:
        cur.LIVE_ROW_BUDGET = rows_budget
    assert len(wide) == 10


def status(app) -> str:
    return str(app.query_one(StatusBar).render())


async def until(pilot, condition, tries: int = 200) -> None:
    for _ in range(tries):
        if condition():
            return
        await pilot.pause(0.05)
    raise AssertionError("the dashboard never got there")


async def test_cursor_keys_walk_the_record(record):
    rec = open_record(record)
    app = ReplayApp(Replay(rec), rec.status, record, rec.summary)
    async with app.run_test(size=(150, 46)) as pilot:
        await until(pilot, lambda: app.state is not None)
        assert app.state.finished and "(end)" in status(app)
        assert "ended at step 160, exit 0" in status(app)
        await pilot.press("less_than_sign")
        await pilot.pause(0.1)
        assert app.cursor == 0 and app.state.label == "WARMUP"
        await pilot.press("right_square_bracket")  # the next episode, as the banner showed it
        await pilot.pause(0.1)
        while app.state.label != "INPUT STRAGGLER":
            await pilot.press("right_square_bracket")
            await pilot.pause(0.1)
        at = app.cursor
        assert app.state.rank == 2 and f"view {at + 1}/" in status(app)
        await pilot.press("right")
        await pilot.pause(0.1)
        assert app.cursor == at + 1
        await pilot.press("left", "left")
        await pilot.pause(0.1)
        assert app.cursor == at - 1
        await pilot.press("l")  # a record's "live" is its end
        await pilot.pause(0.1)
        assert app.cursor == len(app.frames) - 1 and app.state.finished


async def test_live_dashboard_pauses_and_returns_to_live():
    states = [with_history(make_state(steps=s)) for s in (20, 24, 28, 32, 36, 40)]
    app = DashboardApp(StaticSource(states), refresh_s=0.05)
    async with app.run_test(size=(150, 46)) as pilot:
        await until(pilot, lambda: len(app.frames) >= 4)
        await pilot.press("left")
        await pilot.pause(0.1)
        paused = app.state.steps
        assert app.cursor is not None and f"paused at step {paused} (l: live)" in status(app)
        await pilot.pause(0.3)  # the job goes on; the view stays where it was paused
        assert app.state.steps == paused and app.newest.steps >= paused
        await pilot.press("l")
        await pilot.pause(0.2)
        assert app.cursor is None and "paused" not in status(app)
        assert app.state.steps == app.newest.steps


def _at_keys(*keys: str):
    async def run_before(pilot) -> None:
        await until(pilot, lambda: pilot.app.state is not None)
        await pilot.press(*keys)
        await pilot.pause(0.3)
    return run_before


@pytest.mark.parametrize("name, keys", [
    # Inside the episode: from the start, two episodes on (warm-up, then the straggler).
    ("replay_in_episode", ("less_than_sign", "right_square_bracket", "right_square_bracket",
                           "right", "right")),
    ("replay_after_episode", ()),  # the run's end, the straggler over
])
def test_replay_screens(snap_compare, record, name, keys):
    rec = open_record(record)
    assert snap_compare(ReplayApp(Replay(rec), rec.status, record, rec.summary),
                        terminal_size=(150, 46), run_before=_at_keys(*keys))
