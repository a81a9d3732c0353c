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
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from msgspec.structs import replace

from traceml_agent import env, handover, keys, vocab
from traceml_agent.requests import Finish, encode_control
from traceml_agent.sanitize import clean_line
from traceml_tui.report import ending, summary
from traceml_tui.report.ending import EndReply
from traceml_tui.runfolder import folders
from traceml_tui.runfolder import summary_model as model
from traceml_tui.runfolder.exit_codes import (
    job_exit_code,
    lead_with,
    process_exit_code,
    root_cause_end,
)
from traceml_tui.runfolder.layout import RunFolder

from . import nccl_debug
from .job_output import Progress, Tee, parse_root_cause, read_summary, read_tail
from .native_stacks import NativeStackWatcher, NodeStackServer, control_sender
from .options import LaunchError, RunOptions, master_port, prepare_run_dir, torchrun_command

if TYPE_CHECKING:
    from traceml_tui.collect.relay import RelayProcess

COLLECTOR_START_TIMEOUT_S = 20.0
# How long the dashboard of a node other than 0 waits for the run's secret from node 0
# (through torchrun's store, once both torchruns are up); its training does not wait.
SECRET_WAIT_S = 60.0  # past node 0's wait for the shared folder (handover.SHARED_WAIT_S)
FINISH_TIMEOUT_S = 20.0
TERM_GRACE_S = 15.0  # after forwarding SIGTERM, how long torchrun gets before SIGKILL
# After Ctrl-C, how long ranks get to stop by themselves. A rank blocked inside a
# collective never runs Python's SIGINT handler (torchrun would wait 30 s, then kill):
# past this, the launcher sends SIGTERM to the rank processes it knows on this host.
INTERRUPT_GRACE_S = 3.0


def _secret_store(opts: RunOptions, port: int) -> str:
    """Where another node's processes read node 0's secret: torchrun's store."""
    return f"{opts.master_addr}:{port}"


def run_secret(opts: RunOptions, run_dir: Path) -> str | None:
    """The run's secret (agent/keys.py): TRACEML_SECRET if set; else node 0 creates
    RUN_DIR/secret.key; another node reads it there if the folder is shared and node 0
    already made it. Else None: that node's launcher, relay and ranks wait for it, from
    the folder or torchrun's store (agent/handover.py), and nothing else waits."""
    try:
        secret = keys.secret_from_env()
    except keys.SecretError as exc:
        raise LaunchError(f"{env.SECRET}: {exc}") from None
    if secret:
        return secret
    path = RunFolder(run_dir).secret
    if opts.node_rank == 0:
        try:
            keys.write_secret_file(path, keys.new_secret())
            return keys.read_secret_file(path)
        except (OSError, keys.SecretError) as exc:
            raise LaunchError(f"cannot create the run's secret {path}: "
                              f"{getattr(exc, 'strerror', None) or exc}") from None
    return handover.read_file_secret(path)  # not shared, or node 0 not there yet


STORE_WARNING = ("the run's secret goes through torchrun's store: this run is as private "
                 "as the master port {where} (anyone who can reach it can read the secret). "
                 f"Remedy: set {env.SECRET} on every node, or use a shared --out.")
# Someone at the master port wrote a secret of theirs into the store (before node 0
# published, or over it): a node that took it never reports to node 0 (issue 42, 7c).
PLANTED_WARNING = ("{what} in torchrun's store at {where}: someone who can reach the master "
                   "port wrote a secret of theirs, and a node that read it will not report "
                   f"to node 0. Remedy: set {env.SECRET} on every node, or use a shared --out.")


class _Handover(threading.Thread):
    """What goes through torchrun's store, off the main thread (the training never
    waits for it; agent/handover.py). Node 0: nothing once every other node proved it
    shares the run folder, else (after SHARED_WAIT_S) the secret and the folder's path,
    said in one line. Another node: the secret from the shared folder (then its proof)
    or from the store (then that line too)."""

    def __init__(self, opts: RunOptions, port: int, until: Any, run_dir: Path,
                 secret: str | None) -> None:
        super().__init__(name="traceml-handover", daemon=True)
        self.opts, self.host, self.port, self.until = opts, opts.master_addr, port, until
        self.run_dir, self.secret = run_dir, secret
        self.values: dict[str, str] = {}
        self.outcome: str | None = None  # "shared" or "store" once known
        self.start()

    def _warn(self, nodes: list[int] | None = None) -> None:
        who = "" if nodes is None else (
            f" (node(s) {', '.join(map(str, nodes))} did not show the shared run folder "
            f"in {handover.shared_wait_s():.0f} s)")
        print(f"[traceml] node {self.opts.node_rank}: "
              + STORE_WARNING.format(where=f"{self.host}:{self.port}") + who,
              file=sys.stderr, flush=True)

    def _planted(self, what: str) -> None:
        print(f"[traceml] node {self.opts.node_rank}: "
              + PLANTED_WARNING.format(what=what, where=f"{self.host}:{self.port}"),
              file=sys.stderr, flush=True)

    def run(self) -> None:
        if self.opts.node_rank == 0:
            assert self.secret is not None
            values = {handover.RUN_DIR_KEY: str(self.run_dir.resolve()),
                      handover.SECRET_KEY: self.secret}
            planted = []
            self.outcome = handover.publish_unless_shared(
                self.host, self.port, self.secret, self.opts.nnodes, self.run_dir, values,
                self.until, self._warn, lambda: planted.append(True))
            if planted:
                self._planted("another secret was there before node 0's")
            if self.outcome == "store":
                handover.watch_secret(self.host, self.port, self.secret, self.until,
                                      lambda: self._planted("the run's secret was rewritten"))
            return
        path = RunFolder(self.run_dir).secret
        try:
            secret = handover.fetch_secret(f"{self.host}:{self.port}", self.until, path)
        except (ValueError, keys.SecretError):
            return
        if secret is None:
            return
        if handover.read_file_secret(path) == secret:  # a shared folder: prove it
            self.outcome, self.secret = "shared", secret
            try:
                folders.open_private(handover.joined_file(self.run_dir,
                                                          self.opts.node_rank)).close()
            except OSError:
                pass
            handover.prove_shared(self.host, self.port, secret, self.opts.node_rank,
                                  self.until)
            return
        self._warn()  # before the dashboard (which waits for the outcome) takes the screen
        self.outcome, self.secret = "store", secret
        value = handover.fetch(self.host, self.port, handover.RUN_DIR_KEY, self.until)
        if value is not None:
            self.values[handover.RUN_DIR_KEY] = value
        handover.watch_secret(self.host, self.port, secret, self.until, lambda: self._planted(
            "the run's secret changed after this node read it"))

    def wait_secret(self, timeout: float) -> str | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.is_alive() and self.outcome is None:
            time.sleep(0.1)
        return self.secret


def start_collector(run_dir: Path, name: str, opts: RunOptions, started_at: float,
                    secret: str, port: int) -> tuple[subprocess.Popen, dict[str, Any], str]:
    """The collector process, its collector.json, and the control key: a key the ranks
    never see (it goes to the collector's stdin, not into an environment, argument or
    file), which alone ends the record or adds a stack (requests.LAUNCHER_OPS)."""
    folder = RunFolder(run_dir)
    log = folders.open_private(folder.collector_log)
    control_key = secrets.token_hex(32)
    cmd = [sys.executable, "-m", "traceml_tui.collect.collector", "--run-dir", str(run_dir),
           "--run-name", name, "--world-size", str(opts.world_size),
           "--nnodes", str(opts.nnodes), "--nproc-per-node", str(opts.nproc_per_node),
           "--started-at", repr(started_at), "--parent-pid", str(os.getpid()),
           "--control-key-stdin"]
    if opts.multinode:  # other nodes' agents and viewers reach it on fixed ports
        cmd += ["--bind", "0.0.0.0", "--port", str(port), "--view-port", str(port + 1),
                "--advertise", opts.collector_addr or opts.master_addr]
    if opts.hang_after is not None:
        cmd += ["--hang-after", repr(opts.hang_after)]
    if opts.max_restarts:
        cmd += ["--max-restarts", str(opts.max_restarts)]
    if opts.min_nodes is not None:  # --nnodes MIN:MAX
        cmd += ["--min-world-size", str(opts.min_nodes * opts.nproc_per_node)]
    if opts.preflight:
        cmd += ["--preflight", str(folder.netcheck)]
    if opts.metrics_port is not None:
        cmd += ["--metrics-port", str(opts.metrics_port), "--metrics-host", opts.metrics_host]
    # The secret travels in the environment, never on a command line others can read.
    proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.PIPE,
                            start_new_session=True, env={**os.environ, env.SECRET: secret})
    log.close()
    assert proc.stdin is not None
    try:
        proc.stdin.write(f"{control_key}\n".encode())
        proc.stdin.close()
    except OSError:  # it died at once: said below, with its log
        pass
    info_path = folder.collector_json
    deadline = time.monotonic() + COLLECTOR_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if info_path.exists():
            info = json.loads(info_path.read_text())
            if info.get("metrics_error"):  # on the user's terminal, not only in its log
                print(f"[traceml] {clean_line(str(info['metrics_error']))}", file=sys.stderr)
            return proc, info, control_key
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    tail = folder.collector_log.read_text(errors="replace")[-2000:]
    raise LaunchError(f"the collector did not start; its log ({folder.collector_log}):\n"
                      f"{tail}")


class _Signals:
    """Remembers how the run was stopped and passes the signal on to torchrun.

    torchrun runs in a process group of its own (see `_torchrun_preexec`), so the
    terminal's signals reach only us and we pass each on, as the terminal would have:
    Ctrl-C (SIGINT), SIGTERM, and SIGHUP (the terminal or SSH connection closed), on
    which torchrun stops the workers. After a hangup there is no terminal to write to:
    `on_hangup` (set by the dashboard) closes the viewer, and our own output goes to
    the run folder."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.interrupted = False
        self.terminated = False
        self.hangup = False
        self.on_hangup: Any = None
        self.hangup_log: Path | None = None  # where our output goes after a hangup
        self._old: dict[int, Any] = {}

    def __enter__(self) -> _Signals:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    @property
    def exit_code(self) -> int | None:
        """The exit code the user's signal gives the run (128 + signal), if any."""
        if self.hangup:
            return 128 + signal.SIGHUP
        if self.terminated:
            return 128 + signal.SIGTERM
        return None

    def _handle(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT:
            self.interrupted = True
        elif signum == signal.SIGHUP:
            if not self.hangup:
                self.hangup = True
                _detach_from_terminal(self.hangup_log)
                if self.on_hangup is not None:
                    self.on_hangup()
        else:
            self.terminated = True
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.send_signal(signum)
            except ProcessLookupError:
                pass


def _detach_from_terminal(path: Path | None) -> None:
    """The terminal hung up: writing to it would fail (EIO) or stop us (SIGTTOU)."""
    try:
        sink = folders.open_private(path, "a") if path is not None else open(os.devnull, "w")
    except OSError:
        sink = open(os.devnull, "w")
    for fd in (1, 2):
        try:
            os.dup2(sink.fileno(), fd)
        except OSError:
            pass
    sink.close()


def _torchrun_preexec() -> None:
    """In torchrun's child before exec: a process group of its own, so job control
    aimed at the terminal's foreground (SIGTTOU when the dashboard of a background run
    touches the terminal, Ctrl-Z, the hangup) never stops or kills the training
    behind our back; and SIGTERM to torchrun if we die without passing a signal on
    (SIGKILL, the OOM killer), so no rank outlives the launcher."""
    os.setpgid(0, 0)
    try:
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the process group still holds
        pass


def _finish(control: str, request: Finish, collector: subprocess.Popen,
            secret: str, control_key: str) -> EndReply | None:
    """Ask the collector for the final summary; None if it is dead, does not answer, or
    answers with something that is not an end-of-run reply."""
    import zmq

    if collector.poll() is not None:
        return None
    ctx: zmq.Context = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    keys.secure_client(sock, keys.derive(secret))
    sock.connect(control)
    try:
        sock.send(encode_control(replace(request, key=control_key)))
        deadline = time.monotonic() + FINISH_TIMEOUT_S
        while time.monotonic() < deadline:
            if sock.poll(100):
                try:
                    return ending.from_wire(sock.recv_json())
                except ValueError:  # not JSON
                    return None
            if collector.poll() is not None:
                return None
        return None
    finally:
        sock.close()


def _fallback_summary(run_dir: Path, request: Finish) -> EndReply:
    """The collector did not answer: promote its last snapshot (read through the summary
    model), marked incomplete."""
    try:
        snap, _ = read_summary(RunFolder(run_dir).live)  # through the pinned folder
    except model.NotASummary as exc:
        code, _ = job_exit_code(request.torchrun_exit, request.interrupted, [])
        return ending.no_record(
            code if request.exit_code is None else request.exit_code,
            "The collector stopped before it saved any record of this run.\n",
            f"no summary: the collector died without a usable snapshot ({exc}; see "
            f"{RunFolder(run_dir).collector_log})")
    ranks = list(snap.ranks)
    failures = [(r.rank, r.exit_code) for r in ranks if r.exit_code]
    if request.root_cause is not None:  # as the collector reads torchrun's root cause
        rank, root_code = request.root_cause
        row = next((i for i, r in enumerate(ranks) if r.rank == rank), None)
        end = None if row is None else root_cause_end(root_code, ranks[row].exit_code,
                                                      ranks[row].error)
        if row is not None and end is not None:
            ranks[row] = replace(ranks[row], exit_code=end[0], error=end[1])
            failures = lead_with(failures, rank, root_code)
    code, failed_rank = job_exit_code(
        request.torchrun_exit, request.interrupted, failures)
    meta = summary.RunMeta(exit_code=code if request.exit_code is None else request.exit_code,
                           failed_rank=failed_rank)
    run = replace(snap.run, exit_code=meta.exit_code, failed_rank=failed_rank,
                  ended_at=summary.iso(request.ended_at), command=list(request.command))
    doc = replace(snap, complete=False, run=run, ranks=ranks,  # the failure leads, as
                  failure=summary.rank_failure(ranks, meta))  # the collector's record
    return ending.summary_reply(run_dir, doc, lambda: summary.write_summary(run_dir, doc))


def _signal_ranks(proc: subprocess.Popen, sig: int) -> None:
    """Signal every process torchrun started (the ranks and their DataLoader workers)."""
    import psutil

    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        return
    for child in children:
        try:
            child.send_signal(sig)
        except psutil.Error:
            pass


def _wait(proc: subprocess.Popen, signals: _Signals, progress: Progress | None) -> int:
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
            _signal_ranks(proc, signal.SIGTERM)
        if (signals.terminated or signals.hangup) and term_deadline is None:
            term_deadline = time.monotonic() + TERM_GRACE_S
        if term_deadline is not None and time.monotonic() > term_deadline:
            # As torchrun itself would, later: nothing of the job may outlive us.
            _signal_ranks(proc, signal.SIGKILL)
            proc.kill()
            term_deadline = float("inf")


@dataclass
class _Node:
    """What this node of the run talks to: its own collector (node 0), or node 0's."""

    ingest: str  # where this node's agents send
    view: str  # where this node's dashboard reads
    secret: str | None  # None: another node waiting for node 0's, through torchrun's store
    collector: subprocess.Popen | None = None  # node 0 only
    control: str | None = None  # node 0 only
    control_key: str | None = None  # node 0 only: what lets us finish (start_collector)
    handover: _Handover | None = None  # multi-node: what goes through torchrun's store
    relay: RelayProcess | None = None  # another node: its ranks reach node 0 through it
    stacks: NativeStackWatcher | None = None  # node 0: py-spy dumps of its stuck ranks
    node_stacks: NodeStackServer | None = None  # another node: the same, asked by its relay


def _finalize(node: _Node, run_dir: Path, opts: RunOptions, rc: int, signals: _Signals,
              root_cause: tuple[int, int] | None = None) -> EndReply:
    extra: dict[str, Any] = {"run_dir": str(run_dir), "logs": str(RunFolder(run_dir).logs),
                             "torchrun_exit_code": rc}
    if node.stacks is not None and node.stacks.refused:  # forged pids (native_stacks.py)
        extra["native_stack_refused"] = node.stacks.refused
    request = Finish(torchrun_exit=rc, interrupted=signals.interrupted, root_cause=root_cause,
                     command=list(opts.command), ended_at=time.time(), extra=extra,
                     exit_code=signals.exit_code)
    if node.collector is None:
        relay_failed = None
        if node.relay is not None:  # the ranks are gone: their last messages go out now
            relay_failed = node.relay.failure()
            node.relay.stop()
        done = _node_done(opts, run_dir, request, node.handover)
        if relay_failed:  # said again at the end, beside this node's exit code
            done.text += f"node {opts.node_rank}: {relay_failed}\n"
        return done
    assert node.control is not None and node.secret is not None and node.control_key
    reply = _finish(node.control, request, node.collector, node.secret, node.control_key)
    if reply is None:
        reply = _fallback_summary(run_dir, request)
        code = node.collector.poll()
        why = ("the collector did not answer" if code is None
               else f"the collector died (exit code {code})")
        reply.incomplete = (f"the record is INCOMPLETE: {why}; the summary was built from "
                               f"its last snapshot (see {RunFolder(run_dir).collector_log})")
    return reply


def _node_done(opts: RunOptions, run_dir: Path, request: Finish,
               handed: _Handover | None) -> EndReply:
    """A node other than 0 writes no summary: node 0's collector has all ranks. It ends
    with its own job's exit code, as torchrun on that node would, and says where node 0
    keeps the summary (its folder, as node 0 told through torchrun's store)."""
    root = request.root_cause
    failures = [] if root is None else lead_with([], *root)
    code, failed = job_exit_code(request.torchrun_exit, request.interrupted, failures)
    code = code if request.exit_code is None else request.exit_code
    failed_text = "" if failed is None else f", rank {failed} failed"
    node0_dir = None if handed is None else handed.values.get(handover.RUN_DIR_KEY)
    node0_dir = node0_dir and clean_line(node0_dir)  # the store's word: text only
    if getattr(handed, "outcome", None) == "shared":
        where = f"to {RunFolder(run_dir).summary_json} (the shared run folder)"
    elif node0_dir:
        where = f"to {RunFolder(Path(node0_dir[:4096])).summary_json} on that host"
    else:
        where = f"to {vocab.SUMMARY_JSON} in its run folder ({run_dir.name} under its --out)"
    text = (f"node {opts.node_rank}: its ranks ended with exit code {code}{failed_text}.\n"
            f"The job's summary is written by node 0 ({opts.master_addr}) {where}.\n")
    return ending.node_reply(code, text, failed)


def _with_dashboard(node: _Node, run_dir: Path, signals: _Signals,
                    finish: Any, progress: Progress) -> EndReply:
    """The dashboard in the foreground; the job is watched from a thread. Closing (or
    crashing) the viewer leaves the job running: we then go on like --headless."""
    import threading

    from traceml_tui.view.client import ViewClient
    from traceml_tui.view.dashboard import DashboardApp

    from . import terminal

    outcome: dict[str, Any] = {}

    def stop_job() -> None:
        signals.interrupted = True
        if signals.proc is not None and signals.proc.poll() is None:
            signals.proc.send_signal(signal.SIGINT)

    app = DashboardApp(ViewClient(node.view, secret=node.secret), run_dir, stop_job=stop_job)

    def close_viewer() -> None:  # from the SIGHUP handler (the UI thread may be blocked)
        app.terminal_lost()

    def terminal_gone() -> None:  # from the watchdog: no hangup came; the job goes on
        _detach_from_terminal(signals.hangup_log)
        app.terminal_lost()

    signals.on_hangup = close_viewer
    terminal.exit_with_terminal(on_lost=terminal_gone, default_hangup=False)

    def watcher() -> None:
        try:
            outcome["reply"] = finish()
        except Exception as exc:  # reported after the viewer closes
            outcome["error"] = exc
            return
        reply = outcome["reply"]
        try:
            app.call_from_thread(app.run_ended, reply.exit_code, reply.path)
        except Exception:
            pass  # the viewer is already gone

    thread = threading.Thread(target=watcher, name="traceml-job", daemon=True)
    thread.start()
    try:
        app.run()
    except Exception as exc:
        print(f"[traceml] the dashboard failed ({exc!r}); the job goes on", file=sys.stderr)
    signals.on_hangup = None
    if thread.is_alive() and not signals.hangup:
        print(f"[traceml] viewer closed; the job goes on. Re-attach: traceml watch {run_dir}"
              f"   Ctrl-C stops the job.", file=sys.stderr, flush=True)
    while thread.is_alive():
        progress.poll()
        thread.join(0.5)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["reply"]


def _connect(opts: RunOptions, run_dir: Path, name: str, started_at: float, port: int
             ) -> _Node:
    """Node 0 starts the collector; the others use node 0's, on the ports after torchrun's."""
    secret = run_secret(opts, run_dir)
    cport = opts.collector_port or port + 1
    if opts.node_rank == 0:
        assert secret is not None
        collector, info, key = start_collector(run_dir, name, opts, started_at, secret, cport)
        return _Node(info["ingest"], info["view"], secret, collector, info["control"], key)
    host = opts.collector_addr or opts.master_addr
    node = _Node(f"tcp://{host}:{cport}", f"tcp://{host}:{cport + 1}", secret)
    if opts.relay:
        from traceml_tui.collect.relay import RelayProcess

        node.relay = RelayProcess(node.ingest, opts.node_rank, secret,
                                  None if secret else _secret_store(opts, port),
                                  opts.folder(run_dir).relay_log,
                                  None if secret else RunFolder(run_dir).secret,
                                  say=_relay_sayer(opts.node_rank),
                                  unix_path=opts.folder(run_dir).relay_socket)
        _say_relay_failure(node.relay, opts.node_rank)
    return node


def _relay_sayer(node_rank: int) -> Callable[[str], None]:
    """The relay's news (strangers at its port, no rank in sight, node 0 unreachable:
    relay_watch.py) on this node's terminal, as its failure is."""

    def say(line: str) -> None:
        print(f"[traceml] node {node_rank}: {line}", file=sys.stderr, flush=True)

    return say


def _say_relay_failure(relay: RelayProcess, node_rank: int) -> None:
    """A relay that cannot start (its port, node 0 unreachable, no secret) or dies is
    said on this node's terminal at once: node 0 will not see this node's ranks."""

    def watch() -> None:
        relay.proc.wait()
        line = relay.failure()
        if line:
            print(f"[traceml] node {node_rank}: {line}", file=sys.stderr, flush=True)

    threading.Thread(target=watch, name="traceml-relay-watch", daemon=True).start()


def _start_handover(opts: RunOptions, node: _Node, run_dir: Path, port: int,
                    torchrun: subprocess.Popen) -> None:
    """Multi-node without $TRACEML_SECRET: see `_Handover` and agent/handover.py. With
    it, torchrun's store carries nothing of traceml's."""
    if not opts.multinode or os.environ.get(env.SECRET):
        return
    until = lambda: torchrun.poll() is not None  # noqa: E731 - the store ends with it
    node.handover = _Handover(opts, port, until, run_dir, node.secret)


def _preflight(opts: RunOptions, run_dir: Path, port: int) -> None:
    """`traceml netcheck` on the same nodes, in the run's folder, before training: a
    missing node stops here (the training would wait for it), a slow one is said and the
    run goes on; the collector puts the result in the summary."""
    from . import netcheck

    print("[traceml] preflight: checking the network between the nodes first "
          "(traceml netcheck)", file=sys.stderr, flush=True)
    status, doc = netcheck.check(opts, run_dir, port)
    if doc is not None:
        print(netcheck.render(doc, RunFolder(run_dir).netcheck), file=sys.stderr,
              end="", flush=True)
    if status == 3:
        raise LaunchError("preflight: not every node or rank came up; training not started")


def run(opts: RunOptions) -> int:
    if not opts.script.is_file():
        raise LaunchError(f"script not found: {opts.script}")
    import zmq

    if not zmq.has("curve"):
        raise LaunchError("this pyzmq has no CURVE support (needed to protect the run's "
                          "traffic); reinstall pyzmq from its wheels")
    started_at = time.time()
    name, run_dir = prepare_run_dir(opts)
    port = master_port(opts)
    if opts.preflight:
        _preflight(opts, run_dir, port)
    node = _connect(opts, run_dir, name, started_at, port)
    folder = opts.folder(run_dir)
    logs = folder.rank_logs
    cmd = torchrun_command(opts, port, [
        # Every rank's stdout/stderr kept in the run folder; also shown when headless.
        "--log-dir", str(logs), "--tee" if opts.headless else "--redirects", "3",
        "-m", "traceml_agent.bootstrap", str(opts.script), *opts.script_args])
    child_env = dict(os.environ)
    child_env.update({env.ENDPOINT: node.relay.address if node.relay else node.ingest,
                      env.RUN_NAME: name,
                      env.RUN_DIR: str(run_dir.resolve())})
    if opts.nccl_debug:
        folders.make_private_dir(folder.nccl_logs)
        child_env.update(nccl_debug.environment(opts.nccl_debug, run_dir))
    if node.secret is not None:
        child_env[env.SECRET] = node.secret
    else:  # the agents read it from the shared folder or the store: nobody waits for it
        child_env.pop(env.SECRET, None)
        child_env[env.SECRET_STORE] = _secret_store(opts, port)
        print(f"[traceml] node {opts.node_rank}: the run's secret comes from the shared run "
              f"folder, else from node 0 through torchrun's store (docs/security.md); the "
              f"training does not wait for it", file=sys.stderr, flush=True)
    where = f", node {opts.node_rank} of {opts.nnodes}" if opts.multinode else ""
    print(f"[traceml] run {name}: {opts.world_size} rank(s){where}, folder {run_dir}",
          file=sys.stderr, flush=True)
    progress = Progress(run_dir)
    log = (None if opts.headless
           else folders.open_private(folder.torchrun_log))
    with _Signals() as signals:
        signals.hangup_log = folder.launcher_log
        # With the dashboard, torchrun's own output goes to a file, not over the screen.
        proc = subprocess.Popen(cmd, env=child_env, stdout=log,
                                stderr=log if log else subprocess.PIPE,
                                stdin=subprocess.DEVNULL if log else None,
                                preexec_fn=_torchrun_preexec)
        signals.proc = proc
        stderr_tail = Tee(proc.stderr) if log is None else None
        _start_handover(opts, node, run_dir, port, proc)
        stop_watching = threading.Event()
        if node.control is not None and node.secret is not None:  # node 0
            assert node.control_key is not None
            node.stacks = NativeStackWatcher(
                run_dir, 0, control_sender(node.control, node.secret, node.control_key),
                stop_watching, proc.pid)
            node.stacks.start()
        elif node.relay is not None:  # the collector asks through this node's relay
            node.node_stacks = NodeStackServer(node.relay.stacks_sock, opts.node_rank,
                                               stop_watching, proc.pid)
            node.node_stacks.start()

        torchrun_rc: list[int] = []

        def finish() -> EndReply:
            rc = _wait(proc, signals, progress if opts.headless else None)
            torchrun_rc.append(rc)
            if stderr_tail is not None:
                stderr_tail.join(5)
                report = "".join(stderr_tail.lines)
            else:
                report = read_tail(folder.torchrun_log)
            return _finalize(node, run_dir, opts, rc, signals,
                             parse_root_cause(report) if rc else None)

        if not opts.headless and node.secret is None and node.handover is not None:
            print(f"[traceml] node {opts.node_rank}: waiting for node 0's secret to show the "
                  f"dashboard (the training is not waiting)", file=sys.stderr, flush=True)
            node.secret = node.handover.wait_secret(handover.shared_wait_s() + SECRET_WAIT_S)
        if opts.headless:
            reply = finish()
        elif node.secret is None:
            print(f"[traceml] node {opts.node_rank}: no secret from node 0 after "
                  f"{handover.shared_wait_s() + SECRET_WAIT_S:.0f} s; no dashboard here "
                  f"(the job goes on)",
                  file=sys.stderr, flush=True)
            reply = finish()
        else:
            reply = _with_dashboard(node, run_dir, signals, finish, progress)
    stop_watching.set()
    if log is not None:
        log.close()
    if node.collector is not None:
        try:
            node.collector.wait(timeout=5)
        except subprocess.TimeoutExpired:
            node.collector.kill()
    print("\n" + reply.text, end="", flush=True)
    if reply.path:
        # Written through the folder checked at start: if OUT/NAME was swapped since, the
        # summary is where that folder is now, not at the path (another user's now).
        path, moved = folders.where_now(Path(reply.path))
        print(f"[traceml] summary: {clean_line(str(path))}"
              + (f" ({run_dir} was moved or replaced after the start: the path now leads "
                 f"elsewhere)" if moved else ""), file=sys.stderr, flush=True)
    elif not reply.node_done:
        print(f"[traceml] {reply.error or 'no summary written'}", file=sys.stderr,
              flush=True)
    if reply.incomplete:
        print(f"[traceml] {reply.incomplete}", file=sys.stderr, flush=True)
    let_handover_end(node.handover)
    return process_exit_code(reply.exit_code, torchrun_rc[0] if torchrun_rc else None)


# The longest a store call of the handover thread takes against a store that is gone.
HANDOVER_EXIT_WAIT_S = 4 * handover.CONNECT_TIMEOUT_S


def let_handover_end(handed: threading.Thread | None) -> None:
    """Wait for the store thread to leave its last store call before the interpreter
    exits. Its `until` holds once torchrun has ended, so it returns after its current
    call; but a daemon thread still inside torch's TCPStore client (node 0's store gone
    first: a refused connect is retried for ~12 s, more than its 5 s timeout) when the
    interpreter finalizes is stopped by pthread_exit inside C++, and the process aborts
    (SIGABRT, exit -6) after the job itself succeeded: seen on a loaded machine when
    node 1 ended after node 0. The reply is printed before this wait."""
    if handed is not None:
        handed.join(HANDOVER_EXIT_WAIT_S)
