"""`traceml export`: bad input ends in one line and exit code 2, never a traceback."""

from __future__ import annotations

from jobs import traceml


def test_export_of_a_missing_folder_is_one_line(tmp_path):
    proc = traceml("export", str(tmp_path / "nope"), "--perfetto", str(tmp_path / "x.json"))
    assert proc.returncode == 2 and "no such run folder" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_export_of_a_folder_without_a_step_log_says_so(tmp_path):
    proc = traceml("export", str(tmp_path), "--perfetto", str(tmp_path / "x.json"))
    assert proc.returncode == 2 and "has no step log" in proc.stderr
    assert not (tmp_path / "x.json").exists()


def test_export_needs_an_output_file(tmp_path):
    proc = traceml("export", str(tmp_path))
    assert proc.returncode == 2 and "--perfetto" in proc.stderr
