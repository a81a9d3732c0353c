"""A relay's columns within the bounds node 0 holds them to (review of issue 33's relay
columns): what an honest relay sends is never refused whole, and what a hostile one sends
costs node 0 no more than its messages would."""

from __future__ import annotations

import zmq

from traceml_agent import protocol
from traceml_agent.protocol import MAX_RELAY_BATCH, MAX_STR, RELAY_TAG, Identity

T0 = 1_700_000_000.0


def test_a_relays_column_batches_fit_node_0s_bound_whatever_the_host_name() -> None:
    """A row carries its rank's identity (a host name of up to MAX_STR characters): a batch
    of MAX_RELAY_BATCH such rows must still be one node 0 takes, or all of them are lost."""
    from traceml_tui.collect.relay import Relay

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    relay = Relay(ctx, f"tcp://127.0.0.1:{port}", 1, None)
    try:
        ident = Identity(1, 1, 1, "h" * MAX_STR, 1 << 30, 16_384)
        for seq in range(MAX_RELAY_BATCH):
            relay.add(b"rank", protocol.encode(
                "steps", ident, 1 << 40, T0, phases=["forward"], dropped=1 << 40,
                forced=[1 << 40], records=[[(1 << 40) + seq, T0, 10.0, 5.0]]))
        relay.tick(T0)
        assert relay.dropped == 0
        rows = 0
        while rows < MAX_RELAY_BATCH:
            assert router.poll(10_000), f"{rows} rows arrived"
            _, tag, data = router.recv_multipart()
            assert tag == RELAY_TAG
            assert len(data) <= protocol.MAX_RELAY_BATCH_BYTES
            batch = protocol.decode_relay_batch(data)
            rows += len(batch.cols.rows) if batch.cols is not None else 0
        assert rows == MAX_RELAY_BATCH
    finally:
        relay.close()
        router.close()
        ctx.term()


def test_a_drain_of_large_column_batches_costs_node_0_a_bounded_flush(tmp_path) -> None:
    """Rows wait for the end of a drain (up to 256 relay frames of ~1 MiB, from as many
    key holders' connections): their records are taken a bounded number at a time, or
    one flush builds a dozen arrays per record of the whole drain (~540 MiB for 62 MiB of
    frames) and holds the collector's loop for seconds."""
    import tracemalloc

    import numpy as np

    from traceml_agent.protocol import RelayBatch, StepColumns, StepGroup, StepRow
    from traceml_tui.collect.collector import Collector
    from traceml_tui.judge.state import RunState

    world, n = 32, 16_000
    state = RunState("bounds", world, nnodes=1, started_at=T0)
    coll = Collector(tmp_path, state)
    try:
        frames = []
        for r in range(world):
            ident = Identity(r, 0, 0, "h", 1000 + r, world)
            conn = b"c%d" % r
            coll._receive([conn, RELAY_TAG, protocol.encode_relay_batch(RelayBatch(
                0, 0, 0, [0, 0], [protocol.encode("hello", ident, 0, T0),
                                  protocol.encode("steps", ident, 1, T0, phases=["forward"],
                                                  records=[[1, T0, 10.0, 5.0]])]))], 1.0)
            group = StepGroup(["forward"], np.arange(2, 2 + 2 * n, dtype="<i8").tobytes(),
                              np.full(2 * n, T0).tobytes(), np.full(2 * n, 10.0).tobytes(),
                              np.full(2 * n, 1.0).tobytes())
            rows = [StepRow(ident, 2, T0, 0, n), StepRow(ident, 3, T0, 0, n)]
            frames.append([conn, RELAY_TAG, protocol.encode_relay_batch(RelayBatch(
                0, 1, 0, [0, 0], [b"", b""], StepColumns([group], rows)))])
        tracemalloc.start()
        try:
            for f in frames:
                coll._receive(f, 2.0)
            coll.flush_columns()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert state.counters["records"] == world * (1 + 2 * n)
        assert peak < 64 << 20, f"{peak >> 20} MiB"
    finally:
        coll.close()
