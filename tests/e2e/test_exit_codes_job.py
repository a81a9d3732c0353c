"""The real job of tests/launch/test_exit_codes.py (its unit tests stay there, so that the
quick loop is the folders without tests/e2e): a rank exiting 256 fails the job with a
nonzero code."""

from __future__ import annotations

import pytest

from jobs import run_job

pytestmark = pytest.mark.e2e


@pytest.mark.e2e
def test_a_rank_exiting_256_fails_the_job_with_a_nonzero_code(tmp_path):
    """sys.exit(256) exits 0 (the shell's byte): rank 1 leaves at step 10 as if it were
    done, the others' next collective fails, and torchrun fails the job. `traceml run`
    used to exit with the rank's 256, which the shell reads as 0."""
    job = run_job(tmp_path, "ddp_toy.py", nproc=2, name="code256", script_args=(
        "--fail-rank", "1", "--fail-at-step", "10", "--fail-code", "256", "--steps", "40"))
    assert job.returncode != 0, job.stdout[-2000:]
    doc = job.summary
    assert doc["run"]["exit_code"] == job.returncode
