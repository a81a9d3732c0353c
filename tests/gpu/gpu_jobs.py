"""Helpers for the GPU suite: launch a script of tests/gpu/jobs under the real `traceml run`
on one GPU, and the checks every healthy GPU run must pass (what the user sees: the exit
code, the text summary, the rank logs, final_summary.json)."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobs import ROOT, Finished, traceml, validate_schema

JOBS = Path(__file__).resolve().parent / "jobs"
# A first torch.compile, NCCL's start and a cold CUDA context take tens of seconds.
GPU_JOB_TIMEOUT_S = 420
# What the agent prints when it turns itself off (agent/__init__.py): never on a GPU run.
AGENT_OFF_WORDS = ("internal error", "timing turned off")


# (test id, estimated seconds on one GPU, what it tells), most telling per second first.
# The seconds are ESTIMATES (the jobs' lengths, cold CUDA contexts, a first compile), not
# yet measured on a GPU: whoever runs the suite on one corrects them.
EVIDENCE_ORDER: tuple[tuple[str, float, str], ...] = (
    ("test_gpu_capture.py::test_whole_step_graph_capture_and_replay[tensors]", 45,
     "the capture survives the agent; replays time on the replay stream (issue 40, 1)"),
    ("test_gpu_ddp.py::test_compute_straggler_is_named_on_device_time", 50,
     "the device clock, not the host's"),
    ("test_gpu_streams.py::test_fsdp2_on_one_gpu[on-gpu]", 55,
     "FSDP's collectives on their own streams (issue 40, 2)"),
    ("test_gpu_nvml.py::test_nvml_figures_match_nvidia_smi", 40, "NVML finds the GPU"),
    ("test_gpu_ddp.py::test_one_rank_on_nccl", 35, "the NCCL path end to end"),
    ("test_gpu_agent_cost.py::test_agent_cost_per_event_and_per_step", 50,
     "the agent's cost per event and per step"),
    ("test_gpu_streams.py::test_side_stream_prefetcher", 45, "side-stream copies"),
    ("test_gpu_ddp.py::test_two_ranks_share_the_gpu_on_gloo", 45, "every phase timed"),
    ("test_gpu_streams.py::test_amp_grad_scaler_with_skipped_steps", 40, "skipped steps"),
    ("test_gpu_capture.py::test_whole_step_graph_capture_and_replay[loader]", 45,
     "capture with a DataLoader"),
    ("test_gpu_ddp.py::test_no_set_device_learns_the_device_from_the_model", 40,
     "device learning"),
    ("test_gpu_ddp.py::test_forked_dataloader_workers_with_the_agent_on_cuda", 50,
     "forked workers after CUDA"),
    ("test_gpu_streams.py::test_fsdp2_on_one_gpu[cpu-offload]", 60, "offload"),
    ("test_gpu_compiled_step.py::test_compiled_optimizer_step[fullgraph]", 40,
     "a fullgraph-compiled optimizer step (issue 40, 6)"),
    ("test_gpu_compiled_step.py::test_compiled_optimizer_step[adamw-inductor]", 90,
     "the compiled-optimizer recipe (a first inductor compile)"),
    ("test_gpu_capture.py::test_compile_reduce_overhead", 120,
     "cudagraph trees (a first torch.compile takes a minute)"),
)
UNKNOWN_S = 60.0  # a GPU test missing from the table: placed last, at this estimate


@functools.cache
def missing_gpu() -> str | None:
    """Why the GPU suite cannot run here, or None when it can. Asks torch whether CUDA is
    available (the driver, no context) and looks for nvidia-smi, which the NVML test
    compares against; its absence says the driver's tools are not installed."""
    try:
        import torch
    except ImportError:
        return "no GPU: torch is not installed"
    if not torch.backends.cuda.is_built():
        return (f"no GPU: torch {torch.__version__} is a CPU build "
                "(the GPU suite needs a CUDA build of torch and one NVIDIA GPU)")
    if not torch.cuda.is_available():
        return f"no GPU: torch.cuda.is_available() is False (torch {torch.__version__})"
    if shutil.which("nvidia-smi") is None:
        return "no GPU: nvidia-smi is not on PATH (the NVIDIA driver's tools are missing)"
    return None


@dataclass
class GpuRun(Finished):
    """A finished GPU job (jobs.Finished), with its ranks' own output."""

    @property
    def logs(self) -> str:
        """Every rank's own output, as kept in the run folder."""
        return "".join(p.read_text(errors="replace")
                       for p in sorted((self.run_dir / "logs").rglob("*.log")))

    @property
    def seen(self) -> str:
        """Everything the user sees or can open: terminal output and the rank logs."""
        return f"{self.stdout}\n{self.stderr}\n{self.logs}"

    def tail(self) -> str:
        return f"--- stderr ---\n{self.stderr[-3000:]}\n--- logs ---\n{self.logs[-4000:]}"


def one_gpu_env() -> dict[str, str]:
    """Every rank of every job on one GPU: the first one this process may use."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return {"CUDA_VISIBLE_DEVICES": visible or "0"}


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (else
    nvidia-smi's indices): for the tests that need two. No CUDA call."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
               if v.strip()]
    if visible:
        return visible
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def run_gpu(tmp_path: Path, script: str, *traceml_args: str, nproc: int = 1,
            name: str = "gpu", script_args: tuple[str, ...] = (),
            env: dict[str, str] | None = None) -> GpuRun:
    out = tmp_path / "runs"
    proc = traceml("run", str(JOBS / script), "--nproc-per-node", str(nproc), "--headless",
                   "--out", str(out), "--run-name", name, *traceml_args, "--", *script_args,
                   cwd=ROOT, timeout=GPU_JOB_TIMEOUT_S, env={**one_gpu_env(), **(env or {})})
    return GpuRun(proc.returncode, proc.stdout, proc.stderr, out / name)


def hang_labels(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Every HANG the run ever showed: in its timeline, live, or at the end."""
    shown = [e for e in doc.get("timeline", []) if e.get("label") == "HANG"]
    if (doc.get("live_diagnosis") or {}).get("label") == "HANG":
        shown.append(doc["live_diagnosis"])
    if doc.get("hang") is not None:
        shown.append(doc["hang"])
    return shown


def assert_healthy(job: GpuRun, nproc: int, steps: int | None = None) -> dict[str, Any]:
    """A healthy job on the GPU, as traceml reports it: exit 0, every rank reporting on its
    CUDA device with the agent on, no batch refused by the collector, never a HANG, no
    negative time. Returns the summary for the test's own checks."""
    assert job.returncode == 0, job.tail()
    assert "Traceback" not in job.logs, job.tail()
    for words in AGENT_OFF_WORDS:
        assert words not in job.seen, job.tail()
    doc = job.summary
    validate_schema(doc)
    assert doc["complete"] is True
    assert doc["run"]["exit_code"] == 0
    assert len(doc["ranks"]) == nproc
    for r in doc["ranks"]:
        assert r["reported"] and r["agent_off"] is None, r
        assert (r["device"] or "").startswith("cuda"), r  # the CUDA recorder is timing it
        if steps is not None:
            assert r["steps"] == steps, (r["rank"], r["steps"], steps)
        assert r["dropped_records"] == 0, r
        # A record with a bad value (a negative cross-stream time, say) refused by the
        # collector: the agent counted it as sent, the step is lost.
        assert r["bad_records"] == 0, r
        for phase, q in r["phase_ms"].items():
            assert q is None or (q["median"] >= 0 and q["p95"] >= 0), (r["rank"], phase, q)
        assert r["step_ms"]["median"] is not None and r["step_ms"]["median"] > 0, r
    # Nor may one cost the batch around it: the collector counts malformed messages.
    assert doc["collector"]["malformed"] == 0, doc["collector"]
    assert hang_labels(doc) == [], hang_labels(doc)
    assert not re.search(r"\bHANG\b", job.stdout + job.stderr), job.stderr[-3000:]
    return doc


def timed(phases: dict[str, Any], *names: str) -> None:
    """Each named phase has a median over the run's window (it was seen and timed)."""
    for name in names:
        q = phases.get(name)
        assert q is not None and q["median"] is not None, (name, phases)


def nvidia_smi(*fields: str, gpu: str) -> dict[str, str]:
    """One `nvidia-smi --query-gpu` row for one GPU (index or UUID), by field name."""
    out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}",
                          "--format=csv,noheader,nounits", "-i", gpu],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    values = [v.strip() for v in out.strip().splitlines()[0].split(",")]
    return dict(zip(fields, values, strict=True))
