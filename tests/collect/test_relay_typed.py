"""A relay's heartbeats and sys samples in typed lists (RelayBatch.beats, .samples) change
nothing but node 0's cost: the same rank messages, sent as relays sent them before (each
heartbeat and sample as it came) and in the lists, leave the same state, snapshot, summary,
view and counters. And a relay is trusted with nothing more than before: a list entry for
another node's rank, a bad entry, marks without entries, an oversized batch are refused.

The stream has what heartbeats and samples have rules for: liveness and last-seen times
(a rank that goes quiet, one that stops stepping and only beats: a hang), the agent's
counts and state, CUDA graph replays and batches, busy agents, CPU share and wait, memory
headroom and its trend, GPU figures and NVML health, a key presented, unprintable text
cleaned, a restart with a new pid on a new route, an impostor on another relay, another
world's rank, and heartbeats between a rank's steps waiting for the flush."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from relay_replay import frames, outputs, rank_state, replay, slots, steps_only

from traceml_agent import protocol
from traceml_agent.protocol import (
    BEAT_MARK,
    MAX_RELAY_BATCH,
    PHASES,
    RELAY_TAG,
    SYS_MARK,
    Identity,
    RelayBatch,
    encode_relay_batch,
)
from traceml_tui.collect import relay_columns
from traceml_tui.collect.collector import Collector
from traceml_tui.collect.relay import Relay
from traceml_tui.judge.state import RunState
from traceml_tui.report import summary

WORLD, PER_NODE = 24, 8
T0 = 1_700_000_000.0
QUIET, RESTARTED, IMPOSTOR_OF, BUSY = 5, 9, 10, 17
STUCK = 34  # from this tick on no rank steps, all beat: a hang
KEY = "0123456789abcdef" * 2


def _stream() -> list[list[tuple[int, int, bytes]]]:
    """Ticks of (node, route, payload): what each rank sent its node's relay per tick."""
    rng = random.Random(43)
    ids = {r: Identity(r, r % PER_NODE, r // PER_NODE, f"node{r // PER_NODE}", 1000 + r, WORLD)
           for r in range(WORLD)}
    route = {r: r % PER_NODE for r in range(WORLD)}
    seq = dict.fromkeys(range(WORLD), 0)
    step = dict.fromkeys(range(WORLD), 0)
    ticks: list[list[tuple[int, int, bytes]]] = []

    def send(tick: list, r: int, kind: str, ident: Identity | None = None,
             node: int | None = None, at: int | None = None, **body: Any) -> None:
        ident = ident or ids[r]
        seq[r] += 1
        tick.append((ident.node if node is None else node, route[r] if at is None else at,
                     protocol.encode(kind, ident, seq[r], T0 + len(ticks), **body)))

    def beat(tick: list, r: int, t: int, **extra: Any) -> None:
        send(tick, r, "heartbeat", step=step[r], since_step_s=rng.uniform(0, 2),
             phase=rng.choice(("forward", "backward", None, "opt\x1b[2J")),
             in_phase_s=rng.uniform(0, 1), collectives=min(t, STUCK) * 3,
             groups={"g0": min(t, STUCK)}, in_group="g0" if r % 4 == 0 else None,
             in_collective="all_reduce" if t >= STUCK else None, grad_bytes=1 << 20,
             parallel="ddp", framework="torch",
             replays=min(t, STUCK) // 4 if r % 3 == 0 else 0, batches=min(t, STUCK),
             agent_busy="deep trace stopping" if r == BUSY and 20 < t < 30 else None,
             key=KEY if t == 2 else None, gc_slow=t // 10, loader_len=100,
             late_steps=t // 20, **extra)

    def sample(tick: list, r: int, t: int) -> None:
        gpu: dict[str, Any] = {}
        if r % 2:
            gpu = dict(gpu_util=rng.uniform(50, 100), gpu_mem_mb=2000.0 + 10 * t,
                       gpu_mem_total_mb=80_000.0, gpu_alloc_mb=1500.0 + 20 * t,
                       gpu_reserved_mb=1800.0, gpu_peak_mb=1900.0, device="cuda:0",
                       power_w=300.0, sm_clock_mhz=1400.0 if r != 7 else 900.0,
                       sm_clock_max_mhz=1980.0, temp_c=70.0,
                       throttle=["sw thermal"] if r == 7 else [], gpu_uuid=f"GPU-{r}")
        else:
            gpu = dict(gpu_note="no NVML\x07")
        send(tick, r, "sys", cpu_pct=rng.uniform(50, 150), thread_cpu_pct=rng.uniform(30, 90),
             cpu_wait_pct=rng.uniform(0, 40) if r != 3 else 60.0, rss_mb=1000.0 + 5 * t,
             mem_avail_mb=30_000.0 - 10 * t, **gpu)

    for t in range(48):
        tick: list[tuple[int, int, bytes]] = []
        for r in range(WORLD):
            if t == 0:
                send(tick, r, "hello", run="typed", device="cpu", key=None if r else KEY)
                continue
            if r == QUIET and t > 30:
                continue
            if r == RESTARTED and t == 20:  # a new process, on a new connection
                send(tick, r, "goodbye", exit_code=1)
                ids[r] = Identity(r, r % PER_NODE, r // PER_NODE, "node1", 7000 + r, WORLD)
                route[r], step[r] = 100 + r, 0
                beat(tick, r, t)  # before its hello: not its rank's process yet
                send(tick, r, "hello", run="typed", device="cpu")
            if t < STUCK:
                n = rng.choice((1, 2))
                recs = [[step[r] + i, T0 + step[r] + i, 100.0 + rng.uniform(0, 20),
                         *[rng.uniform(1, 30) for _ in PHASES]] for i in range(n)]
                step[r] += n
                send(tick, r, "steps", phases=list(PHASES), records=recs)
            if rng.random() < 0.6:
                beat(tick, r, t)
            if t % 3 == r % 3:
                sample(tick, r, t)
            if rng.random() < 0.3:  # more steps after the heartbeat, same drain
                recs = [[step[r], T0 + step[r], 100.0, *[1.0] * len(PHASES)]]
                step[r] += 1
                if t < STUCK:
                    send(tick, r, "steps", phases=list(PHASES), records=recs)
        if t in (10, 30):  # another node's relay speaks for rank IMPOSTOR_OF: refused
            fake = Identity(IMPOSTOR_OF, 2, 1, "node1", 1000 + IMPOSTOR_OF, WORLD)
            send(tick, IMPOSTOR_OF, "heartbeat", ident=fake, node=2, at=50, step=10**6)
            send(tick, IMPOSTOR_OF, "sys", ident=fake, node=2, at=50, rss_mb=1e6)
            other = Identity(3, 3, 0, "node0", 1003, WORLD * 2)  # another run's world
            send(tick, 3, "heartbeat", ident=other, step=5)
        ticks.append(tick)
    return ticks


def _run(tmp: Path, typed: bool) -> dict[str, Any]:
    state = RunState("typed", WORLD, nnodes=3, nproc_per_node=PER_NODE, started_at=T0,
                     window_steps=32)
    coll = Collector(tmp, state)
    try:
        listed = []
        snaps = replay(coll, state,
                       frames(_stream(), relay_columns.item_of if typed else steps_only),
                       lambda t: 100.0 + t * 1.0, lambda t: t % 8 == 7 or t >= 44,
                       lambda b: listed.append(len(b.beats or ()) + len(b.samples or ())),
                       T0)
        now, mono = T0 + 50, 100.0 + 50
        state.evaluate(now, mono)
        snap = state.snapshot(now, mono, full=True)
        return {
            **outputs(state, snap, now),
            "ranks": {r: _typed_rank(state, r) for r in sorted(state.ranks)},
            "hang": state.hang,
            "snaps": [summary.to_json(summary.build(s, summary.RunMeta(complete=False)))
                      for s in snaps],
            "relays": state._relay_snapshots(mono),
            "listed": sum(listed),
        }
    finally:
        coll.close()


def _typed_rank(state: RunState, r: int) -> dict[str, Any]:
    rs = state.ranks[r]
    out = rank_state(state, r)
    for name in ("heartbeat", "sys", "gpu", "key", "replays_at", "batches_at", "busy_since",
                 "conn"):
        out[name] = getattr(rs, name)
    cpu = state.live_cols.cpu
    out["cpu"] = (float(cpu.run[r]), float(cpu.wait[r]))
    series = state.memory.series.get(r)  # as text: NaN is not equal to itself
    out["memory"] = None if series is None else repr(slots(series) if hasattr(
        type(series), "__slots__") else {k: (v.tolist() if isinstance(v, np.ndarray) else v)
                                         for k, v in vars(series).items()})
    return out


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    return (_run(tmp_path_factory.mktemp("messages"), False),
            _run(tmp_path_factory.mktemp("typed"), True))


def test_the_stream_exercises_the_rules(both: tuple[dict, dict]) -> None:
    old, new = both
    c = old["counters"]
    for name in ("restarts", "not_owner", "foreign"):
        assert c[name] > 0, name
    assert old["listed"] == 0 and new["listed"] > 1_000
    # Liveness: the quiet rank was last seen when it went quiet, the others at the end.
    assert old["ranks"][QUIET]["last_seen"] == 130.0 and old["ranks"][0]["last_seen"] == 147.0
    assert old["ranks"][RESTARTED]["pid"] == 7000 + RESTARTED
    assert old["ranks"][0]["key"] == KEY  # its hello's
    assert sum(rank["key"] == KEY for rank in old["ranks"].values()) > 10  # heartbeats'
    assert old["ranks"][BUSY]["busy_since"] is None
    assert old["ranks"][7]["gpu"] is not None
    assert "\x1b" not in str(old["ranks"]) and "\x07" not in str(old["ranks"])


def test_lists_leave_the_same_state(both: tuple[dict, dict]) -> None:
    old, new = both
    assert new["counters"] == old["counters"]
    assert new["ranks"].keys() == old["ranks"].keys()
    for r in old["ranks"]:
        assert new["ranks"][r] == old["ranks"][r], r
    assert new["relays"] == old["relays"]
    assert new["hang"] == old["hang"]


def test_lists_leave_the_same_summary_and_view(both: tuple[dict, dict]) -> None:
    old, new = both
    assert new["snaps"] == old["snaps"]
    assert new["final"] == old["final"]
    assert new["live"] == old["live"]
    assert new["view"] == old["view"]


# --- bounds: a relay holds a rank's key, not more -------------------------------------


def _ident(rank: int, pid: int | None = None, world: int = 16) -> Identity:
    return Identity(rank, rank % 8, rank // 8, f"node{rank // 8}", pid or 1000 + rank, world)


def _frame(conn: bytes, node: int, n: int, items: list[tuple[int, bytes]]) -> list[bytes]:
    batch = relay_columns.relay_batch(node, n, 0, [r for r, _ in items],
                                      [relay_columns.item_of(p) for _, p in items])
    return [conn, RELAY_TAG, encode_relay_batch(batch)]


@pytest.fixture
def two_nodes(tmp_path: Path) -> Iterator[tuple[RunState, Collector]]:
    """Ranks 0-7 through relay1's connection, 8-15 through relay2's, each with steps."""
    state = RunState("typed", 16, nnodes=2, nproc_per_node=8, started_at=T0)
    coll = Collector(tmp_path, state)
    try:
        for node, conn in ((0, b"relay1"), (1, b"relay2")):
            items = []
            for r in range(node * 8, node * 8 + 8):
                items.append((r % 8, protocol.encode("hello", _ident(r), 0, T0)))
                items.append((r % 8, protocol.encode(
                    "steps", _ident(r), 1, T0, phases=["forward"],
                    records=[[1, T0, 10.0, 5.0]])))
            coll._receive(_frame(conn, node, 0, items), 1.0)
        coll.flush_columns()
        yield state, coll
    finally:
        coll.close()


def test_a_beat_for_another_nodes_rank_is_refused(two_nodes: tuple[RunState, Collector]
                                                  ) -> None:
    state, coll = two_nodes
    before = dict(state.counters)
    # relay2 (node 1) speaks for rank 3, node 0's, as its very process while it is live
    # (owners.may_take_over): refused.
    coll._receive(_frame(b"relay2", 1, 1, [
        (3, protocol.encode("heartbeat", _ident(3), 5, T0, step=99, phase="x")),
        (3, protocol.encode("sys", _ident(3), 6, T0, rss_mb=12345.0))]), 1.5)
    assert state.counters["not_owner"] == before["not_owner"] + 2
    rs = state.ranks[3]
    assert rs.heartbeat.step != 99 and rs.sys is None and rs.last_seen == 1.0
    # Its own relay: taken, and the rank is live as of now.
    coll._receive(_frame(b"relay1", 0, 1, [
        (3, protocol.encode("heartbeat", _ident(3), 5, T0, step=99, phase="x")),
        (3, protocol.encode("sys", _ident(3), 6, T0, rss_mb=12345.0))]), 2.0)
    assert rs.heartbeat.step == 99 and rs.sys is not None and rs.sys.rss_mb == 12345.0
    assert rs.last_seen == 2.0 and state.counters["messages"] == before["messages"] + 2


def test_bad_lists_are_refused_whole_and_bad_entries_alone(
        two_nodes: tuple[RunState, Collector]) -> None:
    state, coll = two_nodes
    rs = state.ranks[1]
    beat = protocol.encode("heartbeat", _ident(1), 5, T0, step=7)
    malformed = state.counters["malformed"]

    def raw(**fields: Any) -> list[bytes]:
        batch = RelayBatch(0, 1, 0, [1], [BEAT_MARK], beats=[msgspec.Raw(beat)])
        batch = msgspec.structs.replace(batch, **fields)
        return [b"relay1", RELAY_TAG, encode_relay_batch(batch)]

    bad_beat = beat.replace(b"\x07", b"\x08")  # step 8: fine; now an out-of-bound field:
    bad_beat = protocol.encode("heartbeat", _ident(1), 5, T0, step=7, in_phase_s=-1.0)
    sys_as_beat = protocol.encode("sys", _ident(1), 5, T0, rss_mb=1.0)
    for frame in (
            raw(payloads=[BEAT_MARK, BEAT_MARK], routes=[1, 1]),  # a mark without its entry
            raw(payloads=[SYS_MARK]),  # a mark of the other kind
            raw(payloads=[b"\x00"]),  # an entry without its mark
            raw(beats=[msgspec.Raw(bad_beat)]),  # an entry out of its Struct's bounds
            raw(beats=[msgspec.Raw(sys_as_beat)]),  # a sample in the heartbeats' list
            raw(routes=[1] * (MAX_RELAY_BATCH + 1), payloads=[BEAT_MARK] * (MAX_RELAY_BATCH + 1),
                beats=[msgspec.Raw(beat)] * (MAX_RELAY_BATCH + 1))):  # past the list's bound
        coll._receive(frame, 9.0)
    assert state.counters["malformed"] == malformed + 6
    assert rs.heartbeat.step != 7 and rs.last_seen == 1.0
    # An entry decode() refuses for its envelope (another protocol version, a rank past
    # its world): that entry alone, the others taken.
    newer = msgspec.msgpack.encode({**msgspec.msgpack.decode(beat), "v": 99})
    past = protocol.encode("heartbeat", Identity(20, 0, 0, "node0", 1001, 16), 5, T0)
    coll._receive([b"relay1", RELAY_TAG, encode_relay_batch(RelayBatch(
        0, 1, 0, [1, 1, 1], [BEAT_MARK] * 3,
        beats=[msgspec.Raw(newer), msgspec.Raw(past), msgspec.Raw(beat)]))], 9.0)
    assert state.counters["malformed"] == malformed + 8
    assert rs.heartbeat.step == 7 and rs.last_seen == 9.0


def test_a_batch_past_its_bytes_is_refused(two_nodes: tuple[RunState, Collector]) -> None:
    state, coll = two_nodes
    beat = protocol.encode("heartbeat", _ident(1), 5, T0, step=7, agent_off="x" * 250)
    n = protocol.MAX_RELAY_BATCH_BYTES // len(beat) + 2
    frame = [b"relay1", RELAY_TAG, encode_relay_batch(RelayBatch(
        0, 1, 0, [1] * n, [BEAT_MARK] * n, beats=[msgspec.Raw(beat)] * n))]
    assert len(frame[2]) > protocol.MAX_RELAY_BATCH_BYTES
    malformed = state.counters["malformed"]
    coll._receive(frame, 9.0)
    assert state.counters["malformed"] == malformed + 1
    assert state.ranks[1].heartbeat.step != 7


def test_the_relay_lists_what_decodes_and_sends_the_rest_as_it_came() -> None:
    """A relay batches only what node 0 would take (one bad entry would cost its whole
    batch), splits batches by their bytes, and forwards no payload that is a mark."""
    import zmq

    ctx = zmq.Context.instance()
    up = ctx.socket(zmq.ROUTER)
    port = up.bind_to_random_port("tcp://127.0.0.1")
    relay = Relay(ctx, f"tcp://127.0.0.1:{port}", 1, None)
    try:
        beat = protocol.encode("heartbeat", _ident(9), 5, T0, step=7)
        sample = protocol.encode("sys", _ident(9), 6, T0, rss_mb=5.0)
        bad = protocol.encode("heartbeat", _ident(9), 7, T0, in_phase_s=-1.0)
        big = [protocol.encode("heartbeat", _ident(9), 10 + i, T0, agent_off="y" * 250)
               for i in range(protocol.MAX_MESSAGE_BYTES // 250 + 5)]
        for p in (beat, BEAT_MARK, sample, SYS_MARK, bad, *big):
            relay.add(b"conn9", p)
        relay.tick(10.0)
        got = []
        while up.poll(2000):
            got.append(protocol.decode_relay_batch(up.recv_multipart()[2]))
            if sum(len(b.payloads) for b in got) >= 3 + len(big):
                break
        assert len(got) >= 2  # the heartbeats' bytes split it
        first = got[0]
        assert first.payloads[:3] == [BEAT_MARK, SYS_MARK, bad]
        assert first.beats is not None and first.beats[0].step == 7
        assert first.samples is not None and first.samples[0].rss_mb == 5.0
        assert sum(len(b.beats or ()) for b in got) == 1 + len(big)
        assert relay.forwarded == 3 + len(big) and relay.dropped == 0
    finally:
        relay.close()
        up.close(0)
