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
