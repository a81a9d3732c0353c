"""The suite's leak check (conftest.py) itself: a session whose tests leave processes
behind fails, naming each test and command line, and the processes are killed. (A clean
session passing untouched is every other run of the suite.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import psutil

# conftest.GRACE_VAR: not imported by name, since tests/gpu has a conftest module too and
# whichever pytest loaded last owns the name "conftest".
GRACE_VAR = "TRACEML_TEST_LEAK_GRACE_S"

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"

LEAKY = """
import subprocess
import sys

SLEEPER = [sys.executable, "-c", "import time; time.sleep(300)"]

def test_clean():
    subprocess.run(["true"], check=True)

def test_leaves_an_orphan():
    # a grandchild in a session of its own whose parent is gone: reparented to init
    subprocess.run(["setsid", "-f", *SLEEPER, "orphan-{tag}"], check=True)

def test_leaves_a_child():
    test_leaves_a_child.proc = subprocess.Popen([*SLEEPER, "child-{tag}"])
"""


def _session(tmp_path: Path, tests: str) -> subprocess.CompletedProcess:
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "test_it.py").write_text(tests)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "test_it.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={**os.environ, GRACE_VAR: "1"})


def _alive(tag: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmdline = proc.info["cmdline"] or []
        if any(tag in arg for arg in cmdline) and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(proc)
    return found


def test_a_session_that_leaks_fails_naming_the_tests_and_kills_what_they_left(tmp_path):
    tag = uuid.uuid4().hex
    try:
        done = _session(tmp_path, LEAKY.format(tag=tag))
        assert done.returncode == 1, done.stdout
        assert "3 passed" in done.stdout  # the tests themselves passed: the leak fails it
        assert "2 process(es) left running by tests (killed)" in done.stdout
        assert "test_it.py::test_leaves_an_orphan: pid" in done.stdout
        assert f"time.sleep(300) orphan-{tag}" in done.stdout
        assert "test_it.py::test_leaves_a_child: pid" in done.stdout
        assert not _alive(tag)
    finally:
        for proc in _alive(tag):
            proc.kill()

