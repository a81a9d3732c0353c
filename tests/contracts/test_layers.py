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

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[2]
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


def _layers() -> tuple[list[str], str]:
    """The layers contract's layers (as module names under the container) and container."""
    config = tomllib.loads(CONFIG.read_text())
    contract = next(c for c in config["tool"]["importlinter"]["contracts"]
                    if c["type"] == "layers")
    [container] = contract["containers"]
    names = [name.strip() for layer in contract["layers"] for name in layer.split("|")]
    return names, container


def test_every_module_is_in_a_layer() -> None:
    """A new module is covered by the folder it goes in, so a module outside every
    layer (a new flat file beside cli.py) fails here rather than escaping every rule."""
    names, container = _layers()
    top = ROOT / container
    outside = []
    for path in sorted(top.rglob("*.py")):
        parts = path.relative_to(top).with_suffix("").parts
        if parts in (("__init__",), ("__main__",)):
            continue
        if parts[0] not in names:
            outside.append("/".join(parts))
    assert not outside, f"modules in no layer of pyproject's contract: {outside}"


def test_every_package_is_installed() -> None:
    """pyproject names its packages one by one (the agent's folder is renamed on install),
    so a new folder must be listed there or a wheel would ship without it."""
    config = tomllib.loads(CONFIG.read_text())
    listed = set(config["tool"]["setuptools"]["packages"])
    on_disk = {".".join(p.parent.relative_to(ROOT).parts)
               for p in (ROOT / "traceml_tui").rglob("__init__.py")}
    assert on_disk <= listed, f"packages missing from pyproject: {sorted(on_disk - listed)}"


# The inner contracts' containers, and the folder each one's modules are in.
INNER = {"traceml_tui.judge": ROOT / "traceml_tui" / "judge", "traceml_agent": ROOT / "agent"}


@pytest.mark.parametrize("container", sorted(INNER))
def test_every_module_of_the_judge_and_the_agent_has_its_place(container: str) -> None:
    """Their inner order is written down (pyproject's contracts); a new module must take a
    place in it, not sit beside it unchecked."""
    config = tomllib.loads(CONFIG.read_text())
    [contract] = [c for c in config["tool"]["importlinter"]["contracts"]
                  if c["type"] == "layers" and c["containers"] == [container]]
    names = {name.strip() for layer in contract["layers"] for name in layer.split("|")}
    modules = {p.stem for p in INNER[container].glob("*.py") if p.stem != "__init__"}
    assert modules <= names, f"{container}: modules in no layer: {sorted(modules - names)}"


@pytest.mark.parametrize("planted, into, message", [
    # the view model imports the judge's state (as view_state.py once did)
    ("from traceml_tui.judge.state import RunState", "viewmodel.py",
     "traceml_tui.viewmodel -> traceml_tui.judge.state"),
    # the judgement reaches up into the collector
    ("from traceml_tui.collect.collector import Collector", "judge/cost.py",
     "traceml_tui.judge.cost -> traceml_tui.collect.collector"),
    # a sibling: the dashboard reads the judge directly
    ("from traceml_tui.judge import diagnosis", "view/dashboard/cells.py",
     "traceml_tui.view.dashboard.cells -> traceml_tui.judge.diagnosis"),
    # inside the judge: a rule reaches up into the state
    ("from traceml_tui.judge.state import RunState", "judge/diagnosis.py",
     "traceml_tui.judge.diagnosis -> traceml_tui.judge.state"),
])
def test_an_upward_import_is_caught(packages: Path, tmp_path: Path, planted: str, into: str,
                                    message: str) -> None:
    """The contracts are not vacuous: one planted import against the layers breaks them."""
    tool = shutil.which("lint-imports")
    if tool is None:
        pytest.skip("import-linter is not installed (pip install -e '.[test]')")
    leaky = tmp_path / "leaky"
    shutil.copytree(ROOT / "traceml_tui", leaky / "traceml_tui", symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    (leaky / "traceml_agent").symlink_to(ROOT / "agent")
    target = leaky / "traceml_tui" / into
    target.write_text(target.read_text() + f"\n{planted}  # noqa\n")
    done = _run([tool, "--config", str(CONFIG), "--no-cache"], leaky, 300)
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert message in out, out[-3000:]
