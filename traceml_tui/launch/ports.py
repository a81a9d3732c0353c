"""A port to name before the program that listens on it starts (torchrun's store, above
all): one outside the kernel's ephemeral range.

A port the kernel hands out for bind(0) is free at that moment only: it comes from the
range the kernel also gives every outgoing connection on the host, so between our probe
and torchrun's listen any connection may take it (a CI run: torchrun's store failed with
EADDRINUSE on such a port). A port outside that range is taken only by a program that
binds it by number, and is probed free before it is named.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Linux's default range, where the file cannot be read.
DEFAULT_EPHEMERAL = (32768, 60999)
# Below this sit well-known and commonly configured service ports (and 29500, torchrun's
# default, which another job on the host may be using).
LOWEST = 10000
TRIES = 200


def ephemeral_range(text: str | None) -> tuple[int, int]:
    """The kernel's ephemeral range from ip_local_port_range's text ("32768\t60999");
    Linux's default when it is missing or unreadable."""
    try:
        lo, hi = (int(v) for v in (text or "").split()[:2])
    except ValueError:
        return DEFAULT_EPHEMERAL
    return (lo, hi) if 0 < lo <= hi <= 65535 else DEFAULT_EPHEMERAL


def _read_range() -> tuple[int, int]:
    try:
        return ephemeral_range(EPHEMERAL_RANGE.read_text())
    except OSError:
        return DEFAULT_EPHEMERAL


def spans(count: int, ephemeral: tuple[int, int]) -> list[tuple[int, int]]:
    """Where `count` consecutive ports may start, outside the ephemeral range:
    half-open [first, past) spans, none when the range leaves no room."""
    lo, hi = ephemeral
    out = [(LOWEST, lo - count + 1), (hi + 1, 65536 - count + 1)]
    return [(a, b) for a, b in out if a < b]


def is_free(port: int) -> bool:
    """Whether a listener could bind the port on every interface now (as torchrun's store
    does, with SO_REUSEADDR: a closed connection's TIME_WAIT does not hold it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def free_ports(count: int = 1, rng: random.Random | None = None) -> int:
    """The first of `count` consecutive ports, free now and outside the ephemeral range;
    where there is no such room (a range widened to the whole space), the kernel's pick."""
    pick = rng or random.Random()
    room = spans(count, _read_range())
    for _ in range(TRIES if room else 0):
        a, b = pick.choice(room)
        base = pick.randrange(a, b)
        if all(is_free(p) for p in range(base, base + count)):
            return base
    for _ in range(TRIES):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count <= 65536 and all(is_free(p) for p in range(base, base + count)):
            return base
    raise OSError("no free TCP port found on this host")
