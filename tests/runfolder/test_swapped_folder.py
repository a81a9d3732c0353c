"""After a swap of a shared --out (OUT/NAME renamed away, a link to another user's folder
in its place), what traceml reads and reopens goes through the folder checked at start
(issue 42, 7f): the headless progress lines, the fallback summary, the step log at
rotation, and the summary path printed at the end says where the record is now."""

from __future__ import annotations

import os
from pathlib import Path

from test_summary_model import crashed_state, doc_of

from traceml_agent.protocol import PHASES, StepRecord
from traceml_tui.report import summary
from traceml_tui.runfolder import folders
from traceml_tui.runfolder.step_log import FILE_NAMES, StepLogWriter, read_steps


def _swap(run_dir: Path) -> tuple[Path, Path]:
    """Another user's move: the run folder renamed away, a link to theirs put in its place."""
    moved, attacker = run_dir.parent / "moved", run_dir.parent / "attacker"
    attacker.mkdir()
    run_dir.rename(moved)
    run_dir.symlink_to(attacker)
    return moved, attacker


def _pinned_run(tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    folders.make_private_dir(run_dir)
    folders.pin_dir(run_dir)
    return run_dir


def test_the_step_log_rotates_into_the_folder_checked_at_start(tmp_path: Path) -> None:
    run_dir = _pinned_run(tmp_path)
    log = StepLogWriter(run_dir / "steps", budget_bytes=8_000, flush_interval_s=0.0)
    records = [StepRecord(i, 1.0 + i, 10.0, tuple(1.0 for _ in PHASES)) for i in range(400)]
    log.append_records(0, tuple(PHASES), records[:10])
    log.flush()
    moved, attacker = _swap(run_dir)
    (attacker / "steps").mkdir()  # where a rotation by path would go
    for i in range(10, 400, 10):
        log.append_records(0, tuple(PHASES), records[i:i + 10])
        log.flush()
    log.close()
    assert log.rotations >= 2 and log.errors == 0
    assert list((attacker / "steps").iterdir()) == []
    assert sorted(p.name for p in (moved / "steps").iterdir()) == sorted(FILE_NAMES)
    assert [r.step for r in read_steps(moved / "steps")][-1] == 399


def test_headless_progress_reads_the_checked_folder_not_the_swapped_path(
        tmp_path: Path, capsys) -> None:
    from traceml_tui.launch import job_output

    run_dir = _pinned_run(tmp_path)
    summary.write_summary(run_dir, doc_of(crashed_state(), complete=False))
    (run_dir / "final_summary.json").replace(run_dir / "live_snapshot.json")
    moved, attacker = _swap(run_dir)
    # Theirs: a "snapshot" whose diagnosis would be printed on the owner's terminal.
    forged = doc_of(crashed_state(), complete=False)
    forged["live_diagnosis"]["summary"] = "ATTACKER WAS HERE"
    summary.write_summary(attacker, forged)
    (attacker / "final_summary.json").replace(attacker / "live_snapshot.json")
    job_output.Progress(run_dir).poll()
    line = capsys.readouterr().err
    assert line.startswith("[traceml] FAILED: rank 2 exited with code 1"), line
    assert "ATTACKER" not in line
    snap, _ = job_output.read_summary(run_dir / "live_snapshot.json")  # the fallback summary's read
    assert "ATTACKER" not in str(snap.live_diagnosis)


def test_the_summary_path_said_at_the_end_is_where_the_record_is_now(tmp_path: Path) -> None:
    run_dir = _pinned_run(tmp_path)
    path = run_dir / "final_summary.json"
    assert folders.where_now(path) == (path, False)
    moved, _ = _swap(run_dir)
    now, was_moved = folders.where_now(path)
    assert was_moved
    if os.path.isdir("/proc/self/fd"):
        assert now == moved / "final_summary.json"
