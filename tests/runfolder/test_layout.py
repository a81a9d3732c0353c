"""The run folder's layout is said once (traceml_tui/runfolder/layout.py): its paths are the
ones users and the docs know, and no other module of the product joins a run folder's
file names itself."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from traceml_agent import vocab
from traceml_tui.runfolder import layout
from traceml_tui.runfolder.layout import RunFolder

PACKAGE = Path(__file__).resolve().parents[2] / "traceml_tui"

# The names of a run folder's files, as vocab and layout.py write them.
NAME_CONSTANTS = {"SECRET_KEY", "SECRET_FILE", "COLLECTOR_JSON", "COLLECTOR_LOG",
                  "LAUNCHER_LOG", "RELAY_LOG", "LIVE_SNAPSHOT_JSON", "SUMMARY_JSON",
                  "SUMMARY_TXT", "NETCHECK_JSON", "LOGS_DIR", "STEP_LOG_DIR", "TRACES_DIR",
                  "TORCHRUN_LOG", "NCCL_DIR", "SCREENSHOTS_DIR"}
NAMES = {getattr(vocab, n, None) for n in NAME_CONSTANTS} | {
    getattr(layout, n, None) for n in NAME_CONSTANTS}
NAMES.discard(None)


def test_paths_are_the_documented_ones():
    """README, docs/slurm.md, docs/network.md and docs/security.md name these paths."""
    one = RunFolder(Path("run"))
    assert {k: str(v) for k, v in {
        "secret": one.secret, "collector": one.collector_json, "log": one.collector_log,
        "live": one.live, "kept": one.kept_live(2), "json": one.summary_json,
        "txt": one.summary_txt, "netcheck": one.netcheck, "logs": one.rank_logs,
        "nccl": one.nccl_logs, "steps": one.step_log, "traces": one.traces,
        "report": one.trace_report(3, ".json"), "torchrun": one.torchrun_log,
        "launcher": one.launcher_log, "relay": one.relay_log, "shots": one.screenshots,
    }.items()} == {
        "secret": "run/secret.key", "collector": "run/collector.json",
        "log": "run/collector.log", "live": "run/live_snapshot.json",
        "kept": "run/live_snapshot.before-restart-2.json", "json": "run/final_summary.json",
        "txt": "run/final_summary.txt", "netcheck": "run/netcheck.json", "logs": "run/logs",
        "nccl": "run/logs/nccl", "steps": "run/steps", "traces": "run/traces",
        "report": "run/traces/capture3.json", "torchrun": "run/torchrun.log",
        "launcher": "run/launcher.log", "relay": "run/relay.log", "shots": "run/snapshots",
    }
    # A node of a multi-node run writes its own logs beside the others' (a shared folder);
    # the job's files stay one per run.
    node = RunFolder(Path("run"), node=1)
    assert str(node.rank_logs) == "run/logs/node1"
    assert (str(node.torchrun_log), str(node.launcher_log), str(node.relay_log)) == (
        "run/torchrun-node1.log", "run/launcher-node1.log", "run/relay-node1.log")
    assert str(node.relay_socket) == "run/relay-node1.sock"  # in the 0700 folder
    assert node.summary_json == one.summary_json and node.nccl_logs == one.nccl_logs


def _joins_a_name(node: ast.AST) -> bool:
    """`x / NAME`, `x / mod.NAME` or `x / "name"` where NAME is a run folder's file."""
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)):
        return False
    right = node.right
    if isinstance(right, ast.Name | ast.Attribute):
        return (right.id if isinstance(right, ast.Name) else right.attr) in NAME_CONSTANTS
    if isinstance(right, ast.Constant) and isinstance(right.value, str):
        return right.value in NAMES
    return isinstance(right, ast.JoinedStr) and any(  # f"live_snapshot.before-...{n}.json"
        isinstance(v, ast.Constant) and any(str(v.value).startswith(Path(n).stem + ".")
                                            for n in NAMES if "." in n)
        for v in right.values)


def test_no_module_but_layout_joins_run_folder_names():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "layout.py" and path.parent.name == "runfolder":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if _joins_a_name(node):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not found, f"run folder paths built outside runfolder/layout.py: {found}"


def test_the_readme_layout_names_every_module():
    """README's Layout section is the map of the house: a new module is named there with
    its role (package __init__ files aside, but for the agent's, its explicit API)."""
    text = (PACKAGE.parent / "README.md").read_text()
    block = text.split("## Layout\n", 1)[1].split("```")[1]
    words = set(re.findall(r"[a-z_]+", block))
    modules = [p for root in ("traceml_tui", "agent")
               for p in sorted((PACKAGE.parent / root).rglob("*.py"))
               if p.stem != "__main__" and (p.stem != "__init__" or p.parent.name == "agent")]
    missing = [str(p.relative_to(PACKAGE.parent)) for p in modules if p.stem not in words]
    assert not missing, f"README's Layout does not name: {missing}"
