"""The product's words, defined once: phases, labels, severities, rank lists, run files.

Every layer imports them from here (the agent, the collector, the view model, the
dashboard, the summary's readers), so a word cannot drift between the process that
writes it and the one that reads it. A phase is one row of PHASE_TABLE (plus the hook
that times it): tests/view/test_phase_table.py adds one that way.
This module is the bottom layer: it imports nothing of the product and nothing
heavy (the agent loads it inside every rank).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final, NamedTuple

# --- phases of one optimizer step ---------------------------------------------------------
#
# PHASE_TABLE below is the one place a phase is declared: every list of phases, the
# recorder's indices, the hang's order, the dashboard's headers, the own-work set and the
# stall hints derive from it. Adding a phase is its row here plus the hook that times it
# (agent/hooks.py, or traceml_agent.phase() in the user's code).

DATALOADER: Final = "dataloader"
H2D: Final = "h2d"
FORWARD: Final = "forward"
BACKWARD: Final = "backward"
# The exposed collective wait: time in collectives after the rank's own work is done.
SYNC: Final = "sync"
OPTIMIZER: Final = "optimizer"
# The residual: step time outside every measured phase (derived, never recorded).
WAIT: Final = "wait"

# Groups of phases. The first three are a rank's own work, compared across ranks;
# waiting for the others is left out: under DDP a straggler's extra work shows as the
# others' sync.
INPUT: Final = "input"        # feeding the step: the diagnosis's INPUT verdicts
COMPUTE: Final = "compute"    # the model's work: the diagnosis's COMPUTE verdicts
OTHER_WORK: Final = "other work"  # the rank's own work that is neither (a checkpoint)
WAITING: Final = "waiting"    # time spent waiting for the others, not working
OWN_WORK_GROUPS: Final[tuple[str, ...]] = (INPUT, COMPUTE, OTHER_WORK)


class Phase(NamedTuple):
    """One row of the phase table."""

    name: str
    short: str  # the dashboard's column header (at most 7 characters)
    group: str  # INPUT, COMPUTE, OTHER_WORK or WAITING
    # Timed by the agent; False: derived by the collector (only the residual, listed last).
    measured: bool = True
    # On a GPU job, timed with CUDA events (its work is queued on the device, so the host
    # clock would measure the launch, not the work); otherwise by the host clock.
    device: bool = False
    # Where a rank's periodic stall in this phase usually comes from (PERIODIC STALL);
    # "" says "in <name>".
    stall_hint: str = ""


# One row per phase, in display and wire order (the order is the row's position).
PHASE_TABLE: Final[tuple[Phase, ...]] = (
    Phase(DATALOADER, "data", INPUT, stall_hint="in the DataLoader: a worker restart, a "
          "shard or file opened every few steps"),
    Phase(H2D, "h2d", INPUT, device=True),
    Phase(FORWARD, "fwd", COMPUTE, device=True),
    Phase(BACKWARD, "bwd", COMPUTE, device=True),
    Phase(SYNC, "sync", WAITING, device=True),
    Phase(OPTIMIZER, "opt", COMPUTE, device=True),
    Phase(WAIT, "wait", WAITING, measured=False, stall_hint="outside forward, backward and "
          "the optimizer: checkpointing, evaluation, logging or uploads between steps"),
)

# Display and wire order.
PHASES: Final[tuple[str, ...]] = tuple(p.name for p in PHASE_TABLE)
# The phases the recorder times (everything but the derived residual), by index.
MEASURED_PHASES: Final[tuple[str, ...]] = tuple(p.name for p in PHASE_TABLE if p.measured)
# The wire sends the measured phases, then the residual, then custom phases (transport.py).
assert PHASES == (*MEASURED_PHASES, WAIT), "the residual is the table's last row, and unmeasured"
INPUT_PHASES: Final[tuple[str, ...]] = tuple(p.name for p in PHASE_TABLE if p.group == INPUT)
COMPUTE_PHASES: Final[tuple[str, ...]] = tuple(p.name for p in PHASE_TABLE
                                               if p.group == COMPUTE)
# A rank's own work: the one definition of it (summed by the diagnosis, the history, the
# dashboard's "worst first" ordering and distribution, the metrics).
LOCAL_PHASES: Final[tuple[str, ...]] = tuple(p.name for p in PHASE_TABLE
                                             if p.group in OWN_WORK_GROUPS)
# Time spent waiting for others, not working.
WAITING_PHASES: Final[tuple[str, ...]] = tuple(p.name for p in PHASE_TABLE
                                               if p.group == WAITING)
# The recorder's device-timed phases (recorder.CudaRecorder).
DEVICE_PHASES: Final[tuple[str, ...]] = tuple(p.name for p in PHASE_TABLE if p.device)
# The dashboard's column headers.
SHORT_NAMES: Final[dict[str, str]] = {p.name: p.short for p in PHASE_TABLE}
# Where a periodic stall in a phase comes from, for the phases that have a hint.
STALL_HINTS: Final[dict[str, str]] = {p.name: p.stall_hint for p in PHASE_TABLE
                                      if p.stall_hint}
# Steps numbered below this are warm-up: counted and kept in the step log, never in the
# windows the diagnosis reads (judge/windows.py), nor in the stepping time an agent's
# sample reports (transport.py): step 0 carries one-off costs no later step has (model.to,
# CUDA context and cudnn autotuning, DDP's first bucket rebuild and its wait for every
# rank to start, torch.compile).
WARMUP_STEPS: Final = 1

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
# The slowest rank changes from step to step (uneven batches drawn afresh each step) and
# every rank waits for whichever it is: no one rank to blame, the work per step to even.
LOAD_IMBALANCE: Final = "LOAD IMBALANCE"
LABELS: Final[tuple[str, ...]] = (
    BALANCED, INPUT_STRAGGLER, COMPUTE_STRAGGLER, STRAGGLER, INPUT_BOUND, WAIT_HEAVY, HANG,
    WARMUP, TIMING_INCOMPLETE, LOAD_IMBALANCE, PERIODIC_STALL, COMM_BOUND)

# --- severities, in increasing order --------------------------------------------------------

INFO: Final = "info"
WARNING: Final = "warning"
CRITICAL: Final = "critical"
SEVERITIES: Final[tuple[str, ...]] = (INFO, WARNING, CRITICAL)

# --- files and folders of a run folder (OUT/NAME/) -------------------------------------------
# Their names only: traceml_tui/runfolder/layout.py makes the paths (and names the files
# only the product writes); the agent joins SECRET_KEY and TRACES_DIR itself.

SECRET_KEY: Final = "secret.key"            # the run's shared secret (0600)
COLLECTOR_JSON: Final = "collector.json"    # where viewers find the collector
COLLECTOR_LOG: Final = "collector.log"
LAUNCHER_LOG: Final = "launcher.log"
RELAY_LOG: Final = "relay.log"              # a node relay's (per node: relay-node1.log)
RELAY_SOCKET: Final = "relay.sock"          # its ranks' Unix socket (relay-node1.sock)
LIVE_SNAPSHOT_JSON: Final = "live_snapshot.json"
SUMMARY_JSON: Final = "final_summary.json"
SUMMARY_TXT: Final = "final_summary.txt"
NETCHECK_JSON: Final = "netcheck.json"
LOGS_DIR: Final = "logs"                    # the ranks' stdout/stderr (and nccl/)
STEP_LOG_DIR: Final = "steps"               # the per-step record of every rank
TRACES_DIR: Final = "traces"                # deep traces (agent/capture.py)

# The memory a growth finding is about (judge/memory.py): the host's RSS or the GPU's.
MEMORY_HOST: Final = "host"
MEMORY_GPU: Final = "gpu"


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

# The most steps one deep trace covers (a capture request's bound, the agent's check): a
# deep trace is for reading, not for a whole run, so its files stay small.
MAX_CAPTURE_STEPS: Final = 50
