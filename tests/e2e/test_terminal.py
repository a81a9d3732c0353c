"""`traceml run` in a real terminal (tmux), as job control and SSH treat it.

A command run under `timeout` (or as a shell's background job `&`) is not the
terminal's foreground job; closing the terminal (an SSH drop, a killed pane) sends
SIGHUP. Neither may stop, freeze or orphan the training, and both must leave a record.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from jobs import ROOT, alive, kill_all, live_ranks_steps, traceml, wait_for
from traceml_agent.vocab import LIVE_SNAPSHOT_JSON

FAULTY = Path(__file__).resolve().parents[1] / "support" / "faulty_ddp.py"

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")]


class Tmux:
    """A tmux server of the test's own (its own socket), one window 160x45."""

    def __init__(self, tmp_path: Path) -> None:
        self.sock = str(tmp_path / f"tmux-{uuid.uuid4().hex[:8]}")
        env = {k: v for k, v in os.environ.items() if k != "TRACEML_SECRET"}
        env.update(OMP_NUM_THREADS="1", TERM="xterm-256color", PYTHONPATH=str(ROOT))
        self.env = env
        self.tmux("new-session", "-d", "-x", "160", "-y", "45", "-s", "t", "bash", "--norc")

    def tmux(self, *args: str) -> str:
        return subprocess.run(["tmux", "-S", self.sock, *args], capture_output=True, text=True,
                              env=self.env, timeout=20).stdout

    def type(self, line: str) -> None:
        self.tmux("send-keys", "-t", "t", line, "Enter")

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", "t")

    def pane_pid(self) -> int:
        return int(self.tmux("display-message", "-p", "-t", "t", "#{pane_pid}").strip())

    def kill(self) -> None:
        subprocess.run(["tmux", "-S", self.sock, "kill-server"], capture_output=True)


def run_processes(run_dir: Path) -> list[psutil.Process]:
    """Every live process of a run: the launcher, the collector, torchrun, the ranks."""
    found = []
    key = str(run_dir)
    for proc in psutil.process_iter(["cmdline", "environ"]):
        try:
            cmd = " ".join(proc.info["cmdline"] or [])
            environ = proc.info["environ"] or {}
        except psutil.Error:
            continue
        if (key in cmd or environ.get("TRACEML_RUN_DIR", "").startswith(key)) and alive(proc):
            found.append(proc)
    return found


@pytest.fixture
def term(tmp_path: Path):
    t = Tmux(tmp_path)
    yield t
    t.kill()
    kill_all(run_processes(tmp_path))


def traceml_cmd(out: Path, name: str, *script_args: str) -> str:
    return " ".join(shlex.quote(a) for a in (
        sys.executable, "-m", "traceml_tui", "run", str(FAULTY), "--nproc-per-node", "2",
        "--out", str(out), "--run-name", name, "--", *script_args))


def test_a_run_under_timeout_in_a_terminal_is_not_frozen(term: Tmux, tmp_path: Path) -> None:
    """`timeout` puts the command in a process group of its own, outside the terminal's
    foreground: a dashboard would be stopped by SIGTTOU, and the job with it. The run
    goes headless by itself, says so, and ends with exit 0 and a summary."""
    out = tmp_path / "runs"
    status = tmp_path / "status"
    # A shell without job control (a script, `ssh host cmd`), where `timeout` makes a
    # process group of its own; in an interactive shell it stays the foreground job.
    inner = f"timeout 150 {traceml_cmd(out, 'bg', '--steps', '60')}; echo $? > {status}"
    term.type(f"sh -c {shlex.quote(inner)}")
    wait_for(status.exists, 170, "the run under timeout to end")
    assert status.read_text().strip() == "0", term.screen()
    doc = json.loads((out / "bg" / "final_summary.json").read_text())
    assert [r["steps"] for r in doc["ranks"]] == [60, 60]
    assert "not the terminal's foreground job" in term.screen()


def test_a_background_job_runs_headless_and_finishes(term: Tmux, tmp_path: Path) -> None:
    out = tmp_path / "runs"
    status = tmp_path / "status"
    term.type(f"({traceml_cmd(out, 'amp', '--steps', '60')}; echo $? > {status}) &")
    wait_for(status.exists, 170, "the background run to end")
    assert status.read_text().strip() == "0", term.screen()
    assert (out / "amp" / "final_summary.json").exists()


def test_closing_the_terminal_stops_the_job_and_leaves_a_record_and_no_process(
        term: Tmux, tmp_path: Path) -> None:
    """The dashboard run's pane is killed (SIGHUP, as an SSH drop): torchrun's
    convention is to stop the workers. The summary is written with exit code 129 and
    no process of the run survives."""
    out = tmp_path / "runs"
    run_dir = out / "hup"
    term.type(traceml_cmd(out, "hup", "--steps", "100000"))

    def stepping() -> bool:  # every rank's 20 steps received (run.steps is the newest's)
        steps = live_ranks_steps(run_dir)
        return len(steps) == 2 and min(steps) >= 20

    wait_for(stepping, 90, "each rank to report 20 steps")
    wait_for(lambda: "rank" in term.screen(), 30, "the dashboard to draw")
    t_hup = time.monotonic()
    term.kill()  # the terminal goes: SIGHUP to its processes
    summary = run_dir / "final_summary.json"
    wait_for(summary.exists, 60, "the summary after the hangup")
    doc = json.loads(summary.read_text())
    assert doc["run"]["exit_code"] == 129, doc["run"]
    assert all(r["steps"] >= 20 for r in doc["ranks"])
    wait_for(lambda: not run_processes(run_dir), 30, "every process of the run to end")
    assert time.monotonic() - t_hup < 60


def test_a_launcher_killed_outright_leaves_a_record_and_no_process(tmp_path: Path) -> None:
    """SIGKILL (the OOM killer's choice) gives `traceml run` no chance to pass anything
    on: torchrun is told by the kernel (parent-death signal) and stops the workers, and
    the collector notices its launcher is gone, writes what it has (incomplete) and exits."""
    out = tmp_path / "runs"
    run_dir = out / "killed"
    env = {k: v for k, v in os.environ.items() if k != "TRACEML_SECRET"}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "traceml_tui", "run", str(FAULTY), "--nproc-per-node", "2",
         "--headless", "--out", str(out), "--run-name", "killed", "--", "--steps", "100000",
         "--quiet"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**env, "OMP_NUM_THREADS": "1"})
    try:
        def stepping() -> bool:
            try:
                # Every rank, not the furthest: the record must hold what each had sent.
                ranks = json.loads((run_dir / LIVE_SNAPSHOT_JSON).read_text())["ranks"]
                return len(ranks) == 2 and min(r["steps"] for r in ranks) >= 20
            except (OSError, ValueError, KeyError, TypeError):
                return False

        wait_for(stepping, 90, "every rank to make 20 steps")
        launcher.kill()
        launcher.wait(10)
        summary = run_dir / "final_summary.json"
        wait_for(summary.exists, 30, "the collector to write the record")
        doc = json.loads(summary.read_text())
        assert doc["complete"] is False
        assert all(r["steps"] >= 20 for r in doc["ranks"])
        wait_for(lambda: not run_processes(run_dir), 30, "every process of the run to end")
    finally:
        kill_all(run_processes(run_dir))


def test_an_agent_that_turned_itself_off_is_said_so_and_not_taken_for_a_hang(
        tmp_path: Path) -> None:
    """The agent fails on every rank at step 20 (its recorder raises): the training goes
    on untouched, each rank says its agent is off and why, and the frozen step counts
    never read as a HANG (threshold 2 s here; the job runs 6 s more)."""
    out = tmp_path / "runs"
    proc = traceml("run", str(FAULTY), "--nproc-per-node", "2", "--headless", "--out",
                   str(out), "--run-name", "off", "--hang-after", "2", "--",
                   "--steps", "320", "--break-agent-at", "20")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done: 320 steps" in proc.stdout  # the training itself was not touched
    doc = json.loads((out / "off" / "final_summary.json").read_text())
    assert all(r["agent_off"] and "injected agent bug" in r["agent_off"]
               for r in doc["ranks"]), [r["agent_off"] for r in doc["ranks"]]
    assert "HANG" not in {e["label"] for e in doc["timeline"]}, doc["timeline"]
    assert doc["diagnosis"]["label"] != "HANG"
    assert "Agent off on rank(s) 0-1" in proc.stdout
