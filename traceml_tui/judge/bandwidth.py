"""The arithmetic of `traceml netcheck`: pure functions, no I/O, table-tested.

Bandwidths follow nccl-tests (its PERFORMANCE.md), so figures compare with what
cluster teams already read:
  algbw = S / t, with S the bytes of the op's *full* buffer (all_gather: the gathered
          output, reduce_scatter: the input before scattering);
  busbw = algbw x the share of S each rank's link carries in a ring:
          all_reduce 2(n-1)/n, all_gather and reduce_scatter (n-1)/n, broadcast 1.
(The network guide's "2 x size / latency" for all_reduce's algbw is not nccl-tests' definition:
its factor 2 belongs in busbw.) Compare busbw with the link's speed.

Localisation: nccl-tests gives one number for the whole job. Here every pair of nodes
runs the same all_reduce alone (one rank each), so a slow node or link shows in the
pairs it is part of. A node is slow when the median bandwidth of its pairs is below
SLOW_RATIO of the median over all nodes: a link shaped to half its speed halves every
pair through it, while the other nodes' pairs with it pull their medians less than half
as far (with 3 nodes and node 2 slow: node 2's pairs are both slow, nodes 0 and 1 have
one slow pair and one fast, so their medians sit between).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .windows import median

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
# A node whose pairs reach less than this share of the nodes' median bandwidth is slow.
SLOW_RATIO = 0.5
# Above this many nodes all pairs would be too many (n^2/2): each node is tested with
# its two "opposite" neighbours instead (k+1 and k+n/2), enough to localise one node.
MAX_ALL_PAIRS_NODES = 16


def bus_factor(op: str, world: int) -> float:
    if world < 2:
        return 0.0
    if op == "all_reduce":
        return 2 * (world - 1) / world
    if op in ("all_gather", "reduce_scatter"):
        return (world - 1) / world
    return 1.0  # broadcast


def bandwidths(op: str, nbytes: int, seconds: float, world: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s for `nbytes` (the op's full buffer) moved in `seconds`."""
    if seconds <= 0:
        return 0.0, 0.0
    alg = nbytes / seconds / 1e9
    return alg, alg * bus_factor(op, world)


def node_pairs(nnodes: int) -> list[tuple[int, int]]:
    if nnodes < 2:
        return []
    if nnodes <= MAX_ALL_PAIRS_NODES:
        return [(a, b) for a in range(nnodes) for b in range(a + 1, nnodes)]
    pairs: set[tuple[int, int]] = set()
    for k in range(nnodes):
        for step in (1, nnodes // 2):
            j = (k + step) % nnodes
            pairs.add((min(k, j), max(k, j)))
    return sorted(p for p in pairs if p[0] != p[1])


@dataclass(frozen=True, slots=True)
class Slow:
    node: int
    host: str
    ratio: float
    why: str

    def to_json(self) -> dict:
        return {"node": self.node, "host": self.host, "ratio": round(self.ratio, 3),
                "why": self.why}


def slow_nodes(pair_gbps: Mapping[tuple[int, int], float], hosts: Sequence[str]
               ) -> list[Slow]:
    """The nodes whose pairs are slow (module docstring). Needs 3 nodes: with 2 there is
    one pair, and a slow pair cannot say which end is slow."""
    nnodes = len(hosts)
    if nnodes < 3 or not pair_gbps:
        return []
    per_node = {k: [g for (a, b), g in pair_gbps.items() if k in (a, b)]
                for k in range(nnodes)}
    node_med = {k: median(v, empty=0.0) for k, v in per_node.items() if v}
    overall = median(node_med.values(), empty=0.0)
    if overall <= 0:
        return []
    out = []
    for k, value in sorted(node_med.items()):
        ratio = value / overall
        if ratio < SLOW_RATIO:
            others = [g for (a, b), g in pair_gbps.items() if k not in (a, b)]
            healthy = f"{median(others, empty=0.0):.3f}" if others else "?"
            out.append(Slow(k, hosts[k], ratio,
                            f"its pairs reach {value:.3f} GB/s busbw, {ratio:.0%} of the "
                            f"nodes' median {overall:.3f} (pairs without it: {healthy}): its "
                            f"link, NIC or interface is slow"))
    return out


def mtu_mismatch(mtus: Mapping[int, int | None]) -> str | None:
    """A sentence when the nodes' interfaces disagree on MTU (jumbo frames on some)."""
    known = {k: v for k, v in mtus.items() if v}
    if len(set(known.values())) < 2:
        return None
    common = max(set(known.values()), key=list(known.values()).count)
    odd = sorted(k for k, v in known.items() if v != common)
    return (f"MTU mismatch: node{'s' if len(odd) > 1 else ''} "
            f"{', '.join(map(str, odd))} use {', '.join(str(known[k]) for k in odd)}, the "
            f"others {common}: frames are fragmented or dropped between them")


def si_bytes(n: float) -> str:
    """A byte count in decimal units, three significant digits ("38.4 kB", "1.6 MB"): a
    small model's gradients are kilobytes, not "0.0 MB"."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.4g} {unit}"
    return f"{n} B"
