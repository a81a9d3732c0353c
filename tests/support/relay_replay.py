"""A relay's stream replayed into a real Collector, sent two ways, for the tests that show a
new relay form changes nothing but node 0's cost (tests/collect/test_relay_columns.py:
steps as columns; test_relay_typed.py: heartbeats and samples in typed lists).

A stream is ticks of (node, route, payload): what each rank sent its node's relay in a
tick. `frames` turns each tick into the ingest frames a relay's tick sends, making each
payload a batch item as the form under test does; `replay` feeds them to the Collector
with a drain's flush every few ticks and evaluations where asked; `outputs` is what the
user and the record see of the state afterwards, and `rank_state`/`slots` what the rules
kept per rank, to compare field by field.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from traceml_agent import protocol
from traceml_agent.protocol import RELAY_TAG, RelayBatch, encode_relay_batch
from traceml_tui import viewmodel
from traceml_tui.collect import relay_columns, view_build
from traceml_tui.collect.collector import Collector
from traceml_tui.judge.snapshot import Snapshot
from traceml_tui.judge.state import RunState
from traceml_tui.report import summary

Tick = list[tuple[int, int, bytes]]
# How a relay makes a batch item of a rank's payload; None: the payloads as they came
# (RelayBatch.payloads, as relays sent them before columns).
ItemOf = Callable[[bytes], relay_columns.Item] | None
DRAIN_TICKS = 3  # a drain: a few ticks of batches, then the flush


def as_columns(payload: bytes) -> relay_columns.Item:
    """Steps as columns where they fit, everything else as it came."""
    marks = relay_columns.plain_steps(payload)
    return payload if marks is None else (marks, payload)


def steps_only(payload: bytes) -> relay_columns.Item:
    """Steps as columns, heartbeats and samples as they came (before the typed lists)."""
    item = relay_columns.item_of(payload)
    return payload if isinstance(item, tuple) and isinstance(item[0], bytes) else item


def frames(ticks: list[Tick], item_of: ItemOf) -> Iterator[list[list[bytes]]]:
    """Per tick, each node's batch as a relay's tick sends it, as ingest frames."""
    counts: dict[int, int] = {}
    for tick in ticks:
        out = []
        for node in sorted({n for n, _, _ in tick}):
            routes = [rt for n, rt, _ in tick if n == node]
            payloads = [p for n, _, p in tick if n == node]
            n = counts.get(node, 0)
            batch = (RelayBatch(node, n, 0, routes, payloads) if item_of is None else
                     relay_columns.relay_batch(node, n, 0, routes,
                                               [item_of(p) for p in payloads]))
            counts[node] = n + 1
            out.append([b"relay%d" % node, RELAY_TAG, encode_relay_batch(batch)])
        yield out


def replay(coll: Collector, state: RunState, ticks: Iterator[list[list[bytes]]],
           mono: Callable[[int], float], evaluate_at: Callable[[int], bool],
           on_batch: Callable[[protocol.RelayBatch], None] = lambda b: None,
           t0: float = 0.0) -> list[Snapshot]:
    """Every tick's frames into the collector at monotonic time `mono(tick)`; a flush every
    DRAIN_TICKS ticks, and a flush and an evaluation at the ticks `evaluate_at` picks,
    whose snapshots are returned. `on_batch` sees each batch as node 0 decodes it."""
    snaps = []
    for t, tick in enumerate(ticks):
        now = mono(t)
        for frame in tick:
            on_batch(protocol.decode_relay_batch(frame[2]))
            coll._receive(frame, now)
        if t % DRAIN_TICKS == DRAIN_TICKS - 1:
            coll.flush_columns()
        if evaluate_at(t):
            coll.flush_columns()
            state.evaluate(t0 + t, now)
            snaps.append(state.snapshot(t0 + t, now, full=True))
    coll.flush_columns()
    return snaps


def outputs(state: RunState, snap: Snapshot, ended_at: float) -> dict[str, Any]:
    """What the user and the record see: the counters, the live and final summaries and
    the view."""
    return {
        "counters": dict(state.counters),
        "live": summary.to_json(summary.build(snap, summary.RunMeta(complete=False))),
        "final": summary.to_json(summary.build(snap, summary.RunMeta(
            command=["x"], exit_code=0, ended_at=ended_at))),
        "view": viewmodel.encode_view(view_build.build(snap, state.recent_steps)),
    }


def slots(obj: Any) -> dict[str, Any]:
    """An object's __slots__ fields, arrays as lists (to compare with ==)."""
    out = {}
    for name in type(obj).__slots__:
        v = getattr(obj, name)
        out[name] = v.tolist() if isinstance(v, np.ndarray) else v
    return out


def rank_state(state: RunState, r: int) -> dict[str, Any]:
    """What the rules kept of rank `r`: its record's fields, its window, its ring."""
    rs, b = state.ranks[r], state.block
    fields = ("steps", "last_step", "last_seen", "last_step_at", "since_step_at_msg_s",
              "dropped", "forced", "bad_records", "finished", "first_step", "first_step_at",
              "stacks", "device")
    out: dict[str, Any] = {f: getattr(rs, f) for f in fields}
    out["pid"] = rs.ident.pid
    # By name: a series' number is the order names first reached a window, which is not
    # the same when some records wait for a flush (and nothing reads the numbers).
    out["window"] = {name: np.nan_to_num(b.series[i][r], nan=-1.0).tolist()
                     for name, i in [("", 0), *b.index.items()]}
    out["step_no"] = b.step_no[r].tolist()
    out["ring"] = (b.pos[r], b.count[r], sorted(b.known[r]), b.last_names[r])
    out["heartbeat"] = rs.heartbeat.since_step_s
    return out
