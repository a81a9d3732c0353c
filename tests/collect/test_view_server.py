"""The collector freezes a view only for someone who reads it: a viewer's request (at
most once per tick, the same bytes for every viewer of that tick), or every tick for a
/metrics server, whose thread may not touch the state. A headless or detached run pays
no view at all (~8 ms a tick at 1,024 ranks, ~210 ms at 16,384)."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest
import zmq

from traceml_tui import viewmodel
from traceml_tui.collect.canned import make_state
from traceml_tui.collect.collector import Collector


@pytest.fixture
def coll(tmp_path: Path):
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    c = Collector(run_dir, make_state(world_size=8))
    try:
        yield c
    finally:
        c.close()


def snapshots_taken(coll: Collector) -> list[bool]:
    """Counts the state's snapshots (full or not) from now on."""
    taken: list[bool] = []
    real = coll.state.snapshot

    def counted(now: float, mono_now: float, full: bool = False):
        taken.append(full)
        return real(now, mono_now, full)

    coll.state.snapshot = counted  # type: ignore[method-assign]
    return taken


def ask_view(coll: Collector, req: zmq.Socket) -> viewmodel.RunView:
    """One viewer's request over the collector's real view socket, answered by it."""
    req.send(msgpack.packb({"op": "view"}))
    assert coll.view.poll(10_000), "the request never reached the collector"
    coll.views.handle()
    assert req.poll(10_000), "no reply"
    frames = req.recv_multipart()
    assert len(frames) == 2
    return viewmodel.decode_view(frames[0])


def test_no_viewer_no_view_then_one_view_per_tick_for_every_viewer(coll):
    taken = snapshots_taken(coll)
    for _ in range(5):  # ticks of a run nobody watches
        coll.views.refresh()
    assert taken == []
    ctx = zmq.Context.instance()
    viewers = [ctx.socket(zmq.REQ) for _ in range(2)]
    try:
        for req in viewers:
            req.setsockopt(zmq.LINGER, 0)
            req.connect(coll.view_addr)
        first = ask_view(coll, viewers[0])
        assert len(first.rows) == 8 and first.rows[2].rank == 2
        bytes_of_tick = coll.views.bytes
        second = ask_view(coll, viewers[1])  # the same tick: the same frozen view
        assert taken == [False] and coll.views.bytes is bytes_of_tick
        assert second == first
        # What the builds cost is charged to the next tick, which the collector spaces
        # by its cost (EVAL_BACKOFF): views on request stay inside the ticks' budget.
        assert coll.views.take_spent() > 0.0 and coll.views.take_spent() == 0.0
        coll.views.refresh()  # the next tick: frozen again for the next request
        ask_view(coll, viewers[0])
        assert taken == [False, False] and coll.views.take_spent() > 0.0
    finally:
        for req in viewers:
            req.close()


def test_a_metrics_server_has_the_view_frozen_every_tick(coll):
    taken = snapshots_taken(coll)
    coll.views.eager = True  # as the collector sets it when it serves /metrics
    for _ in range(3):
        coll.views.refresh()
    assert taken == [False] * 3
    assert coll.views.take_spent() == 0.0  # built inside the tick, already counted there
    assert coll.views.now is not None and len(coll.views.now.rows) == 8
