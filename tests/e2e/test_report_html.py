"""`traceml report RUN_DIR`: the self-contained HTML report of a real run (issue 41,
item 3): every section there, the verdict the summary's, nothing fetched from the
network, the record's text escaped, a run without its final summary still reported with
the missing part named, and the page rendered by the real Chromium."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from jobs import run_job, traceml
from traceml_tui.report.html_report import SECTIONS

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("report")
    done = run_job(tmp, "ddp_toy.py", nproc=3,
                   script_args=("--scenario", "forward", "--rank", "1", "--steps", "60"))
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def _report(run_dir: Path, *extra: str) -> tuple[subprocess.CompletedProcess, str]:
    proc = traceml("report", str(run_dir), *extra, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc, (run_dir / "report.html").read_text()


@pytest.mark.e2e
def test_every_section_and_the_summarys_verdict(job):
    proc, page = _report(job.run_dir)
    assert "wrote" in proc.stderr and "report.html" in proc.stderr
    for sid in SECTIONS:
        assert f'<section id="{sid}">' in page, sid
    d = job.summary["diagnosis"]
    assert d["label"] == "COMPUTE STRAGGLER" and d["rank"] == 1
    verdict = re.search(r'<p class="summary">(.*?)</p>', page, re.S).group(1)
    assert html.unescape(verdict) == d["summary"]
    assert "<svg" in page and "rank 1 (worst step" in page
    # Nothing fetched: no script, no external src/href, no http(s) URL in an attribute.
    assert "<script" not in page.lower()
    assert not re.search(r'(src|href)\s*=\s*["\']?\s*(https?:)?//', page, re.I)
    assert len(page) < 2_000_000


@pytest.mark.e2e
def test_hostile_text_from_the_record_is_escaped(job, tmp_path):
    run = tmp_path / "hostile"
    shutil.copytree(job.run_dir, run, ignore=shutil.ignore_patterns("secret.key", "logs"))
    doc = json.loads((run / "final_summary.json").read_text())
    evil = '<script>alert("x")</script><img src=http://evil.example/x>'
    for r in doc["ranks"]:
        r["host"] = evil
    doc["diagnosis"]["summary"] = evil
    (run / "final_summary.json").write_text(json.dumps(doc))
    (run / "final_summary.txt").write_text(evil)
    _, page = _report(run)
    assert "<script" not in page and "<img" not in page
    assert "&lt;script&gt;" in page


@pytest.mark.e2e
def test_a_run_without_its_final_summary_names_what_is_missing(job, tmp_path):
    run = tmp_path / "crashed"
    shutil.copytree(job.run_dir, run, ignore=shutil.ignore_patterns("secret.key", "logs"))
    (run / "final_summary.json").unlink()
    (run / "final_summary.txt").unlink()
    proc, page = _report(run)
    assert "missing" in proc.stderr
    assert 'id="missing"' in page and "no final_summary.json" in page
    assert "last live snapshot" in page
    (run / "live_snapshot.json").unlink()
    proc, page = _report(run)
    assert "no live snapshot either" in page and "<svg" in page  # the step log still draws
    for sid in SECTIONS:
        assert f'<section id="{sid}">' in page, sid


def test_user_mistakes_are_one_line(tmp_path):
    proc = traceml("report", str(tmp_path / "nope"), timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0
    assert "no such run folder" in proc.stderr
    proc = traceml("report", str(tmp_path), timeout=60)
    assert proc.returncode == 2 and "is not a traceml run folder" in proc.stderr
    (tmp_path / "final_summary.json").write_text("{not json")
    proc = traceml("report", str(tmp_path), timeout=60)
    assert proc.returncode == 2 and "not a traceml summary" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.e2e
@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium (Debian's chromium)")
def test_chromium_renders_every_section(job, tmp_path):
    _report(job.run_dir)
    page = job.run_dir / "report.html"
    flags = [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu",
             f"--user-data-dir={tmp_path / 'chromium'}"]
    dom = subprocess.run([*flags, "--dump-dom", page.as_uri()], capture_output=True,
                         text=True, timeout=120).stdout
    for sid in SECTIONS:
        assert f'<section id="{sid}">' in dom, sid
    assert "COMPUTE STRAGGLER" in dom and "<svg" in dom
    shot = tmp_path / "report.png"
    subprocess.run([*flags, "--window-size=1000,3600", f"--screenshot={shot}", page.as_uri()],
                   capture_output=True, timeout=120)
    assert shot.stat().st_size > 10_000
