"""The frameworks people train with, written the way their docs show, under `traceml run`.

Each case is one real job (2 ranks, gloo, CPU) from examples/frameworks/: rank 1 is a
compute straggler for the middle of the run's first half, rank 0 an input straggler
in the second half, and the rest is balanced (two ranks, the least that has a straggler
and a rank it is compared with, and each rank has a core of this 2-core machine: a third
rank added ~6 CPU-s of start-up per job to the suite, nine jobs that run alone). The
live timeline must name both with the right rank and phase; the whole run must be
BALANCED (each fault covers under a third of the steps, so no rank's medians move);
every phase must be measured on every rank, with the model's own forward time inside
"forward"; and the step count must equal the framework's own count of optimizer steps.
"""

from __future__ import annotations

import re

import pytest

from jobs import EXAMPLES, traceml, validate_schema

FRAMEWORKS = EXAMPLES / "frameworks"
OPTIMIZER_STEPS = 200
BASE_FORWARD_MS = 6.0

# (id, script, script args, micro-batches per optimizer step, extra environment)
CASES = [
    ("lightning-automatic", "lightning_train.py", (), 1, {}),
    ("lightning-manual", "lightning_train.py", ("--manual",), 1, {}),
    ("lightning-accumulate", "lightning_train.py", ("--accumulate", "2"), 2, {}),
    # Two DataLoader workers hide slow loading until it is about twice the step.
    ("hf-trainer", "hf_trainer.py", ("--accumulate", "2", "--workers", "2"), 2,
     {"INPUT_EXTRA_MS": "100"}),
    ("accelerate", "accelerate_loop.py", ("--accumulate", "2"), 2, {}),
    ("ddp-compile-wrapped", "ddp_variants.py", ("--compile", "wrap"), 1, {}),
    ("ddp-compile-method", "ddp_variants.py", ("--compile", "method"), 1, {}),
    # Three independent patterns of a plain loop in one job, to keep CI's time.
    ("ddp-bf16-two-optimizers-iterable", "ddp_variants.py",
     ("--bf16", "--two-optimizers", "--iterable"), 1, {}),
]


def faults(micro_per_step: int) -> str:
    """Compute fault on rank 1 for steps 30-90, input fault on rank 0 for 110-170: each
    twice the live window (32 steps), under a third of the run."""
    m = micro_per_step
    return f"compute:1:{30 * m}:{90 * m},input:0:{110 * m}:{170 * m}"


@pytest.mark.e2e
@pytest.mark.frameworks
@pytest.mark.alone  # the timeline holds only the injected episodes
@pytest.mark.parametrize("name, script, args, micro, env", CASES, ids=[c[0] for c in CASES])
def test_framework_gets_the_right_label_rank_and_phase(tmp_path, name, script, args, micro,
                                                       env):
    out = tmp_path / "runs"
    proc = traceml("run", str(FRAMEWORKS / script), "--nproc-per-node", "2", "--headless",
                   "--out", str(out), "--run-name", name, "--", "--steps",
                   str(OPTIMIZER_STEPS), *args,
                   env={"FAULTS": faults(micro), "BASE_FORWARD_MS": str(BASE_FORWARD_MS),
                        **env})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = __import__("json").loads((out / name / "final_summary.json").read_text())
    validate_schema(doc)

    # The framework's own count of optimizer steps is the agent's count on every rank.
    counted = re.search(r"OPTIMIZER_STEPS=(\d+)", proc.stdout)
    assert counted and int(counted.group(1)) == OPTIMIZER_STEPS
    assert [r["steps"] for r in doc["ranks"]] == [OPTIMIZER_STEPS] * 2

    # Every phase measured on every rank, the model's forward inside "forward".
    assert doc["timing"]["complete"], doc["timing"]
    for r in doc["ranks"]:
        for phase in ("dataloader", "forward", "backward", "sync", "optimizer"):
            assert r["phase_ms"][phase] is not None, (r["rank"], phase)
        assert r["phase_ms"]["forward"]["median"] >= 0.8 * BASE_FORWARD_MS * micro, r

    # Both stragglers named live, with the right rank and phase; balanced overall.
    named = {(e["label"], e["rank"], e["phase"]) for e in doc["timeline"]}
    assert ("COMPUTE STRAGGLER", 1, "forward") in named, doc["timeline"]
    assert ("INPUT STRAGGLER", 0, "dataloader") in named, doc["timeline"]
    wrong = {label for label, _, _ in named} - {"WARMUP", "BALANCED", "COMPUTE STRAGGLER",
                                                "INPUT STRAGGLER"}
    assert not wrong, doc["timeline"]
    assert doc["diagnosis"]["label"] == "BALANCED", doc["diagnosis"]

    # No global module hook for torch.compile to warn about.
    assert "global hooks" not in proc.stdout + proc.stderr


@pytest.mark.e2e
@pytest.mark.frameworks
@pytest.mark.alone  # the timeline holds only the injected episodes
def test_a_forward_inside_a_compiled_step_is_reported_untimed_not_guessed(tmp_path):
    """`torch.compile` on a whole loss function: no hook runs inside compiled code, so the
    forward cannot be seen. The run says so instead of calling the job balanced."""
    out = tmp_path / "runs"
    proc = traceml("run", str(FRAMEWORKS / "ddp_variants.py"), "--nproc-per-node", "2",
                   "--headless", "--out", str(out), "--run-name", "step", "--", "--steps",
                   "120", "--compile", "step")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = __import__("json").loads((out / "step" / "final_summary.json").read_text())
    validate_schema(doc)
    assert doc["diagnosis"]["label"] == "TIMING INCOMPLETE"
    assert doc["diagnosis"]["phase"] == "forward"
    assert not doc["timing"]["complete"]
    assert doc["timing"]["untimed"][0]["phase"] == "forward"
    assert doc["timing"]["untimed"][0]["ranks"] == [0, 1]
    labels = {e["label"] for e in doc["timeline"]}
    assert labels <= {"WARMUP", "TIMING INCOMPLETE"}, doc["timeline"]
    assert "Not timed: forward on rank(s) 0-1" in proc.stdout
