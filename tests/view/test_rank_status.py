"""A rank's state in the dashboard: table of (what the collector knows) -> state."""

from __future__ import annotations

import dataclasses

import pytest

from traceml_tui.collect.view_build import rank_status
from traceml_tui.judge.snapshot import RankSnapshot
from traceml_tui.viewmodel import DONE, FAILED, OK, STALE, STOPPED, WAITING

BASE = RankSnapshot(rank=0, local_rank=0, node=0, host="h", pid=1, reported=True, steps=50,
                    window_steps=50, step_ms=None, phase_ms={}, live_step_ms=20.0,
                    live_phase_ms={}, recent_step_ms=(), sys=None, idle_s=0.1,
                    since_step_s=0.02, exit_code=None, error=None, finished=False,
                    dropped=0, device="cpu")

CASES = [
    ("stepping", {}, OK),
    ("never reported", {"reported": False}, WAITING),
    ("silent 10 s", {"idle_s": 10.0}, STALE),
    ("no step for 10 s", {"since_step_s": 10.0}, STALE),
    ("ended cleanly", {"finished": True, "exit_code": 0}, DONE),
    ("raised", {"finished": True, "exit_code": 1}, FAILED),
    ("Ctrl-C (KeyboardInterrupt)", {"finished": True, "exit_code": 130}, STOPPED),
    ("SIGTERM", {"finished": True, "exit_code": -15}, STOPPED),
    ("terminal closed", {"finished": True, "exit_code": 129}, STOPPED),
    ("killed outright (OOM)", {"finished": True, "exit_code": -9}, FAILED),
]


@pytest.mark.parametrize("name, change, expected", CASES, ids=[c[0] for c in CASES])
def test_rank_status(name: str, change: dict, expected: str) -> None:
    assert rank_status(dataclasses.replace(BASE, **change)) == expected
