"""The hang record (docs/hangs.md): what the summary keeps of a hang, whatever the stop
does after it, and who may add a stack to it. Pure state and summary, no processes."""

from __future__ import annotations

import time

from traceml_agent.protocol import PHASES, Identity, decode, encode
from traceml_tui.judge.state import RunState
from traceml_tui.report import summary
from traceml_tui.runfolder import summary_model as model

T0 = 1_700_000_000.0
_STEP_MS = {"dataloader": 5.0, "forward": 15.0, "backward": 20.0, "sync": 2.0}


def _steps(state: RunState, ident: Identity, first: int, last: int, now: float,
           conn: object = None) -> None:
    records = [[s, T0 + s, 50.0, *(_STEP_MS.get(p) for p in PHASES)]
               for s in range(first, last + 1)]
    state.ingest(decode(encode("steps", ident, 0, T0, phases=list(PHASES), records=records)),
                 now=now, conn=conn)


def _beat(state: RunState, ident: Identity, now: float, since: float, **fields) -> None:
    state.ingest(decode(encode("heartbeat", ident, 1, T0 + now, step=20, since_step_s=since,
                               **fields)), now=now)


def _hung_job(stack_at: float = 5.0):
    """Two ranks stepped 20 times; then rank 1 sleeps in forward (its stack says so) while
    rank 0 waits in all_reduce, until HANG is latched with rank 1 as the culprit. Its
    stack comes at `stack_at` (never, if the hang latches first)."""
    state = RunState("latched", world_size=2, started_at=T0, hang_after_s=5.0)
    idents = [Identity(r, r, 0, f"host{r}", 100 + r, 2) for r in range(2)]
    for i in idents:
        _steps(state, i, 0, 19, now=1.0)
    t = 2.0
    while state.hang is None:
        _beat(state, idents[0], t, since=t - 1.0, phase="backward",
              collectives=20)
        _beat(state, idents[1], t, since=t - 1.0, phase="forward", collectives=20)
        if t == stack_at:
            state.ingest(decode(encode("stacks", idents[1], 2, T0 + t, stacks=[
                ["MainThread", "wait_forever (hang_wakes.py:30)"]])), now=t)
        state.evaluate(T0 + t, mono_now=t + 0.5)
        t += 1.0
        assert t < 30, "no hang latched"
    assert state.hang.culprits == (1,)
    return state, idents, t


def test_the_summary_keeps_the_latched_hang_after_ctrl_c_woke_the_stuck_rank():
    """Ctrl-C: rank 1's sleep raises inside `with traceml_agent.step()`, which closes its
    step (the step count moves, its stack is cleared), then every rank exits. The record
    of a run stopped by a signal still says HANG rank 1, with the stack it had."""
    state, idents, t = _hung_job()
    _steps(state, idents[1], 20, 20, now=t)  # the woken rank's step, closed on the way out
    _steps(state, idents[0], 20, 20, now=t)  # and the collective it released
    for i in idents:
        state.ingest(decode(encode("goodbye", i, 3, T0 + t, exit_code=1)), now=t)
    state.evaluate(T0 + t, mono_now=t + 0.5)
    assert state.hang is None  # live, the aftermath reads as the hang's end ...
    assert state.keep_latched_hang()  # ... the stop's record keeps the hang
    doc = model.to_doc(summary.build(state.snapshot(T0 + t + 1, t + 1, full=True),
                                     summary.RunMeta()))
    assert (doc["diagnosis"]["label"], doc["diagnosis"]["rank"]) == ("HANG", 1)
    assert doc["hang"]["kind"] == "behind" and doc["hang"]["ranks"] == [1]
    assert "wait_forever" in doc["hang"]["stacks"]["1"][0]["stack"]
    assert doc["timeline"][-1]["label"] == "HANG"
    assert doc["timeline"][-1]["end_step"] is None


def test_a_stack_that_came_after_the_last_evaluation_is_kept_when_the_rank_wakes():
    """The stuck rank's stack arrives after the tick that latched the hang, and Ctrl-C
    wakes the rank before the next tick: its closing step clears the rank's own stack
    before any evaluation copied it into the hang's record. The record still has it
    (a race a 3-rank Ctrl-C job lost once in ~4 fresh-clone runs)."""
    state, idents, t = _hung_job(stack_at=-1.0)
    assert 1 not in state.hang_stacks
    state.ingest(decode(encode("stacks", idents[1], 2, T0 + t, stacks=[
        ["MainThread", "wait_forever (hang_wakes.py:30)"]])), now=t)
    _steps(state, idents[1], 20, 20, now=t)  # woken before the next tick
    _steps(state, idents[0], 20, 20, now=t)
    state.evaluate(T0 + t, mono_now=t + 0.5)
    assert state.hang is None and state.keep_latched_hang()
    doc = model.to_doc(summary.build(state.snapshot(T0 + t + 1, t + 1, full=True),
                                     summary.RunMeta()))
    assert "wait_forever" in doc["hang"]["stacks"]["1"][0]["stack"]


def test_the_hangs_the_exiting_ranks_stale_heartbeats_make_are_not_the_record():
    """Woken, the ranks close a step one after the other and die without a goodbye:
    after each step their last heartbeats (seconds old already) make a new hang, the
    aftermath's, one replacing the other. The record keeps rank 1's."""
    state, idents, t = _hung_job()
    for woken in (idents[1], idents[0]):
        _steps(state, woken, 20, 20, now=t)
        t += 6.0
        for i in idents:
            _beat(state, i, t, since=6.0, phase="sync", in_collective="all_reduce",
                  collectives=21)
        state.evaluate(T0 + t, mono_now=t + 0.5)  # no evaluation saw the step alone
        assert state.hang is not None and state.hang.culprits != (1,)  # the aftermath's
    assert state.keep_latched_hang()
    doc = model.to_doc(summary.build(state.snapshot(T0 + t + 1, t + 1, full=True),
                                     summary.RunMeta()))
    assert (doc["diagnosis"]["label"], doc["diagnosis"]["rank"]) == ("HANG", 1)
    assert doc["hang"]["ranks"] == [1]
    assert "wait_forever" in doc["hang"]["stacks"]["1"][0]["stack"]
    assert [e["label"] for e in doc["timeline"]].count("HANG") == 1


def test_the_latched_hang_survives_the_flush_of_a_gil_stuck_ranks_queued_steps():
    """A rank stuck in a C call that holds the GIL sends nothing: its agent's queue keeps
    the steps it took before it stuck, 15 of them here. Ctrl-C wakes it and its agent
    flushes them all, then every rank exits. Those steps were taken before the hang, not
    after it: the record still says HANG rank 1 (it used to drop the hang once a flush
    held more than AFTERMATH_STEPS steps per rank)."""
    state = RunState("gil", world_size=2, started_at=T0, hang_after_s=5.0)
    idents = [Identity(r, r, 0, f"host{r}", 100 + r, 2) for r in range(2)]
    _steps(state, idents[0], 0, 34, now=1.0)
    _steps(state, idents[1], 0, 19, now=1.0)  # steps 20-34 wait in its agent's queue
    t = 2.0
    while state.hang is None:
        _beat(state, idents[0], t, since=t - 1.0, phase="backward", collectives=35)
        state.evaluate(T0 + t, mono_now=t + 0.5)
        t += 1.0
        assert t < 30, "no hang latched"
    assert 1 in state.hang.culprits
    state.intake.set_native_stack(1, 101, "pause (libc.so.6)\nblock_in_c (ddp_toy.py:120)")
    state.evaluate(T0 + t, mono_now=t + 0.5)
    _steps(state, idents[1], 20, 35, now=t)  # the flush, and the step Ctrl-C closed
    _steps(state, idents[0], 35, 35, now=t)
    for i in idents:
        state.ingest(decode(encode("goodbye", i, 3, T0 + t, exit_code=1)), now=t)
    state.evaluate(T0 + t, mono_now=t + 0.5)
    assert state.keep_latched_hang()
    doc = model.to_doc(summary.build(state.snapshot(T0 + t + 1, t + 1, full=True),
                                     summary.RunMeta()))
    assert (doc["diagnosis"]["label"], doc["diagnosis"]["rank"]) == ("HANG", 1), doc["diagnosis"]
    assert "block_in_c" in doc["hang"]["stacks"]["1"][0]["stack"]


def test_a_hang_that_resolved_itself_is_not_brought_back():
    """The job went on for many steps after the stall: the end is not the hang's."""
    state, idents, t = _hung_job()
    for i in idents:
        _steps(state, i, 20, 60, now=t)
    state.evaluate(T0 + t, mono_now=t + 0.5)
    assert state.hang is None
    assert not state.keep_latched_hang()
    doc = model.to_doc(summary.build(state.snapshot(T0 + t + 1, t + 1, full=True),
                                     summary.RunMeta()))
    assert doc["hang"] is None


def _progress(r: int, node: int, silent: float, relay_silent: bool):
    from traceml_tui.judge.hang import RankProgress

    return RankProgress(r, f"host{node}", 30, 30, "backward", None, 20.0, silent,
                        node=node, relay_silent=relay_silent)


def test_ranks_silent_behind_a_silent_relay_read_relay_lost_not_dead():
    """Node 1's relay died: its ranks go silent with it. That is "node 1's relay lost";
    a silent rank whose relay still speaks is dead as before."""
    from traceml_tui.judge import hang

    ranks = [_progress(0, 0, 0.5, False), _progress(1, 0, 0.5, False),
             _progress(2, 1, 12.0, True), _progress(3, 1, 12.0, True)]
    report = hang.detect(ranks, 100.0, 5.0)
    assert report is not None and report.kind == hang.RELAY_LOST
    assert report.culprits == (2, 3) and report.diagnosis.node == 1
    assert "node 1's relay lost" in report.diagnosis.summary
    assert "dead" not in report.diagnosis.summary and "gone or frozen" not in \
        report.diagnosis.summary
    ranks[3] = _progress(3, 1, 12.0, False)  # its relay speaks: the rank itself is gone
    assert hang.detect(ranks, 100.0, 5.0).kind == hang.DEAD


def ranks_progress(state: RunState, mono_now: float):
    from traceml_tui.judge import progress

    return progress.of_ranks(state.ranks.values(), state.relays, state.waiting_routes,
                             mono_now)


def test_the_state_marks_ranks_behind_a_silent_relay():
    """Ranks whose messages came through node 1's relay, when that relay's batches stop."""
    from traceml_tui.judge import hang

    state = RunState("relay", world_size=2, started_at=T0, nnodes=2, hang_after_s=5.0)
    ident = Identity(1, 0, 1, "host1", 101, 2)
    state.intake.relay_seen(1, 0, 0, now=1.0)
    _steps(state, ident, 0, 19, now=1.0, conn=(b"relay-conn", 0))  # the relay's route 0
    progress = {p.rank: p for p in ranks_progress(state, 1.0 + 10.0)}
    assert progress[1].node == 1 and progress[1].relay_silent
    assert not {p.rank: p for p in ranks_progress(state, 2.0)}[1].relay_silent
    assert hang.RELAY_LOST == "relay lost"


# --- stacks of other nodes' ranks: through their relay, from their launcher ---------------


def test_a_relay_passes_stack_requests_to_its_launcher_and_its_dumps_up():
    """The collector asks on the relay's own route; the launcher's answer goes up beside
    the batches, for the relay's own node only."""
    import socket

    import zmq

    from traceml_agent import protocol as p
    from traceml_tui.collect.relay import Relay

    ctx = zmq.Context()
    mine, launcher = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    collector = ctx.socket(zmq.ROUTER)
    relay = None
    try:
        port = collector.bind_to_random_port("tcp://127.0.0.1")
        relay = Relay(ctx, f"tcp://127.0.0.1:{port}", 1, None, stacks=mine)
        relay.tick(float("inf"))  # a keepalive: the collector learns the relay's identity
        assert collector.poll(5000)
        conn, tag, _ = collector.recv_multipart()
        assert tag == p.RELAY_TAG
        request = p.encode_relay_stacks(p.RelayStackRequest(2, 4242))
        collector.send_multipart([conn, p.RELAY_TAG, p.RELAY_ROUTE.pack(p.RELAY_SELF_ROUTE),
                                  request])
        # Short reads between turns of the relay: the request may reach the relay's
        # socket after its first turn (a first 5 s read then used up the whole deadline).
        launcher.settimeout(0.05)
        deadline = time.monotonic() + 30
        got = None
        while got is None and time.monotonic() < deadline:
            relay.on_upstream()
            try:
                got = launcher.recv(4096)
            except (TimeoutError, BlockingIOError):
                pass
        assert p.decode_relay_stacks(got) == p.RelayStackRequest(2, 4242)
        launcher.send(p.encode_relay_stacks(p.RelayStacks(0, 2, 4242, "not my node")))
        launcher.send(p.encode_relay_stacks(p.RelayStacks(1, 2, 4242, "pause (libc.so.6)")))
        deadline = time.monotonic() + 5
        while relay.stacks_sent == 0 and time.monotonic() < deadline:
            relay.on_stacks()
        assert collector.poll(5000)
        frames = collector.recv_multipart()
        assert frames[:2] == [conn, p.RELAY_STACKS_TAG]
        assert p.decode_relay_stacks(frames[2]) == p.RelayStacks(1, 2, 4242,
                                                                 "pause (libc.so.6)")
        assert relay.stacks_sent == 1  # the other node's was dropped
    finally:
        if relay is not None:
            relay.close()
        launcher.close()
        mine.close()
        # destroy, not term: a failed assertion must not leave term() waiting forever on
        # a socket the relay still holds (it did, and hung a whole test run).
        ctx.destroy(linger=0)


def test_only_the_relay_of_that_rank_may_add_its_stack():
    """A rank's key opens the ingest socket: the stack of rank 3 is taken only from the
    connection that relays rank 3's messages, for node 1, for rank 3's pid."""
    state = RunState("relay", world_size=4, started_at=T0, nnodes=2, hang_after_s=5.0)
    state.intake.relay_seen(1, 0, 0, now=1.0)
    ident = Identity(3, 1, 1, "host1", 303, 4)
    _steps(state, ident, 0, 5, now=1.0, conn=(b"relay-1", 7))
    direct = Identity(2, 0, 1, "host1", 302, 4)
    _steps(state, direct, 0, 5, now=1.0, conn=(b"rank-2", None))
    for conn, node, rank, pid in ((b"rank-2", 1, 3, 303),  # another connection
                                  (b"relay-1", 0, 3, 303),  # another node
                                  (b"relay-1", 1, 3, 999),  # another process
                                  (b"rank-2", 1, 2, 302)):  # a direct rank, not relayed
        assert not state.intake.relay_stack(conn, node, rank, pid, "forged"), (conn, node, rank)
    assert state.ranks[3].stacks == () and state.ranks[2].stacks == ()
    assert state.intake.relay_stack(b"relay-1", 1, 3, 303, "pause (libc.so.6)\x1b[2J")
    (name, text), = state.ranks[3].stacks
    assert name.startswith("native") and "pause" in text and "\x1b" not in text


def test_a_launcher_dumps_only_processes_of_its_own_torchrun():
    """A pid from a hello is a rank's word: not a descendant of this node's torchrun,
    it is refused and counted, and nothing is sent."""
    import os
    import socket
    import threading

    from traceml_agent.protocol import RelayStackRequest
    from traceml_tui.launch.native_stacks import NodeStackServer

    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        server = NodeStackServer(mine, 1, threading.Event(), torchrun_pid=os.getpid() + 10**6,
                                 py_spy="/bin/false")
        server.answer(RelayStackRequest(3, os.getpid()))
        assert server.refused == 1 and server.sent == 0
        theirs.setblocking(False)
        try:
            theirs.recv(4096)
            raise AssertionError("something was sent")
        except BlockingIOError:
            pass
    finally:
        mine.close()
        theirs.close()
