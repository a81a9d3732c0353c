"""Every test file the docs and comments name exists (issue 43, item 4): tests/ mirrors the
code's folders, and a path written before a move (tests/ then test_x.py) would send a reader to
nothing. Markdown anywhere in the repository, and the comments and docstrings of the
product, the benchmarks and the tests themselves; a glob (`tests/collect/test_metrics*.py`)
must match at least one file."""

from __future__ import annotations

import re
from pathlib import Path

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
