"""`--nccl-debug`: the NCCL log parser on lines of NCCL's own format, the
environment each rank gets, and the evidence the agent sends and the summary prints."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import msgspec
import pytest

from traceml_agent import nccl_log, protocol
from traceml_agent.nccl_log import NcclState, parse
from traceml_agent.protocol import Identity, ProtocolError, decode, encode
from traceml_tui.launch import nccl_debug

HEAD = "node3:4242:4300 [3] NCCL INFO "
STARTED = (HEAD + "AllReduce: opCount {n} size 4194304 datatype 7 op 0 root 0 "
           "comm 0x7f8a4c000b80 [nranks=8] stream 0x7f8a4c001000")
DONE = HEAD + "AllReduce: opCount {n} DONE"


@pytest.mark.parametrize("lines, state", [
    ([STARTED.format(n="1d"), DONE.format(n="1d"), STARTED.format(n="1e")],
     NcclState("AllReduce", 0x1E, "0x7f8a4c000b80", 0x1D)),
    ([STARTED.format(n="1e"), DONE.format(n="1e")],
     NcclState("AllReduce", 0x1E, "0x7f8a4c000b80", 0x1E)),
    ([HEAD + "Bootstrap : Using eth0:10.0.0.3<0>", HEAD + "NET/Socket : Using [0]eth0"],
     NcclState()),
    ([HEAD + "Broadcast: opCount 0 sendbuff 0x1 recvbuff 0x2 count 5 datatype 0 op 0 root 0 "
             "comm 0xabc [nranks=2] stream 0x1"],
     NcclState("Broadcast", 0, "0xabc", None)),
], ids=["stuck in 1e", "all done", "no collective yet", "first broadcast"])
def test_parse_finds_the_last_started_and_done_collectives(lines, state):
    assert parse("\n".join(lines)) == state


def test_describe_reads_as_the_seeds_grep():
    stuck = parse("\n".join([STARTED.format(n="1d"), DONE.format(n="1d"),
                             STARTED.format(n="1e")]))
    assert stuck.describe() == ("last started AllReduce opCount 1e (comm 0x7f8a4c000b80), "
                                "last DONE opCount 1d: stuck in it")
    assert NcclState().describe() == "no collective in its NCCL log"


def test_ddps_unused_parameter_report_is_kept():
    text = ("[rank1]: RuntimeError: Expected to have finished reduction ...\n"
            "Parameter indices which did not receive grad for rank 1: 4 5\n")
    assert parse(text).unused == "Parameter indices which did not receive grad for rank 1: 4 5"


def test_the_agent_reads_only_its_own_file_and_only_its_tail(tmp_path):
    host, pid = socket.gethostname(), os.getpid()
    own = Path(nccl_log.own_log(str(tmp_path), host.split(".")[0], pid))
    filler = "x" * 1000 + "\n"
    own.write_text(STARTED.format(n="1") + "\n" + filler * 400 + DONE.format(n="7") + "\n"
                   + STARTED.format(n="8") + "\n")
    Path(nccl_log.own_log(str(tmp_path), host, pid + 1)).write_text(STARTED.format(n="99"))
    state = nccl_log.read_own(str(tmp_path), host, pid)
    assert (state.op_count, state.done) == (8, 7)
    assert nccl_log.read_own(str(tmp_path), host, pid + 2) is None
    assert nccl_log.read_own(None, host, pid) is None
    link = Path(nccl_log.own_log(str(tmp_path), "linked", pid))
    link.symlink_to(own)
    assert nccl_log.read_own(str(tmp_path), "linked", pid) is None  # never through a link


def test_every_rank_logs_to_its_own_file_in_the_private_run_folder(tmp_path):
    envs = nccl_debug.environment("INFO", tmp_path)
    assert envs["NCCL_DEBUG"] == "INFO" and "COLL" in envs["NCCL_DEBUG_SUBSYS"]
    assert envs["NCCL_DEBUG_FILE"] == str(tmp_path.resolve() / "logs" / "nccl"
                                          / "nccl-%h-%p.log")
    assert envs["TORCH_DISTRIBUTED_DEBUG"] == "INFO"  # DETAIL crashed gloo jobs (TRACE has it)
    for level in nccl_debug.LEVELS:  # no level turns on the mode that crashed gloo DDP
        assert nccl_debug.environment(level, tmp_path)["TORCH_DISTRIBUTED_DEBUG"] != "DETAIL"
    assert envs["TORCH_NCCL_TRACE_BUFFER_SIZE"] and envs["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert not any(v.startswith("/tmp/nccl") for v in envs.values())


IDENT = Identity(1, 1, 0, "node3", 4242, 4)


def test_the_stacks_message_carries_the_nccl_state_bounded():
    wire = parse(STARTED.format(n="1e")).to_wire()
    msg = decode(encode("stacks", IDENT, 3, 1.0, stacks=[["MainThread", "  x\n"]], nccl=wire))
    assert msgspec.to_builtins(msg.body.nccl) == wire
    for bad in ({"op": "x" * 65}, {"op_count": -1}, {"weird": 1}, ["AllReduce"],
                {"unused": "u" * 2001}):
        with pytest.raises(ProtocolError):
            decode(encode("stacks", IDENT, 3, 1.0, stacks=[], nccl=bad))
    assert decode(encode("stacks", IDENT, 3, 1.0, stacks=[])).body.nccl is None
    assert protocol.MAX_GROUPS >= 33


def test_a_hang_prints_each_ranks_last_collectives():
    from test_state import T0, steps  # the shared fixtures of the state tests

    from traceml_tui.judge.state import RunState
    from traceml_tui.report import summary
    from traceml_tui.runfolder import summary_model as model

    state = RunState("run", world_size=2, started_at=T0)
    for rank in (0, 1):
        state.ingest(steps(rank, range(30)), now=0.0)
    for rank, n in ((0, "1e"), (1, "1d")):
        ident = Identity(rank, rank, 0, f"host{rank}", 1000 + rank, 2)
        state.ingest(decode(encode("stacks", ident, 9, T0, stacks=[["MainThread", "  x\n"]],
                                   nccl=parse(STARTED.format(n=n)).to_wire())), now=0.0)
        state.ingest(decode(encode("heartbeat", ident, 10, T0, step=30, phase="sync",
                                   since_step_s=60.0)), now=0.0)
    state.evaluate(T0 + 60, mono_now=1.0)
    assert state.hang is not None
    doc = model.to_doc(summary.build(state.snapshot(T0 + 60, 1.0, full=True), summary.RunMeta()))
    text = summary.render_text(doc)
    assert "NCCL logs, each rank's last collectives:" in text
    assert "rank 0: last started AllReduce opCount 1e" in text
    assert "rank 1: last started AllReduce opCount 1d" in text
