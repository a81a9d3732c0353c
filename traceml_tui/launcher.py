"""`traceml run`: collector + torchrun with the agent in every rank + the final summary.

Order of events:
  1. check the script and make the run folder (errors here cost the user nothing);
  2. start the collector in its own session (Ctrl-C must not kill the record keeper)
     and wait for it to announce its address in collector.json;
  3. start torchrun, which runs `python -m traceml_agent.bootstrap SCRIPT ARGS` in every
     rank, with the collector's address and the run identity in the environment;
  4. forward SIGINT/SIGTERM to torchrun, wait for it;
  5. ask the collector to finish: it drains the ranks' last messages, writes
     final_summary.json and tells us the job's exit code; if it cannot, build the
     summary from its last snapshot, marked incomplete;
  6. exit with the training job's exit code (130 after Ctrl-C).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from traceml_agent import env

from . import summary
from .collector import COLLECTOR_JSON

COLLECTOR_START_TIMEOUT_S = 20.0
FINISH_TIMEOUT_S = 20.0
TERM_GRACE_S = 15.0  # after forwarding SIGTERM, how long torchrun gets before SIGKILL
# After Ctrl-C, how long ranks get to stop by themselves. A rank blocked inside a
# collective never runs Python's SIGINT handler (torchrun would wait 30 s, then kill):
# past this, the launcher sends SIGTERM to the rank processes it knows on this host.
INTERRUPT_GRACE_S = 3.0
STATUS_EVERY_S = 10.0


_ROOT_CAUSE = re.compile(
    r"Root Cause \(first observed failure\):.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)",
    re.S)


def parse_root_cause(text: str) -> tuple[int, int] | None:
    """torchrun's own record of the first rank that failed: (rank, exit code), where a
    negative exit code is the signal that killed it. The only witness when a rank is
    killed outright: it sends no goodbye, while the survivors report errors of their own."""
    match = _ROOT_CAUSE.search(text)
    return (int(match.group(1)), int(match.group(2))) if match else None


class LaunchError(Exception):
    """A problem with the user's input or environment: printed as one line, no traceback."""


@dataclass
class RunOptions:
    script: Path
    script_args: list[str] = field(default_factory=list)
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    run_name: str | None = None
    out: Path = Path("traceml_runs")
    headless: bool = True
    command: list[str] = field(default_factory=list)
    hang_after: float | None = None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare_run_dir(opts: RunOptions) -> tuple[str, Path]:
    if opts.run_name:
        name = opts.run_name
        if "/" in name or name in (".", ".."):
            raise LaunchError(f"--run-name {name!r} must be a plain name, not a path")
        run_dir = opts.out / name
        if (run_dir / summary.SUMMARY_JSON).exists() or (run_dir / COLLECTOR_JSON).exists():
            raise LaunchError(f"run folder {run_dir} already holds a run; choose another "
                              f"--run-name or remove the folder")
    else:
        stem = datetime.now().strftime(f"{opts.script.stem}-%Y%m%d-%H%M%S")
        name, n = stem, 1
        while (opts.out / name).exists():
            n += 1
            name = f"{stem}-{n}"
        run_dir = opts.out / name
    try:
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LaunchError(f"cannot create run folder {run_dir}: {exc.strerror or exc}") from None
    return name, run_dir


def start_collector(run_dir: Path, name: str, opts: RunOptions, started_at: float
                    ) -> tuple[subprocess.Popen, dict[str, Any]]:
    log = open(run_dir / "collector.log", "ab")
    cmd = [sys.executable, "-m", "traceml_tui.collector", "--run-dir", str(run_dir),
           "--run-name", name, "--world-size", str(opts.nproc_per_node * opts.nnodes),
           "--nnodes", str(opts.nnodes), "--nproc-per-node", str(opts.nproc_per_node),
           "--started-at", repr(started_at)]
    if opts.hang_after is not None:
        cmd += ["--hang-after", repr(opts.hang_after)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    log.close()
    info_path = run_dir / COLLECTOR_JSON
    deadline = time.monotonic() + COLLECTOR_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if info_path.exists():
            return proc, json.loads(info_path.read_text())
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    tail = (run_dir / "collector.log").read_text(errors="replace")[-2000:]
    raise LaunchError(f"the collector did not start; its log ({run_dir / 'collector.log'}):\n"
                      f"{tail}")


def torchrun_command(opts: RunOptions, run_dir: Path) -> list[str]:
    port = opts.master_port or (_free_port() if opts.nnodes == 1 else 29500)
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc-per-node", str(opts.nproc_per_node),
        "--nnodes", str(opts.nnodes), "--node-rank", str(opts.node_rank),
        "--master-addr", opts.master_addr, "--master-port", str(port),
        # Every rank's stdout/stderr kept in the run folder; also shown when headless.
        "--log-dir", str(run_dir / "logs"), "--tee" if opts.headless else "--redirects", "3",
        "-m", "traceml_agent.bootstrap", str(opts.script), *opts.script_args,
    ]


class _Signals:
    """Remembers how the run was stopped and passes the signal on to torchrun."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.interrupted = False
        self.terminated = False
        self._old: dict[int, Any] = {}

    def __enter__(self) -> _Signals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def _handle(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT:
            self.interrupted = True
        else:
            self.terminated = True
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.send_signal(signum)
            except ProcessLookupError:
                pass


def _finish(control: str, request: dict[str, Any], collector: subprocess.Popen
            ) -> dict[str, Any] | None:
    """Ask the collector for the final summary; None if it is dead or does not answer."""
    import zmq

    if collector.poll() is not None:
        return None
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(control)
    try:
        sock.send_json(request)
        deadline = time.monotonic() + FINISH_TIMEOUT_S
        while time.monotonic() < deadline:
            if sock.poll(100):
                return sock.recv_json()
            if collector.poll() is not None:
                return None
        return None
    finally:
        sock.close()


def _fallback_summary(run_dir: Path, request: dict[str, Any]) -> dict[str, Any]:
    """The collector did not answer: promote its last snapshot, marked incomplete."""
    live = run_dir / summary.LIVE_JSON
    if not live.exists():
        raise LaunchError("the collector died before writing any snapshot; no summary")
    doc = json.loads(live.read_text())
    failures = [(r["rank"], r["exit_code"]) for r in doc["ranks"] if r.get("exit_code")]
    code, failed_rank = summary.job_exit_code(
        request["torchrun_exit"], request["interrupted"], failures)
    doc["complete"] = False
    doc["run"]["exit_code"] = request.get("exit_code", code)
    doc["run"]["failed_rank"] = failed_rank
    doc["run"]["ended_at"] = summary.iso(request["ended_at"])
    doc["run"]["command"] = request["command"]
    summary.write_summary(run_dir, doc)
    return {"exit_code": doc["run"]["exit_code"], "text": summary.render_text(doc),
            "path": str(run_dir / summary.SUMMARY_JSON)}


class _Progress:
    """Headless progress: a line when the live diagnosis changes, and every STATUS_EVERY_S."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / summary.LIVE_JSON
        self.last_key: tuple | None = None
        self.last_print = time.monotonic()
        self.mtime = 0
        self.doc: dict[str, Any] | None = None

    def poll(self) -> None:
        try:  # the file changes every few seconds: parse it only when it did
            mtime = self.path.stat().st_mtime_ns
            if mtime != self.mtime:
                self.doc, self.mtime = json.loads(self.path.read_text()), mtime
        except (OSError, ValueError):
            return
        doc = self.doc
        if doc is None:
            return
        d = doc["live_diagnosis"]
        key = (d["label"], d["rank"])
        now = time.monotonic()
        if key != self.last_key or now - self.last_print >= STATUS_EVERY_S:
            run = doc["run"]
            who = f" rank {d['rank']}" if d["rank"] is not None else ""
            print(f"[traceml] step {run['steps']} · {run['ranks_reporting']}/{run['world_size']}"
                  f" ranks · {d['label']}{who}: {d['summary']}", file=sys.stderr, flush=True)
            self.last_key, self.last_print = key, now


class _Tee:
    """Copies a child's stream to our stderr line by line, keeping the last lines."""

    def __init__(self, stream: Any) -> None:
        import collections
        import threading

        self.lines: collections.deque[str] = collections.deque(maxlen=400)
        self.thread = threading.Thread(target=self._run, args=(stream,), daemon=True)
        self.thread.start()

    def _run(self, stream: Any) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace")
            self.lines.append(line)
            sys.stderr.write(line)
            sys.stderr.flush()

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)


def _read_tail(path: Path, limit: int = 64_000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _terminate_ranks(run_dir: Path) -> None:
    """SIGTERM the rank processes of this host, as the collector last saw them."""
    try:
        doc = json.loads((run_dir / summary.LIVE_JSON).read_text())
    except (OSError, ValueError):
        return
    host = socket.gethostname()
    for r in doc.get("ranks", []):
        if r.get("host") == host and r.get("pid"):
            try:
                os.kill(int(r["pid"]), signal.SIGTERM)
            except (ProcessLookupError, PermissionError, ValueError):
                pass


def _wait(proc: subprocess.Popen, signals: _Signals, progress: _Progress | None,
          run_dir: Path | None = None) -> int:
    term_deadline = None
    interrupt_deadline = None
    while True:
        try:
            return proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            pass
        if progress is not None:
            progress.poll()
        if signals.interrupted and interrupt_deadline is None:
            interrupt_deadline = time.monotonic() + INTERRUPT_GRACE_S
        if interrupt_deadline is not None and time.monotonic() > interrupt_deadline:
            interrupt_deadline = float("inf")  # once
            if run_dir is not None:
                _terminate_ranks(run_dir)
        if signals.terminated and term_deadline is None:
            term_deadline = time.monotonic() + TERM_GRACE_S
        if term_deadline is not None and time.monotonic() > term_deadline:
            proc.kill()


def _finalize(info: dict[str, Any], collector: subprocess.Popen, run_dir: Path,
              opts: RunOptions, rc: int, signals: _Signals,
              root_cause: tuple[int, int] | None = None) -> dict[str, Any]:
    request: dict[str, Any] = {
        "op": "finish", "torchrun_exit": rc, "interrupted": signals.interrupted,
        "root_cause": None if root_cause is None else list(root_cause),
        "command": opts.command, "ended_at": time.time(),
        "extra": {"run_dir": str(run_dir), "logs": str(run_dir / "logs"),
                  "torchrun_exit_code": rc},
    }
    if signals.terminated:
        request["exit_code"] = 143
    reply = _finish(info["control"], request, collector)
    if reply is None:
        reply = _fallback_summary(run_dir, request)
    return reply


def _with_dashboard(info: dict[str, Any], run_dir: Path, signals: _Signals,
                    finish: Any, progress: _Progress) -> dict[str, Any]:
    """The dashboard in the foreground; the job is watched from a thread. Closing (or
    crashing) the viewer leaves the job running: we then go on like --headless."""
    import threading

    from .dashboard import DashboardApp
    from .view_client import ViewClient

    outcome: dict[str, Any] = {}

    def stop_job() -> None:
        signals.interrupted = True
        if signals.proc is not None and signals.proc.poll() is None:
            signals.proc.send_signal(signal.SIGINT)

    app = DashboardApp(ViewClient(info["view"]), run_dir, stop_job=stop_job)

    def watcher() -> None:
        try:
            outcome["reply"] = finish()
        except Exception as exc:  # reported after the viewer closes
            outcome["error"] = exc
            return
        reply = outcome["reply"]
        try:
            app.call_from_thread(app.run_ended, reply.get("exit_code"), reply["path"])
        except Exception:
            pass  # the viewer is already gone

    thread = threading.Thread(target=watcher, name="traceml-job", daemon=True)
    thread.start()
    try:
        app.run()
    except Exception as exc:
        print(f"[traceml] the dashboard failed ({exc!r}); the job goes on", file=sys.stderr)
    if thread.is_alive():
        print(f"[traceml] viewer closed; the job goes on. Re-attach: traceml watch {run_dir}"
              f"   Ctrl-C stops the job.", file=sys.stderr, flush=True)
        while thread.is_alive():
            progress.poll()
            thread.join(0.5)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["reply"]


def run(opts: RunOptions) -> int:
    if not opts.script.is_file():
        raise LaunchError(f"script not found: {opts.script}")
    started_at = time.time()
    name, run_dir = prepare_run_dir(opts)
    collector, info = start_collector(run_dir, name, opts, started_at)
    cmd = torchrun_command(opts, run_dir)
    child_env = dict(os.environ)
    child_env.update({env.ENDPOINT: info["ingest"], env.RUN_NAME: name,
                      env.RUN_DIR: str(run_dir.resolve())})
    print(f"[traceml] run {name}: {opts.nproc_per_node * opts.nnodes} rank(s), folder {run_dir}",
          file=sys.stderr, flush=True)
    progress = _Progress(run_dir)
    log = None if opts.headless else open(run_dir / "torchrun.log", "ab")
    with _Signals() as signals:
        # With the dashboard, torchrun's own output goes to a file, not over the screen.
        proc = subprocess.Popen(cmd, env=child_env, stdout=log,
                                stderr=log if log else subprocess.PIPE,
                                stdin=subprocess.DEVNULL if log else None)
        signals.proc = proc
        stderr_tail = _Tee(proc.stderr) if log is None else None

        def finish() -> dict[str, Any]:
            rc = _wait(proc, signals, progress if opts.headless else None, run_dir)
            if stderr_tail is not None:
                stderr_tail.join(5)
                report = "".join(stderr_tail.lines)
            else:
                report = _read_tail(run_dir / "torchrun.log")
            return _finalize(info, collector, run_dir, opts, rc, signals,
                             parse_root_cause(report) if rc else None)

        if opts.headless:
            reply = finish()
        else:
            reply = _with_dashboard(info, run_dir, signals, finish, progress)
    if log is not None:
        log.close()
    try:
        collector.wait(timeout=5)
    except subprocess.TimeoutExpired:
        collector.kill()
    print("\n" + reply["text"], end="", flush=True)
    print(f"[traceml] summary: {reply['path']}", file=sys.stderr, flush=True)
    code = reply.get("exit_code")
    return 1 if code is None else int(code)
