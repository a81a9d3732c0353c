"""The master port named before torchrun listens on it: outside the kernel's ephemeral
range (a CI run: torchrun's store failed with EADDRINUSE on a bind(0) port that an
outgoing connection took in between), probed free, and the kernel's pick only where the
range leaves no room."""

from __future__ import annotations

import random
import socket

import pytest

from traceml_tui.launch import ports


@pytest.mark.parametrize(("text", "expected"), [
    ("32768\t60999\n", (32768, 60999)),
    ("1024 65535", (1024, 65535)),
    ("", ports.DEFAULT_EPHEMERAL),
    (None, ports.DEFAULT_EPHEMERAL),
    ("60999 32768", ports.DEFAULT_EPHEMERAL),  # not a range
    ("x y", ports.DEFAULT_EPHEMERAL),
    ("0 70000", ports.DEFAULT_EPHEMERAL),
])
def test_the_ephemeral_range_is_read_or_linux_default(text, expected):
    assert ports.ephemeral_range(text) == expected


@pytest.mark.parametrize(("count", "ephemeral", "expected"), [
    (1, (32768, 60999), [(10000, 32768), (61000, 65536)]),
    (3, (32768, 60999), [(10000, 32766), (61000, 65534)]),
    (1, (10000, 65535), []),  # the whole space is ephemeral: no room
    (1, (1024, 60999), [(61000, 65536)]),
    (1, (20000, 65535), [(10000, 20000)]),
])
def test_ports_are_chosen_outside_the_ephemeral_range(count, ephemeral, expected):
    assert ports.spans(count, ephemeral) == expected


def test_a_chosen_port_is_free_and_never_ephemeral():
    lo, hi = ports.ephemeral_range(ports.EPHEMERAL_RANGE.read_text())
    for seed in range(20):
        base = ports.free_ports(3, random.Random(seed))
        assert not any(lo <= p <= hi for p in range(base, base + 3)), base
        assert all(ports.is_free(p) for p in range(base, base + 3))


def test_a_port_something_listens_on_is_not_chosen():
    """The first candidate (the same seed draws it) is held by a listener: the next is
    taken."""
    first = ports.free_ports(1, random.Random(7))
    with socket.socket() as held:
        held.bind(("0.0.0.0", first))
        held.listen()
        assert not ports.is_free(first)
        assert ports.free_ports(1, random.Random(7)) != first
