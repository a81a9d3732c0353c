"""The quick loop is a folder (issue 43, item 4): every test that starts a real job lives in
tests/e2e/, so `pytest --ignore=tests/e2e` starts none, and `-m "not e2e"` leaves the same
tests. Read from the sources: a job is started through the support helpers (jobs.py's
`run_job`, `spawn_traceml`, `traceml("run", ...)`) or by torchrun itself; the e2e mark is
not written outside tests/e2e/ (conftest gives it there)."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
STARTS_A_JOB = re.compile(r"\b(run_job|spawn_traceml)\(|\btraceml\(\s*\"run\"|"
                          r"torch\.distributed\.run|\[\"torchrun\"|mark\.e2e")


def test_no_test_outside_e2e_starts_a_job():
    found = []
    for path in sorted(TESTS.rglob("test_*.py")):
        parts = path.relative_to(TESTS).parts
        if parts[0] in ("e2e", "gpu") or path == Path(__file__).resolve():
            continue  # the jobs' folders (gpu/: its own marker, `gpu`), and this file
        for no, line in enumerate(path.read_text("utf-8").splitlines(), 1):
            if STARTS_A_JOB.search(line) and not line.lstrip().startswith("#"):
                found.append(f"{path.relative_to(TESTS)}:{no}: {line.strip()}")
    assert found == [], "\n".join(found)
