"""A straggler slowed by its host's CPUs, not by more work (docs/diagnosis.md, "CPU wait
beside a straggler"): the agent reads the training thread's run-queue wait from the
kernel, the collector averages it over the intervals the rank stepped in, and the
diagnosis says so when that wait explains the gap."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from traceml_agent.protocol import PHASES, Identity, decode, encode
from traceml_agent.sysmetrics import RunQueueWait, SystemSampler
from traceml_tui.judge import diagnosis as dx
from traceml_tui.judge.state import CPU_WAIT_WEIGHT, RunState
from traceml_tui.report import summary

T0 = 1_700_000_000.0
HAS_SCHEDSTAT = os.path.exists(f"/proc/self/task/{threading.get_native_id()}/schedstat")


# --- the rule: table-driven, pure ----------------------------------------------------------

def ranks(waits: dict[int, float | None], slow: int = 3, phase: str = "backward",
          gap: float = 20.0) -> list[dx.RankTiming]:
    """Four ranks of 100 ms steps; rank `slow` spends `gap` ms more in `phase`; `waits`:
    each rank's share of its time waiting for a CPU (absent: 2 %)."""
    out = []
    for r in range(4):
        phase_ms = {"dataloader": 1.0, "h2d": 1.0, "forward": 20.0, "backward": 40.0,
                    "optimizer": 5.0, "sync": 10.0}
        if r == slow:
            phase_ms[phase] += gap
        out.append(dx.RankTiming(r, 20, 100.0, phase_ms, cpu_wait=waits.get(r, 0.02)))
    return out


# (name, waits, the label, whether the CPU evidence is given). The gap is 20 ms of 100 ms
# steps: the CPU explains it from 10 ms of extra wait per step (CPU_WAIT_EXPLAINS 0.5).
CASES = [
    ("culprit waited 15 ms more than the others", {3: 0.17}, dx.COMPUTE_STRAGGLER, True),
    ("just half the gap", {3: 0.12}, dx.COMPUTE_STRAGGLER, True),
    ("under half the gap: its own work", {3: 0.11}, dx.COMPUTE_STRAGGLER, False),
    ("every rank waits as long: no one set apart", {r: 0.3 for r in range(4)},
     dx.COMPUTE_STRAGGLER, False),
    ("a bystander waits, not the culprit", {1: 0.5}, dx.COMPUTE_STRAGGLER, False),
    ("the culprit's wait not read", {3: None}, dx.COMPUTE_STRAGGLER, False),
    ("no other rank's wait read", {0: None, 1: None, 2: None, 3: 0.5},
     dx.COMPUTE_STRAGGLER, False),
]


@pytest.mark.parametrize("name, waits, label, cpu", CASES, ids=[c[0] for c in CASES])
def test_a_stragglers_cpu_wait_is_named_when_it_explains_the_gap(name, waits, label, cpu):
    d = dx.diagnose(ranks(waits))
    assert (d.label, d.rank) == (label, 3)
    assert ("for a CPU core" in d.summary) == cpu, d.summary
    assert ("model-side work" in d.summary) == (not cpu), d.summary


def test_the_evidence_gives_the_wait_per_step_against_the_median_rank():
    d = dx.diagnose(ranks({3: 0.17}))
    assert "waited 17.0 ms of each step for a CPU core, 15.0 ms more than the median rank's" \
        in d.summary, d.summary  # 17 % of its 100 ms step, against 2 % of the others


def test_an_input_straggler_on_a_starved_core_gets_the_cpu_evidence_too():
    d = dx.diagnose(ranks({3: 0.2}, phase="dataloader"))
    assert d.label == dx.INPUT_STRAGGLER and "for a CPU core" in d.summary, d.summary


def test_a_throttled_gpu_is_said_beside_the_cpu():
    rows = ranks({3: 0.2})
    rows[3] = dx.RankTiming(3, 20, 100.0, rows[3].phase_ms, cpu_wait=0.2,
                            gpu=dx.GpuHealth(1410.0, ("hw thermal",), 300.0, 90.0))
    for r in range(3):
        rows[r] = dx.RankTiming(r, 20, 100.0, rows[r].phase_ms, cpu_wait=0.02,
                                gpu=dx.GpuHealth(1980.0, (), 300.0, 60.0))
    d = dx.diagnose(rows)
    cpu, gpu = d.summary.find("for a CPU core"), d.summary.find("GPU is throttled")
    assert 0 < cpu < gpu, d.summary


# --- the collector: averaged over the intervals the rank stepped in -----------------------

def _state() -> tuple[RunState, Identity]:
    state = RunState("cpu", world_size=1, started_at=T0)
    return state, Identity(0, 0, 0, "host0", 100, 1)


def _steps(state: RunState, ident: Identity, first: int, last: int) -> None:
    records = [[s, T0 + s, 50.0, *(5.0 for _ in PHASES)] for s in range(first, last + 1)]
    state.ingest(decode(encode("steps", ident, 0, T0, phases=list(PHASES), records=records)),
                 now=1.0)


def _sys(state: RunState, ident: Identity, pct: float | None) -> None:
    state.ingest(decode(encode("sys", ident, 1, T0, cpu_wait_pct=pct)), now=1.0)


def test_the_collector_counts_only_samples_of_intervals_the_rank_stepped_in():
    state, ident = _state()
    _sys(state, ident, 90.0)  # before any step: the job's start-up, not its steps
    assert state.ranks[0].cpu_wait is None
    _steps(state, ident, 0, 9)
    _sys(state, ident, 40.0)
    assert state.ranks[0].cpu_wait == pytest.approx(0.4)
    _sys(state, ident, 0.0)  # no step since: blocked in a collective, or done
    assert state.ranks[0].cpu_wait == pytest.approx(0.4)
    _steps(state, ident, 10, 19)
    _sys(state, ident, 80.0)
    assert state.ranks[0].cpu_wait == pytest.approx(0.4 + CPU_WAIT_WEIGHT * 0.4)
    _steps(state, ident, 20, 29)
    _sys(state, ident, None)  # not read this time (an old agent, no schedstat)
    assert state.ranks[0].cpu_wait == pytest.approx(0.4 + CPU_WAIT_WEIGHT * 0.4)


def test_the_summary_row_carries_the_average_and_the_sample_the_latest():
    state, ident = _state()
    _steps(state, ident, 0, 9)
    _sys(state, ident, 33.3)
    doc = summary.build(state.snapshot(T0 + 2, 2.0, full=True), summary.RunMeta())
    row = doc["ranks"][0]
    assert row["cpu_wait_pct"] == 33.3 and row["sys"]["cpu_wait_pct"] == 33.3


# --- the agent: the kernel's run queue, on a real core ------------------------------------

HOG = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    sum(range(10000))\n"


@pytest.mark.skipif(not HAS_SCHEDSTAT, reason="this kernel keeps no scheduler statistics")
def test_a_thread_sharing_its_core_with_busy_processes_is_seen_waiting():
    """The training thread pinned to one core beside two busy processes: it gets about a
    third of it and waits the rest; a sleeping thread waits for nothing."""
    core = max(os.sched_getaffinity(0))
    result: dict[str, float | None] = {}

    def busy_on_core() -> None:
        os.sched_setaffinity(0, {core})  # this thread only
        wait = RunQueueWait()
        wait.share(threading.get_ident(), time.monotonic())
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            sum(range(1000))
        result["busy"] = wait.share(threading.get_ident(), time.monotonic())

    def sleeping() -> None:
        wait = RunQueueWait()
        wait.share(threading.get_ident(), time.monotonic())
        time.sleep(1.0)
        result["sleeping"] = wait.share(threading.get_ident(), time.monotonic())

    hogs = [subprocess.Popen([sys.executable, "-c", HOG],
                             preexec_fn=lambda: os.sched_setaffinity(0, {core}))
            for _ in range(2)]
    try:
        threads = [threading.Thread(target=busy_on_core), threading.Thread(target=sleeping)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    assert result["busy"] is not None and result["busy"] > 0.4, result
    assert result["sleeping"] is not None and result["sleeping"] < 0.1, result


def test_the_sampler_says_nothing_of_a_thread_it_cannot_read():
    sampler = SystemSampler()
    assert sampler.sample(None)["cpu_wait_pct"] is None  # no training thread yet
    assert sampler.sample(-12345)["cpu_wait_pct"] is None  # no such thread
    me = threading.get_ident()
    assert sampler.sample(me)["cpu_wait_pct"] is None  # the first read: no interval yet
    time.sleep(0.05)
    second = sampler.sample(me)["cpu_wait_pct"]
    assert (second is None) == (not HAS_SCHEDSTAT)
    if second is not None:
        assert 0.0 <= second <= 100.0


def test_a_restarted_rank_starts_without_the_old_processs_wait():
    state, ident = _state()
    _steps(state, ident, 0, 9)
    _sys(state, ident, 60.0)
    assert state._live_table().cpu_wait.tolist() == [pytest.approx(0.6)]
    again = Identity(0, 0, 0, "host0", 101, 1)  # a new process says hello
    state.ingest(decode(encode("hello", again, 0, T0, run="cpu")), now=2.0)
    assert state.ranks[0].cpu_wait is None
    _steps(state, again, 0, 9)
    assert np.isnan(state._live_table().cpu_wait).all()  # not read for the new process


# --- what the user sees: the banner's evidence, the worst-rank panel -----------------------

def _starved_state():
    """A canned 8-rank job whose rank 2 is behind in backward; each rank's sys samples
    say how long its training thread waited for a CPU, rank 2's far longer."""
    from traceml_tui.collect.canned import make_state

    state = make_state(world_size=8, straggler=2, phase="backward")
    for rank in range(8):
        ident = state.ranks[rank].ident
        nxt = state.ranks[rank].last_step + 1  # a step in the sample's interval
        state.ingest(decode(encode("steps", ident, 4, T0, phases=list(PHASES), records=[
            [nxt, T0 + nxt, 35.0, *(1.0 for _ in PHASES)]])), 0.0)
        state.ingest(decode(encode("sys", ident, 5, T0, cpu_pct=35.0,
                                   cpu_wait_pct=85.0 if rank == 2 else 3.0)), 0.0)
    for tick in range(3):
        state.evaluate(T0 + 10 + tick)
    return state


def test_the_panel_shows_a_long_wait_for_a_cpu_and_not_a_short_one():
    from traceml_tui.collect import view_build

    snap = _starved_state().snapshot(T0 + 13, 14.0, full=True)
    view = view_build.build(snap)
    culprit, bystander = (view_build.detail(snap, r, view, ()) for r in (2, 3))
    assert culprit is not None and bystander is not None
    assert culprit.cpu == "CPU 35%  its training thread waited 85% of its time for a core"
    assert bystander.cpu is None  # 3 %: a machine's ordinary scheduling


async def test_the_dashboard_says_the_culprit_waited_for_a_cpu_where_the_user_looks():
    from rich.console import Console

    from traceml_tui.collect.canned import StaticSource
    from traceml_tui.view.dashboard import DashboardApp
    from traceml_tui.view.dashboard.banner import Banner
    from traceml_tui.view.dashboard.rank_panel import RankPanel

    def text_of(widget) -> str:
        console = Console(width=300, record=True, file=open(os.devnull, "w"))
        console.print(widget.content)
        return " ".join(console.export_text().split())

    app = DashboardApp(StaticSource(_starved_state()), refresh_s=0.05)
    async with app.run_test(size=(160, 50)) as pilot:
        for _ in range(200):
            if app.state is not None:
                break
            await pilot.pause(0.05)
        worst = text_of(app.query_one("#worst", RankPanel))
        assert "rank 2" in worst and "waited 85% of its time for a core" in worst, worst
        banner = text_of(app.query_one(Banner))
        assert "COMPUTE STRAGGLER" in banner and "for a CPU core" in banner, banner
