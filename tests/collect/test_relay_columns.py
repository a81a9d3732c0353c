"""A relay's columns (protocol.StepColumns) change nothing but node 0's cost: the same
rank messages, sent as old relays send them (each payload as it came) and as columns,
leave the same state, snapshot, summary, view, step log and counters.

The stream has what the per-message path has rules for: several phase lists, unmeasured
phases, warm-up steps, duplicates, an absurd step, a stall past the threshold of an
evaluation, dropped and forced counts, a refused record, a restart with a new pid on a new
route, an impostor on another relay, heartbeats between a rank's steps, and goodbyes."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from relay_replay import as_columns, frames, outputs, rank_state, replay, slots

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
from traceml_tui.collect import relay_columns
from traceml_tui.collect.collector import Collector
from traceml_tui.judge.state import RunState
from traceml_tui.runfolder.layout import RunFolder
from traceml_tui.runfolder.step_log import read_steps

WORLD, PER_NODE = 24, 8
T0 = 1_700_000_000.0
LISTS = (list(PHASES), [*PHASES, "custom"], ["forward", "backward"])
STALLED, RESTARTED, IMPOSTOR_OF, ENDED, ABSURD, DROPPING, FORCED, BAD = 12, 9, 10, 11, 4, 6, 7, 8
BURST, WINDOW = 3, 32


def _stream() -> list[list[tuple[int, int, bytes]]]:
    """Ticks of (node, route, payload): what each rank sent its node's relay per tick."""
    rng = random.Random(33)
    ids = {r: Identity(r, r % PER_NODE, r // PER_NODE, f"node{r // PER_NODE}", 1000 + r, WORLD)
           for r in range(WORLD)}
    route = {r: r % PER_NODE for r in range(WORLD)}
    seq = dict.fromkeys(range(WORLD), 0)
    step = dict.fromkeys(range(WORLD), 0)
    ticks: list[list[tuple[int, int, bytes]]] = []

    def send(tick: list, r: int, kind: str, ident: Identity | None = None, node: int | None = None,
             at: int | None = None, **body: Any) -> None:
        ident = ident or ids[r]
        seq[r] += 1
        tick.append((ident.node if node is None else node, route[r] if at is None else at,
                     protocol.encode(kind, ident, seq[r], T0 + len(ticks), **body)))

    def records(r: int, n: int, names: list[str], first: int | None = None) -> list[list]:
        out = []
        for i in range(n):
            s = step[r] if first is None else first + i
            ph = [None if rng.random() < 0.15 else rng.uniform(1.0, 40.0) for _ in names]
            slow = 900.0 if r == STALLED and len(ticks) > 30 and s % 7 == 0 else 0.0
            out.append([s, T0 + s * 0.1, 100.0 + rng.uniform(0, 20) + slow, *ph])
            if first is None:
                step[r] += 1
        return out

    for t in range(48):
        tick: list[tuple[int, int, bytes]] = []
        for r in range(WORLD):
            names = LISTS[r % 3]
            if t == 0:
                send(tick, r, "hello", run="cols", device="cpu")
                continue
            if r == ENDED and t > 40:
                continue
            if r == RESTARTED and t == 20:  # a new process, on a new connection
                send(tick, r, "goodbye", exit_code=1)  # the old one ended first
                ids[r] = Identity(r, r % PER_NODE, r // PER_NODE, "node1", 7000 + r, WORLD)
                route[r], step[r] = 100 + r, 0
                send(tick, r, "hello", run="cols", device="cpu")
            extra: dict[str, Any] = {}
            if r == DROPPING:
                extra["dropped"] = t // 5
            if r == FORCED:
                extra["forced"] = [t // 10] * len(names)
            recs = records(r, rng.choice((1, 1, 2, 3)), names)
            if r == ABSURD and t == 25:
                recs.append([10**9, T0, 100.0, *[1.0] * len(names)])  # then more steps
            if r == BAD and t % 9 == 1:  # behind rows of its own waiting for the flush
                recs.append([step[r], T0, 100.0, *[-1.0] * len(names)])
            send(tick, r, "steps", phases=names, records=recs, **extra)
            if t % 6 == r % 6:  # a replayed batch: duplicates
                send(tick, r, "steps", phases=names, records=records(r, 2, names, step[r] - 2))
            if rng.random() < 0.5:
                send(tick, r, "heartbeat", step=step[r], since_step_s=rng.uniform(0, 2))
            if t % 5 == r % 5:
                send(tick, r, "sys", cpu_pct=50.0, rss_mb=1000.0 + t)
            if rng.random() < 0.3:  # more steps after the heartbeat, same tick
                send(tick, r, "steps", phases=names, records=records(r, 1, names))
            if r == ABSURD and t == 32:  # the last of its rank's records in this drain
                send(tick, r, "steps", phases=names,
                     records=[[10**9, T0, 100.0, *[1.0] * len(names)]])
            if r == BURST and t == 14:  # more records in one drain than its window holds
                send(tick, r, "steps", phases=names, records=records(r, 40, names))
            if r == ENDED and t == 40:
                send(tick, r, "goodbye", exit_code=0, steps=step[r])
        # Another node's relay speaks for rank IMPOSTOR_OF, as another process: refused.
        if t in (10, 30):
            fake = Identity(IMPOSTOR_OF, 2, 0, "node0", 9999, WORLD)
            send(tick, IMPOSTOR_OF, "steps", ident=fake, node=2, at=50,
                 phases=LISTS[0], records=[[500 + t, T0, 1.0, *[1.0] * len(LISTS[0])]])
            step[IMPOSTOR_OF] += 0
        ticks.append(tick)
    return ticks


def _run(tmp: Path, columns: bool) -> dict[str, Any]:
    state = RunState("cols", WORLD, nnodes=3, nproc_per_node=PER_NODE, started_at=T0,
                     window_steps=WINDOW)
    coll = Collector(tmp, state)
    try:
        rows = []
        replay(coll, state, frames(_stream(), as_columns if columns else None),
               lambda t: 100.0 + t * 0.2, lambda t: t in (20, 32),
               lambda b: rows.append(0 if b.cols is None else len(b.cols.rows)), T0)
        coll.step_log.flush()
        snap = state.snapshot(T0 + 50, 110.0, full=True)
        out = {
            **outputs(state, snap, T0 + 60),
            "ranks": {r: rank_state(state, r) for r in sorted(state.ranks)},
            "stalls": {r: slots(log) for r, log in state.stall_book.logs.items()},
            "relays": state._relay_snapshots(110.0),
        }
        logged: dict[int, list] = {}
        for rec in read_steps(RunFolder(tmp).step_log):
            logged.setdefault(rec.rank, []).append(rec)
        out["log"] = logged
        out["columns_rows"] = sum(rows)
        return out
    finally:
        coll.close()


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    return (_run(tmp_path_factory.mktemp("messages"), False),
            _run(tmp_path_factory.mktemp("columns"), True))


def test_the_stream_exercises_the_rules(both: tuple[dict, dict]) -> None:
    old, new = both
    c = old["counters"]
    assert c["absurd_steps"] == 2  # the last of its rank's records in a drain, and not
    for name in ("duplicate_records", "absurd_steps", "restarts", "not_owner", "bad_records",
                 "agent_dropped"):
        assert c[name] > 0, name
    assert new["columns_rows"] > 500 and old["columns_rows"] == 0
    assert any(old["stalls"].values()) and old["ranks"][ENDED]["finished"]


def test_columns_leave_the_same_state(both: tuple[dict, dict]) -> None:
    old, new = both
    assert new["counters"] == old["counters"]
    assert new["ranks"].keys() == old["ranks"].keys()
    for r in old["ranks"]:
        assert new["ranks"][r] == old["ranks"][r], r
    assert new["stalls"] == old["stalls"]
    assert new["relays"] == old["relays"]


def test_columns_leave_the_same_summary_and_view(both: tuple[dict, dict]) -> None:
    old, new = both
    assert new["final"] == old["final"]
    assert new["live"] == old["live"]
    assert new["view"] == old["view"]


def test_columns_leave_the_same_step_log(both: tuple[dict, dict]) -> None:
    old, new = both
    assert new["log"].keys() == old["log"].keys()
    for r in old["log"]:
        assert new["log"][r] == old["log"][r], r


def _column_batch(rows: list[StepRow], groups: list[StepGroup]) -> list[bytes]:
    batch = RelayBatch(0, 0, 0, [0] * len(rows), [b""] * len(rows), StepColumns(groups, rows))
    return [b"relay0", RELAY_TAG, encode_relay_batch(batch)]


def _group(steps: list[int], step_ms: list[float], values: list[list[float]],
           phases: list[str] | None = None) -> StepGroup:
    return StepGroup(phases or ["forward", "backward"], np.array(steps, "<i8").tobytes(),
                     np.full(len(steps), T0).tobytes(), np.array(step_ms, "<f8").tobytes(),
                     np.array(values, "<f8").tobytes())


def test_a_relays_bad_columns_are_refused_and_counted(tmp_path: Path) -> None:
    """A relay holds a rank's key, not more: its rows are checked as a message is."""
    state = RunState("cols", 8, nnodes=1, started_at=T0)
    coll = Collector(tmp_path, state)
    try:
        ident = Identity(0, 0, 0, "node0", 1000, 8)
        coll._receive([b"relay0", RELAY_TAG, encode_relay_batch(RelayBatch(
            0, 0, 0, [0, 0], [protocol.encode("hello", ident, 0, T0),
                              protocol.encode("steps", ident, 1, T0, phases=["forward"],
                                              records=[[1, T0, 10.0, 5.0]])]))], 1.0)
        before = dict(state.counters)
        row = StepRow(ident, 2, T0, 0, 4)
        bad = [math.nan, math.inf, -1.0, 2e8]  # each refused as protocol._record refuses
        coll._receive(_column_batch([row], [_group([2, 3, 4, 5], bad, [[1, 1]] * 4)]), 1.0)
        coll.flush_columns()
        assert state.counters["bad_records"] == before["bad_records"] + 4
        assert state.ranks[0].bad_records == 4 and state.ranks[0].last_step == 1
        # Values out of bounds, a wrong count of records, a phase list that repeats, a rank
        # of another world, a group that does not exist: refused, never raised.
        coll._receive(_column_batch([StepRow(ident, 3, T0, 0, 2)],
                                    [_group([6, 7], [10.0, 10.0], [[-5, 1], [1, math.inf]])]),
                      1.0)
        coll.flush_columns()
        assert state.counters["bad_records"] == before["bad_records"] + 6
        malformed = state.counters["malformed"]
        for rows, groups in (
                ([StepRow(ident, 4, T0, 0, 3)], [_group([8, 9], [1.0, 1.0], [[1, 1]] * 2)]),
                ([StepRow(ident, 4, T0, 0, 1)],
                 [_group([8], [1.0], [[1, 1]], ["forward", "forward"])]),
                ([StepRow(Identity(9, 0, 0, "x", 1, 8), 4, T0, 0, 1)],
                 [_group([8], [1.0], [[1, 1]])]),
                ([StepRow(ident, 4, T0, 3, 1)], [_group([8], [1.0], [[1, 1]])]),
                ([StepRow(ident, 4, T0, 0, 1, forced=[1])], [_group([8], [1.0], [[1, 1]])])):
            coll._receive(_column_batch(rows, groups), 1.0)
            coll.flush_columns()
        assert state.counters["malformed"] == malformed + 5
        # An empty payload without its row, or a row without its payload: the batch is bad.
        coll._receive([b"relay0", RELAY_TAG, encode_relay_batch(RelayBatch(
            0, 1, 0, [0], [b""]))], 1.0)
        assert state.counters["malformed"] == malformed + 6
        # The good rows still count: the rank's steps went on.
        coll._receive(_column_batch([StepRow(ident, 9, T0, 0, 2)],
                                    [_group([2, 3], [10.0, 11.0], [[1, None], [2, 3]])]), 1.0)
        coll.flush_columns()
        assert state.ranks[0].last_step == 3 and state.ranks[0].steps == 3
        # Another world's rank, a new process without hello: refused as a message is.
        other = Identity(0, 0, 0, "node0", 4242, 8)
        coll._receive(_column_batch([StepRow(other, 10, T0, 0, 1)],
                                    [_group([50], [10.0], [[1, 1]])]), 1.0)
        coll.flush_columns()
        assert state.ranks[0].last_step == 3 and state.counters["foreign"] >= 1
    finally:
        coll.close()


def test_step_log_columns_read_back_and_bad_ones_are_skipped(tmp_path: Path) -> None:
    from traceml_tui.runfolder.step_log import StepLogWriter

    with StepLogWriter(tmp_path) as log:
        log.append(0, 1, T0, 10.0, ["forward"], [None])
        log.append_columns(("forward",), np.array([1, 2]), np.array([5, 6]),
                           np.array([T0, T0 + 1]), np.array([10.0, 11.0]),
                           np.array([[np.nan], [3.0]]))
        log._buf += log._pack((3, 0, b"\0" * 8, b"\0" * 8, b"\0" * 8, b"\0" * 8, b""))  # short
        log.append_columns(("forward",), np.array([3]), np.array([7]), np.array([T0]),
                           np.array([12.0]), np.array([[4.0]]))
    got = [(s.rank, s.step, s.step_ms, s.phase_ms) for s in read_steps(tmp_path)]
    assert got == [(0, 1, 10.0, (None,)), (1, 5, 10.0, (None,)), (2, 6, 11.0, (3.0,)),
                   (3, 7, 12.0, (4.0,))]


def test_relays_tick_slower_only_where_the_agents_send_slower_or_nodes_are_many() -> None:
    """A relay's batch costs node 0 the same however little it holds: the tick follows
    the agents' send interval (past ~2,000 ranks they send less often than every 0.4 s)
    and the job's nodes (past ~50, their relays together would send node 0 more than
    RELAY_BATCHES_PER_S batches a second at 0.2 s). A small job's relays stay at 0.2 s."""
    import zmq

    from traceml_tui.collect.relay import RELAY_BATCHES_PER_S, TICK_S, Relay, tick_s

    assert tick_s(8, 8) == tick_s(400, 8) == TICK_S == 0.2  # up to 50 nodes
    assert tick_s(512, 8) == 64 / RELAY_BATCHES_PER_S == 0.25
    assert tick_s(1024, 8) == tick_s(16_384, 8) == tick_s(16_384, 64) == 0.5
    ctx = zmq.Context()
    relays = [Relay(ctx, "tcp://127.0.0.1:9", 0, None) for _ in range(2)]
    try:
        for relay, world in zip(relays, (16, 1024), strict=True):
            assert relay.tick_s == TICK_S
            for local in range(8):  # its node's ranks say how many share the node
                ident = Identity(local, local, 0, "node0", 1 + local, world)
                relay.add(b"r%d" % local, protocol.encode(
                    "steps", ident, 1, T0, phases=["forward"], records=[[1, T0, 10.0, 5.0]]))
        assert relays[0].tick_s == 0.2 and relays[1].tick_s == 0.5
    finally:
        for relay in relays:
            relay.close()
        ctx.term()


def test_a_relay_sends_as_columns_only_what_decode_takes_whole() -> None:
    """decode_plain_steps (the relay's cheaper check) says yes exactly where decode() gives
    the message with every record kept and no collectives: anything else goes up as it
    came, and the collector judges it as it always has."""
    import msgspec as ms

    ident = Identity(1, 1, 0, "node0", 10, 8)

    def steps(records: list, **extra: Any) -> bytes:
        return protocol.encode("steps", ident, 1, T0, phases=["forward", "backward"],
                               records=records, **extra)

    ok = [2, T0, 10.0, 1.0, None]
    no_kind = ms.msgpack.decode(steps([ok]))
    del no_kind["kind"]
    cases = [steps([ok]), steps([ok, [3, T0, 10, 1, 2]]), steps([ok], forced=[0, 1]),
             steps([[2.0, T0, 10.0, 1.0, None]]), steps([[2, T0, 10.0, math.nan, None]]),
             steps([[2, T0, -1.0, 1.0, None]]), steps([[2, T0, 10.0, 1.0]]),
             steps([[True, T0, 10.0, 1.0, 2.0]]), steps([[2, None, 10.0, 1.0, 2.0]]),
             steps([ok], forced=[1]), steps([ok] * 300), ms.msgpack.encode(no_kind),
             steps([ok], colls=[["g", "all_reduce", "backward", 1, 8, 1.0]]),
             protocol.encode("steps", Identity(1, 1, 0, "n", 10, 1), 1, T0, phases=["x"],
                             records=[[2, T0, 1.0, 1.0]]),
             protocol.encode("heartbeat", ident, 1, T0, phase="steps")]
    for i, payload in enumerate(cases):
        try:
            msg = protocol.decode(payload)
            whole = (msg.kind == "steps" and not msg.bad_records and not msg.body.colls
                     and len(msg.records) <= relay_columns.MAX_ROW_RECORDS)
        except protocol.ProtocolError:
            whole = False
        assert (relay_columns.plain_steps(payload) is not None) == whole, i
