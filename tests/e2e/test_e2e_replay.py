"""End to end (issue 41, items 1 and 2): `traceml watch RUN_DIR` on real runs that are
over opens the dashboard on their record: the README's demo after it ended (walk to the
episode where rank 2 straggles), a crashed run (a rank raises), a run whose collector was
SIGKILLed mid-run (the launcher's incomplete summary, then the steps alone), and a run
folder copied elsewhere without its secret."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from jobs import EXAMPLES, kill_session, live_ranks_steps, run_job, traceml, wait_for
from traceml_tui.collect.replay import Replay, open_record
from traceml_tui.runfolder.layout import RunFolder
from traceml_tui.runfolder.step_log import read_steps
from traceml_tui.view.dashboard.banner import Banner
from traceml_tui.view.dashboard.replay_app import ReplayApp
from traceml_tui.view.dashboard.status_bar import StatusBar

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The README's demo job, as a new user runs it (4 ranks, rank 2 loads slowly)."""
    done = run_job(tmp_path_factory.mktemp("demo"), "straggler_demo.py", nproc=4, name="demo")
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def _texts(app) -> tuple[str, str]:
    return str(app.query_one(Banner).render()), str(app.query_one(StatusBar).render())


async def _opened(pilot) -> None:
    for _ in range(400):
        if pilot.app.state is not None:
            return
        await pilot.pause(0.05)
    raise AssertionError("the record never opened")


def _app(run_dir: Path) -> ReplayApp:
    rec = open_record(run_dir)
    return ReplayApp(Replay(rec), rec.status, run_dir, rec.summary)


async def test_the_readme_demo_after_it_ended_walks_to_rank_2s_episode(demo):
    app = _app(demo.run_dir)
    async with app.run_test(size=(150, 46)) as pilot:
        await _opened(pilot)
        banner, status = _texts(app)
        # Opens at the end: the record's verdict (the summary's), the run's end. Rank 2's
        # loader is its cause; on a busy machine its compute may lag too (STRAGGLER).
        verdict = demo.summary["diagnosis"]
        assert verdict["label"] in ("INPUT STRAGGLER", "STRAGGLER") and verdict["rank"] == 2
        assert "run ended (exit code 0)" in banner and verdict["label"] in banner
        assert "ended at step 150, exit 0" in status and "(end)" in status
        await pilot.press("less_than_sign")
        await pilot.pause(0.1)
        assert "WARMUP" in _texts(app)[0]
        for _ in range(10):  # the next episode, until the banner names rank 2
            await pilot.press("right_square_bracket")
            await pilot.pause(0.1)
            if app.state.label == "INPUT STRAGGLER":
                break
        banner, status = _texts(app)
        assert "INPUT STRAGGLER" in banner and "rank 2" in banner and "dataloader" in banner
        assert app.state.worst is not None and app.state.worst.rank == 2
        assert f"record at step {app.state.steps} (view " in status
        assert app.state.steps < 150 and not app.state.finished


def test_watch_opens_the_record_in_a_terminal(demo, tmp_path):
    """The command itself, in a real terminal (tmux), on a copy of the folder without its
    secret or collector.json (another machine): the screen shows the record, `q` closes
    it. Read from the screen, not the bytes written: Textual redraws only the cells that
    changed, so a status line need not arrive as one run of bytes."""
    if shutil.which("tmux") is None:
        pytest.skip("needs tmux")
    from test_terminal import Tmux

    copy = tmp_path / "copied"
    shutil.copytree(demo.run_dir, copy, ignore=shutil.ignore_patterns(
        "secret.key", "collector.json"))
    os.chmod(copy, 0o700)
    term = Tmux(tmp_path)
    try:
        term.type(f"{sys.executable} -m traceml_tui watch {copy}; echo watch-exit=$?")
        wait_for(lambda: "ended at step 150, exit 0" in term.screen()
                 and "INPUT STRAGGLER" in term.screen(), 90, "the record drawn")
        term.tmux("send-keys", "-t", "t", "q")
        wait_for(lambda: "watch-exit=0" in term.screen(), 30, "watch closed by q")
    finally:
        term.kill()


def test_watch_refuses_a_record_anyone_could_have_written(demo, tmp_path):
    shared = tmp_path / "shared"
    shutil.copytree(demo.run_dir, shared)
    os.chmod(shared, 0o777)
    proc = traceml("watch", str(shared), timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0
    assert "can be written by other users" in proc.stderr and "not opening it" in proc.stderr


async def test_a_crashed_run_says_what_failed(tmp_path):
    done = run_job(tmp_path, "ddp_toy.py", nproc=3, name="crashed", script_args=(
        "--scenario", "input", "--rank", "2", "--steps", "200", "--fail-rank", "1",
        "--fail-at-step", "60"))
    assert done.returncode != 0
    failure = done.summary["failure"]["summary"]
    app = _app(done.run_dir)
    async with app.run_test(size=(150, 46)) as pilot:
        await _opened(pilot)
        banner, status = _texts(app)
        assert f"crashed: {failure}" in status
        assert failure in banner  # the banner leads with the failure, as the summary does
        await pilot.press("left")
        await pilot.pause(0.1)
        assert "crashed:" in _texts(app)[1] and not app.state.finished


def _logged_steps(run_dir: Path) -> int:
    """The fewest steps any rank has in the run's step log so far."""
    per_rank: dict[int, int] = {}
    for rec in read_steps(RunFolder(run_dir).step_log):
        per_rank[rec.rank] = per_rank.get(rec.rank, 0) + 1
    return min(per_rank.values(), default=0)


async def test_a_run_whose_collector_was_killed(tmp_path):
    out = tmp_path / "runs"
    proc = subprocess.Popen(
        [sys.executable, "-m", "traceml_tui", "run", str(EXAMPLES / "ddp_toy.py"),
         "--nproc-per-node", "2", "--headless", "--out", str(out), "--run-name", "orphan",
         "--", "--scenario", "input", "--rank", "1", "--steps", "1000000"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    run_dir = out / "orphan"
    try:
        wait_for(lambda: min(live_ranks_steps(run_dir) or [0]) >= 60, 120, "60 steps")
        # The replay reads the step log, written once a second, not the live file: killed
        # just after the live file said 60, the log held 54 (fresh-clone run 18, beside a
        # CPU hog). The record keeps what reached the log before the kill.
        wait_for(lambda: _logged_steps(run_dir) >= 60, 30, "60 steps in the step log")
        collector = json.loads((run_dir / "collector.json").read_text())["pid"]
        os.kill(collector, signal.SIGKILL)
        wait_for(lambda: (run_dir / "collector.log").exists(), 10, "the collector's end")
        proc.send_signal(signal.SIGINT)
        proc.wait(90)
    finally:
        kill_session(proc)
    doc = json.loads((run_dir / "final_summary.json").read_text())
    assert doc["complete"] is False
    app = _app(run_dir)
    async with app.run_test(size=(150, 46)) as pilot:
        await _opened(pilot)
        assert "the collector died mid-run" in _texts(app)[1]
        assert app.state.steps >= 60
    # The launcher gone with it (a lost node): no summary at all, the steps alone.
    (run_dir / "final_summary.json").unlink()
    app = _app(run_dir)
    async with app.run_test(size=(150, 46)) as pilot:
        await _opened(pilot)
        banner, status = _texts(app)
        assert "the collector died: steps only, no summary" in status
        assert "INPUT STRAGGLER" in banner and "rank 1" in banner
        await pilot.press("less_than_sign")
        await pilot.pause(0.1)
        assert app.cursor == 0
