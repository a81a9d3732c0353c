"""perfetto: the Chrome trace of a whole job, from step records and a summary document.

The last test goes the collector's way: real wire messages into a RunState and a
StepLogWriter, the summary built from the RunState, the log read back, the trace built."""

from __future__ import annotations

import json
import os
from collections import defaultdict

import pytest

from traceml_agent.protocol import PHASES, Identity, decode, encode
from traceml_tui.judge import diagnosis as dx
from traceml_tui.judge.state import LIVE_STEPS, RunState
from traceml_tui.report import summary
from traceml_tui.report.perfetto import DIAGNOSIS_PID, STEP_TID, build_trace, write_trace
from traceml_tui.runfolder import summary_model as model
from traceml_tui.runfolder.step_log import LoggedStep, StepLogWriter, read_steps

T0 = 1_790_000_000.0
# dataloader, h2d, forward, backward, sync, optimizer, wait: 100 ms, h2d not measured.
MS = (10.0, None, 20.0, 30.0, 5.0, 15.0, 20.0)


def step(rank: int, n: int, t_end: float, phase_ms=MS, step_ms: float = 100.0,
         phases=PHASES) -> LoggedStep:
    return LoggedStep(rank, n, t_end, step_ms, tuple(phases), tuple(phase_ms))


def run_summary(**parts) -> model.Summary:
    """A summary holding only the given sections (the rest as a summary's defaults)."""
    parts.setdefault("run", model.Run())
    return model.Summary(diagnosis=model.Diagnosis(label=dx.BALANCED), step_ms=model.StepMs(),
                         **{"ranks": [], **parts})


def hosts(n: int) -> list[model.Rank]:
    return [model.Rank(rank=r, host=f"node{r // 2}") for r in range(n)]


def spans(trace: dict, pid: int, tid: int | None = None) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == pid
            and (tid is None or e["tid"] == tid)]


def meta(trace: dict, name: str) -> dict[tuple[int, int], dict]:
    return {(e["pid"], e["tid"]): e["args"] for e in trace["traceEvents"]
            if e["ph"] == "M" and e["name"] == name}


def phase_tid(trace: dict, rank: int, phase: str) -> int:
    return next(tid for (pid, tid), args in meta(trace, "thread_name").items()
                if pid == rank and args["name"] == phase)


def test_one_step_is_laid_out_back_to_back_ending_at_t_end():
    trace = build_trace([step(0, 5, T0 + 1.0)])
    # Time 0 is the whole second before the step's start (T0 + 0.9 s).
    assert trace["otherData"]["epoch_base_s"] == T0
    assert [(e["name"], e["ts"], e["dur"]) for e in spans(trace, 0, STEP_TID)] == [
        ("step 5", 900_000.0, 100_000.0)]
    laid = {e["name"]: (e["ts"] - 900_000.0, e["dur"]) for e in spans(trace, 0)
            if e["tid"] != STEP_TID}
    assert laid == {"dataloader": (0.0, 10_000.0), "forward": (10_000.0, 20_000.0),
                    "backward": (30_000.0, 30_000.0), "sync": (60_000.0, 5_000.0),
                    "optimizer": (65_000.0, 15_000.0), "wait": (80_000.0, 20_000.0)}
    # h2d was not measured (None): it has a track but no span.
    assert phase_tid(trace, 0, "h2d") == PHASES.index("h2d") + 1
    assert "reconstructed" in trace["otherData"]["note"]


def test_one_process_per_rank_named_and_sorted():
    records = [step(r, 0, T0 + 0.1) for r in (2, 0, 1)]
    doc = run_summary(ranks=hosts(4), phases=list(PHASES))
    trace = build_trace(records, doc)
    names = {pid: a["name"] for (pid, _), a in meta(trace, "process_name").items()}
    assert names == {0: "rank 0 (node0)", 1: "rank 1 (node0)", 2: "rank 2 (node1)",
                     3: "rank 3 (node1)"}  # rank 3 never reported a step: present, empty
    order = {pid: a["sort_index"] for (pid, _), a in meta(trace, "process_sort_index").items()}
    assert sorted(order, key=order.get) == [0, 1, 2, 3]
    tracks = [a["name"] for (pid, _), a in sorted(meta(trace, "thread_name").items())
              if pid == 0]
    assert tracks == ["step", *PHASES]
    assert spans(trace, 3) == [] and len(spans(trace, 2)) == 1 + 6
    assert DIAGNOSIS_PID not in names  # no summary timeline, no diagnosis process


def test_tracks_are_monotonic_and_never_overlap():
    records = []
    for rank in range(3):
        t = T0
        for n in range(50):
            ms = 100.0 + (n * 7 + rank * 13) % 30
            t += ms / 1000
            # Phases adding up to more than the gap since the previous step (clock jitter):
            # drawn from t_end back, they would overlap the previous step's spans.
            records.append(step(rank, n, t, (10.0, None, 20.0, 30.0, 5.0, 15.0, ms - 60.0),
                                step_ms=ms - 2.0))
    trace = build_trace(reversed(records))  # any input order
    by_track = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            by_track[e["pid"], e["tid"]].append(e)
    assert len(by_track) == 3 * 7
    for events in by_track.values():
        assert len(events) == 50
        for a, b in zip(events, events[1:], strict=False):
            assert b["ts"] >= a["ts"] + a["dur"] - 1e-3
            assert b["args"]["step"] == a["args"]["step"] + 1
    first = min(e["ts"] for es in by_track.values() for e in es)
    assert 0.0 <= first < 1e6


def test_custom_phases_repeats_and_the_last_steps_bound():
    phases = (*PHASES, "checkpoint")
    records = [step(0, n, T0 + n * 0.2, (*MS, 50.0), step_ms=150.0, phases=phases)
               for n in range(10)]
    records.append(records[3])  # a replayed record
    trace = build_trace(records)
    assert phase_tid(trace, 0, "checkpoint") == len(PHASES) + 1
    assert len(spans(trace, 0, STEP_TID)) == 10
    bounded = build_trace(records, last_steps_per_rank=4)
    assert [e["args"]["step"] for e in spans(bounded, 0, STEP_TID)] == [3, 7, 8, 9]


def test_episodes_and_hang_on_the_diagnosis_process():
    iso = summary.iso
    doc = run_summary(
        run=model.Run(name="r", started_at=iso(T0), ended_at=iso(T0 + 60)),
        ranks=[model.Rank(rank=0, host="h"), model.Rank(rank=1, host="h")],
        timeline=[
            model.Episode(label=dx.WARMUP, severity="info", start=iso(T0), end=iso(T0 + 5),
                          start_step=0, end_step=8, summary="warming up"),
            model.Episode(label=dx.INPUT_STRAGGLER, rank=1, phase="dataloader",
                          severity="warning", start=iso(T0 + 5), end=iso(T0 + 30),
                          start_step=8, end_step=200, summary="rank 1 waits for input"),
            model.Episode(label=dx.HANG, rank=1, severity="critical", start=iso(T0 + 30),
                          start_step=200, summary="hung"),
        ],
        hang=model.Hang(kind="collective", ranks=[1], since=iso(T0 + 30), stalled_s=30.0,
                        threshold_s=20.0),
    )
    trace = build_trace([step(0, 1, T0 + 1.0), step(1, 1, T0 + 1.0)], doc)
    assert trace["otherData"]["epoch_base_s"] == T0  # the run's start is the earliest time
    episodes = spans(trace, DIAGNOSIS_PID, 1)
    assert [(e["name"], e["ts"], e["dur"]) for e in episodes] == [
        ("WARMUP", 0.0, 5e6), ("INPUT STRAGGLER rank 1", 5e6, 25e6),
        ("HANG rank 1", 30e6, 30e6)]  # the open episode runs to the run's end
    assert episodes[1]["args"]["summary"] == "rank 1 waits for input"
    assert [(e["name"], e["ts"]) for e in spans(trace, DIAGNOSIS_PID, 2)] == [
        ("HANG (collective): rank(s) 1", 30e6)]
    instants = [(e["name"], e["ts"], e["s"]) for e in trace["traceEvents"] if e["ph"] == "i"]
    assert instants == [("INPUT STRAGGLER rank 1", 5e6, "g"), ("HANG rank 1", 30e6, "g"),
                        ("HANG (collective): rank(s) 1", 30e6, "g")]  # no WARMUP marker
    names = meta(trace, "process_name")
    assert names[DIAGNOSIS_PID, 0]["name"] == "diagnosis"
    assert meta(trace, "process_sort_index")[DIAGNOSIS_PID, 0]["sort_index"] == 0


def test_write_trace_is_atomic(tmp_path):
    path = tmp_path / "timeline.json"
    write_trace(path, [step(0, 1, T0 + 1.0)])
    first = path.read_text()
    assert json.loads(first)["traceEvents"]

    def broken():
        yield step(0, 2, T0 + 2.0)
        raise RuntimeError("the log went away")

    with pytest.raises(RuntimeError):
        write_trace(path, broken())
    assert path.read_text() == first
    assert os.listdir(tmp_path) == ["timeline.json"]  # no temp file left behind


# --- the collector's way ----------------------------------------------------------------


def _batch(rank: int, first: int, n: int, slow_dl: float) -> bytes:
    ms = [5.0, 1.0, 30.0, 50.0, 4.0, 8.0, 2.0]
    ms[PHASES.index("dataloader" if rank == 2 else "sync")] += slow_dl
    records = [[s, T0 + 0.2 * (s + 1), sum(ms), *ms] for s in range(first, first + n)]
    ident = Identity(rank, rank, rank // 2, f"node{rank // 2}", 100 + rank, 4)
    return encode("steps", ident, first, T0, phases=list(PHASES), records=records)


def test_step_log_round_trip_with_a_real_summary(tmp_path):
    state = RunState("roundtrip", world_size=4, nnodes=2, started_at=T0)
    log = StepLogWriter(tmp_path / "steps")
    now = T0
    # Balanced, then rank 2 an input straggler for LIVE_STEPS steps, evaluated as it comes.
    for first, n, slow in ((0, 2 * dx.MIN_STEPS, 0.0), (2 * dx.MIN_STEPS, LIVE_STEPS, 40.0)):
        for rank in range(4):
            msg = decode(_batch(rank, first, n, slow))
            state.ingest(msg, now=now)
            log.append_records(msg.ident.rank, msg.phases, msg.records)
        for _ in range(dx.CONFIRM_TICKS):
            now += 1.0
            state.evaluate(now)
    log.close()
    doc = model.decode(summary.to_json(summary.build(state.snapshot(now, 0.0, full=True),
                                                     summary.RunMeta(ended_at=now))))
    assert [e.label for e in doc.timeline] == [dx.BALANCED, dx.INPUT_STRAGGLER]

    records = list(read_steps(tmp_path / "steps"))
    total = 2 * dx.MIN_STEPS + LIVE_STEPS
    assert len(records) == 4 * total and log.records == 4 * total
    trace = json.loads(json.dumps(build_trace(records, doc)))

    names = {pid: a["name"] for (pid, _), a in meta(trace, "process_name").items()}
    assert names == {0: "rank 0 (node0)", 1: "rank 1 (node0)", 2: "rank 2 (node1)",
                     3: "rank 3 (node1)", DIAGNOSIS_PID: "diagnosis"}
    for rank in range(4):
        steps = spans(trace, rank, STEP_TID)
        assert [e["args"]["step"] for e in steps] == list(range(total))
        assert all(e["dur"] == pytest.approx(1000 * (100.0 + (40.0 if e["args"]["step"] >=
                   2 * dx.MIN_STEPS else 0.0))) for e in steps)
    # The straggler's last step: 140 ms, its dataloader (5 + 40 ms) laid out first.
    last = spans(trace, 2, STEP_TID)[-1]
    dataloader = spans(trace, 2, phase_tid(trace, 2, "dataloader"))
    assert dataloader[-1]["dur"] == pytest.approx(45_000.0)
    assert dataloader[-1]["ts"] == pytest.approx(last["ts"], abs=0.01)
    assert last["ts"] + last["dur"] == pytest.approx(
        (records[-1].t_end - trace["otherData"]["epoch_base_s"]) * 1e6, abs=0.01)
    straggler = [e for e in trace["traceEvents"] if e["ph"] == "i"]
    assert [e["name"] for e in straggler] == ["INPUT STRAGGLER rank 2"]
