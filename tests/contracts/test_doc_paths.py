"""Every test file the docs and comments name exists (issue 43, item 4): tests/ mirrors the
code's folders, and a path written before a move (tests/ then test_x.py) would send a reader to
nothing. Markdown anywhere in the repository, and the comments and docstrings of the
product, the benchmarks and the tests themselves; a glob (`tests/collect/test_metrics*.py`)
must match at least one file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# A path under tests/ ending in .py: words, slashes and a glob's star (`<layer>` in a
# placeholder such as tests/<layer>/test_x.py is no path and does not match).
TEST_PATH = re.compile(r"(?<![\w/.])tests/[\w/*]+\.py\b")
SKIP = {".venv", ".git", "traceml_runs", "node_modules", "__pycache__"}


def _texts() -> list[Path]:
    out = [p for p in ROOT.rglob("*.md") if not SKIP & set(p.relative_to(ROOT).parts)]
    for folder in ("agent", "traceml_tui", "benchmarks", "tests", "examples", ".ci"):
        out += [p for p in (ROOT / folder).rglob("*") if p.is_file()
                and p.suffix in (".py", ".sh", "") and not SKIP & set(p.parts)]
    return sorted(set(out))


def test_the_scan_finds_the_paths_it_checks():
    named = {m.group(0) for p in _texts() for m in TEST_PATH.finditer(p.read_text("utf-8"))}
    assert "tests/contracts/test_layers.py" in named  # CONTRIBUTING and README name it


def test_every_tests_path_named_in_the_docs_and_comments_exists():
    missing = []
    for path in _texts():
        try:
            text = path.read_text("utf-8")
        except UnicodeDecodeError:
            continue
        for line_no, line in enumerate(text.splitlines(), 1):
            for match in TEST_PATH.finditer(line):
                named = match.group(0)
                if not any(ROOT.glob(named)):
                    missing.append(f"{path.relative_to(ROOT)}:{line_no}: {named}")
    assert missing == [], "\n".join(missing)


def test_every_test_module_imported_by_another_resolves_when_run_alone():
    """A test module that imports another's fixtures (`from test_state import steps`) must
    find it whichever file is run alone: in its own folder (pytest puts a test's folder
    on the path) or in a folder of pyproject's `pythonpath`. Found by a full run only,
    such an import fails for `pytest tests/judge/test_cpu_wait.py` (seen after the move)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    config = tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))
    on_path = [ROOT / p for p in config["tool"]["pytest"]["ini_options"]["pythonpath"]]
    imported = re.compile(r"^\s*(?:from|import) (test_\w+)", re.M)
    unresolved = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        for name in imported.findall(path.read_text("utf-8")):
            if not any((folder / f"{name}.py").is_file() for folder in (path.parent, *on_path)):
                unresolved.append(f"{path.relative_to(ROOT)} imports {name}")
    assert unresolved == [], "\n".join(unresolved)
