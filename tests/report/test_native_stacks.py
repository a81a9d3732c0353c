"""Stacks of ranks stuck in native code (native_stacks.py): a rank blocked in a C call
that holds the GIL sends nothing, so node 0's `traceml run` takes its Python and native
stack from outside with `py-spy dump --native`, and the hang report shows it."""

from __future__ import annotations

import json

import pytest
from msgspec.structs import replace
from test_requests import control
from test_state import ident, steps  # noqa: F401 - helpers of the state tests

from traceml_agent.requests import NativeStack, RequestError, decode_control, encode_control
from traceml_tui.collect.collector import Collector
from traceml_tui.judge.ingest import NATIVE_THREAD
from traceml_tui.judge.state import RunState
from traceml_tui.launch.native_stacks import stuck_ranks
from traceml_tui.runfolder import summary_model as model


def test_only_this_nodes_named_ranks_without_a_stack_are_dumped():
    ranks = [model.Rank(rank=r, node=n, pid=pid)
             for r, n, pid in ((1, 0, 11), (2, 0, 12), (3, 0, 13), (5, 1, 15), (6, 0, None))]
    doc = model.Summary(run=model.Run(), diagnosis=model.Diagnosis(label="HANG"),
                        step_ms=model.StepMs(), ranks=ranks,
                        hang=model.Hang(kind="collective", ranks=[1, 2, 5, 6],
                                        stacks={"2": []}, since="t"))
    assert stuck_ranks(doc, node=0) == [(1, 11)]  # 6: no pid known
    assert stuck_ranks(replace(doc, hang=None), node=0) == []


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
