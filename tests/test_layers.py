"""The layers cannot leak and the core's types hold: import-linter's contracts and mypy,
both configured in pyproject.toml, run here so CI fails on a violation.

Both tools see the packages under their import names (the agent lives in agent/ but is
imported as traceml_agent), through a folder of symbolic links.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "pyproject.toml"


@pytest.fixture(scope="module")
def packages(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("packages")
    (where / "traceml_agent").symlink_to(ROOT / "agent")
    (where / "traceml_tui").symlink_to(ROOT / "traceml_tui")
    return where


def _run(cmd: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_import_contracts_hold(packages: Path) -> None:
    tool = shutil.which("lint-imports")
    if tool is None:
        pytest.skip("import-linter is not installed (pip install -e '.[test]')")
    done = _run([tool, "--config", str(CONFIG), "--no-cache"], packages, 300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "0 broken" in out


def test_the_core_type_checks(packages: Path, tmp_path: Path) -> None:
    pytest.importorskip("mypy", reason="mypy is not installed (pip install -e '.[test]')")
    done = _run([sys.executable, "-m", "mypy", "--config-file", str(CONFIG),
                 "--cache-dir", str(tmp_path / "cache"), "-p", "traceml_agent",
                 "-p", "traceml_tui"], packages, 600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "Success" in done.stdout


def test_a_leak_is_caught(packages: Path, tmp_path: Path) -> None:
    """The contracts are not vacuous: a view-model module that imports the collector's
    state (as view_state.py once did) breaks them."""
    tool = shutil.which("lint-imports")
    if tool is None:
        pytest.skip("import-linter is not installed (pip install -e '.[test]')")
    leaky = tmp_path / "leaky"
    shutil.copytree(ROOT / "traceml_tui", leaky / "traceml_tui", symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    (leaky / "traceml_agent").symlink_to(ROOT / "agent")
    view = leaky / "traceml_tui" / "view_state.py"
    view.write_text(view.read_text() + "\nfrom .state import Snapshot  # noqa\n")
    done = _run([tool, "--config", str(CONFIG), "--no-cache"], leaky, 300)
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert "traceml_tui.view_state is not allowed to import traceml_tui.state" in out
