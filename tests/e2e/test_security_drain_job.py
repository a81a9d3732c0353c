"""The real job of tests/collect/test_security_drain.py (its unit tests stay there, so that the
quick loop is the folders without tests/e2e): a key holder's flood of large steps beside a
real job stalls nothing."""

from __future__ import annotations

import contextlib
import json
import signal
import time
from pathlib import Path

import psutil
import pytest
from test_security_drain import SECRET, STEPS, Flood, _flood_payloads, _live

from jobs import EXAMPLES, kill_session, spawn_traceml, wait_for
from traceml_tui.view.client import ViewClient, ViewUnavailable

pytestmark = pytest.mark.e2e


@pytest.mark.e2e
def test_a_key_holders_flood_of_large_steps_stalls_nothing(tmp_path: Path) -> None:
    out, name = tmp_path / "runs", "drain"
    run_dir = out / name
    proc = spawn_traceml(
        "run", str(EXAMPLES / "ddp_toy.py"), "--nproc-per-node", "2", "--headless",
        "--out", str(out), "--run-name", name, "--",
        "--steps", str(STEPS), "--compute-ms", "100",
        env={"TRACEML_SECRET": SECRET})
    flood: Flood | None = None
    viewer: ViewClient | None = None
    try:
        wait_for(lambda: (doc := _live(run_dir)) is not None
                 and min([r["steps"] for r in doc["ranks"]] or [0]) >= 10, 90, "training")
        info = json.loads((run_dir / "collector.json").read_text())
        viewer = ViewClient(info["view"], timeout_s=20, secret=SECRET)
        collector = psutil.Process(info["pid"])
        rss_before = collector.memory_info().rss
        flood = Flood(info["ingest"], _flood_payloads(2))
        flood.start()
        slowest = stalest = 0.0
        rss_peak = rss_before
        started = time.monotonic()
        final = run_dir / "final_summary.json"
        while not final.exists() and time.monotonic() - started < 60:
            asked = time.monotonic()
            try:
                view, _ = viewer.fetch()  # the dashboard's own request
            except ViewUnavailable:
                if final.exists():  # the job ended meanwhile: the collector is gone
                    break
                raise
            slowest = max(slowest, time.monotonic() - asked)
            assert view.world_size == 2
            age = time.time() - (run_dir / "live_snapshot.json").stat().st_mtime
            with contextlib.suppress(psutil.Error):
                rss_peak = max(rss_peak, collector.memory_info().rss)
            stalest = max(stalest, age)
            time.sleep(0.2)
        sent = flood.sent
        flood.stop()
        flood = None
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-3000:]
        doc = json.loads((run_dir / "final_summary.json").read_text())
        counters = doc["collector"]
        print(f"flood: {sent} messages sent; slowest view {slowest:.2f} s, live file at most "
              f"{stalest:.1f} s old; steps {[r['steps'] for r in doc['ranks']]}; hang "
              f"{doc['hang']}; collector RSS +{(rss_peak - rss_before) >> 20} MiB at most; "
              f"counters {counters}")
        # What the user sees did not stall, and the record is the job's.
        assert [r["steps"] for r in doc["ranks"]] == [STEPS, STEPS], counters
        assert doc["hang"] is None and "HANG" not in json.dumps(doc["timeline"]), doc["hang"]
        assert slowest < 3.0, f"a view took {slowest:.1f} s"
        assert stalest < 8.0, f"the live file went {stalest:.1f} s stale"
        # The flood was real: most of it reached the collector and was refused there.
        assert sent >= 100, sent
        assert counters["not_owner"] + counters["foreign"] + counters["backlog_refused"] > 50
        assert counters["connections_over_cap"] > 0  # 32 > 2 x 2 + 16
    finally:
        if flood is not None:
            flood.stop()
        if viewer is not None:
            viewer.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(20)
            except Exception:
                kill_session(proc)
                proc.wait(10)
