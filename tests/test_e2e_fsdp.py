"""FSDP2 (`fully_shard`) on CPU/gloo under traceml run: timed, and the straggler named."""

from __future__ import annotations

import pytest

from jobs import run_job, validate_schema

pytestmark = pytest.mark.e2e


def test_fsdp_input_straggler_is_named_not_the_rank_that_waits_for_it(tmp_path):
    job = run_job(tmp_path, "fsdp_toy.py", nproc=2, name="fsdp",
                  script_args=("--scenario", "input", "--rank", "1", "--delay-ms", "25",
                               "--steps", "60"))
    assert job.returncode == 0, job.stderr[-3000:]
    doc = job.summary
    validate_schema(doc)
    assert doc["run"]["parallel"] == "fsdp"
    assert [r["steps"] for r in doc["ranks"]] == [60, 60]
    d = doc["diagnosis"]
    assert (d["label"], d["rank"], d["phase"]) == ("INPUT STRAGGLER", 1, "dataloader")
    rank0, rank1 = (r["phase_ms"] for r in doc["ranks"])
    medians = {p: (rank0[p] and rank0[p]["median"], rank1[p] and rank1[p]["median"])
               for p in rank0}
    # Rank 0 waits for rank 1 in the all-gathers FSDP2 issues inside forward. They go
    # through torch.distributed, so the agent times them as sync (nested in forward):
    # the wait is rank 0's sync, and forward keeps the compute, alike on both ranks.
    assert rank0["sync"]["median"] > rank1["sync"]["median"] + 10, medians
    assert abs(rank0["forward"]["median"] - rank1["forward"]["median"]) < 10, medians
    for phases in (rank0, rank1):
        assert phases["backward"]["median"] > 0 and phases["optimizer"]["median"] > 0
