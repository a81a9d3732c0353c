"""What a straggler's host says about its gap: its training thread's wait for a CPU core
against the other ranks', and its GPU's health (throttling, a low clock). Pure functions
of the ranks' table, said in the straggler's verdict (diagnosis._straggler) beside, or in
place of, the model-side advice; docs/diagnosis.md gives the reasoning for each
threshold."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import isfinite
from typing import TypeGuard

import numpy as np

from .timings import GpuHealth, Table, Timings, median_of
from .windows import median

# GPU health beside a COMPUTE STRAGGLER (docs/diagnosis.md, "GPU health"). NVML's reasons
# that slow the clocks for the GPU's own sake; "idle", "app clocks", "sync boost" and
# "display clocks" are settings or states, not a fault of the board.
THROTTLE_FAULTS = ("hw thermal", "sw thermal", "power brake", "hw slowdown", "power cap")
# An SM clock this share below the median rank's is named: GPU Boost moves clocks a few
# per cent under load (15 MHz steps), so 10% is beyond its wander, and alone slows the
# rank's kernels about as much as SKEW_ENTER's gap.
CLOCK_LOW_SHARE = 0.10
# A straggler is slowed by its host's CPUs, not by more work, when its training thread
# waited for a core (the kernel's run queue) at least this share of its gap longer per
# step than the median other rank's share of waiting would make it wait: other work
# shares its cores. Half: the wait then accounts for most of what sets the rank apart,
# and telling the user to look for extra model-side work would send them the wrong way.
CPU_WAIT_EXPLAINS = 0.5
# A straggler's cores do not explain its gap, but the other ranks' training threads (the
# median one) waited for a core at least this share of the time they were ready to run:
# the host's cores are shared (more runnable threads than cores: other ranks, their
# communication threads, loader workers, another job), and on such a host a rank can
# run slower for a stretch with no work of its own (a busier core, a busy SMT sibling,
# a shared cache), which its own wait need not show. The model-side advice then says
# so, where that usual wait, in ms a step, is CPU_WAIT_EXPLAINS of the gap or more (were
# it to fall on one rank it would account for the gap as its own wait would): a gap far
# larger (a sleeping loader's 30 ms beside others waiting 4 ms a step) is not the host's;
# and where the culprit's own time on a CPU or waiting for one is no less than the median
# other rank's. Not more by some share of the gap: a step's shares cannot say *where* in
# the step a thread waited, and a wait that falls in a compute phase delays every rank
# while one in the exposed sync delays none. Beside a CPU hog, an even tiny-model job's
# rank 0 spent 2.2 ms more in backward for 32 steps (fresh-clone run 48) having run and
# waited per step about as the others (+0.6 ms): the same job without the agent, timed by
# hand, showed its slow backwards to be the same CPU time plus ~2 involuntary context
# switches each (preempted, not asleep). A thread ready for less of the step than the
# others lost its gap asleep (a sleep, I/O, a lock: fresh-clone run 46's 8 ms sleep, ready
# 4.4 ms a step less), which no sharing of cores explains.
# A sixth of the ready time: measured on a 2-core box, 3 ranks of a compute-heavy job
# waited 3-6 %, 3 tiny-model ranks on gloo 7-25 % (their communication threads share the
# cores), the same beside a CPU hog 14-22 %, where rank 0 was sent to "check its
# model-side work" for a stretch of 32 steps (fresh-clone run 40).
HOST_SHARED_WAIT = 0.15
# A sample's shares are the steps' only where the rank spent at least this share of the
# sample's interval inside steps (Sys.stepping_pct); below it the rest (start-up,
# evaluation, a checkpoint, a wait for the other ranks to start) weighs as much as the
# steps, and is read as not read (CPU_UNREAD). Seen in a restarted job's second attempt
# (fresh-clone run 49): 20 steps of 3 ms in a sample of start-up, its thread 1.3 % on a
# CPU, sent rank 0 to "check its model-side work" for 2 ms of backward.
CPU_STEPPING_MIN_PCT = 50.0


def _finite(value: float | None) -> TypeGuard[float]:
    return value is not None and isfinite(value)


GPU_ADVICE = ("check its cooling, power limit and clocks (nvidia-smi -q -d "
               "PERFORMANCE,TEMPERATURE,POWER)")


def _faults(gpu: GpuHealth) -> list[str]:
    return [f for f in THROTTLE_FAULTS if f in gpu.throttle]


def _median_clock(gpus: Sequence[GpuHealth]) -> float | None:
    clocks = [c for g in gpus if _finite(c := g.sm_clock_mhz)]
    return median(clocks) if clocks else None


def node_gpu_evidence(ranks: Table, members: Sequence[int]) -> str | None:
    """What a slow node's GPUs say: how many are throttled (THROTTLE_FAULTS), or their
    median SM clock CLOCK_LOW_SHARE below the other nodes'."""
    gpus = Timings.of(ranks).gpus()
    inside = [g for r, g in gpus.items() if r in members]
    outside = [g for r, g in gpus.items() if r not in members]
    if not inside:
        return None
    hot = [g for g in inside if _faults(g)]
    mine, theirs = _median_clock(inside), _median_clock(outside)
    vs, low = "", False
    if mine is not None and theirs:
        vs = f", SM clock median {mine:.0f} MHz vs {theirs:.0f} on the other nodes"
        low = mine <= (1.0 - CLOCK_LOW_SHARE) * theirs
    if not hot and not low:
        return None
    if not hot:
        return f"its GPUs clock low{vs}"
    named = [f for f in THROTTLE_FAULTS if any(f in g.throttle for g in hot)]
    return f"{len(hot)} of its {len(inside)} GPUs are throttled ({', '.join(named)}){vs}"


def ready_waits(t: Timings) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row: the share of its ready time (on a CPU or waiting for one) the training
    thread waited, and its ms a step on a CPU and waiting; NaN where not read."""
    run, wait = t.cpu_run, t.cpu_wait
    with np.errstate(invalid="ignore", divide="ignore"):
        waited = np.where(run > 0, wait / (wait + run), np.nan)
    return waited, run * t.step_ms, wait * t.step_ms


def _usual_wait(waited: np.ndarray, outside: np.ndarray) -> float | None:
    """The median share of ready time waited over the rows `outside` the culprit; None
    unless at least half of them were read (the median of a few is no median rank) or
    where they never ran."""
    others = waited[outside]
    known = others[np.isfinite(others)]
    if not len(known) or 2 * len(known) < len(others):
        return None
    usual = median_of(known)
    return usual if usual < 1.0 else None


def cpu_explains(extra_ms: float, gap_ms: float) -> bool:
    return extra_ms >= CPU_WAIT_EXPLAINS * gap_ms  # NaN compares False


CPU_ADVICE = ("other work shares its cores (other processes, DataLoader workers, intra-op "
               "threads); give each rank cores of its own (taskset or numactl, fewer "
               "DataLoader workers, OMP_NUM_THREADS)")


# Said beside a straggler's advice when its CPU wait cannot be compared (not read yet: the
# first share comes a sample after the training thread is known; or too few other ranks
# read): the model-side advice alone would be a confident guess (a rank of a 2-core box
# beside a busy process was sent to look for model-side work at step 12).
CPU_UNREAD = ("how long its training thread waited for a core was not read: other work "
               "sharing its cores is not ruled out")


@dataclass(frozen=True, slots=True)
class CpuWait:
    """What a straggler's CPU wait says about its gap, in one reading: `explains` (the
    evidence, said in place of the model-side advice) where its cores explain
    CPU_WAIT_EXPLAINS of the gap; `read` False where it cannot be compared with the
    median rank's (its own share not read, or too few of the others': CPU_UNREAD)."""

    read: bool
    explains: str | None = None
    # Where the cores are shared enough to matter (HOST_SHARED_WAIT): the median other
    # rank's share of ready time waited; None otherwise.
    usual: float | None = None


def cpu_wait(ranks: Table, rank: int, gap_ms: float) -> CpuWait:
    """The culprit's CPU wait against the median rank's (CpuWait).

    Compared as the share of its ready time (on a CPU or waiting for one) the training
    thread waited: on an evenly busy host every thread waits that share, so a rank with
    more work also waits longer, and only the wait beyond what the median rank's share
    gives its own CPU time is the CPU's doing."""
    t = Timings.of(ranks)
    i = t.row(rank)
    if i is None:
        return CpuWait(read=False)
    waited, run_ms, wait_ms = ready_waits(t)
    others = np.arange(len(t)) != i
    usual = _usual_wait(waited, others)
    if usual is None or not waited[i] == waited[i]:
        return CpuWait(read=False)
    mine = float(wait_ms[i])
    if not cpu_explains(mine - float(run_ms[i]) * usual / (1.0 - usual), gap_ms):
        # The shared host's caveat (HOST_SHARED_WAIT), unless the culprit's thread was
        # ready (on a CPU or waiting for one) for less of the step than the others: it
        # then lost its gap asleep (a sleep, I/O, a lock), no sharing's doing.
        read = others & np.isfinite(waited)  # the others read (as _usual_wait counts them)
        ready = float(run_ms[i] + wait_ms[i]) - median_of(wait_ms[read] + run_ms[read])
        shared = (usual >= HOST_SHARED_WAIT and cpu_explains(median_of(wait_ms[read]), gap_ms)
                  and ready >= 0.0)
        return CpuWait(read=True, usual=usual if shared else None)
    return CpuWait(True, f"its training thread waited {mine:.1f} ms of each step for a CPU "
                         f"core, {waited[i]:.0%} of the time it was ready to run against "
                         f"{usual:.0%} on the median rank: {CPU_ADVICE}", usual)


def node_cpu_evidence(ranks: Table, members: Sequence[int], gap_ms: float) -> str | None:
    """What a slow node's CPUs say: its ranks' training threads waited for a core beyond
    the other nodes' median share of waiting, by half the gap or more (the median rank of
    the node); None otherwise, or where too few waits were read."""
    t = Timings.of(ranks)
    inside = np.isin(t.ranks, np.asarray(members, dtype=np.int64))
    waited, run_ms, wait_ms = ready_waits(t)
    usual = _usual_wait(waited, ~inside)
    mine = waited[inside]
    if usual is None or 2 * int(np.isfinite(mine).sum()) < len(mine):
        return None
    extra = wait_ms[inside] - run_ms[inside] * usual / (1.0 - usual)
    if not cpu_explains(median_of(extra), gap_ms):
        return None
    return (f"its ranks' training threads waited {median_of(wait_ms[inside]):.1f} ms of each "
            f"step for a CPU core, {median_of(mine):.0%} of the time they were ready to run "
            f"against {usual:.0%} on the other nodes: other work shares its cores (other "
            f"jobs or processes on that host, DataLoader workers, intra-op threads)")


def gpu_evidence(ranks: Table, rank: int) -> tuple[str, bool] | None:
    """What the culprit's GPU says about a compute straggler: throttled for one of
    THROTTLE_FAULTS, or an SM clock CLOCK_LOW_SHARE below the median rank's; and whether
    that sets it apart (a low clock, or a throttle that most other ranks do not share)."""
    gpus = Timings.of(ranks).gpus()
    mine = gpus.get(rank)
    if mine is None:
        return None
    faults = [f for f in THROTTLE_FAULTS if f in mine.throttle]
    clocks = [c for g in gpus.values() if _finite(c := g.sm_clock_mhz)]
    mid = median(clocks) if len(clocks) >= 2 else None
    clock = mine.sm_clock_mhz
    low = (_finite(clock) and mid is not None and mid > 0
           and clock <= (1.0 - CLOCK_LOW_SHARE) * mid)
    if not faults and not low:
        return None
    vs = f", SM clock {clock:.0f} MHz vs median {mid:.0f}" if _finite(clock) and mid else ""
    if faults:
        seen = [g for r, g in gpus.items() if r != rank]
        also = sum(1 for g in seen if any(f in g.throttle for f in faults))
        others = f" (as are {also} of {len(seen)} other ranks')" if also else ""
        text = f"rank {rank}'s GPU is throttled ({', '.join(faults)}){others}{vs}"
        return text, bool(low) or 2 * also < len(seen)
    return f"rank {rank}'s GPU clocks low{vs}", True
