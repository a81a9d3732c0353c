"""Deep traces are bounded on disk and a full disk is said, never raised (issue 42, 7e:
103 MB in 16 s at 2 ranks, no bound; ENOSPC not handled)."""

from __future__ import annotations

import errno
import os
from collections import namedtuple
from pathlib import Path

import pytest

from traceml_tui.collect import deep_traces
from traceml_tui.collect.deep_traces import DeepTrace, DeepTraceBoard
from traceml_tui.runfolder.layout import RunFolder

ROLES = {0: "worst", 1: "median"}


def _fill(run_dir: Path, mb: int, name: str = "capture1-rank0.json") -> None:
    path = RunFolder(run_dir).traces / name
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(mb << 20)  # sparse: its size counts, no disk is used


def test_captures_stop_at_the_traces_budget(tmp_path: Path) -> None:
    board = DeepTraceBoard(tmp_path, budget_bytes=100 << 20)
    cap, error = board.start(ROLES, 5, now=0.0)
    assert cap is not None and error is None
    for rank in (0, 1):  # the capture ends (failed, nothing analysed)
        cap.states[rank] = "failed"
    _fill(tmp_path, 60)
    _fill(tmp_path, 50, ".capture2-rank1.json.tmp99/capture2-rank1.json")  # half-written
    cap, error = board.start(ROLES, 5, now=1.0)
    assert cap is None and error is not None
    assert error.startswith("deep traces are at their budget:") and "110 MB of 100 MB" in error
    assert "delete old captures" in error and "\n" not in error
    assert board.disk_refused == 1
    os.remove(RunFolder(tmp_path).traces / "capture1-rank0.json")  # the user deletes some
    cap, error = board.start(ROLES, 5, now=2.0)
    assert cap is not None, error


def test_the_budget_can_be_set_and_defaults_to_a_bound(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    assert DeepTraceBoard(tmp_path).budget_bytes == deep_traces.TRACES_BUDGET_BYTES
    monkeypatch.setenv("TRACEML_TRACES_BUDGET_MB", "5")
    assert DeepTraceBoard(tmp_path).budget_bytes == 5 << 20


def test_a_nearly_full_disk_refuses_a_capture_before_the_ranks_fill_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    VFS = namedtuple("VFS", "f_bavail f_frsize")
    monkeypatch.setattr(deep_traces.os, "statvfs", lambda _p: VFS(100, 4096))
    cap, error = DeepTraceBoard(tmp_path).start(ROLES, 5, now=0.0)
    assert cap is None and error is not None and error.startswith("the disk under")
    assert "0 MB free" in error


@pytest.mark.parametrize("code, said", [
    (errno.ENOSPC, "problem: the disk is full (no space left on device)"),
    (errno.EDQUOT, "problem: the disk is full"),
    (errno.EACCES, "problem: could not save the analysis:"),
])
def test_a_failed_save_of_the_analysis_is_said_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, said: str) -> None:
    def full(*_a: object, **_k: object) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(deep_traces.folders, "write_atomic", full)
    cap = DeepTrace(1, 5, (0,), 0.0, {0: "worst"}, states={0: "failed"},
                    errors={0: "could not write the trace: OSError(28, 'No space left')"})
    text, saved = DeepTraceBoard(tmp_path)._analyse(cap)
    assert saved is None and said in text
