"""End to end: a transient compute straggler, in a real `traceml run` job (torchrun, gloo,
3 ranks on CPU: the straggler, a rank to compare it with and a third so that the median
rank is not the straggler's half; a fourth only added start-up), is filed on the steps it
happened and priced at what it cost.

Rank 2's forward sleeps longer on a known range of steps only (examples/ddp_toy.py
--from-step/--to-step). The summary's timeline must file a COMPUTE STRAGGLER rank 2
episode within 10 steps of that range, with no other label on its steps, and its lost
time within 25 % of the extra time the job measurably took on those steps (from the
run's step log: per step the median rank's step, less the median of the clean steps).
Before evidence dating the straggler was filed on the steps after it ended (about 10 ms
steps: COMM-BOUND 53-127, then COMPUTE STRAGGLER 127-220 costing 0.0 s)."""

from __future__ import annotations

import statistics
from collections import defaultdict

import pytest

from jobs import run_job, validate_schema
from traceml_tui.runfolder.step_log import read_steps

pytestmark = pytest.mark.e2e

SLOW_RANK = 2
SLACK_STEPS = 10  # the promise: filed within 10 steps of the range
COST_TOLERANCE = 0.25  # lost time within 25 % of the measured extra time


def _job_steps(run_dir) -> dict[int, float]:
    """Per step, the median rank's step time (ms) from the run's step log."""
    logs = sorted({p.parent for p in run_dir.rglob("steps.*.msgpack")})
    assert logs, f"no step log under {run_dir}"
    per_step: dict[int, list[float]] = defaultdict(list)
    for rec in read_steps(logs[0]):
        per_step[rec.step].append(rec.step_ms)
    return {s: statistics.median(v) for s, v in per_step.items() if len(v) >= 3}


# (base compute per forward in ms: the step's scale, extra ms, first and last slow
# step, steps). ~10 ms steps: the toy's smallest model, where gloo's all-reduce is
# the step; ~100 ms: 90 ms of device-like compute per forward.
CASES = [
    pytest.param(0.0, 40.0, 40, 99, 170, id="10ms-steps"),
    pytest.param(90.0, 60.0, 30, 59, 95, id="100ms-steps"),
]


@pytest.mark.alone  # milliseconds and seconds, measured
@pytest.mark.parametrize(("compute_ms", "extra_ms", "first", "last", "steps"), CASES)
def test_a_transient_straggler_is_filed_on_its_steps_and_priced(
        tmp_path, compute_ms, extra_ms, first, last, steps):
    job = run_job(tmp_path, "ddp_toy.py", nproc=3, name="transient", script_args=(
        "--scenario", "forward", "--rank", str(SLOW_RANK), "--from-step", str(first),
        "--to-step", str(last), "--steps", str(steps), "--delay-ms", str(extra_ms),
        "--compute-ms", str(compute_ms), "--dim", "32", "--batch", "8"))
    assert job.returncode == 0, job.stderr[-3000:]
    doc = job.summary
    validate_schema(doc)
    timeline = doc["timeline"]
    ours = [e for e in timeline if e["label"] == "COMPUTE STRAGGLER"
            and e["rank"] == SLOW_RANK and e["start_step"] <= last
            and (e["end_step"] is None or e["end_step"] >= first)]
    assert len(ours) == 1, timeline
    e = ours[0]
    assert e["phase"] == "forward", e
    assert abs(e["start_step"] - first) <= SLACK_STEPS, (e, timeline)
    assert e["end_step"] is not None and abs(e["end_step"] - last) <= SLACK_STEPS, timeline
    # No other label on the straggler's steps (the victims' COMM-BOUND is its symptom).
    inner = range(first + SLACK_STEPS, last - SLACK_STEPS + 1)
    for other in timeline:
        if other is e or other["label"] == "WARMUP":
            continue
        end = other["end_step"] if other["end_step"] is not None else steps
        assert end < inner.start or other["start_step"] >= inner.stop, (other, timeline)
    # Priced at what the job measurably lost on its steps.
    job_ms = _job_steps(job.run_dir)
    clean = [ms for s, ms in job_ms.items()
             if 5 <= s < first - 5 or last + 5 < s < steps - 2]
    base = statistics.median(clean)
    extra_s = sum(max(0.0, job_ms[s] - base) for s in range(first, last + 1)
                  if s in job_ms) / 1000.0
    print(f"filed {e['start_step']}-{e['end_step']} for {first}-{last} (named at "
          f"{e['named_step']}, cleared at {e['cleared_step']}); lost {e['lost_s']} s, "
          f"measured {extra_s:.2f} s over a clean {base:.1f} ms step")
    assert extra_s > 0.5 * (last - first + 1) * extra_ms / 1000.0, (extra_s, base)
    assert e["lost_s"] == pytest.approx(extra_s, rel=COST_TOLERANCE), (e, extra_s, base)
    # The text summary's timeline says the same.
    assert f"steps {e['start_step']:>6}-{e['end_step']:<6}  COMPUTE STRAGGLER rank 2" in job.stdout
