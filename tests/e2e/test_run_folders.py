"""Run folders on a shared --out, probed as another local user would (runuser -u nobody):
a planted folder is refused, never adopted, and `traceml watch` attaches to nothing of
theirs. Skipped where there is no second user to be."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from jobs import EXAMPLES

pytestmark = pytest.mark.skipif(
    not hasattr(os, "getuid") or os.getuid() != 0 or shutil.which("runuser") is None,
    reason="needs root and runuser to act as a second user (nobody)")

PLANTED_SECRET = "ab" * 32


def as_nobody(script: str) -> None:
    subprocess.run(["runuser", "-u", "nobody", "--", "sh", "-ec", script], check=True)


@pytest.fixture
def shared_out():
    """A scratch folder every user may write (mode 1777, as /tmp or a cluster's scratch)."""
    base = Path(tempfile.mkdtemp(prefix="traceml-shared-", dir="/tmp"))
    base.chmod(0o1777)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def traceml(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRACEML_SECRET"}
    return subprocess.run([sys.executable, "-m", "traceml_tui", *args], capture_output=True,
                          text=True, timeout=120, env={**env, "OMP_NUM_THREADS": "1"})


def test_a_planted_run_folder_is_refused_not_adopted(shared_out: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim-notes.txt"
    victim.write_text("private\n")
    attacker = Path(tempfile.mkdtemp(prefix="attacker-", dir="/tmp"))
    attacker.chmod(0o777)
    planted = shared_out / "exp"
    as_nobody(f"mkdir -m 0777 {planted} && echo {PLANTED_SECRET} > {planted}/secret.key && "
              f"ln -s {victim} {planted}/collector.log && ln -s {attacker} {planted}/logs")
    proc = traceml("run", str(EXAMPLES / "ddp_toy.py"), "--nproc-per-node", "2", "--headless",
                   "--out", str(shared_out), "--run-name", "exp", "--", "--steps", "20")
    try:
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "belongs to user nobody" in lines[0], proc.stderr
        assert victim.read_text() == "private\n"  # nothing appended through the link
        assert list(attacker.iterdir()) == []  # no rank logs in their folder
    finally:
        shutil.rmtree(attacker, ignore_errors=True)


def test_a_world_writable_folder_of_ours_is_refused_too(shared_out: Path) -> None:
    """Ours but mode 0777: anyone could swap files in it while the run goes."""
    (shared_out / "open").mkdir(mode=0o777)
    (shared_out / "open").chmod(0o777)
    proc = traceml("run", str(EXAMPLES / "ddp_toy.py"), "--headless", "--out", str(shared_out),
                   "--run-name", "open", "--", "--steps", "5")
    assert proc.returncode == 2 and "can be written by other users" in proc.stderr


def test_a_new_run_folder_is_private(tmp_path: Path) -> None:
    out = tmp_path / "runs"
    proc = traceml("run", str(EXAMPLES / "ddp_toy.py"), "--headless", "--out", str(out),
                   "--run-name", "mine", "--", "--steps", "12")
    assert proc.returncode == 0, proc.stderr[-2000:]
    for path in (out / "mine", out / "mine" / "logs", out / "mine" / "steps"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    for name in ("collector.log", "secret.key", "final_summary.json", "collector.json",
                 "steps/steps.0.msgpack"):
        assert stat.S_IMODE((out / "mine" / name).stat().st_mode) == 0o600, name


def test_watch_never_attaches_to_another_users_live_run(shared_out: Path) -> None:
    planted = shared_out / "bait"
    info = json.dumps({"view": "tcp://127.0.0.1:9", "ingest": "tcp://127.0.0.1:9",
                       "control": "tcp://127.0.0.1:9", "pid": 1})
    as_nobody(f"mkdir -m 0755 {planted} && echo '{info}' > {planted}/collector.json && "
              f"echo {PLANTED_SECRET} > {planted}/secret.key")
    found = traceml("watch", "--out", str(shared_out))
    assert found.returncode == 2 and "no live run" in found.stderr, found.stderr
    named = traceml("watch", str(planted))
    assert named.returncode == 2 and "belongs to user nobody" in named.stderr, named.stderr
