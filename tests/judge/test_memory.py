"""Memory over time, per rank (judge/memory.py): the growth rule over one series (a leak,
a plateau after warm-up, the allocator's cache steps, noise, too few samples), the
imbalance across ranks, the bounded series of a long run, and the collector fed real
wire messages up to the summary's `memory` section and text lines."""

from __future__ import annotations

import numpy as np
import pytest

from traceml_agent.protocol import Identity, decode, encode
from traceml_agent.sysmetrics import MemoryHeadroom
from traceml_tui.judge import diagnosis as dx
from traceml_tui.judge import memory as mem
from traceml_tui.judge.state import RunState
from traceml_tui.report import summary
from traceml_tui.runfolder import summary_model as model

T0 = 1_700_000_000.0
RNG = np.random.default_rng(7)
T = np.arange(60.0)  # a minute of samples, one a second


def noisy(y: np.ndarray, sd: float = 8.0) -> np.ndarray:
    return y + RNG.normal(0.0, sd, len(y))


def staircase(steps_at: tuple[float, ...], height: float) -> np.ndarray:
    return 400.0 + sum((T >= at) * height for at in steps_at)


# (what, series MB over T, growing?)
GROWTH_CASES = [
    ("a leak of 10 MB/s", noisy(400.0 + 10.0 * T), True),
    ("a slow leak, 2 MB/s, from 2 GB", noisy(2000.0 + 2.0 * T), False),  # rise 88 < 10 %
    ("a slow leak, 2 MB/s, from 400 MB", noisy(400.0 + 2.0 * T), True),
    ("a leak that starts after warm-up growth", noisy(400 + 30 * np.minimum(T, 5) + 5 * T),
     True),
    ("growth during warm-up, then a plateau", noisy(400 + 40.0 * np.minimum(T, 12)), False),
    ("one step of the allocator's cache", staircase((40.0,), 256.0), False),
    ("two cache steps, the last third flat", staircase((20.0, 35.0), 128.0), False),
    ("noise of 40 MB around a level", noisy(np.full(60, 800.0), 40.0), False),
    ("memory that falls", noisy(1200.0 - 8.0 * T), False),
    ("a leak that stopped halfway", noisy(400 + 10.0 * np.minimum(T, 35)), False),
]


@pytest.mark.parametrize("what, mb, grows", GROWTH_CASES, ids=[c[0] for c in GROWTH_CASES])
def test_growth(what, mb, grows):
    fit = mem.growth(T, mb)
    assert fit is not None and fit.growing == grows, fit


def test_the_rate_is_the_leaks():
    fit = mem.growth(T, noisy(400.0 + 10.0 * T))
    assert fit is not None and fit.rate_mb_s == pytest.approx(10.0, rel=0.05)
    assert fit.rise_mb == pytest.approx(10.0 * fit.span_s, rel=0.05)


@pytest.mark.parametrize("t", [np.arange(10.0), np.arange(0.0, 12.0, 0.5), np.array([0.0])],
                         ids=["ten samples", "twelve seconds", "one sample"])
def test_too_few_samples_or_seconds_are_not_judged(t):
    assert mem.growth(t, 400.0 + 50.0 * t) is None


def test_samples_not_read_are_left_out():
    mb = 400.0 + 10.0 * T
    mb[::3] = np.nan
    fit = mem.growth(T, mb)
    assert fit is not None and fit.growing


# (what, MB by rank, the rank that stands out or None)
IMBALANCE_CASES = [
    ("one rank at 2x", [300.0, 310.0, 620.0, 305.0], 2),
    ("all equal", [300.0, 310.0, 305.0, 300.0], None),
    ("twice as big but small", [40.0, 40.0, 100.0], None),
    ("1.3x is not 1.5x", [1000.0, 1000.0, 1300.0], None),
    ("one rank read", [300.0, float("nan")], None),
]


@pytest.mark.parametrize("what, mb, rank", IMBALANCE_CASES, ids=[c[0] for c in IMBALANCE_CASES])
def test_imbalance(what, mb, rank):
    got = mem.imbalance(np.arange(len(mb)), np.array(mb))
    assert (None if got is None else got[0]) == rank


def test_a_days_run_is_held_in_fixed_arrays_and_its_slope_still_read():
    s = mem._Series()
    for i in range(86_400):  # a day at one sample a second, leaking 1 MB a minute
        s.add(float(i), 1000.0 + i / 60.0, float("nan"))
    assert s.kept <= mem.WHOLE and s.ring.shape == (mem.RING, 3)
    whole = s.whole[: s.kept]
    assert whole[0, 0] == 0.0 and np.all(np.diff(whole[:, 0]) > 0)
    fit = mem._judged(s, 1)
    assert fit is not None and fit.growing and fit.rate_mb_s * 60 == pytest.approx(1.0)


def test_a_leak_late_in_a_long_run_is_read_from_the_newest_samples():
    s = mem._Series()
    for i in range(7200):  # two hours flat, then 3 MB/s for the last 3 minutes
        s.add(float(i), 1000.0 + max(0, i - 7020) * 3.0, float("nan"))
    fit = mem._judged(s, 1)
    assert fit is not None and fit.growing and fit.rate_mb_s == pytest.approx(3.0, rel=0.1)


# --- the collector fed wire messages, to the summary -----------------------------------------

def _ingest_sys(state: RunState, rank: int, t: float, **fields: float | None) -> None:
    ident = Identity(rank, rank, 0, f"host{rank}", 1000 + rank, state.world_size)  # test_state's
    state.ingest(decode(encode("sys", ident, 1, t, **fields)), now=t - T0)


def _run(leak_mb_s: float, gpu: bool = False) -> RunState:
    state = RunState("mem", world_size=2, started_at=T0)
    for i in range(60):
        for rank in (0, 1):
            grows = leak_mb_s * i if rank == 1 else 0.0
            if gpu:
                _ingest_sys(state, rank, T0 + i, rss_mb=300.0, gpu_alloc_mb=1000.0 + grows,
                            gpu_mem_mb=2000.0 + grows, gpu_mem_total_mb=80_000.0,
                            mem_avail_mb=20_000.0)
            else:
                _ingest_sys(state, rank, T0 + i, rss_mb=300.0 + grows,
                            mem_avail_mb=6000.0)
    return state


def test_a_leaking_rank_is_named_with_its_rate_and_the_time_left():
    doc = model.to_doc(summary.build(_run(10.0).snapshot(T0 + 61, 61.0, full=True),
                                     summary.RunMeta()))
    m = doc["memory"]
    assert m["growing"] == [1]
    top = m["ranks"][0]
    assert (top["rank"], top["growing"]) == (1, "host")
    assert top["rss_rate_mb_min"] == pytest.approx(600.0, rel=0.01)
    assert top["limit_in_s"] == pytest.approx(600.0, rel=0.01)  # 6,000 MB at 10 MB/s
    assert m["imbalance"]["rank"] == 1 and m["imbalance"]["ratio"] == pytest.approx(2.97)
    text = summary.render_text(doc)
    assert ("Memory growing: rank 1's host memory grew 440 MB (+600 MB/min); about 10 min "
            "left before its limit") in text
    assert "Memory imbalance: rank 1 holds 890 MB, 3.0x the others' median (300 MB)" in text


def test_gpu_growth_is_timed_against_the_gpus_free_memory():
    doc = model.to_doc(summary.build(_run(50.0, gpu=True).snapshot(T0 + 61, 61.0, full=True),
                        summary.RunMeta()))
    top = doc["memory"]["ranks"][0]
    assert (top["rank"], top["growing"]) == (1, "gpu")
    free = 80_000.0 - (2000.0 + 50.0 * 59)
    assert top["headroom_mb"] == pytest.approx(free) and top["limit_in_s"] == pytest.approx(
        free / 50.0, rel=0.01)
    assert doc["memory"]["imbalance"] is None  # host memory equal


def test_ranks_that_hold_steady_are_said_to():
    doc = model.to_doc(summary.build(_run(0.0).snapshot(T0 + 61, 61.0, full=True),
                                     summary.RunMeta()))
    assert doc["memory"]["growing"] == [] and doc["memory"]["imbalance"] is None
    assert "Memory: steady on every rank (host RSS 300-300 MB)" in summary.render_text(doc)


def test_a_straggler_whose_memory_grows_says_so():
    d = dx.Diagnosis("STRAGGLER", 1, "backward", "warning", "Rank 1 is slow in backward.")
    trends = _run(10.0).memory.trends()
    said = mem.memory_evidence(d, trends).summary
    assert said.startswith("Rank 1 is slow in backward. Rank 1's host memory grew 440 MB")
    other = dx.Diagnosis("STRAGGLER", 0, "backward", "warning", "Rank 0 is slow.")
    assert mem.memory_evidence(other, trends) == other


def test_a_restarted_rank_starts_a_new_series():
    state = _run(10.0)
    again = Identity(1, 1, 0, "host1", 999, 2)
    state.ingest(decode(encode("hello", again, 0, T0 + 70, run="mem")), now=70.0)
    assert 1 not in state.memory.series


def test_the_agent_reads_a_headroom_here():
    room = MemoryHeadroom().bytes()
    assert room is None or room > 0


GB = 2**30
MEMINFO = "MemTotal:       65536000 kB\nMemAvailable:   20971520 kB\n"  # 20 GB available

# (what, /proc/self/cgroup, {file under sys/fs/cgroup: text}, meminfo, headroom bytes)
HEADROOM_CASES = [
    ("v2 limit", "0::/job.slice/rank\n",
     {"job.slice/rank/memory.max": f"{8 * GB}\n", "job.slice/rank/memory.current": f"{3 * GB}"},
     MEMINFO, 5 * GB),
    ("v2 without a limit: the host's", "0::/job.slice/rank\n",
     {"job.slice/rank/memory.max": "max\n", "job.slice/rank/memory.current": f"{3 * GB}"},
     MEMINFO, 20 * GB),
    ("v2 limit above what the host has", "0::/job\n",
     {"job/memory.max": f"{64 * GB}", "job/memory.current": f"{1 * GB}"}, MEMINFO, 20 * GB),
    ("v2 in a namespace: the mount's root", "0::/\n",
     {"memory.max": f"{4 * GB}", "memory.current": f"{1 * GB}"}, MEMINFO, 3 * GB),
    ("v1 limit", "4:memory:/slurm/job1\n0::/\n",
     {"memory/slurm/job1/memory.limit_in_bytes": f"{6 * GB}",
      "memory/slurm/job1/memory.usage_in_bytes": f"{2 * GB}"}, MEMINFO, 4 * GB),
    ("v1 unlimited: the host's", "4:memory:/\n",
     {"memory/memory.limit_in_bytes": "9223372036854771712",
      "memory/memory.usage_in_bytes": f"{2 * GB}"}, MEMINFO, 20 * GB),
    ("v1 over its limit: none left", "4:memory:/x\n",
     {"memory/x/memory.limit_in_bytes": f"{2 * GB}", "memory/x/memory.usage_in_bytes":
      f"{3 * GB}"}, MEMINFO, 0),
    ("no cgroup files", "0::/gone\n", {}, MEMINFO, 20 * GB),
    ("no procfs", None, {}, None, None),
]


@pytest.mark.parametrize("what, cgroup, files, meminfo, room", HEADROOM_CASES,
                         ids=[c[0] for c in HEADROOM_CASES])
def test_headroom(tmp_path, what, cgroup, files, meminfo, room):
    if cgroup is not None:
        (tmp_path / "proc/self").mkdir(parents=True)
        (tmp_path / "proc/self/cgroup").write_text(cgroup)
    if meminfo is not None:
        (tmp_path / "proc").mkdir(exist_ok=True)
        (tmp_path / "proc/meminfo").write_text(meminfo)
    for name, text in files.items():
        path = tmp_path / "sys/fs/cgroup" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert MemoryHeadroom(str(tmp_path)).bytes() == room


def test_prometheus_has_every_ranks_memory_and_the_growing_ranks_rate_and_time_left():
    from prometheus_client.parser import text_string_to_metric_families

    from traceml_tui.collect import metrics, view_build

    state = _run(10.0)
    snap = state.snapshot(T0 + 61, 61.0)
    text = metrics.render(view_build.build(snap, state.recent_steps), snap, "demo").decode()
    fams = {f.name: f.samples for f in text_string_to_metric_families(text)}
    rss = {s.labels["rank"]: s.value for s in fams["traceml_rank_rss_bytes"]}
    assert rss == {"0": 300.0 * 2**20, "1": (300.0 + 590.0) * 2**20}
    (rate,) = fams["traceml_rank_memory_growth_bytes_per_second"]
    assert (rate.labels["rank"], rate.labels["memory"]) == ("1", "host")
    assert rate.value == pytest.approx(10.0 * 2**20, rel=0.01)
    (left,) = fams["traceml_rank_memory_limit_seconds"]
    assert left.labels["rank"] == "1" and left.value == pytest.approx(600.0, rel=0.01)


def test_the_worst_rank_panel_names_the_growing_ranks_worst_first():
    from traceml_tui.collect import view_build

    snap = _run(10.0).snapshot(T0 + 61, 61.0)
    assert view_build.memory_lines(snap, 0, others=True) == (
        "memory: host 300 MB, steady",
        "rank 1 memory grows (host): host 890 MB, +600 MB/min, about 10 min left before "
        "its limit")
    assert view_build.memory_lines(snap, 0, others=False) == ("memory: host 300 MB, steady",)


def test_the_final_verdict_on_a_slow_rank_whose_memory_grows_says_so():
    """The issue's run: the leaking rank swaps late and reads as a backward straggler; the
    verdict on it says its memory grew (the summary's diagnosis, built by the state)."""
    from test_state import BALANCED_MS, steps

    state = RunState("mem", world_size=4, started_at=T0)
    slow = list(BALANCED_MS)
    slow[3] *= 3  # backward
    for rank in range(4):
        state.ingest(steps(rank, range(40), slow if rank == 1 else BALANCED_MS, world=4),
                     now=1.0)
        for i in range(60):
            _ingest_sys(state, rank, T0 + i, rss_mb=300.0 + (10.0 * i if rank == 1 else 0),
                        mem_avail_mb=6000.0)
    doc = model.to_doc(summary.build(state.snapshot(T0 + 61, 61.0, full=True), summary.RunMeta()))
    d = doc["diagnosis"]
    assert d["rank"] == 1 and d["phase"] == "backward", d
    assert "Rank 1's host memory grew 440 MB (+600 MB/min)" in d["summary"], d["summary"]
    state.evaluate(T0 + 62, 62.0)  # the live label, as the dashboard's banner shows it
    live = state.snapshot(T0 + 62, 62.0).live
    assert live.rank == 1 and "Rank 1's host memory grew" in live.summary, live


def test_a_read_judges_a_bounded_number_of_ranks_the_longest_waiting_first():
    from traceml_agent.protocol import Sys

    book = mem.MemoryBook()
    n = mem.TRENDS_PER_READ + 100
    for i in range(20):
        for rank in range(n):
            book.seen(rank, T0 + i, Sys(v=1, id=Identity(rank, 0, 0, "h", 1, n), seq=i,
                                        t=T0 + i, rss_mb=300.0))
    assert len(book.trends()) == mem.TRENDS_PER_READ  # the first read: as many as it may
    assert len(book.trends()) == n  # the next: the rest
    book.seen(5, T0 + 30, Sys(v=1, id=Identity(5, 0, 0, "h", 1, n), seq=30, t=T0 + 30,
                              rss_mb=900.0))
    assert book.trends()[5].rss_mb == 900.0 and not book._dirty


def test_the_live_file_reads_trends_as_a_viewer_does_and_the_record_afresh():
    """The live file (a whole-window part that may be reused) judges the trends at most
    every LIVE_EVERY_S, as a viewer does; the record judges them at the moment."""
    state = _run(10.0)
    first = state.snapshot(T0 + 61, 61.0, full=True, window_max_age_s=10.0)
    _ingest_sys(state, 1, T0 + 61, rss_mb=300.0 + 10.0 * 61, mem_avail_mb=6000.0)
    soon = state.snapshot(T0 + 62, 62.0, full=True, window_max_age_s=10.0)
    assert soon.memory == first.memory  # within LIVE_EVERY_S: the same trends
    record = state.snapshot(T0 + 62.5, 62.5, full=True)
    assert record.memory[1].rss_mb == pytest.approx(300.0 + 10.0 * 61)
    _ingest_sys(state, 1, T0 + 62, rss_mb=300.0 + 10.0 * 62, mem_avail_mb=6000.0)
    later = state.snapshot(T0 + 61 + mem.LIVE_EVERY_S, 61.0 + mem.LIVE_EVERY_S, full=True,
                           window_max_age_s=10.0)
    assert later.memory[1].rss_mb == pytest.approx(300.0 + 10.0 * 62)


def test_the_record_judges_every_ranks_trend_a_full_read_a_bounded_number(monkeypatch):
    """Past TRENDS_PER_READ ranks a read leaves the rest for the next one; the record has
    no next one, so it judges every rank with new samples (a leak on the last ranks of a
    16,384-rank job was up to 16 reads old in the final summary)."""
    monkeypatch.setattr(mem, "TRENDS_PER_READ", 1)
    state = _run(10.0)  # rank 1 leaks; rank 0's samples came first
    view = state.snapshot(T0 + 61, 61.0, full=True)  # the view socket's summary so far
    assert [t.rank for t in view.memory] == [0]
    state = _run(10.0)
    record = state.snapshot(T0 + 61, 61.0, full=True, record=True)
    assert [t.rank for t in record.memory if t.growing] == [1]
