"""Every script in examples/mistakes/ makes exactly the mistake it is named after, and
clean.py none: each runs under the real `traceml run` (2 ranks, torchrun, gloo, CPU),
and the run's final_summary.json must list exactly that finding, on its ranks, with
its evidence and fix; the headless text summary shows it too."""

from __future__ import annotations

import pytest

from jobs import EXAMPLES, run_job, validate_schema

MISTAKES = EXAMPLES / "mistakes"
CUDA_ONLY = {"same-device"}
# Where a mistake is not on every rank: rank 0 alone loaded the checkpoint; rank 1
# reads rank 0's shard.
RANKS = {"params-differ-across-ranks": [1], "sampler-shard-mismatch": [1]}
CASES = sorted(p.stem for p in MISTAKES.glob("*.py") if not p.stem.startswith("_"))


@pytest.mark.e2e
@pytest.mark.parametrize("name", [c for c in CASES if c not in CUDA_ONLY])
def test_example_makes_exactly_its_mistake(tmp_path, name):
    job = run_job(tmp_path, f"mistakes/{name}.py", nproc=2, name=name)
    assert job.returncode == 0, job.stderr[-4000:]
    doc = job.summary
    validate_schema(doc)
    found = doc["checks"]
    assert [c["id"] for c in found] == ([] if name == "clean" else [name])
    for c in found:
        assert c["ranks"] == RANKS.get(name, [0, 1])
        assert c["evidence"] and c["fix"] and c["severity"] in ("info", "warning", "critical")
        assert name in job.stdout and c["fix"] in job.stdout  # the text summary says it


def test_every_finding_id_has_an_example():
    from traceml_agent.findings import CHECKS

    assert set(CASES) == set(CHECKS) | {"clean"}
