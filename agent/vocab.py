"""The product's words, defined once: phases, labels, severities, rank lists, run files.

Every layer imports them from here (the agent, the collector, the view model, the
dashboard, the summary's readers), so adding a phase or a label is one edit and a
word cannot drift between the process that writes it and the one that reads it.
This module is the bottom layer: it imports nothing of the product and nothing
heavy (the agent loads it inside every rank).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

# --- phases of one optimizer step ---------------------------------------------------------

DATALOADER: Final = "dataloader"
H2D: Final = "h2d"
FORWARD: Final = "forward"
BACKWARD: Final = "backward"
# The exposed collective wait: time in collectives after the rank's own work is done.
SYNC: Final = "sync"
OPTIMIZER: Final = "optimizer"
# The residual: step time outside every measured phase (derived, never recorded).
WAIT: Final = "wait"

# Display and wire order.
PHASES: Final[tuple[str, ...]] = (DATALOADER, H2D, FORWARD, BACKWARD, SYNC, OPTIMIZER, WAIT)
# The phases the recorder times (everything but the derived residual), by index.
MEASURED_PHASES: Final[tuple[str, ...]] = PHASES[:-1]
# A rank's own work, compared across ranks. Waiting for the others (sync, and the
# residual) is left out: under DDP a straggler's extra work shows as the others' sync.
INPUT_PHASES: Final[tuple[str, ...]] = (DATALOADER, H2D)
COMPUTE_PHASES: Final[tuple[str, ...]] = (FORWARD, BACKWARD, OPTIMIZER)
LOCAL_PHASES: Final[tuple[str, ...]] = INPUT_PHASES + COMPUTE_PHASES
# Time spent waiting for others, not working.
WAITING_PHASES: Final[tuple[str, ...]] = (SYNC, WAIT)

# --- diagnosis labels ---------------------------------------------------------------------

BALANCED: Final = "BALANCED"
INPUT_STRAGGLER: Final = "INPUT STRAGGLER"
COMPUTE_STRAGGLER: Final = "COMPUTE STRAGGLER"
STRAGGLER: Final = "STRAGGLER"
INPUT_BOUND: Final = "INPUT-BOUND"
WAIT_HEAVY: Final = "WAIT-HEAVY"
HANG: Final = "HANG"
WARMUP: Final = "WARMUP"
# Some phase the verdict depends on could not be timed: better no verdict than a wrong one.
TIMING_INCOMPLETE: Final = "TIMING INCOMPLETE"
# A few steps of one rank (or of every rank) far above its typical step, recurring with a
# period: a checkpoint, an evaluation, an upload that every other rank waits for.
PERIODIC_STALL: Final = "PERIODIC STALL"
# Every rank waits in collectives for most of its step and no rank is behind.
COMM_BOUND: Final = "COMM-BOUND"
LABELS: Final[tuple[str, ...]] = (
    BALANCED, INPUT_STRAGGLER, COMPUTE_STRAGGLER, STRAGGLER, INPUT_BOUND, WAIT_HEAVY, HANG,
    WARMUP, TIMING_INCOMPLETE, PERIODIC_STALL, COMM_BOUND)
# Labels that name a culprit every rank waits for, with its per-step gap.
STRAGGLER_LABELS: Final[tuple[str, ...]] = (INPUT_STRAGGLER, COMPUTE_STRAGGLER, STRAGGLER)

# --- severities, in increasing order --------------------------------------------------------

INFO: Final = "info"
WARNING: Final = "warning"
CRITICAL: Final = "critical"
SEVERITIES: Final[tuple[str, ...]] = (INFO, WARNING, CRITICAL)

# --- files and folders of a run folder (OUT/NAME/) -------------------------------------------

SECRET_KEY: Final = "secret.key"            # the run's shared secret (0600)
COLLECTOR_JSON: Final = "collector.json"    # where viewers find the collector
COLLECTOR_LOG: Final = "collector.log"
LAUNCHER_LOG: Final = "launcher.log"
RELAY_LOG: Final = "relay.log"              # a node relay's (per node: relay-node1.log)
LIVE_SNAPSHOT_JSON: Final = "live_snapshot.json"
SUMMARY_JSON: Final = "final_summary.json"
SUMMARY_TXT: Final = "final_summary.txt"
NETCHECK_JSON: Final = "netcheck.json"
LOGS_DIR: Final = "logs"                    # the ranks' stdout/stderr (and nccl/)
STEP_LOG_DIR: Final = "steps"               # the per-step record of every rank
TRACES_DIR: Final = "traces"                # deep-trace captures


def format_ranks(ranks: Iterable[int]) -> str:
    """Sorted ranks as compact ranges: 0-3,5,7-9."""
    out: list[str] = []
    start = prev = None
    for r in sorted(set(ranks)):
        if prev is not None and r == prev + 1:
            prev = r
            continue
        if start is not None:
            out.append(f"{start}-{prev}" if prev != start else str(start))
        start = prev = r
    if start is not None:
        out.append(f"{start}-{prev}" if prev != start else str(start))
    return ",".join(out)
