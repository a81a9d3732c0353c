"""Adding a phase is one row of vocab.PHASE_TABLE (plus the hook that times it).

A scratch copy of the repository gets a "checkpoint" row and nothing else; the dashboard,
diagnosis and hang tests then run against that copy (its import paths are checked), and
the dashboard shows the new column.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from traceml_agent import vocab

ROOT = Path(__file__).resolve().parents[2]
ROW = '    Phase("checkpoint", "ckpt", OTHER_WORK),\n'

# Run inside the scratch copy: what a user sees and where the code came from.
CHECK = r'''
import asyncio, sys
import traceml_agent, traceml_tui
from traceml_agent import recorder, vocab
from traceml_tui.judge.hang import PHASE_ORDER
from traceml_tui.view.dashboard import DashboardApp
from traceml_tui.view.dashboard.heat_table import HeatTable
from traceml_tui.viewmodel import OWN_COLUMNS, VIEW_PHASES
from traceml_tui.collect.canned import StaticSource, make_state

print("agent", traceml_agent.__file__)
print("tui", traceml_tui.__file__)
print("measured", ",".join(recorder.MEASURED), "optimizer", recorder.OPTIMIZER)
print("order", PHASE_ORDER["checkpoint"], "own", "checkpoint" in
      [VIEW_PHASES[i] for i in OWN_COLUMNS])

# Its hook, as traceml_agent.phase("checkpoint") would time it: a standard slot, not custom.
from collections import deque
out = deque()
rec = recorder.Recorder(out)
slot = rec.phase_index("checkpoint")
rec.close_step()
rec.begin(slot); rec.end(); rec.close_step()
print("timed", slot, out[-1][3][slot] is not None, len(rec.names))

async def header():
    app = DashboardApp(StaticSource(make_state(world_size=8, steps=12)), refresh_s=0.05)
    async with app.run_test(size=(160, 40)) as pilot:
        table = app.query_one(HeatTable)
        for _ in range(200):
            if app.state is not None and table.lines:
                break
            await pilot.pause(0.05)
        return table.render_line(0).text

print("header", asyncio.run(header()))
'''


def scratch_copy(dest: Path) -> Path:
    for part in ("agent", "traceml_tui", "tests", "docs/spec"):  # spec: the summary's schema
        shutil.copytree(ROOT / part, dest / part,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "__snapshots__"))
    shutil.copy(ROOT / "pyproject.toml", dest)
    # The installed package maps traceml_agent to /work's agent/: point it at the copy's.
    (dest / "traceml_agent").symlink_to(dest / "agent", target_is_directory=True)
    return dest


def add_row(vocab_py: Path) -> None:
    """The one edit: a row before the residual (the table's last row)."""
    text = vocab_py.read_text()
    at = text.index("    Phase(WAIT,")
    vocab_py.write_text(text[:at] + ROW + text[at:])


def test_a_new_phase_is_one_table_row(tmp_path):
    copy = scratch_copy(tmp_path / "repo")
    add_row(copy / "agent" / "vocab.py")
    support = copy / "tests" / "support"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(copy), str(support)]),
           "PYTHONDONTWRITEBYTECODE": "1"}

    check = subprocess.run([sys.executable, "-c", CHECK], cwd=copy, env=env,
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stderr
    out = dict(line.split(" ", 1) for line in check.stdout.splitlines() if " " in line)
    # The copy, not this checkout, was imported.
    assert out["agent"].startswith(str(copy)), out
    assert out["tui"].startswith(str(copy)), out
    # Derived from the row: the recorder times it, the hang orders it, it is own work.
    assert out["measured"].split()[0].split(",")[-1] == "checkpoint", out
    assert out["order"] == "7 own True", out
    assert out["timed"] == "6 True 7", out
    # The heat table's header has the new column, before "wait".
    header = out["header"].split()
    assert header.index("ckpt") == header.index("wait") - 1, header

    # The snapshot tests (SVG screenshots) live in test_snapshots.py: not run here, a new
    # column changes every screenshot by design.
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
         "tests/view/test_dashboard.py", "tests/judge/test_diagnosis.py",
         "tests/judge/test_hang.py"],
        cwd=copy, env=env, capture_output=True, text=True, timeout=300)
    assert tests.returncode == 0, tests.stdout[-4000:] + tests.stderr[-2000:]
    assert " passed" in tests.stdout and "failed" not in tests.stdout, tests.stdout[-2000:]


def test_the_table_keeps_todays_phases_and_wire_order():
    """The wire format and final_summary.json name phases in this order (docs/spec/)."""
    assert vocab.PHASES == ("dataloader", "h2d", "forward", "backward", "sync", "optimizer",
                            "wait")
    assert vocab.MEASURED_PHASES == vocab.PHASES[:-1]
    assert vocab.LOCAL_PHASES == ("dataloader", "h2d", "forward", "backward", "optimizer")
    assert vocab.WAITING_PHASES == ("sync", "wait")
    assert all(0 < len(p.short) < 8 for p in vocab.PHASE_TABLE)  # fits a heat-table cell
    assert len({p.name for p in vocab.PHASE_TABLE}) == len(vocab.PHASE_TABLE)
