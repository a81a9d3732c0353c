"""The real job of tests/collect/test_metrics.py (its unit tests stay there, so that the quick
loop is the folders without tests/e2e): a real Prometheus scrapes a running job's /metrics
and names its straggler."""

from __future__ import annotations

import json
import signal
import subprocess
import urllib.parse
import urllib.request

import pytest
from test_metrics import PROMETHEUS

from jobs import EXAMPLES, free_ports, kill_session, spawn_traceml, wait_for

pytestmark = pytest.mark.e2e


@pytest.mark.skipif(PROMETHEUS is None, reason="no Prometheus server (Debian's prometheus)")
def test_a_real_prometheus_scrapes_a_run_and_names_the_straggler(tmp_path):
    out = tmp_path / "runs"
    base = free_ports(3)
    metrics_port, prom_port = base, base + 1
    job = spawn_traceml("run", str(EXAMPLES / "ddp_toy.py"), "--nproc-per-node", "2",
                        "--headless", "--out", str(out), "--run-name", "prom",
                        "--metrics-port", str(metrics_port), "--",
                        "--scenario", "input", "--rank", "1", "--delay-ms", "30",
                        "--steps", "100000")
    config = tmp_path / "prometheus.yml"
    config.write_text(f"""
global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: traceml
    static_configs:
      - targets: ["127.0.0.1:{metrics_port}"]
""")
    prom = subprocess.Popen(
        [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def query(q: str) -> list[dict]:
        url = f"http://127.0.0.1:{prom_port}/api/v1/query?" + urllib.parse.urlencode({"query": q})
        try:
            with urllib.request.urlopen(url, timeout=5) as reply:
                return json.loads(reply.read())["data"]["result"]
        except OSError:
            return []

    try:
        wait_for(lambda: query('traceml_diagnosis_info{label="INPUT STRAGGLER"}'), 120,
                 "Prometheus to record the straggler")
        (found,) = query('traceml_diagnosis_info{label="INPUT STRAGGLER"}')
        assert found["metric"]["rank"] == "1" and found["metric"]["job"] == "traceml"
        assert found["metric"]["exported_job"] == "prom"  # the run's name, beside the scrape's
        slow = query('traceml_rank_phase_seconds{phase="dataloader"} > 0.02')
        assert [r["metric"]["rank"] for r in slow] == ["1"]
        share = query("traceml_cost_step_share")
        assert share and float(share[0]["value"][1]) > 0.3
    finally:
        kill_session(prom)
        prom.wait(10)
        job.send_signal(signal.SIGINT)
        try:
            job.wait(60)
        except subprocess.TimeoutExpired:
            kill_session(job)
            job.kill()
