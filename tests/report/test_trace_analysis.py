"""trace_analysis on real CPU traces (tests/data/traces/make_traces.py) and on a hand-written
GPU-shaped trace whose every figure is worked out below from its timestamps (µs).

The GPU fixture (gpu_handwritten.json), two steps, window [1000, 1800] = 800 µs:
  step 7 [1000, 1500]: DataLoader [1000, 1180]; pageable HtoD copy [1200, 1260];
      sgemm [1260, 1360]; 4 elementwise kernels of 5 µs at 1360, 1370, 1380, 1390;
      NCCL AllReduce on stream 20 [1340, 1440]; Optimizer.step [1420, 1490]
  step 8 [1500, 1800]: DataLoader [1500, 1530]; pinned HtoD copy [1540, 1550];
      sgemm [1600, 1700] (no correlation id: linked by an ac2g flow only);
      memset [1700, 1710]; Optimizer.step [1700, 1790]
GPU busy = [1200, 1440] + [1540, 1550] + [1600, 1710] = 240 + 10 + 110 = 360 µs.
"""

from __future__ import annotations

import copy
import gzip
import json
from pathlib import Path

import pytest

from traceml_tui.report import trace_analysis as ta

TRACES = Path(__file__).parents[1] / "data" / "traces"
GPU = TRACES / "gpu_handwritten.json"
RANK0 = TRACES / "cpu_rank0.json"
RANK1 = TRACES / "cpu_rank1.json.gz"  # the input straggler: its dataset sleeps 2 ms a sample


@pytest.fixture(scope="module")
def gpu() -> ta.TraceAnalysis:
    return ta.analyze_file(GPU)


@pytest.fixture(scope="module")
def cpu_ranks() -> tuple[ta.TraceAnalysis, ta.TraceAnalysis]:
    return ta.analyze_file(RANK0), ta.analyze_file(RANK1)


# --- the hand-written GPU trace: exact figures ------------------------------------------


def test_gpu_window_steps_and_busy_share(gpu):
    assert gpu.rank == 3 and gpu.world_size == 8
    assert gpu.steps == (7, 8)
    assert gpu.window_us == 800.0
    assert [(s.step, s.dur_us, s.dataloader_us) for s in gpu.step_stats] == [
        (7, 500.0, 180.0), (8, 300.0, 30.0)]
    assert gpu.gpu_busy_share == pytest.approx(360 / 800)
    assert gpu.gpu_idle_share == pytest.approx(440 / 800)
    assert gpu.needs_gpu == ()


def test_gpu_gaps_name_what_launched_the_next_activity(gpu):
    gaps = [(g.offset_us, g.dur_us, g.next_gpu_op, g.launch_call, g.launched_by, g.link,
             g.cpu_during) for g in gpu.idle_gaps]
    assert gaps == [
        # Before the first copy: the CPU was in the DataLoader (180 of the 200 µs).
        (0.0, 200.0, "Memcpy HtoD (Pageable -> Device)", "cudaMemcpyAsync", "aten::copy_",
         "correlation", "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"),
        # After the AllReduce: Optimizer.step covers 50 µs of it, the next DataLoader 30.
        (440.0, 100.0, "Memcpy HtoD (Pinned -> Device)", "cudaMemcpyAsync", "aten::copy_",
         "correlation", "Optimizer.step#SGD.step"),
        # The tail: nothing follows inside the window.
        (710.0, 90.0, None, None, None, None, "Optimizer.step#SGD.step"),
        # The second sgemm has no correlation id: the ac2g flow leads to its launch.
        (550.0, 50.0, "ampere_sgemm_128x64_nn", "cudaLaunchKernel", "aten::mm", "flow",
         "aten::mm"),
    ]
    assert gpu.idle_gaps[0].ts == 1000.0  # on the trace's own clock, to find it in Perfetto


def test_gpu_without_links_falls_back_to_the_op_running_at_that_time():
    doc = ta.load_trace(GPU)
    events = [e for e in doc["traceEvents"] if e.get("cat") != "ac2g"]  # drop the flow
    trace = ta.analyze({"traceEvents": events})
    gap = next(g for g in trace.idle_gaps if g.offset_us == 550.0)
    # aten::mm [1560, 1600] is the innermost cpu_op running when the sgemm starts at 1600.
    assert (gap.launch_call, gap.launched_by, gap.link) == (None, "aten::mm", "time")


def test_gpu_kernels_small_kernels_and_overlap(gpu):
    assert [(k.name[:22], k.count, k.total_us, k.mean_us) for k in gpu.top_kernels] == [
        ("ampere_sgemm_128x64_nn", 2, 200.0, 100.0),
        ("ncclDevKernel_AllReduc", 1, 100.0, 100.0),
        ("void at::native::vecto", 4, 20.0, 5.0),
    ]
    small = gpu.small_kernels
    assert (small.count, small.time_us) == (4, 20.0)
    assert small.count_share == pytest.approx(4 / 7)  # 7 kernels; copies and memsets are not
    assert small.time_share == pytest.approx(20 / 320)
    # AllReduce [1340, 1440] overlaps sgemm [1340, 1360] and the 4 small kernels: 20 + 20.
    assert gpu.comm_overlap == ta.Overlap(collective_us=100.0, overlapped_us=40.0, share=0.4)
    assert gpu.collective_us == 100.0


def test_gpu_host_to_device_copies_pageable_and_pinned(gpu):
    assert gpu.h2d_copies == ta.HostToDevice(
        count=2, total_us=70.0, bytes=1048576 + 4096, pageable_count=1, pageable_us=60.0,
        pinned_count=1, pinned_us=10.0, unknown_count=0, longest_us=60.0)


def test_gpu_cpu_ops_by_self_time_and_collectives(gpu):
    ops = {op.name: (op.count, op.total_us, op.self_us) for op in gpu.cpu_ops}
    assert ops["aten::to"] == (1, 50.0, 10.0)  # aten::copy_ [1190, 1230] nested inside
    assert ops["aten::linear"] == (1, 60.0, 10.0)  # aten::addmm [1240, 1290] nested inside
    assert ops["aten::copy_"] == (2, 53.0, 53.0)
    assert [op.name for op in gpu.cpu_ops][:3] == ["aten::copy_", "aten::addmm", "aten::mm"]
    assert [(c.name, c.count, c.total_us) for c in gpu.collectives] == [
        ("nccl:all_reduce", 1, 14.0), ("record_param_comms:allreduce", 1, 12.0)]


def test_gpu_findings_map_to_the_guides_patterns(gpu):
    found = {f.pattern: f for f in gpu.findings}
    # DataLoader 210 of 800 µs of steps; idle 55%; 4 of 7 kernels tiny; pageable 60/800.
    # Overlap 40% is above LOW_OVERLAP_SHARE: no AllReduce finding.
    assert list(found) == ["dataloader_stall", "gpu_idle", "launch_bound", "unpinned_copy"]
    assert found["dataloader_stall"].evidence == "DataLoader takes 26% of the steps"
    assert "pin_memory=True" in found["unpinned_copy"].hint
    assert "200 µs" in found["gpu_idle"].evidence
    assert all(f.title == ta.PATTERNS[f.pattern] and f.hint for f in gpu.findings)


def test_low_overlap_is_a_finding():
    doc = copy.deepcopy(ta.load_trace(GPU))
    for e in doc["traceEvents"]:  # move the AllReduce after every other kernel of step 7
        if e.get("name", "").startswith("nccl") and e.get("cat") == "kernel":
            e["ts"] = 1400
    trace = ta.analyze(doc)
    assert trace.comm_overlap.share == 0.0
    assert "no_overlap" in [f.pattern for f in trace.findings]


def test_memcpy_kinds_from_the_name_or_from_args():
    assert ta.copy_kinds("Memcpy HtoD (Pageable -> Device)", {}) == ("Pageable", "Device")
    assert ta.copy_kinds("Memcpy HtoD", {"src": "Pinned", "dst": "Device"}) == ("Pinned",
                                                                                 "Device")
    assert ta.copy_kinds("Memcpy HtoD", {}) == (None, None)
    events = [{"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 0, "dur": 5},
              {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pageable)",
               "ts": 5, "dur": 5}]
    trace = ta.analyze({"traceEvents": events})
    assert (trace.h2d_copies.count, trace.h2d_copies.unknown_count) == (1, 1)
    assert trace.notes == (
        "no ProfilerStep spans: the window is the span of all events",
        "1 host-to-device copies do not say pageable or pinned",
        "no collective (NCCL) kernels: communication overlap not measured")
    assert trace.comm_overlap is None and trace.gpu_busy_share == 1.0


def test_gzip_and_bare_event_lists_load(tmp_path):
    doc = ta.load_trace(GPU)
    packed = tmp_path / "no_suffix"
    packed.write_bytes(gzip.compress(json.dumps(doc["traceEvents"]).encode()))
    assert ta.analyze_file(packed).gpu_busy_share == pytest.approx(0.45)


def test_to_dict_is_json(gpu):
    doc = json.loads(json.dumps(gpu.to_dict()))
    assert doc["idle_gaps"][3]["link"] == "flow"
    assert doc["small_kernels"]["count_share"] == 0.5714
    assert doc["needs_gpu"] == []


# --- real CPU traces from a 2-rank gloo DDP job ------------------------------------------


def test_cpu_trace_says_gpu_metrics_need_a_gpu(cpu_ranks):
    rank0, _ = cpu_ranks
    assert rank0.needs_gpu == ta.GPU_METRICS
    assert all(getattr(rank0, name) is None for name in ta.GPU_METRICS)
    doc = rank0.to_dict()
    assert doc["gpu_busy_share"] is None and "gpu_busy_share" in doc["needs_gpu"]
    assert "no GPU activity" in ta.render_text(rank0)


def test_cpu_trace_steps_dataloader_and_collectives(cpu_ranks):
    rank0, rank1 = cpu_ranks
    for trace, rank in ((rank0, 0), (rank1, 1)):
        assert (trace.rank, trace.world_size) == (rank, 2)
        assert trace.steps == (1, 2, 3)  # schedule(wait=0, warmup=1, active=3)
        assert all(s.dur_us > 0 and 0 < s.dataloader_us < s.dur_us for s in trace.step_stats)
        assert sum(s.dur_us for s in trace.step_stats) <= trace.window_us
        collectives = {c.name: c.count for c in trace.collectives}
        assert collectives["gloo:all_reduce"] == 3  # one gradient bucket per step
        assert collectives["c10d::allreduce_"] == 3
        assert trace.cpu_ops and trace.cpu_ops[0].self_us >= trace.cpu_ops[-1].self_us
    # Rank 1 sleeps 8 x 2 ms per batch in its dataset; rank 0 does not sleep at all.
    assert all(s.dataloader_us >= 16_000 for s in rank1.step_stats)
    assert all(s.dataloader_us < 5_000 for s in rank0.step_stats)
    assert [f.pattern for f in rank1.findings] == ["dataloader_stall"]
    assert "dataloader_stall" not in [f.pattern for f in rank0.findings]


def test_compare_names_the_straggler_the_others_wait_for(cpu_ranks):
    rank0, rank1 = cpu_ranks
    result = ta.compare_ranks(rank1, rank0)
    rows = {r.metric: r for r in result.rows}
    assert (result.worst_rank, result.median_rank) == (1, 0)
    assert rows["dataloader_us_per_step"].delta >= 15_000
    # Rank 0 sits in gloo:all_reduce waiting for rank 1's input: ~16 ms more per step.
    assert rows["collective_us_per_step"].delta <= -10_000
    assert rows["gpu_busy_share"] == ta.CompareRow("gpu_busy_share", None, None, None)
    assert [f.pattern for f in result.findings] == ["straggler"]
    assert "rank 1" in result.findings[0].evidence
    # The other way round, the fast rank is no straggler.
    assert ta.compare_ranks(rank0, rank1).findings == ()
    assert json.loads(json.dumps(result.to_dict()))["rows"][0]["metric"] == "steps"


def test_trace_files_stay_small():
    for path in TRACES.glob("*.json*"):
        assert path.stat().st_size < 300_000, path.name


def test_a_ranks_trace_path_is_read_only_inside_the_runs_traces_folder(tmp_path):
    """Issue 20 finding 5: a rank answering a capture with /dev/zero, a FIFO, a link or a
    file elsewhere gets an error, quickly, and the collector reads nothing unbounded."""
    import gzip
    import json
    import os
    import time

    from traceml_tui.report.trace_analysis import load_trace

    root = tmp_path / "traces"
    root.mkdir()
    good = root / "rank0.json"
    good.write_text(json.dumps({"traceEvents": []}))
    assert load_trace(good, root) == {"traceEvents": []}
    os.mkfifo(root / "fifo.json")
    (root / "link.json").symlink_to(good)
    outside = tmp_path / "elsewhere.json"
    outside.write_text("{}")
    bomb = root / "bomb.json.gz"
    bomb.write_bytes(gzip.compress(b" " * (3 << 20)))
    t0 = time.monotonic()
    for path in ("/dev/zero", root / "fifo.json", root / "link.json", outside,
                 root / ".." / "elsewhere.json"):
        with pytest.raises((ValueError, OSError)):
            load_trace(path, root)
    with pytest.raises(ValueError, match="decompressed"):
        load_trace(bomb, root, limit=1 << 20)
    assert time.monotonic() - t0 < 5
