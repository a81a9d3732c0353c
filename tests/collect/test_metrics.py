"""Prometheus metrics (metrics.py): the exposition over canned states, its bounded
cardinality, and a real Prometheus server (Debian's prometheus) scraping a real run and
answering a query for the straggler's rank through its HTTP API."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import urllib.parse
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from jobs import EXAMPLES, free_ports, kill_session, spawn_traceml, wait_for
from traceml_tui.collect import metrics
from traceml_tui.collect.canned import T0, make_state, make_view


def scrape(state) -> dict[str, list]:
    view = make_view(state)
    snap = state.snapshot(T0 + 75.0, 0.5)
    text = metrics.render(view, snap, "demo").decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_a_straggler_reads_in_the_metrics():
    fams = scrape(make_state(world_size=8, straggler=2, phase="dataloader"))
    (diag,) = fams["traceml_diagnosis_info"]
    assert diag.labels["label"] == "INPUT STRAGGLER" and diag.labels["rank"] == "2"
    assert diag.labels["node"] == "0" and diag.labels["severity"] == "critical"
    steps = {s.labels["rank"]: s.value for s in fams["traceml_rank_step_seconds"]}
    assert len(steps) == 8 and all(0.03 < v < 0.04 for v in steps.values())
    dl = {s.labels["rank"]: s.value for s in fams["traceml_rank_phase_seconds"]
          if s.labels["phase"] == "dataloader"}
    assert dl["2"] > 0.029 and dl["0"] < 0.001
    assert {s.name for s in fams["traceml_rank_steps"]} == {"traceml_rank_steps_total"}
    assert fams["traceml_cost_step_share"][0].value > 0.5
    assert all(s.labels["job"] == "demo" for s in fams["traceml_rank_step_seconds"])


def test_slurm_jobs_are_labelled(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    fams = scrape(make_state(world_size=4, straggler=1))
    assert {s.labels.get("slurm_job_id") for s in fams["traceml_diagnosis_info"]} == {"4242"}


def test_cardinality_is_bounded_past_1024_ranks():
    fams = scrape(make_state(world_size=2048, nproc_per_node=8, steps=12, straggler=700,
                             phase="forward"))
    ranks = {s.labels["rank"] for s in fams["traceml_rank_step_seconds"]}
    assert "700" in ranks and len(ranks) == 1 + metrics.PER_RANK_WORST
    nodes = {s.labels["node"] for s in fams["traceml_node_worst_step_seconds"]}
    assert len(nodes) == 2048 // 8  # every node, aggregated
    assert sum(s.value for s in fams["traceml_ranks"]) == 2048


PROMETHEUS = shutil.which("prometheus")


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
