"""Prometheus metrics (metrics.py): the exposition over canned states, its bounded
cardinality, and a real Prometheus server (Debian's prometheus) scraping a real run and
answering a query for the straggler's rank through its HTTP API."""

from __future__ import annotations

import shutil

from prometheus_client.parser import text_string_to_metric_families

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
