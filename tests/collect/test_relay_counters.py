"""A node relay's counters speak for that node only from the connection that relays its
ranks, and are bounded on the wire (issue 42, 7d: a key holder's batch once read
lost_batches 4.6e18 and added a relay for node 0, whose ranks have none)."""

from __future__ import annotations

import json
from pathlib import Path

from traceml_agent import protocol
from traceml_agent.protocol import RELAY_TAG, Identity, RelayBatch, encode_relay_batch
from traceml_tui.collect.collector import Collector
from traceml_tui.judge.state import RunState
from traceml_tui.report import summary

T0 = 1_700_000_000.0


def _batch(conn: bytes, node: int, batches: int, dropped: int = 0,
           payloads: tuple[bytes, ...] = ()) -> list[bytes]:
    return [conn, RELAY_TAG, encode_relay_batch(RelayBatch(
        node, batches, dropped, [0] * len(payloads), list(payloads)))]


def _relays(state: RunState) -> dict:
    snap = state.snapshot(T0 + 10, 5.0, full=True)
    doc = json.loads(summary.to_json(summary.build(snap, summary.RunMeta(complete=False))))
    return doc["relays"]


def test_only_the_relay_of_a_nodes_ranks_sets_its_counters(tmp_path: Path) -> None:
    state = RunState("relays", 2, nnodes=2, nproc_per_node=1, started_at=T0)
    coll = Collector(tmp_path, state)
    try:
        node0 = Identity(0, 0, 0, "node0", 1000, 2)
        node1 = Identity(1, 0, 1, "node1", 1001, 2)
        coll._receive([b"direct", protocol.encode("hello", node0, 0, T0)], 1.0)
        coll._receive(_batch(b"relay1", 1, 0, payloads=(
            protocol.encode("hello", node1, 0, T0),)), 1.0)
        assert _relays(state)["nodes"] == [1]
        refused = state.counters["not_owner"]
        # A key holder on a connection of its own: node 1's counters, a relay for node 0.
        coll._receive(_batch(b"evil", 1, 1 << 40, 1 << 40), 2.0)
        coll._receive(_batch(b"evil", 0, 1 << 39, 7), 2.0)
        coll._receive(_batch(b"direct", 0, 1 << 39, 7), 2.0)  # node 0's own rank's connection
        assert state.counters["not_owner"] == refused + 1
        # Beyond the wire's bound (2**40), whoever sends it: a malformed batch.
        malformed = state.counters["malformed"]
        coll._receive(_batch(b"relay1", 1, (1 << 62) - 1, 1 << 62), 2.0)
        assert state.counters["malformed"] == malformed + 1
        coll._receive(_batch(b"relay1", 1, 1, 2), 3.0)  # the real relay goes on
        relays = _relays(state)
        assert relays["nodes"] == [1], relays  # no phantom relay for node 0
        assert relays["lost_batches"] == 0 and relays["dropped"] == 2, relays
        assert relays["batches"] == 2, relays
        # torchrun restarts node 1's rank and its relay: the new process's hello through the
        # new connection moves the node's counters to it, numbered afresh.
        coll._receive(_batch(b"relay1", 1, 2, payloads=(
            protocol.encode("goodbye", node1, 1, T0 + 4, exit_code=1),)), 4.0)
        later = Identity(1, 0, 1, "node1", 1002, 2)
        coll._receive(_batch(b"relay1b", 1, 0, payloads=(
            protocol.encode("hello", later, 0, T0 + 9, attempt=1),)), 9.0)
        coll._receive(_batch(b"relay1b", 1, 1), 9.5)
        assert state.ranks[1].ident.pid == 1002 and state.relays[1].conn == b"relay1b"
        relays = _relays(state)
        assert relays["lost_batches"] == 0 and relays["batches"] == 2, relays
        coll._receive(_batch(b"relay1", 1, 3), 9.6)  # the old connection: no longer its relay
        assert state.counters["not_owner"] == refused + 2
    finally:
        coll.close()
