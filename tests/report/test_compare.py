"""`traceml compare`: the metrics, the verdict and what the command prints."""

from __future__ import annotations

import json

import pytest

from jobs import traceml
from traceml_tui.report.compare import NOISE_SHARE, compare, metrics, render, verdict


def summary(name: str, step: float, dataloader: list[float], label: str = "BALANCED",
            rank: int | None = None) -> dict:
    ranks = []
    for i, dl in enumerate(dataloader):
        phases = {"dataloader": dl, "h2d": None, "forward": 2.0, "backward": 3.0, "sync": 1.0,
                  "optimizer": 0.5, "wait": 0.5}
        ranks.append({"rank": i, "steps": 100, "phase_ms": {
            p: None if v is None else {"median": v, "p95": v} for p, v in phases.items()}})
    return {"run": {"name": name}, "step_ms": {"median": step},
            "diagnosis": {"label": label, "rank": rank, "phase": None}, "ranks": ranks}


def test_metrics_follow_the_median_rank_and_the_worst_gap():
    m = metrics(summary("a", 40.0, [1.0, 30.0, 1.0]))
    assert m["step_ms"] == 40.0
    assert m["input_ms"] == 1.0
    assert m["compute_ms"] == 5.5
    assert m["skew_ms"] == pytest.approx(29.0)
    assert m["sync_ms"] == 1.0 and m["wait_ms"] == 0.5


@pytest.mark.parametrize(("old", "new", "expected"), [
    (40.0, 20.0, "improved"),
    (40.0, 40.0 * (1 + NOISE_SHARE / 2), "unchanged"),
    (40.0, 40.0 * (1 - NOISE_SHARE / 2), "unchanged"),
    (40.0, 60.0, "regressed"),
    (None, 10.0, "unknown"),
    (0.0, 10.0, "unknown"),
])
def test_verdict(old, new, expected):
    assert verdict(old, new) == expected


def test_a_fixed_straggler_reads_as_improved():
    old = summary("old", 40.0, [1.0, 30.0, 1.0], "INPUT STRAGGLER", 1)
    new = summary("new", 11.0, [1.0, 1.0, 1.0])
    result = compare(old, new)
    assert result.verdict == "improved"
    assert result.diagnosis.old.label == "INPUT STRAGGLER"
    text = render(result)
    assert "INPUT STRAGGLER (rank 1) -> BALANCED" in text
    assert "verdict: IMPROVED" in text


def test_command_line_text_and_json(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(summary("old", 40.0, [1.0, 30.0, 1.0], "INPUT STRAGGLER", 1)))
    b.write_text(json.dumps(summary("new", 41.0, [1.0, 30.0, 1.0], "INPUT STRAGGLER", 1)))
    text = traceml("compare", str(a), str(b), timeout=60)
    assert text.returncode == 0, text.stderr
    assert "verdict: UNCHANGED" in text.stdout
    as_json = traceml("compare", str(a), str(b), "--json", timeout=60)
    assert json.loads(as_json.stdout)["verdict"] == "unchanged"


def test_a_file_that_is_not_a_summary_is_one_clear_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"hello": 1}')
    proc = traceml("compare", str(bad), str(bad), timeout=60)
    assert proc.returncode == 2
    assert f"{bad} is not a traceml summary: Object missing required field" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def rated(name: str, world: int, steps_per_s: float, samples_per_s: float | None) -> dict:
    doc = summary(name, 1000.0 / steps_per_s, [1.0] * world)
    doc["run"]["world_size"] = world
    doc["throughput"] = {"steps_per_s": steps_per_s, "samples_per_s": samples_per_s,
                         "ranks": world}
    return doc


@pytest.mark.parametrize(("world", "samples", "efficiency", "assessment"), [
    (2, 3_700.0, 0.925, "within the realistic range"),  # 2x: 90-95%
    (4, 6_000.0, 0.75, "below the realistic range"),     # 4x: 85-95%
    (8, 15_000.0, 0.9375, "above the realistic range"),  # 8x: 80-90%
    (32, 20_000.0, 0.3125, "below the realistic range"),  # beyond the table: the 16 row
])
def test_scaling_efficiency_against_a_one_rank_baseline(world, samples, efficiency, assessment):
    base = rated("one", 1, 31.25, 2_000.0)
    result = compare(base, rated("many", world, 30.0, samples))
    sc = result.to_json()["scaling"]
    assert sc["basis"] == "samples/s" and sc["ideal"] == world
    assert sc["efficiency"] == pytest.approx(efficiency)
    assert sc["assessment"].startswith(assessment)
    text = render(result)
    assert f"scaling 1 -> {world} ranks" in text and f"efficiency {efficiency:.0%}" in text


def test_scaling_without_batch_sizes_uses_steps_times_ranks():
    sc = compare(rated("one", 1, 20.0, None), rated("two", 2, 18.0, None)).to_json()["scaling"]
    assert sc["basis"].startswith("steps/s x ranks")
    assert sc["efficiency"] == pytest.approx(0.9) and sc["expected"] == [0.90, 0.95]


def test_no_scaling_section_when_the_new_run_is_not_larger():
    assert compare(rated("a", 2, 20.0, 600.0), rated("b", 2, 21.0, 630.0)).scaling is None
