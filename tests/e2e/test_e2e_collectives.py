"""End to end (issue 32, item 3): a real torchrun job with DDP and a per-step all-gather
on a second process group. final_summary.json and the text summary name that group and op
with its exposed time, beside DDP's gradient all-reduce."""

from __future__ import annotations

import pytest

from jobs import run_job, validate_schema

pytestmark = pytest.mark.e2e


def test_a_second_groups_all_gather_is_named_beside_ddps_all_reduce(tmp_path):
    job = run_job(tmp_path, "metrics_group.py", nproc=2, name="groups",
                  script_args=("--steps", "30"))
    assert job.returncode == 0, job.stderr[-3000:]
    doc = job.summary
    validate_schema(doc)
    rows = {(c["group"], c["op"], c["phase"]): c for c in doc["collectives"]}
    gather = rows.get(("r0-1", "all_gather", "none"))  # new_group([0, 1]), between phases
    reduce = rows.get(("world", "all_reduce", "backward"))  # DDP's reducer
    assert gather is not None and reduce is not None, doc["collectives"]
    for c in (gather, reduce):
        assert c["ranks"] == 2
        assert c["count_per_step"] == pytest.approx(1.0, abs=0.1)
        assert c["exposed_ms_per_step"] > 0 and 0 < c["share_of_sync"] < 1
    assert gather["bytes_per_step"] == 4 * (1 << 18)  # the script's 256k floats
    assert reduce["bytes_per_step"] > 0
    # The two hold the job's sync time between them; the rest is DDP's broadcast of its
    # module states, once at its construction (~10 ms of a 30-step job's sync beside a
    # busy process: 14 %, fresh-clone run 28), and nothing else.
    rest = [c for c in doc["collectives"] if c is not gather and c is not reduce]
    assert all(c["op"].startswith("broadcast") and c["count_per_step"] < 0.1 for c in rest), rest
    assert gather["share_of_sync"] + reduce["share_of_sync"] > 0.7, doc["collectives"]
    assert sum(c["share_of_sync"] for c in doc["collectives"]) > 0.95, doc["collectives"]
    text = (job.run_dir / "final_summary.txt").read_text()
    assert "all_gather on group r0-1 (outside phases)" in text
    assert "all_reduce on group world (in backward)" in text
