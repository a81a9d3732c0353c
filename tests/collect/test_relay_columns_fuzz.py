"""Relay columns against the per-message path, on drawn interleavings (issue 33's review).

A relay's column rows are what its ranks' steps messages would have been; whatever a
batch holds (several relay connections and routes, a rank's other messages between its
rows, a new process's hello mid-batch, an impostor's rows, records out of order, absurd,
refused or past the window, drains that end anywhere, and a flush forced early by
MAX_PENDING_RECORDS), node 0 must end in the same state and counters as if the relay had
sent every message as it came. test_relay_columns.py holds one scripted stream to it;
here Hypothesis draws the streams."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from traceml_agent import protocol
from traceml_agent.protocol import (
    PHASES,
    RELAY_TAG,
    Identity,
    RelayBatch,
    StepColumns,
    StepGroup,
    StepRow,
    encode_relay_batch,
)
from traceml_tui.collect.collector import Collector
from traceml_tui.judge import ingest_columns
from traceml_tui.judge.state import RunState
from traceml_tui.runfolder.step_log import StepLogWriter, read_steps

WORLD = 4
T0 = 1_700_000_000.0
LISTS = (("forward", "backward"), ("forward", "backward", "custom"), tuple(PHASES))
STEP = st.one_of(st.integers(0, 40), st.integers(0, 40), st.sampled_from(
    [-1, 2**62, 2**62 + 1, 2**63 - 1, -2**63, 10**9, 1 << 20, (1 << 20) + 5]))
# Mostly real values (a record with one bad value is refused whole, and a rank's rows are
# taken as columns only once it has a record), now and then what a message may not hold.
EDGE_MS = (math.nan, math.inf, -math.inf, -1.0, -0.0, 0.0, 86_400_000.0, 86_400_001.0, 1e300)
MS = st.integers(0, 79).map(lambda i: EDGE_MS[i] if i < len(EDGE_MS) else 1.0 + i * 2.5)
EDGE_VALUE = (None, None, None, math.nan, math.inf, -1.0, 1e300)
VALUE = st.integers(0, 159).map(lambda i: EDGE_VALUE[i] if i < len(EDGE_VALUE) else i / 3)
KINDS = ["steps"] * 5 + ["hello", "heartbeat", "sys", "goodbye", "stacks", "cut", "drain"]


@st.composite
def _event(draw: st.DrawFn) -> dict[str, Any]:
    """One rank message on one relay connection and route, or a batch's or drain's end."""
    rank = draw(st.sampled_from([0, 0, 1, 1, 2, 3]))
    # Mostly the rank's own connection, route and process; now and then another's.
    ev = {"kind": draw(st.sampled_from(KINDS)), "rank": rank,
          "conn": draw(st.sampled_from([rank % 2] * 8 + [0, 1])),
          "route": draw(st.sampled_from([rank % 3] * 8 + [0, 1, 2])),
          "pid": draw(st.sampled_from([1] * 8 + [2])),
          "world": draw(st.sampled_from([WORLD] * 15 + [WORLD + 1]))}
    if ev["kind"] == "steps":
        phases = ev["phases"] = draw(st.sampled_from(LISTS))
        ev["records"] = draw(st.lists(st.tuples(
            STEP, st.floats(0, 2e9) | st.just(math.nan), MS,
            st.lists(VALUE, min_size=len(phases), max_size=len(phases))), max_size=5))
        ev["dropped"] = draw(st.integers(0, 5))
        ev["forced"] = draw(st.sampled_from([None, None, [1] * len(phases), [2] * len(phases)]))
    return ev


def _ident(ev: dict[str, Any]) -> Identity:
    return Identity(ev["rank"], ev["rank"], 0, "h", 100 + ev["pid"], ev["world"])


def _payload(ev: dict[str, Any], seq: int) -> bytes:
    kind, ident = ev["kind"], _ident(ev)
    if kind == "steps":
        records = [[s, t, ms, *(None if v is None or v != v else v for v in vals)]
                   for s, t, ms, vals in ev["records"]]
        forced = {"forced": ev["forced"]} if ev["forced"] else {}
        return protocol.encode("steps", ident, seq, T0, phases=list(ev["phases"]),
                               records=records, dropped=ev["dropped"], **forced)
    body: dict[str, Any] = {
        "hello": {"run": "fuzz", "device": "cpu"},
        "heartbeat": {"step": 1, "since_step_s": 0.5 + seq},
        "sys": {"cpu_pct": 10.0, "rss_mb": float(seq)},
        "stacks": {"stacks": [["MainThread", f"at {seq}"]]},
        "goodbye": {"exit_code": 0, "steps": 1}}[kind]
    return protocol.encode(kind, ident, seq, T0, **body)


def _batch(conn: int, held: list[tuple[dict[str, Any], int]], columns: bool) -> list[bytes]:
    """One relay batch: steps messages as column rows (as a hostile relay may pack them:
    any record values) or every message as it came."""
    routes, payloads, rows = [], [], []
    groups: dict[tuple[str, ...], list] = {}
    for ev, seq in held:
        routes.append(ev["route"])
        if not (columns and ev["kind"] == "steps"):
            payloads.append(_payload(ev, seq))
            continue
        records = groups.setdefault(ev["phases"], [])
        rows.append(StepRow(_ident(ev), seq, T0, list(groups).index(ev["phases"]),
                            len(ev["records"]), ev["dropped"], ev["forced"]))
        records.extend(ev["records"])
        payloads.append(b"")
    cols = None
    if rows:
        cols = StepColumns([StepGroup(
            list(phases), np.array([r[0] for r in recs], "<i8").tobytes(),
            np.array([r[1] for r in recs], "<f8").tobytes(),
            np.array([r[2] for r in recs], "<f8").tobytes(),
            np.array([[math.nan if v is None else v for v in r[3]] for r in recs],
                     "<f8").tobytes()) for phases, recs in groups.items()], rows)
    return [b"relay%d" % conn, RELAY_TAG,
            encode_relay_batch(RelayBatch(0, 0, 0, routes, payloads, cols))]


def _run(tmp: Path, events: list[dict[str, Any]], columns: bool) -> dict[str, Any]:
    state = RunState("fuzz", WORLD, nnodes=1, started_at=T0, window_steps=8)
    # The collector's receive path alone: a whole Collector per drawn stream binds sockets.
    coll = Collector.__new__(Collector)
    coll.state, coll.pending, coll.routes = state, ingest_columns.Pending(), {}
    coll.step_log = StepLogWriter(tmp)
    held: dict[int, list] = {0: [], 1: []}
    seen: list[dict] = []
    mono = 100.0

    def cut() -> None:
        for conn, evs in held.items():
            if evs:
                coll._receive(_batch(conn, evs, columns), mono)
                evs.clear()

    try:
        for seq, ev in enumerate(events):
            if ev["kind"] in ("cut", "drain"):
                cut()
                if ev["kind"] == "drain":
                    coll.flush_columns()
                    seen.append(_ranks(state))  # as each drain leaves it, not only the last
                    mono += 0.3
                    state.evaluate(T0, mono)
            elif ev["kind"] != "steps" or all(-2**63 <= r[0] < 2**63 for r in ev["records"]):
                held[ev["conn"]].append((ev, seq))
        cut()
        coll.flush_columns()
    finally:
        coll.step_log.close()
    seen.append(_ranks(state))
    log: dict[int, list] = {}  # each rank's in the order it sent them
    for s in read_steps(tmp):
        log.setdefault(s.rank, []).append((s.step, s.step_ms, s.phases, s.phase_ms))
    return {"counters": dict(state.counters), "ranks": seen, "log": log}


def _ranks(state: RunState) -> dict[int, tuple]:
    return {r: (rs.steps, rs.last_step, rs.last_seen, rs.last_step_at,
                rs.since_step_at_msg_s, rs.dropped, rs.forced, rs.bad_records, rs.finished,
                rs.first_step, rs.ident.pid, rs.stacks, rs.conn, rs.heartbeat,
                np.nan_to_num(state.block.series[0][r], nan=-1.0).tolist(),
                state.block.step_no[r].tolist(), state.block.pos[r], state.block.count[r])
            for r, rs in state.ranks.items()}


@settings(max_examples=80, derandomize=True, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(st.lists(_event(), min_size=30, max_size=80),  # shorter ones seldom reach a row
       st.sampled_from([2, ingest_columns.MAX_PENDING_RECORDS]))
def test_columns_end_as_the_messages_they_stand_for(events: list[dict[str, Any]],
                                                     bound: int) -> None:
    import tempfile

    saved = ingest_columns.MAX_PENDING_RECORDS
    ingest_columns.MAX_PENDING_RECORDS = bound
    try:
        with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
            old = _run(Path(a), events, False)
            new = _run(Path(b), events, True)
    finally:
        ingest_columns.MAX_PENDING_RECORDS = saved
    assert new["counters"] == old["counters"]
    assert new["ranks"] == old["ranks"]
    assert new["log"] == old["log"]
