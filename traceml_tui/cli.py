"""The `traceml` command: run, watch, compare, export, netcheck, collector
(docs/spec/CLI.md).

User mistakes end in one clear line and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from . import __version__
from .launch import nccl_debug, slurm, terminal
from .launch.slurm import SlurmError
from .runfolder.exit_codes import INTERRUPTED_EXIT

RUN_USAGE = "traceml run SCRIPT [options] [-- SCRIPT ARGS...]"


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more, got {value}")
    return value


def _nnodes(text: str) -> tuple[int, int]:
    """torchrun's --nnodes: N, or MIN:MAX (elastic membership); (min, max)."""
    low, sep, high = text.partition(":")
    first = _positive(low)
    last = _positive(high) if sep else first
    if last < first:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX with MIN <= MAX, got {text!r}")
    return first, last


def _port(text: str) -> int:
    value = _non_negative(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port 1-65535, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="traceml", description="Live diagnosis of PyTorch distributed training.")
    parser.add_argument("--version", action="version", version=f"traceml {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    run = sub.add_parser("run", usage=RUN_USAGE, help="run a training script under torchrun",
                         description="Run SCRIPT under torchrun with the agent in every rank.")
    run.add_argument("script", metavar="SCRIPT", help="the training script (unmodified)")
    # Unset node flags (None) are taken from Slurm under srun, else torchrun's defaults.
    _node_arguments(run)
    run.add_argument("--collector-addr", default=None, metavar="HOST",
                     help="multi-node: where the other nodes reach node 0's collector "
                          "(default: the master address)")
    run.add_argument("--collector-port", type=_port, default=None, metavar="P",
                     help="multi-node: the collector's port on node 0 (default: master port "
                          "+ 1); viewers use the next port")
    run.add_argument("--no-relay", action="store_true",
                     help="multi-node: this node's ranks send straight to node 0's collector "
                          "instead of through a relay on this node (one per node by default)")
    run.add_argument("--run-name", default=None, metavar="NAME",
                     help="names the run (default: script name and time)")
    run.add_argument("--out", type=Path, default=Path("traceml_runs"), metavar="DIR",
                     help="base folder for run folders (default traceml_runs)")
    run.add_argument("--hang-after", type=float, default=None, metavar="SECONDS",
                     help="report HANG after this long without a step on any rank "
                          "(default: 20 median steps, at least 10 s)")
    run.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                     help="serve Prometheus metrics at http://HOST:PORT/metrics on node 0 "
                          "(docs/metrics.md)")
    run.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                     help="address the metrics bind (default 127.0.0.1; 0.0.0.0 for a "
                          "Prometheus on another host)")
    # torchrun's elastic options, passed on as given (docs/restarts.md).
    run.add_argument("--max-restarts", "--max_restarts", type=_non_negative, default=0,
                     metavar="N", help="torchrun restarts the whole group up to N times after "
                                       "a rank fails; the record keeps every attempt")
    run.add_argument("--rdzv-backend", "--rdzv_backend", default=None, metavar="NAME",
                     help="torchrun's rendezvous backend (e.g. c10d; default: torchrun's)")
    run.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default=None, metavar="HOST:PORT",
                     help="torchrun's rendezvous endpoint (with --rdzv-backend c10d)")
    run.add_argument("--rdzv-id", "--rdzv_id", default=None, metavar="ID",
                     help="torchrun's rendezvous id (the same on every node)")
    run.add_argument("--headless", action="store_true",
                     help="no dashboard: print progress and a text summary at the end")
    run.add_argument("--preflight", action="store_true",
                     help="run traceml netcheck on the same nodes before training; its result "
                          "goes into the summary and COMM-BOUND's evidence")
    run.add_argument("--nccl-debug", nargs="?", const="INFO", default=None,
                     type=str.upper, choices=nccl_debug.LEVELS, metavar="LEVEL",
                     help="NCCL and torch.distributed debug logs per rank in the run folder "
                          "(WARN, INFO (default), TRACE); a HANG then shows each rank's last "
                          "NCCL opCount")

    watch = sub.add_parser("watch", help="open the dashboard on a running job, or on the "
                           "record of one that is over",
                           description="Attach the dashboard to a run that is going: a run "
                           "folder, tcp://HOST:PORT (its collector's view address, e.g. "
                           "through an SSH tunnel), or by default the newest live run under "
                           "traceml_runs. Quitting never stops the job. A run folder whose "
                           "run has ended, crashed or lost its collector opens read-only on "
                           "its record, with a time cursor (docs/replay.md).")
    watch.add_argument("target", nargs="?", metavar="RUN_DIR | tcp://HOST:PORT")
    watch.add_argument("--out", type=Path, default=Path("traceml_runs"), metavar="DIR",
                       help="where to look for the newest live run (default traceml_runs)")
    watch.add_argument("--secret-file", type=Path, default=None, metavar="FILE",
                       help="the run's secret.key (default: $TRACEML_SECRET, else the one in "
                            "the run folder); needed for tcp://HOST:PORT")
    watch.add_argument("--web", nargs="?", type=int, const=8000, default=None, metavar="PORT",
                       help="serve the dashboard to a browser on PORT (default 8000) instead "
                            "of this terminal (needs textual-serve)")
    watch.add_argument("--web-host", default="127.0.0.1", metavar="HOST",
                       help="address the browser view binds (default 127.0.0.1: reach it "
                            "through an SSH tunnel); the page always needs the token in "
                            "the URL it prints")
    watch.add_argument("--web-viewers", type=int, default=4, metavar="N",
                       help="browser tabs (each one a viewer process) open at once "
                            "(default 4; more are refused)")

    cmp = sub.add_parser("compare", help="compare two runs' final_summary.json")
    cmp.add_argument("old", type=Path, metavar="OLD")
    cmp.add_argument("new", type=Path, metavar="NEW")
    cmp.add_argument("--json", action="store_true", help="print the comparison as JSON")

    exp = sub.add_parser("export", help="export a run's phase timeline for Perfetto",
                         description="Write the whole job's per-rank phase timeline as a "
                         "Chrome-trace JSON file that https://ui.perfetto.dev opens.")
    exp.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    exp.add_argument("--perfetto", type=Path, required=True, metavar="OUT.json",
                     help="where to write the trace")
    exp.add_argument("--last-steps", type=_positive, default=None, metavar="N",
                     help="only each rank's last N steps (long runs make big files)")

    rep = sub.add_parser("report", help="write a run's self-contained HTML report",
                         description="Write one HTML file (no server, no network, no script: "
                         "it opens from a mail attachment and prints) with the run's verdict, "
                         "cost, episodes, per-rank step time, phases, memory, collectives, "
                         "setup findings, hang stacks and configuration.")
    rep.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    rep.add_argument("-o", "--out", type=Path, default=None, metavar="OUT.html",
                     help="where to write it (default RUN_DIR/report.html)")

    net = sub.add_parser("netcheck", help="check the network between the job's nodes",
                         description="Run on every node with the launch flags of traceml run: "
                         "checks that every rank comes up, each node's interface, MTU and "
                         "InfiniBand ports, sweeps all_reduce, all_gather, reduce_scatter and "
                         "broadcast over sizes (algbw, busbw), times every pair of nodes "
                         "alone to name a slow node or link, and writes netcheck.json in the "
                         "run folder on node 0. Exit 0 healthy, 1 not, 3 ranks missing.")
    _node_arguments(net)
    net.add_argument("--run-name", default=None, metavar="NAME",
                     help="the run folder's name (default netcheck and the time); the same on "
                          "every node")
    net.add_argument("--out", type=Path, default=Path("traceml_runs"), metavar="DIR",
                     help="base folder for run folders (default traceml_runs)")
    net.add_argument("--timeout", type=float, default=120.0, metavar="SECONDS",
                     help="how long to wait for every rank to come up (default 120)")

    sub.add_parser("collector", help="run a collector by hand (see traceml collector -h)",
                   add_help=False)
    return parser


def _node_arguments(p: argparse.ArgumentParser) -> None:
    """The node layout flags `traceml run` and `traceml netcheck` share (torchrun's)."""
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=_positive, default=None,
                   metavar="N", help="processes on this node (default 1; under srun, the "
                                     "node's GPUs)")
    p.add_argument("--nnodes", type=_nnodes, default=None, metavar="N|MIN:MAX",
                   help="nodes in the job (default 1; under srun, the step's nodes); "
                        "traceml run takes MIN:MAX (torchrun's elastic membership)")
    p.add_argument("--node-rank", "--node_rank", type=_non_negative, default=None,
                   metavar="K", help="this node's index (default 0; under srun, SLURM_NODEID)")
    p.add_argument("--master-addr", "--master_addr", default=None, metavar="HOST",
                   help="node 0's address (default 127.0.0.1; under srun, the first host)")
    p.add_argument("--master-port", "--master_port", type=_port, default=None, metavar="P",
                   help="torchrun's port on node 0 (default: a free one outside the kernel's "
                        "ephemeral range on one node, 29500 on several)")


def _split_script_args(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def _cmd_run(parser: argparse.ArgumentParser, argv: list[str], full_argv: list[str]) -> int:
    from .launch.launcher import run
    from .launch.options import LaunchError, RunOptions

    ours, script_args = _split_script_args(argv)
    run_parser = parser._subparsers._group_actions[0].choices["run"]  # type: ignore[union-attr,index]
    args, unknown = run_parser.parse_known_args(ours[1:])
    if unknown:
        run_parser.error(f"unrecognized arguments: {' '.join(unknown)} (arguments for your "
                         f"script go after --, as in: traceml run {args.script} -- "
                         f"{' '.join(unknown)})")
    headless = args.headless or not terminal.owns_foreground()
    if not args.headless and headless and terminal.is_terminal(sys.stdout):
        print("[traceml] not the terminal's foreground job: no dashboard, progress lines "
              "instead (attach one with: traceml watch)", file=sys.stderr, flush=True)
    if args.hang_after is not None and args.hang_after <= 0:
        run_parser.error("--hang-after must be a positive number of seconds")
    if args.metrics_port is not None and not 1 <= args.metrics_port <= 65535:
        run_parser.error(f"--metrics-port {args.metrics_port} is not a TCP port")
    try:
        nodes = _node_flags(args, Path(args.script))
    except SlurmError as exc:
        print(f"traceml run: error: {exc}", file=sys.stderr)
        return 2
    if nodes["node_rank"] >= nodes["nnodes"]:
        run_parser.error(f"--node-rank {nodes['node_rank']} must be below --nnodes "
                         f"{nodes['nnodes']}")
    min_nodes = nodes.pop("min_nodes")
    opts = RunOptions(
        script=Path(args.script), script_args=script_args, out=args.out, headless=headless,
        max_restarts=args.max_restarts, min_nodes=min_nodes, rdzv_backend=args.rdzv_backend,
        rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id,
        command=["traceml", *full_argv], hang_after=args.hang_after,
        nccl_debug=args.nccl_debug, preflight=args.preflight,
        collector_addr=args.collector_addr, collector_port=args.collector_port,
        relay=not args.no_relay, metrics_port=args.metrics_port,
        metrics_host=args.metrics_host, **nodes)
    try:
        return run(opts)
    except LaunchError as exc:
        print(f"traceml run: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before the job started (e.g. waiting for node 0's secret)
        print("traceml run: interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT


def _node_flags(args: argparse.Namespace, script: Path) -> dict[str, Any]:
    """The node layout: flags the user gave, else Slurm's step (under srun), else one node."""
    step = slurm.from_env(os.environ)
    low, high = args.nnodes if args.nnodes is not None else (None, None)
    given = {"nproc_per_node": args.nproc_per_node, "nnodes": high,
             "node_rank": args.node_rank, "master_addr": args.master_addr,
             "master_port": args.master_port, "run_name": args.run_name}
    if step is not None:
        found = {"nproc_per_node": step.gpus_per_node, "nnodes": step.nnodes,
                 "node_rank": step.node_rank, "master_addr": step.master_addr,
                 "master_port": step.master_port,
                 "run_name": f"{script.stem}-slurm{step.job_id}"}
        given = {k: found[k] if v is None else v for k, v in given.items()}
    defaults = {"nproc_per_node": 1, "nnodes": 1, "node_rank": 0, "master_addr": "127.0.0.1"}
    chosen: dict[str, Any] = {k: defaults.get(k) if v is None else v for k, v in given.items()}
    return {**chosen, "min_nodes": low if low != high else None}


def _cmd_netcheck(args: argparse.Namespace) -> int:
    from .launch import netcheck
    from .launch.options import RunOptions

    if args.timeout <= 0:
        print("traceml netcheck: error: --timeout must be a positive number of seconds",
              file=sys.stderr)
        return 2
    try:
        nodes = _node_flags(args, Path("netcheck"))
    except SlurmError as exc:
        print(f"traceml netcheck: error: {exc}", file=sys.stderr)
        return 2
    if nodes["node_rank"] >= nodes["nnodes"]:
        print(f"traceml netcheck: error: --node-rank {nodes['node_rank']} must be below "
              f"--nnodes {nodes['nnodes']}", file=sys.stderr)
        return 2
    if nodes.pop("min_nodes") is not None:
        print("traceml netcheck: error: --nnodes MIN:MAX is for traceml run (netcheck needs "
              "every node)", file=sys.stderr)
        return 2
    opts = RunOptions(script=Path("netcheck"), out=args.out, headless=True,
                      command=["traceml", "netcheck"], **nodes)
    try:
        return netcheck.main(opts, args.timeout)
    except KeyboardInterrupt:
        print("traceml netcheck: interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT


def _cmd_watch(args: argparse.Namespace) -> int:
    from .view.client import RunIsOver, ViewClient, WatchTargetError, resolve_target

    try:
        address, run_dir, secret = resolve_target(args.target, args.out, args.secret_file)
    except RunIsOver as over:
        return _watch_record(args, over.run_dir)
    except WatchTargetError as exc:
        print(f"traceml watch: error: {exc}", file=sys.stderr)
        return 2
    if args.web is not None:
        return _serve_web(args, address, run_dir)
    web_viewer = bool(os.environ.get("TEXTUAL_DRIVER", "").endswith("web_driver:WebDriver"))
    if not web_viewer and not terminal.owns_foreground():
        print("traceml watch: error: the dashboard needs a terminal in the foreground "
              "(not a background job, not redirected)", file=sys.stderr)
        return 2
    from .view.dashboard import DashboardApp

    if not web_viewer:  # its terminal gone (hangup, EOF, EIO), the viewer goes too
        terminal.exit_with_terminal()
    DashboardApp(ViewClient(address, secret=secret), run_dir).run()
    return 0


def _watch_record(args: argparse.Namespace, run_dir: Path) -> int:
    """`traceml watch RUN_DIR` on a run that is over: the dashboard on its record."""
    from .collect.replay import Replay, ReplayError, open_record

    try:
        record = open_record(run_dir)
    except ReplayError as exc:
        print(f"traceml watch: error: {exc}", file=sys.stderr)
        return 2
    if args.web is not None:
        print("traceml watch: error: --web serves live runs only; open the record in a "
              f"terminal, or share it as a page: traceml report {run_dir}", file=sys.stderr)
        return 2
    if not terminal.owns_foreground():
        print("traceml watch: error: the dashboard needs a terminal in the foreground "
              "(not a background job, not redirected)", file=sys.stderr)
        return 2
    from .view.dashboard.replay_app import ReplayApp

    terminal.exit_with_terminal()
    ReplayApp(Replay(record), record.status, run_dir, record.summary).run()
    return 0


def _serve_web(args: argparse.Namespace, address: str, run_dir: Path | None) -> int:
    try:
        from .view import web
    except ImportError:
        print("traceml watch: error: --web needs textual-serve "
              "(pip install traceml-tui[web])", file=sys.stderr)
        return 2
    if not 1 <= args.web <= 65535:
        print(f"traceml watch: error: --web port {args.web} is not a TCP port", file=sys.stderr)
        return 2
    if not 1 <= args.web_viewers <= web.MAX_VIEWERS:
        print(f"traceml watch: error: --web-viewers must be 1 to {web.MAX_VIEWERS}",
              file=sys.stderr)
        return 2
    target = str(run_dir) if run_dir is not None else address
    try:
        # It prints the one URL that opens the page (with its token) once it is bound.
        web.serve(target, args.secret_file, args.web_host, args.web, "traceml",
                  args.web_viewers)
    except KeyboardInterrupt:
        pass
    except OSError as exc:
        print(f"traceml watch: error: cannot serve on {args.web_host}:{args.web}: {exc}",
              file=sys.stderr)
        return 2
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from .report.export import ExportError, export_perfetto

    try:
        counts = export_perfetto(args.run_dir, args.perfetto, args.last_steps)
    except ExportError as exc:
        print(f"traceml export: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.perfetto}: {counts['records']} step records of {counts['ranks']} rank(s); "
          f"open it in https://ui.perfetto.dev", file=sys.stderr)
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from .report.html_report import ReportError, write_report

    try:
        out, facts = write_report(args.run_dir, args.out)
    except ReportError as exc:
        print(f"traceml report: error: {exc}", file=sys.stderr)
        return 2
    missing = f"; missing: {len(facts['missing'])} part(s), named in it" if facts["missing"] else ""
    print(f"wrote {out}: {facts['records']} step records of {facts['ranks']} rank(s) from "
          f"{facts['source']}{missing}", file=sys.stderr)
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from .report.compare import CompareError, compare, load, render

    try:
        result = compare(load(args.old), load(args.new))
    except CompareError as exc:
        print(f"traceml compare: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_json(), indent=2) if args.json else render(result),
          end="" if not args.json else "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv[:1] == ["run"]:
        return _cmd_run(parser, argv, argv)
    if argv[:1] == ["collector"]:
        from .collect.collector import main as collector_main

        return collector_main(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "compare":
        return _cmd_compare(args)
    if args.command == "watch":
        return _cmd_watch(args)
    if args.command == "export":
        return _cmd_export(args)
    if args.command == "report":
        return _cmd_report(args)
    if args.command == "netcheck":
        return _cmd_netcheck(args)
    parser.print_help()
    return 2
