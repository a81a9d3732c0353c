"""What the product reports for each training framework of tests/e2e/test_e2e_frameworks.py.

The same cases (3 ranks, gloo, 200 optimizer steps, rank 1 compute-slow for steps
30-89, rank 2 input-slow for 110-169), run under `traceml run`, one JSON line each:
the framework's own optimizer-step count and the agent's per rank, whether every phase
was measured, the episodes the live diagnosis named (label, rank, phase, steps) and the
whole run's verdict. About 3 minutes on 2 cores.

    python benchmarks/framework_report.py
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_e2e_frameworks import (  # noqa: E402
    BASE_FORWARD_MS,
    CASES,
    FRAMEWORKS,
    OPTIMIZER_STEPS,
    faults,
)

from jobs import traceml  # noqa: E402

PHASES = ("dataloader", "forward", "backward", "sync", "optimizer")


def main() -> None:
    for name, script, args, micro, env in CASES:
        out = Path(tempfile.mkdtemp(prefix="traceml-fw-"))
        proc = traceml("run", str(FRAMEWORKS / script), "--nproc-per-node", "3", "--headless",
                       "--out", str(out), "--run-name", name, "--", "--steps",
                       str(OPTIMIZER_STEPS), *args,
                       env={"FAULTS": faults(micro), "BASE_FORWARD_MS": str(BASE_FORWARD_MS),
                            **env})
        doc = json.loads((out / name / "final_summary.json").read_text())
        counted = re.search(r"OPTIMIZER_STEPS=(\d+)", proc.stdout)
        print(json.dumps({
            "case": name, "exit": proc.returncode,
            "framework_steps": counted and int(counted.group(1)),
            "agent_steps": [r["steps"] for r in doc["ranks"]],
            "every_phase_measured": doc["timing"]["complete"] and all(
                r["phase_ms"][p] is not None for r in doc["ranks"] for p in PHASES),
            "episodes": [(e["label"], e["rank"], e["phase"], e["start_step"], e["end_step"])
                         for e in doc["timeline"] if e["label"] not in ("WARMUP", "BALANCED")],
            "final": doc["diagnosis"]["label"]}), flush=True)


if __name__ == "__main__":
    main()
