"""`traceml run --nccl-debug LEVEL`: the network guide's debug environment, per rank.

The seed's wrapper sets NCCL_DEBUG, NCCL_DEBUG_SUBSYS and NCCL_DEBUG_FILE for every
rank and TORCH_DISTRIBUTED_DEBUG=DETAIL (here never, see TORCH_DEBUG), then greps each
rank's last opCount by hand.
Here every rank logs to its own file inside the run folder (never a shared /tmp path:
the folder is private, docs/security.md), named by NCCL itself from host and pid, and the
agents read their own tails when they stall (traceml_agent/nccl_log.py), so a HANG shows
each rank's last started and finished collective. PyTorch's NCCL flight recorder is
switched on too: on a watchdog timeout every rank dumps its last collectives to
RUN_DIR/logs/nccl/flight-recorder-rank<N> (docs/network.md says how to read them).
"""

from __future__ import annotations

from pathlib import Path

from traceml_agent import nccl_log
from traceml_tui.runfolder.layout import RunFolder

LEVELS = ("WARN", "INFO", "TRACE")
# COLL logs each collective's start and DONE (the opCount lines); INIT and NET say which
# interface and transport each communicator chose, the first thing to check on a slow
# link.
SUBSYSTEMS = "INIT,NET,COLL"
FLIGHT_RECORDER_ENTRIES = 2000
# TORCH_DISTRIBUTED_DEBUG: INFO already makes DDP name the parameters that got no
# gradient (by index). DETAIL (names, and a check of every collective's shapes across
# ranks) is never set, at any level: with torch 2.13 on gloo it killed a plain DDP job
# with SIGSEGV at its first step (examples/ddp_toy.py, with or without traceml), and a
# debug flag must not take the job down. A user who wants it sets it themselves.
TORCH_DEBUG = {"WARN": "INFO", "INFO": "INFO", "TRACE": "INFO"}


def environment(level: str, run_dir: Path) -> dict[str, str]:
    """The variables for every rank of this node (the folder must exist, 0700)."""
    logs = RunFolder(run_dir.resolve()).nccl_logs
    return {
        "NCCL_DEBUG": level,
        "NCCL_DEBUG_SUBSYS": SUBSYSTEMS,
        "NCCL_DEBUG_FILE": str(logs / nccl_log.FILE_PATTERN),
        "TORCH_DISTRIBUTED_DEBUG": TORCH_DEBUG[level],
        "TORCH_NCCL_TRACE_BUFFER_SIZE": str(FLIGHT_RECORDER_ENTRIES),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(logs / "flight-recorder-rank"),
        nccl_log.LOG_DIR_ENV: str(logs),
    }
