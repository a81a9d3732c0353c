"""What a rank's own NCCL debug log says about its last collectives (`--nccl-debug`).

The network-debugging workflow greps each rank's NCCL log for its last
`opCount`: a collective that started and never logged DONE is the one the rank is
stuck in, and ranks whose last opCounts differ entered different collectives. With
`traceml run --nccl-debug INFO` every rank logs to its own file in the run folder
(NCCL_DEBUG_FILE with %h and %p: host and pid), and when a rank stalls the agent's
sender thread reads the tail of its own file and sends what it found beside its
stacks: the collector needs no access to other nodes' disks.

NCCL INFO lines look like (the prefix is host:pid:tid [device]):

    node3:4242:4300 [3] NCCL INFO AllReduce: opCount 1e size 4194304 datatype 7 op 0 \
        root 0 comm 0x7f8a4c000b80 [nranks=8] stream 0x7f8a4c001000     (one line)
    node3:4242:4300 [3] NCCL INFO AllReduce: opCount 1e DONE

opCount is hexadecimal. TORCH_DISTRIBUTED_DEBUG=DETAIL adds DDP's report of the
parameters that got no gradient, which is kept as the evidence of an unused-parameter
mismatch.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

LOG_DIR_ENV = "TRACEML_NCCL_LOG_DIR"
FILE_PATTERN = "nccl-%h-%p.log"  # NCCL expands %h (host) and %p (pid)
TAIL_BYTES = 256 << 10  # the last collectives are at the end; a log may be gigabytes
MAX_UNUSED = 2000

_OP = re.compile(r"NCCL INFO (\w+): opCount ([0-9a-fA-F]+)\b(.*)")
_COMM = re.compile(r"\bcomm (0x[0-9a-fA-F]+)")
_UNUSED = re.compile(r"(Parameter indices which did not receive grad.*|"
                     r".*did not receive grad for rank.*)")


@dataclass(frozen=True, slots=True)
class NcclState:
    """The last collective a rank started, and the last one it finished, per its log."""

    op: str | None = None
    op_count: int | None = None
    comm: str | None = None
    done: int | None = None  # the opCount of the last DONE line
    unused: str | None = None  # DDP's unused-parameter report (TORCH_DISTRIBUTED_DEBUG)

    def to_wire(self) -> dict:
        return {"op": self.op, "op_count": self.op_count, "comm": self.comm,
                "done": self.done, "unused": self.unused}

    def describe(self) -> str:
        """As the seed's grep would read it."""
        if self.op_count is None:
            return "no collective in its NCCL log"
        started = f"last started {self.op} opCount {self.op_count:x}"
        if self.comm:
            started += f" (comm {self.comm})"
        if self.done == self.op_count:
            return f"{started}, DONE"
        finished = "none DONE" if self.done is None else f"last DONE opCount {self.done:x}"
        return f"{started}, {finished}: stuck in it"


def describe(wire: dict) -> str:
    """`NcclState.describe` of a state as received (to_wire)."""
    return NcclState(wire.get("op"), wire.get("op_count"), wire.get("comm"),
                     wire.get("done"), wire.get("unused")).describe()


def parse(text: str) -> NcclState:
    op = comm = unused = None
    op_count = done = None
    for line in text.splitlines():
        m = _OP.search(line)
        if m is not None:
            count = int(m.group(2), 16)
            if "DONE" in m.group(3):
                done = count
            else:
                op, op_count = m.group(1), count
                c = _COMM.search(m.group(3))
                comm = c.group(1) if c else None
            continue
        u = _UNUSED.search(line)
        if u is not None:
            unused = u.group(1).strip()[:MAX_UNUSED]
    return NcclState(op, op_count, comm, done, unused)


def own_log(log_dir: str, host: str, pid: int) -> str:
    return os.path.join(log_dir, FILE_PATTERN.replace("%h", host).replace("%p", str(pid)))


def read_own(log_dir: str | None, host: str, pid: int) -> NcclState | None:
    """This rank's state from the tail of its own log; None when there is no log. NCCL
    writes %h as the host name up to its first dot."""
    if not log_dir:
        return None
    for name in dict.fromkeys((host.split(".")[0], host)):
        try:
            fd = os.open(own_log(log_dir, name, pid),
                         os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK)
            break
        except OSError:
            continue
    else:
        return None
    try:
        size = os.fstat(fd).st_size
        os.lseek(fd, max(0, size - TAIL_BYTES), os.SEEK_SET)
        data = os.read(fd, TAIL_BYTES)
    except OSError:
        return None
    finally:
        os.close(fd)
    return parse(data.decode("utf-8", "replace"))
