"""Stacks of ranks stuck in native code (native_stacks.py): a rank blocked in a C call
that holds the GIL sends nothing, so node 0's `traceml run` takes its Python and native
stack from outside with `py-spy dump --native`, and the hang report shows it."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess

import pytest
from test_requests import control
from test_state import ident, steps  # noqa: F401 - helpers of the state tests

from jobs import EXAMPLES, kill_session, ptrace_allowed, spawn_traceml, wait_for
from traceml_agent.requests import NativeStack, RequestError, decode_control, encode_control
from traceml_tui.collect.collector import Collector
from traceml_tui.judge.ingest import NATIVE_THREAD
from traceml_tui.judge.state import RunState
from traceml_tui.launch.native_stacks import stuck_ranks
from traceml_tui.report import summary


def test_only_this_nodes_named_ranks_without_a_stack_are_dumped():
    doc = {"hang": {"ranks": [1, 2, 5], "stacks": {"2": []}, "since": "t"},
           "ranks": [{"rank": 1, "node": 0, "pid": 11}, {"rank": 2, "node": 0, "pid": 12},
                     {"rank": 3, "node": 0, "pid": 13}, {"rank": 5, "node": 1, "pid": 15}]}
    assert stuck_ranks(doc, node=0) == [(1, 11)]
    assert stuck_ranks({"hang": None, "ranks": doc["ranks"]}, node=0) == []


def test_a_native_stack_request_is_checked_and_kept_for_the_process_it_came_from(tmp_path):
    good = NativeStack(rank=1, pid=5, text="x")
    assert decode_control(encode_control(good)) == good
    for bad in ({"op": "native_stack", "rank": -1, "pid": 5, "text": "x"},
                {"op": "native_stack", "rank": 1, "pid": -1, "text": "x"},
                {"op": "native_stack", "rank": 1, "pid": 5, "text": "x" * 20_000},
                {"op": "native_stack", "rank": 1, "pid": 5},
                {"op": "native_stack", "rank": 1, "pid": 5, "text": "x", "more": 1}):
        with pytest.raises(RequestError):
            decode_control(json.dumps(bad).encode())
    # A rank outside the run is the collector's to refuse (it knows the world size).
    (tmp_path / "run").mkdir(mode=0o700)
    coll = Collector(tmp_path / "run", RunState("run", world_size=2))
    try:
        for request, ok in ((NativeStack(rank=2, pid=5, text="x"), False),
                            (NativeStack(rank=1, pid=5, text="x"), True)):
            reply = control(coll, encode_control(request))
            assert reply["ok"] is ok, reply
    finally:
        coll.close()
    state = RunState("run", world_size=2)
    state.ingest(steps(1, range(3)), now=0.0)
    state.intake.set_native_stack(1, 999, "not this process")  # another pid: a restarted rank
    assert state.ranks[1].stacks == ()
    state.intake.set_native_stack(1, state.ranks[1].ident.pid, "pause (libc.so.6)\x1b[2J")
    ((name, text),) = state.ranks[1].stacks
    assert name == NATIVE_THREAD and "\x1b" not in text  # cleaned like any rank text
    state.ingest(steps(1, range(3, 4)), now=0.0)  # it steps again: the stall is over
    assert state.ranks[1].stacks == ()


@pytest.mark.skipif(shutil.which("py-spy") is None, reason="py-spy is not installed")
@pytest.mark.skipif(not ptrace_allowed(), reason="ptrace is forbidden here (Yama scope)")
def test_a_rank_stuck_in_c_holding_the_gil_is_named_with_its_native_frames(tmp_path):
    out = tmp_path / "runs"
    job = spawn_traceml("run", str(EXAMPLES / "ddp_toy.py"), "--nproc-per-node", "2",
                        "--headless", "--out", str(out), "--run-name", "native", "--",
                        "--gil-hang-rank", "1", "--hang-at-step", "30", "--steps", "100000")
    run_dir = out / "native"

    def live() -> dict:
        try:
            return json.loads((run_dir / "live_snapshot.json").read_text())
        except (OSError, ValueError):
            return {}

    def native_stack(doc: dict) -> str:
        threads = ((doc.get("hang") or {}).get("stacks") or {}).get("1") or []
        return next((t["stack"] for t in threads if t["thread"] == NATIVE_THREAD), "")

    try:
        wait_for(lambda: "pause" in native_stack(live()), 120, "rank 1's native stack")
        doc = live()  # while the hang lasts: what a viewer and the record say
    finally:
        job.send_signal(signal.SIGINT)
        try:
            job.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            kill_session(job)
            job.kill()
    hang = doc["hang"]
    assert doc["live_diagnosis"]["label"] == "HANG" and hang["ranks"] == [1], hang
    assert hang["kind"] == "dead" and "rank 1 stopped reporting" in doc["live_diagnosis"]["summary"]
    native = native_stack(doc)
    assert "pause (libc" in native and "block_in_c_holding_the_gil" in native
    text = summary.render_text(doc)
    assert "Rank 1, taken from outside (py-spy --native), innermost call first:" in text
    assert "pause (libc" in text
