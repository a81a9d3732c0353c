"""An emulated cluster on one machine: Linux network namespaces on a bridge.

Each "node" is a namespace with its own address (10.78.T.K+1/24) and, through
`unshare --uts`, its own host name; one veth per node joins it to a bridge in the root
namespace. `slow={k: "200mbit"}` shapes node k's link both ways with a token bucket
(tc tbf on both ends of its veth). Traffic stays between these namespaces; tests skip
with the reason where the machine forbids namespaces (not root, no CAP_NET_ADMIN).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

_tags = itertools.count(1)


def unavailable() -> str | None:
    """Why namespaces cannot be used here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"tlprobe{os.getpid()}"  # xdist workers probe at once, each at its collection
    probe = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"ip netns add failed: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    for tool in (["tc", "-V"], ["unshare", "--version"]):
        try:
            subprocess.run(tool, capture_output=True, check=True)
        except (OSError, subprocess.CalledProcessError):
            return f"{tool[0]} is not available"
    return None


@dataclass(frozen=True)
class Node:
    index: int
    netns: str
    interface: str
    address: str
    host: str

    def wrap(self, cmd: Sequence[str]) -> list[str]:
        """`cmd` inside this node: its namespace and its own host name."""
        return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "sh", "-c",
                f'hostname {self.host} && exec "$@"', "sh", *cmd]


def _sh(*cmd: str) -> None:
    subprocess.run(list(cmd), check=True, capture_output=True, text=True)


@contextlib.contextmanager
def cluster(n: int, slow: dict[int, str] | None = None) -> Iterator[list[Node]]:
    tag = f"{os.getpid() % 1000}x{next(_tags)}"
    net = 10 + (os.getpid() + next(_tags)) % 200
    bridge = f"tlbr{tag}"
    nodes = [Node(k, f"tl{tag}n{k}", f"tl{tag}v{k}", f"10.78.{net}.{k + 1}", f"node{k}")
             for k in range(n)]
    try:
        _sh("ip", "link", "add", bridge, "type", "bridge")
        _sh("ip", "link", "set", bridge, "up")
        for node in nodes:
            peer = f"{node.interface}p"
            _sh("ip", "netns", "add", node.netns)
            _sh("ip", "link", "add", node.interface, "type", "veth", "peer", "name", peer)
            _sh("ip", "link", "set", peer, "master", bridge)
            _sh("ip", "link", "set", peer, "up")
            _sh("ip", "link", "set", node.interface, "netns", node.netns)
            inside = ["ip", "netns", "exec", node.netns]
            _sh(*inside, "ip", "addr", "add", f"{node.address}/24", "dev", node.interface)
            _sh(*inside, "ip", "link", "set", node.interface, "up")
            _sh(*inside, "ip", "link", "set", "lo", "up")
            rate = (slow or {}).get(node.index)
            if rate:  # both ways: its sending (inside) and its receiving (the bridge side)
                tbf = ["root", "tbf", "rate", rate, "burst", "64kb", "latency", "100ms"]
                _sh(*inside, "tc", "qdisc", "add", "dev", node.interface, *tbf)
                _sh("tc", "qdisc", "add", "dev", peer, *tbf)
        yield nodes
    finally:
        for node in nodes:
            subprocess.run(["ip", "netns", "del", node.netns], capture_output=True)
            subprocess.run(["ip", "link", "del", f"{node.interface}p"], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)
