"""Faults around a real job: traceml must never hurt the job it watches, and must say
exactly what it kept of the record.

Each test breaks one thing with real processes (a SIGKILLed or restarted collector, a
killed or frozen viewer, a crashing rank, a scheduler's SIGTERM, an unwritable or full
run folder, a taken port) and compares what traceml kept against what the job really
did. The job is tests/support/faulty_ddp.py, which writes its own per-step record (a wall-clock
time per optimizer step and rank) outside traceml, so "what was lost" is measured, not
assumed.

Already covered elsewhere, not repeated here: a collector SIGKILL followed by Ctrl-C
(test_e2e_run: incomplete summary, exit 130), SIGINT/SIGTERM to a cooperative job
(test_e2e_run: 130/143 with a summary), a rank exiting with its own code
(test_e2e_run: exit 3, failed_rank), a rank SIGKILLed (test_e2e_hang: 137, "died"),
quitting the dashboard in-process (test_e2e_watch), user mistakes on the command line.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from jobs import free_ports, validate_schema, wait_for
from traceml_agent.transport import SEND_INTERVAL_S
from traceml_tui.collect.collector import SNAPSHOT_INTERVAL_S
from traceml_tui.launch.launcher import TERM_GRACE_S
from traceml_tui.view.client import ViewClient, resolve_target

pytestmark = pytest.mark.e2e

FAULTY = Path(__file__).resolve().parents[1] / "support" / "faulty_ddp.py"
# A fault may slow the job by this much at most before we call it hurt: the 2-core test
# machine drifts by 20-40% from minute to minute, so this is "within noise", not a budget.
SPEED_TOLERANCE = 0.30
# How far the record may end before a collector SIGKILL: one snapshot interval, plus the
# agent's batching and a slow machine's scheduling.
LOSS_BOUND_S = SNAPSHOT_INTERVAL_S + SEND_INTERVAL_S + 1.0
JOB_TIMEOUT_S = 120


def _env() -> dict[str, str]:
    """The test's environment for jobs: one thread per rank (2 cores), and no run secret
    inherited from the caller (hand-started collectors here run without one)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TRACEML_SECRET", None)
    return env


class Reaper:
    """Kills what a test started and left running, by pid, with every descendant: a
    failed assertion must not leave ranks training on a shared 2-core machine."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.pids: list[int] = []

    def track(self, proc: subprocess.Popen) -> subprocess.Popen:
        self.procs.append(proc)
        return proc

    def reap(self) -> None:
        victims: list[psutil.Process] = []
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    parent = psutil.Process(proc.pid)
                    victims += [*parent.children(recursive=True), parent]
                except psutil.NoSuchProcess:
                    pass
        for pid in self.pids:
            try:
                victims.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                pass
        for p in victims:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass


@pytest.fixture
def reaper() -> Iterator[Reaper]:
    r = Reaper()
    yield r
    r.reap()


@pytest.fixture(scope="module")
def module_reaper() -> Iterator[Reaper]:
    r = Reaper()
    yield r
    r.reap()


def start_run(out: Path, name: str, *script_args: str, nproc: int = 2,
              script: Path = FAULTY) -> subprocess.Popen:
    """`traceml run` in the background, headless, as a user or a scheduler starts it."""
    return subprocess.Popen(
        [sys.executable, "-m", "traceml_tui", "run", str(script), "--nproc-per-node", str(nproc),
         "--headless", "--out", str(out), "--run-name", name, "--", *script_args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())


def finish(proc: subprocess.Popen, timeout: float = JOB_TIMEOUT_S) -> tuple[int, str, str]:
    stdout, stderr = proc.communicate(timeout=timeout)
    return proc.returncode, stdout, stderr


def step_times(progress: Path, rank: int) -> list[float]:
    """The rank's own record: the wall-clock time at which each of its steps ended."""
    try:
        lines = (progress / f"rank{rank}.txt").read_text().splitlines()
    except OSError:
        return []
    return [float(line.split()[1]) for line in lines if len(line.split()) == 2]


def pace(times: list[float], start: float, end: float) -> float:
    """Steps per second the rank made between two wall-clock moments."""
    inside = [t for t in times if start <= t <= end]
    assert len(inside) >= 10, f"too few steps between {start} and {end} to judge a pace"
    return (len(inside) - 1) / (inside[-1] - inside[0])


def done_rate(output: str) -> float:
    """Steps per second from the job's own "done: N steps in X s" line (rank 0, on
    `traceml run`'s stdout with the ranks' other output)."""
    match = re.search(r"done: (\d+) steps in ([\d.]+) s", output)
    assert match, f"no 'done:' line from the job in:\n{output[-2000:]}"
    return int(match.group(1)) / float(match.group(2))


def assert_same_speed(faulted: float, clean: float, what: str) -> None:
    ratio = faulted / clean
    assert abs(ratio - 1) <= SPEED_TOLERANCE, (
        f"{what}: {faulted:.1f} steps/s with the fault vs {clean:.1f} without ({ratio:.2f}x)")


def snapshot_has_all_ranks(run_dir: Path, world: int) -> bool:
    try:
        doc = json.loads((run_dir / "live_snapshot.json").read_text())
    except (OSError, ValueError):
        return False
    return sum(1 for r in doc["ranks"] if r["steps"] > 0) == world


# --- the collector dies -------------------------------------------------------------------


@pytest.mark.alone  # compares the job's pace (xdist: nothing beside it)
def test_collector_sigkilled_midrun_costs_the_job_nothing_and_the_record_two_seconds(
        tmp_path: Path, reaper: Reaper) -> None:
    """The collector is SIGKILLed (OOM killer, a stray kill) while the job trains and the
    job then finishes on its own. The ranks must not slow down (their agents' sends have
    nowhere to go and must drop, not block), `traceml run` must still end with the job's
    exit code 0, and final_summary.json is the last snapshot, marked incomplete, ending at
    most one snapshot interval before the kill."""
    steps = "300"
    clean = reaper.track(start_run(tmp_path / "runs", "clean", "--steps", steps))
    rc, clean_out, clean_err = finish(clean)
    assert rc == 0, clean_err[-3000:]
    clean_rate = done_rate(clean_out)

    progress = tmp_path / "progress"
    run_dir = tmp_path / "runs" / "killed"
    proc = reaper.track(start_run(tmp_path / "runs", "killed", "--steps", steps,
                                  "--progress", str(progress)))
    wait_for(lambda: len(step_times(progress, 0)) >= 60 and snapshot_has_all_ranks(run_dir, 2),
             120, "60 steps and a first snapshot")
    collector_pid = json.loads((run_dir / "collector.json").read_text())["pid"]
    t_kill = time.time()
    os.kill(collector_pid, signal.SIGKILL)
    rc, stdout, stderr = finish(proc)

    assert rc == 0, stderr[-3000:]
    assert "Traceback" not in stdout + stderr
    assert "INCOMPLETE" in stdout
    assert "the record is INCOMPLETE: the collector died" in stderr
    doc = json.loads((run_dir / "final_summary.json").read_text())
    validate_schema(doc)
    assert doc["complete"] is False
    assert doc["run"]["exit_code"] == 0

    # Training did not notice: the whole run, against a run without the fault ...
    assert_same_speed(done_rate(stdout), clean_rate, "whole run")
    # ... and, on the same run, the pace after the kill against the pace before it.
    times = step_times(progress, 0)
    assert len(times) == int(steps)
    assert_same_speed(pace(times, t_kill, times[-1]), pace(times, times[10], t_kill),
                      "after the kill vs before")

    # What was lost: the steps after the last snapshot, no more.
    for r in doc["ranks"]:
        times = step_times(progress, r["rank"])
        real_at_kill = sum(1 for t in times if t <= t_kill)
        assert 1 <= r["steps"] <= real_at_kill, (r["rank"], r["steps"], real_at_kill)
        record_ends_before_kill_s = t_kill - times[r["steps"] - 1]
        assert record_ends_before_kill_s <= LOSS_BOUND_S, (
            f"rank {r['rank']}: the record ends {record_ends_before_kill_s:.2f} s before the "
            f"kill ({r['steps']} of {real_at_kill} steps)")


@dataclass
class Restart:
    """What happened to a job whose collector started late, was SIGKILLed and restarted."""

    progress: Path
    run_dir: Path
    ranks_rc: int
    before_first_up: int  # steps rank 0 had made when the first collector was listening
    first_live: dict[str, Any]  # the first collector's last snapshot before the kill
    second_up_at: float  # wall clock when the second collector was listening
    second_rc: int
    final: dict[str, Any]  # the second collector's final_summary.json
    steps: int


def _hand_collector(run_dir: Path, port: int, reaper: Reaper) -> subprocess.Popen:
    return reaper.track(subprocess.Popen(
        [sys.executable, "-m", "traceml_tui", "collector", "--run-dir", str(run_dir),
         "--world-size", "2", "--port", str(port), "--exit-when-done"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env()))


def _listening(run_dir: Path, pid: int) -> bool:
    try:
        return json.loads((run_dir / "collector.json").read_text())["pid"] == pid
    except (OSError, ValueError, KeyError):
        return False


@pytest.fixture(scope="module")
def restarted(tmp_path_factory: pytest.TempPathFactory, module_reaper: Reaper) -> Restart:
    """Ranks started with plain torchrun and TRACEML_ENDPOINT on a fixed port, before any
    collector listens there; a collector started by hand 1.5 s into training, SIGKILLed
    3 s later, and a new one started on the same port and run folder 1.5 s after that."""
    tmp = tmp_path_factory.mktemp("restart")
    progress, run_dir, stop = tmp / "progress", tmp / "run", tmp / "stop"
    port, master = free_ports(1), free_ports(1)
    most = 20_000  # the job stops where the stop file says, once the collectors are done
    env = {**_env(), "TRACEML_ENDPOINT": f"tcp://127.0.0.1:{port}"}
    ranks = module_reaper.track(subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(master), "-m", "traceml_agent.bootstrap", str(FAULTY),
         "--steps", str(most), "--progress", str(progress), "--quiet", "--stop-file",
         str(stop)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env))
    wait_for(lambda: len(step_times(progress, 0)) >= 40, 60, "the ranks' first steps")

    first = _hand_collector(run_dir, port, module_reaper)
    wait_for(lambda: _listening(run_dir, first.pid), 20, "the first collector")
    before_first_up = len(step_times(progress, 0))
    time.sleep(3.0)
    first_live = json.loads((run_dir / "live_snapshot.json").read_text())
    first.kill()
    first.wait(10)
    time.sleep(1.5)
    second = _hand_collector(run_dir, port, module_reaper)
    wait_for(lambda: _listening(run_dir, second.pid), 20, "the second collector")
    second_up_at = time.time()
    # 200 more steps with the second collector, however long the collectors took to
    # start on a busy machine (a fixed 600-step job had made 479 by then: fresh-clone
    # run 25). The ranks are within a step of each other (DDP): both stop there.
    steps = len(step_times(progress, 0)) + 200
    assert steps < most - 1_000, "the job nearly ended before its collectors were done"
    stop.with_name("stop.tmp").write_text(str(steps))
    stop.with_name("stop.tmp").rename(stop)
    ranks_rc = ranks.wait(JOB_TIMEOUT_S)
    second_rc = second.wait(30)
    final = json.loads((run_dir / "final_summary.json").read_text())
    return Restart(progress, run_dir, ranks_rc, before_first_up, first_live, second_up_at,
                   second_rc, final, steps)


def test_collector_starting_late_gets_the_steps_made_before_it_listened(
        restarted: Restart) -> None:
    """Agents whose collector is not there yet keep their messages queued (bounded) and
    connect when it comes: the steps made before it listened are not lost."""
    assert restarted.before_first_up >= 40
    for r in restarted.first_live["ranks"]:
        assert r["steps"] >= restarted.before_first_up - 5, (r["rank"], r["steps"])


def test_collector_restarted_on_the_same_port_gets_every_step_after_the_restart(
        restarted: Restart) -> None:
    """A SIGKILLed collector replaced on the same port: the agents reconnect by themselves
    and everything they send after that arrives; the job never noticed (exit 0)."""
    assert restarted.ranks_rc == 0
    assert restarted.second_rc == 0
    doc = restarted.final
    validate_schema(doc)
    for r in doc["ranks"]:
        times = step_times(restarted.progress, r["rank"])
        assert len(times) == restarted.steps
        after_restart = sum(1 for t in times if t > restarted.second_up_at)
        assert after_restart >= 100
        assert after_restart <= r["steps"] <= restarted.steps, (r["rank"], r["steps"])


def test_collector_restarted_does_not_call_a_partial_record_complete(
        restarted: Restart) -> None:
    """What a user reading final_summary.json must be able to trust: "complete": true
    means every step the ranks made is counted."""
    doc = restarted.final
    partial = any(r["steps"] < restarted.steps for r in doc["ranks"])
    assert not (partial and doc["complete"]), (
        f"complete: true with {[r['steps'] for r in doc['ranks']]} of {restarted.steps} steps")


# --- viewers die ------------------------------------------------------------------------


def _read_line(proc: subprocess.Popen, timeout: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "the viewer said nothing"
    return proc.stdout.readline()


FROZEN_VIEWER = """
import sys
from traceml_tui.view.client import ViewClient, resolve_target
address, _, secret = resolve_target(sys.argv[1])
client = ViewClient(address, secret=secret)
client.fetch()
print("attached", flush=True)
while True:
    client.fetch()
"""


@pytest.mark.alone  # compares the job's pace (xdist: nothing beside it)
def test_viewers_killed_or_frozen_change_nothing_for_the_job(tmp_path: Path,
                                                             reaper: Reaper) -> None:
    """Two viewers on a running job: a real `traceml watch` in a terminal (script(1) gives
    it one), SIGKILLed once it has drawn the dashboard, and a client polling the view
    socket as fast as it can, frozen with SIGSTOP mid-stream. The ranks keep their pace,
    other viewers are still served, and the run ends complete with every step (exit 0)."""
    out, progress = tmp_path / "runs", tmp_path / "progress"
    run_dir = out / "watched"
    steps = 400
    job = reaper.track(start_run(out, "watched", "--steps", str(steps), "--progress",
                                 str(progress)))
    wait_for(lambda: (run_dir / "collector.json").exists(), 30, "the collector")
    typescript = tmp_path / "typescript"
    watch = reaper.track(subprocess.Popen(
        ["script", "-qfec", f"{sys.executable} -m traceml_tui watch {run_dir}", str(typescript)],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True, env={**_env(), "TERM": "xterm-256color"}))
    frozen = reaper.track(subprocess.Popen(
        [sys.executable, "-c", FROZEN_VIEWER, str(run_dir)], stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True, env=_env()))
    assert _read_line(frozen, 30).strip() == "attached"

    def dashboard_drawn() -> bool:
        screen = typescript.read_bytes() if typescript.exists() else b""
        return b"WARMUP" in screen or b"BALANCED" in screen

    wait_for(dashboard_drawn, 30, "the watch dashboard to draw the run")
    wait_for(lambda: len(step_times(progress, 0)) >= 60, 60, "60 steps")
    os.kill(frozen.pid, signal.SIGSTOP)
    t_fault = time.time()
    os.killpg(watch.pid, signal.SIGKILL)
    watch.wait(10)

    # Another viewer is still served, and sees the job moving.
    address, _, secret = resolve_target(str(run_dir))
    client = ViewClient(address, secret=secret)
    try:
        seen, _ = client.fetch()
        wait_for(lambda: client.fetch()[0].steps >= seen.steps + 20, 20, "steps in the view")
    finally:
        client.close()
    rc, stdout, stderr = finish(job)
    frozen.kill()

    assert rc == 0, stderr[-3000:]
    doc = json.loads((run_dir / "final_summary.json").read_text())
    validate_schema(doc)
    assert doc["complete"] is True
    assert [r["steps"] for r in doc["ranks"]] == [steps, steps]
    times = step_times(progress, 0)
    assert_same_speed(pace(times, t_fault, times[-1]), pace(times, times[10], t_fault),
                      "after the viewers died vs before")


# --- a rank crashes -----------------------------------------------------------------------


@dataclass
class Finished:
    rc: int
    stdout: str
    stderr: str
    run_dir: Path
    progress: Path

    @property
    def summary(self) -> dict[str, Any]:
        return json.loads((self.run_dir / "final_summary.json").read_text())


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory, module_reaper: Reaper) -> Finished:
    """Rank 2 of 3 raises at step 12. Ranks 0 and 1 then fail too, inside gloo ("Connection
    closed by peer"): the record must still point at rank 2, the first cause."""
    tmp = tmp_path_factory.mktemp("crash")
    proc = module_reaper.track(start_run(
        tmp / "runs", "crash", "--steps", "300", "--raise-rank", "2", "--raise-at-step", "12",
        "--progress", str(tmp / "progress"), nproc=3))
    rc, stdout, stderr = finish(proc)
    return Finished(rc, stdout, stderr, tmp / "runs" / "crash", tmp / "progress")


def test_rank_crash_record_names_it_with_its_traceback_and_keeps_every_step(
        crashed: Finished) -> None:
    assert crashed.rc == 1, crashed.stderr[-3000:]  # an uncaught exception: Python's 1
    doc = crashed.summary
    validate_schema(doc)
    assert doc["complete"] is True
    assert doc["run"]["exit_code"] == 1
    assert doc["run"]["failed_rank"] == 2
    rank2 = doc["ranks"][2]
    assert rank2["exit_code"] == 1
    assert "RuntimeError: injected fault on rank 2 at step 12" in rank2["error"]
    assert 'raise RuntimeError(f"injected fault' in rank2["error"]  # the frame, not just the line
    for r in doc["ranks"]:  # every step each rank made before the crash is kept
        assert r["steps"] == len(step_times(crashed.progress, r["rank"])) == 12


def test_rank_crash_printed_summary_shows_the_failed_ranks_traceback(crashed: Finished) -> None:
    """What the user reads at the end of the run: the rank that failed first, and the
    last lines of its traceback."""
    assert "RuntimeError: injected fault on rank 2 at step 12" in crashed.stdout
    assert re.search(r"[Rr]ank 2 failed", crashed.stdout)


def test_rank_crash_leads_the_summary_its_text_and_the_printed_end(crashed: Finished) -> None:
    """Failures first (issue 32): the user's first question is what failed, so the first
    line names the rank, its exit code and its exception's last line; the performance
    verdict of the steps before it follows."""
    failure = crashed.summary["failure"]
    assert list(crashed.summary)[2] == "failure"
    assert {k: failure[k] for k in ("rank", "exit_code", "signal", "error", "step")} == {
        "rank": 2, "exit_code": 1, "signal": None, "step": 12,
        "error": "RuntimeError: injected fault on rank 2 at step 12"}
    first = ("FAILED: rank 2 exited with code 1 after 12 steps: RuntimeError: injected fault "
             "on rank 2 at step 12")
    text = (crashed.run_dir / "final_summary.txt").read_text().splitlines()
    assert text[0].startswith(first), text[:4]
    assert text[3].startswith("Diagnosis of the steps before it: "), text[:4]
    printed = [line for line in crashed.stdout.splitlines() if line.strip()]
    assert printed[0].startswith(first), crashed.stdout[:2000]


def test_a_rank_that_dies_at_exit_after_its_goodbye_is_the_failure(
        tmp_path: Path, reaper: Reaper) -> None:
    """Fresh-clone run 43: a rank's script returned (its goodbye said 0), then the process
    aborted in gloo's teardown; torchrun failed the job, yet the record named no failure.
    torchrun's word wins: the rank failed, at exit, after all its steps."""
    proc = reaper.track(start_run(tmp_path / "runs", "atexit", "--steps", "20",
                                  "--step-ms", "5", "--abort-at-exit-rank", "1", "--quiet"))
    rc, stdout, stderr = finish(proc)
    assert rc == 134, stderr[-3000:]  # 128 + SIGABRT, as a shell reads it
    doc = json.loads((tmp_path / "runs" / "atexit" / "final_summary.json").read_text())
    validate_schema(doc)
    failure = doc["failure"]
    assert failure is not None and (failure["rank"], failure["signal"], failure["step"]) == (
        1, "SIGABRT", 20), failure
    assert "after its script returned" in failure["summary"], failure
    # (Rank 0 may still be on its way out when torchrun, seeing rank 1 die, stops it: its
    # own exit is not this test's; fresh-clone run 51.)
    assert doc["run"]["failed_rank"] == 1
    printed = [line for line in stdout.splitlines() if line.strip()]
    assert printed[0].startswith("FAILED: rank 1 was killed by signal 6 (SIGABRT) after 20 "
                                 "steps: died at exit"), stdout[:2000]


# --- a scheduler's SIGTERM to a job that does not stop ------------------------------------


@dataclass
class Terminated:
    rc: int
    stdout: str
    stderr: str
    run_dir: Path
    summary_after_s: float  # from SIGTERM to final_summary.json on disk
    steps_at_term: list[int]
    rank_pids: list[int]
    alive_after_exit: list[int]


@pytest.fixture(scope="module")
def terminated(tmp_path_factory: pytest.TempPathFactory, module_reaper: Reaper) -> Terminated:
    """Every rank ignores SIGTERM (as a job with its own preemption handler may, while it
    saves a checkpoint). `traceml run` gets SIGTERM, as from a scheduler."""
    tmp = tmp_path_factory.mktemp("term")
    progress, run_dir = tmp / "progress", tmp / "runs" / "term"
    proc = module_reaper.track(start_run(tmp / "runs", "term", "--steps", "1000000",
                                         "--ignore-sigterm", "--progress", str(progress)))
    wait_for(lambda: len(step_times(progress, 1)) >= 40 and snapshot_has_all_ranks(run_dir, 2),
             60, "40 steps")
    live = json.loads((run_dir / "live_snapshot.json").read_text())
    ranks = [psutil.Process(r["pid"]) for r in live["ranks"]]  # the ranks' own pids
    module_reaper.pids += [p.pid for p in ranks]
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    steps_at_term = [len(step_times(progress, r)) for r in (0, 1)]
    summary = run_dir / "final_summary.json"
    wait_for(summary.exists, TERM_GRACE_S + 30, "final_summary.json")
    summary_after = time.monotonic() - t0
    rc, stdout, stderr = finish(proc, 60)
    time.sleep(1.0)
    alive = [p.pid for p in ranks if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    return Terminated(rc, stdout, stderr, run_dir, summary_after, steps_at_term,
                      [p.pid for p in ranks], alive)


def test_sigterm_to_a_job_ignoring_it_still_ends_with_143_and_a_summary(
        terminated: Terminated) -> None:
    """A scheduler sends SIGTERM, then SIGKILL after its grace (Slurm's KillWait and
    Kubernetes' default are 30 s): the summary must be on disk before that."""
    assert terminated.rc == 143, terminated.stderr[-3000:]
    assert terminated.summary_after_s < TERM_GRACE_S + 8  # launcher's grace + collector finish
    doc = json.loads((terminated.run_dir / "final_summary.json").read_text())
    validate_schema(doc)
    assert doc["run"]["exit_code"] == 143
    for r, before in zip(doc["ranks"], terminated.steps_at_term, strict=True):
        assert r["steps"] >= before  # nothing the ranks did before the signal is lost


def test_sigterm_leaves_no_rank_running_after_traceml_exits(terminated: Terminated) -> None:
    """Bare torchrun, given SIGTERM, SIGKILLs ranks that ignore it (after 30 s): nothing
    of the job survives it. `traceml run` must not leave less cleaned up."""
    assert terminated.alive_after_exit == [], (
        f"rank processes {terminated.alive_after_exit} still running after traceml exited")


# --- the run folder cannot be written ------------------------------------------------------


MARKER_SCRIPT = """
from pathlib import Path
Path(__file__).with_suffix(".ran").write_text("the script ran")
"""


def _marker_script(tmp_path: Path) -> Path:
    """A script that leaves a file when it runs: proof that no rank was started."""
    script = tmp_path / "train.py"
    script.write_text(MARKER_SCRIPT)
    return script


def _assert_one_clear_line(rc: int, stdout: str, stderr: str, *words: str) -> None:
    assert rc == 2, stderr[-3000:]
    assert "Traceback" not in stdout + stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("traceml run: error:"), stderr
    for word in words:
        assert word in lines[0], lines[0]


def _run_now(*args: str, timeout: float = 60) -> tuple[int, str, str]:
    proc = subprocess.run([sys.executable, "-m", "traceml_tui", "run", *args],
                          capture_output=True, text=True, timeout=timeout, env=_env())
    return proc.returncode, proc.stdout, proc.stderr


def test_out_under_a_regular_file_is_one_line_and_starts_nothing(tmp_path: Path) -> None:
    """Works as root too, where a chmod 0555 folder would still be writable."""
    script = _marker_script(tmp_path)
    blocker = tmp_path / "file.txt"
    blocker.write_text("not a folder")
    rc, stdout, stderr = _run_now(str(script), "--nproc-per-node", "2", "--headless",
                                  "--out", str(blocker / "sub"))
    _assert_one_clear_line(rc, stdout, stderr, "cannot write to run folder", "Not a directory")
    assert not script.with_suffix(".ran").exists()


@contextmanager
def tmpfs(path: Path, *options: str) -> Iterator[Path]:
    """A small tmpfs at `path` (read-only or tiny), for a file system that refuses writes
    even to root. Skips the test where mounting is not allowed."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(options), "tmpfs",
                              str(path)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(folder: Path) -> None:
    """Write zeros into `folder` until its file system is full."""
    chunk = b"\0" * (64 << 10)
    with open(folder / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError:
            pass


def test_out_on_a_read_only_file_system_is_one_line_and_starts_nothing(tmp_path: Path) -> None:
    script = _marker_script(tmp_path)
    with tmpfs(tmp_path / "ro", "ro", "size=1m") as ro:
        rc, stdout, stderr = _run_now(str(script), "--headless", "--out", str(ro / "runs"))
    _assert_one_clear_line(rc, stdout, stderr, "cannot write to run folder",
                           "Read-only file system")
    assert not script.with_suffix(".ran").exists()


def test_out_on_a_full_disk_is_one_line_and_starts_nothing(tmp_path: Path) -> None:
    script = _marker_script(tmp_path)
    with tmpfs(tmp_path / "full", "size=256k") as full:
        fill(full)
        rc, stdout, stderr = _run_now(str(script), "--headless", "--out", str(full / "runs"))
    assert not script.with_suffix(".ran").exists()
    _assert_one_clear_line(rc, stdout, stderr, "No space left on device")


@dataclass
class DiskFull:
    rc: int
    stdout: str
    stderr: str
    run_dir: Path
    progress: Path
    t_full: float
    steps: int
    live_snapshot: str  # the run folder's live_snapshot.json after the run


@pytest.fixture(scope="module")
def disk_full(tmp_path_factory: pytest.TempPathFactory, module_reaper: Reaper) -> DiskFull:
    """The run folder's disk fills up mid-run (another job's checkpoints, say). The job
    prints nothing, so its own output cannot fail it: only traceml's writes meet the full
    disk. The ranks' own record is kept on another disk."""
    tmp = tmp_path_factory.mktemp("diskfull")
    progress, steps = tmp / "progress", 300
    with tmpfs(tmp / "mnt", "size=4m") as mnt:
        run_dir = mnt / "runs" / "full"
        proc = module_reaper.track(start_run(mnt / "runs", "full", "--steps", str(steps),
                                             "--quiet", "--progress", str(progress)))
        wait_for(lambda: len(step_times(progress, 0)) >= 60 and snapshot_has_all_ranks(
            run_dir, 2), 60, "60 steps and a snapshot")
        t_full = time.time()
        fill(mnt)
        rc, stdout, stderr = finish(proc)
        live = (run_dir / "live_snapshot.json").read_text()
    return DiskFull(rc, stdout, stderr, run_dir, progress, t_full, steps, live)


@pytest.mark.alone  # compares the job's pace (xdist: nothing beside it)
def test_disk_full_midrun_costs_the_job_nothing(disk_full: DiskFull) -> None:
    """Snapshots fail to write from then on: the ranks keep their pace and finish, and the
    last snapshot written before is still whole (written atomically)."""
    for rank in (0, 1):
        assert len(step_times(disk_full.progress, rank)) == disk_full.steps
    assert "Root Cause" not in disk_full.stderr  # torchrun saw every rank exit 0
    times = step_times(disk_full.progress, 0)
    assert_same_speed(pace(times, disk_full.t_full, times[-1]),
                      pace(times, times[10], disk_full.t_full), "after the disk filled vs before")
    doc = json.loads(disk_full.live_snapshot)
    assert doc["complete"] is False and doc["run"]["steps"] > 0


@pytest.mark.alone  # compares the job's pace (xdist: nothing beside it)
def test_disk_full_midrun_ends_with_the_jobs_code_and_shows_the_record(
        disk_full: DiskFull) -> None:
    """The summary cannot be saved; the user should still get the job's exit code, the
    summary on the terminal, and one line saying it could not be written."""
    assert "Traceback" not in disk_full.stdout + disk_full.stderr
    assert disk_full.rc == 0
    assert "No space left on device" in disk_full.stderr
    assert f"{disk_full.steps} steps" in disk_full.stdout


# --- a port is taken --------------------------------------------------------------------


@pytest.mark.parametrize("offset", [
    pytest.param(1, id="collector-port"),
    pytest.param(2, id="view-port"),
    pytest.param(0, id="master-port"),
])
def test_port_taken_on_node_0_is_a_clear_error(tmp_path: Path, offset: int) -> None:
    """Node 0 of a 2-node job uses the master port P (torchrun), P+1 (the collector, which
    the other nodes' agents reach) and P+2 (viewers). Another process holds one of them."""
    port = free_ports(3)
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("0.0.0.0", port + offset))
        holder.listen()
        rc, stdout, stderr = _run_now(
            str(FAULTY), "--nproc-per-node", "1", "--nnodes", "2", "--node-rank", "0",
            "--master-port", str(port), "--run-name", "x", "--headless",
            "--out", str(tmp_path / "runs"), timeout=90)
    assert "Traceback" not in stdout + stderr, stderr[-3000:]
    assert rc == 2, stderr[-3000:]
    assert "traceml run: error:" in stderr
    assert str(port + offset) in stderr and "in use" in stderr

