"""Helpers for tests that launch real `traceml run` jobs (torchrun, gloo, CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
# The contract itself (docs/spec): one schema file, the one every summary is checked against.
SCHEMA = Path(__file__).resolve().parents[2] / "docs" / "spec" / "summary.schema.json"
JOB_TIMEOUT_S = 240


@dataclass
class Finished:
    returncode: int
    stdout: str
    stderr: str
    run_dir: Path

    @property
    def summary(self) -> dict[str, Any]:
        return json.loads((self.run_dir / "final_summary.json").read_text())


def traceml(*args: str, cwd: Path | None = None, timeout: float = JOB_TIMEOUT_S,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run the real `traceml` command line (as a user would), capturing its output.

    On a timeout the failure says what every process of the job was doing (state and
    kernel wait channel), and the whole job is killed: nothing of it may go on loading
    the machine for the tests after it."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "traceml_tui", *args], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=full_env, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        tree = process_tree(proc.pid)
        kill_session(proc)
        stdout, stderr = proc.communicate()
        raise subprocess.TimeoutExpired(
            exc.cmd, timeout, output=stdout,
            stderr=f"{stderr[-4000:]}\n--- processes at the timeout ---\n{tree}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def process_tree(pid: int) -> str:
    """`ps` lines (state, wait channel, command) of pid and its descendants."""
    import psutil

    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return "(gone)"
    pids = ",".join(str(p.pid) for p in procs)
    return subprocess.run(["ps", "-o", "pid,ppid,stat,wchan:24,etime,args", "-p", pids],
                          capture_output=True, text=True).stdout


def kill_all(procs) -> None:
    """SIGKILL each psutil process listed: one that ended since it was listed is what
    this wanted already, never an error of the test (psutil.NoSuchProcess: a teardown
    once failed a green run on a process that exited between the listing and the kill)."""
    import psutil

    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass


def alive(proc) -> bool:
    """Whether a psutil process listed earlier still runs (gone or a zombie: not)."""
    import psutil

    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the job: its process group (start_new_session=True) and every descendant,
    the collector included (it runs in a session of its own)."""
    import signal

    import psutil

    try:
        rest = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        rest = []
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for child in rest:
        try:
            child.kill()
        except psutil.Error:
            pass


def spawn_traceml(*args: str, env: dict[str, str] | None = None,
                  wrapper: tuple[str, ...] = ()) -> subprocess.Popen:
    """Start `traceml` in the background (one "node" of a multi-node job); `wrapper`
    prefixes the command, e.g. ("ip", "netns", "exec", "node1")."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen([*wrapper, sys.executable, "-m", "traceml_tui", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=full_env)


def free_ports(count: int) -> int:
    """The first of `count` consecutive free TCP ports (torchrun's, the collector's, the
    viewers' for a multi-node run): the product's choice, outside the ephemeral range that
    every outgoing connection on the host draws from (launch/ports.py)."""
    from traceml_tui.launch import ports

    return ports.free_ports(count)


def run_job(tmp_path: Path, script: str, *args: str, nproc: int = 3, name: str = "job",
            script_args: tuple[str, ...] = ()) -> Finished:
    out = tmp_path / "runs"
    proc = traceml("run", str(EXAMPLES / script), "--nproc-per-node", str(nproc), "--headless",
                   "--out", str(out), "--run-name", name, *args, "--", *script_args)
    return Finished(proc.returncode, proc.stdout, proc.stderr, out / name)


def validate_schema(doc: dict[str, Any]) -> None:
    import jsonschema

    jsonschema.validate(doc, json.loads(SCHEMA.read_text()))

def live_steps(run_dir: Path) -> int:
    """Steps the collector has seen so far, from the run's live snapshot (0 before it exists)."""
    try:
        return json.loads((run_dir / "live_snapshot.json").read_text())["run"]["steps"]
    except (OSError, ValueError, KeyError):
        return 0


def live_ranks_steps(run_dir: Path) -> list[int]:
    """Every rank's steps in the run's live snapshot (empty before it exists)."""
    try:
        doc = json.loads((run_dir / "live_snapshot.json").read_text())
    except (OSError, ValueError):
        return []
    return [r["steps"] for r in doc["ranks"]]


def wait_for(condition, timeout: float, what: str = "the job") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def ptrace_allowed() -> bool:
    """Whether this process may ptrace its jobs' ranks (py-spy's native stacks): Yama's
    scope below 2, or 2 as root. (Shared by test_native_stacks and test_e2e_hang_record.)"""
    try:
        scope = int(Path("/proc/sys/kernel/yama/ptrace_scope").read_text())
    except (OSError, ValueError):
        return True
    return scope < 2 or (scope == 2 and os.geteuid() == 0)
