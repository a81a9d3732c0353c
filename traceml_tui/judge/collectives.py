"""Which collective, on which process group, issued from which phase, took the sync time.

The agents account their steps' collectives per (process group, op, phase it was issued
in) and send one row per key and batch (protocol.CollRow): explicit torch.distributed
calls with their exposed wait, and the sync the hooks saw no call for (DDP's reducer
waiting for its gradient all-reduce in backward) as one more row. This book adds them up
for the whole run, bounded whatever the ranks send: at most MAX_GROUPS distinct groups
(the rest are "other"), ops and phases from the known vocabularies ("other" else), and
MAX_KEYS keys in all.

Per-step figures divide a key's totals by the steps of the ranks that issued it (their
count times the job's mean steps per rank): a metrics all-gather on a group of two ranks
reads as what it costs those two ranks per step, not diluted over the world. A key's
share of sync is its exposed time over all keys' exposed time.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from traceml_agent.protocol import CollRow
from traceml_agent.vocab import PHASES

from . import diagnosis as dx

MAX_GROUPS = 16
MAX_KEYS = 64
OTHER = "other"
# The ops the agent wraps (collective_names.COLLECTIVES, leading "_" dropped), DDP's gradient
# all-reduce and an unattributed gradient sync (another framework's reducer).
OPS = frozenset({
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
    "reduce_scatter", "reduce_scatter_tensor", "broadcast", "broadcast_object_list",
    "barrier", "all_to_all", "all_to_all_single", "reduce", "gather", "scatter",
    "monitored_barrier", "all_reduce_coalesced", "all_gather_coalesced",
    "broadcast_coalesced", "all_gather_single", "reduce_scatter_single", "gradient_sync",
    OTHER})
# "none": issued outside every phase (between forward and the optimizer, say).
KNOWN_PHASES = frozenset(PHASES) | {"none", OTHER}
# COMM-BOUND names the top key when it holds at least this share of the sync: below,
# no one collective dominates and naming one would mislead.
DOMINANT_SHARE = 0.5
COUNT_MAX = 1 << 62


@dataclass(frozen=True, slots=True)
class CollectiveStat:
    """One key's run totals and per-step figures (per step of a rank that issued it)."""

    group: str
    op: str
    phase: str
    ranks: int  # ranks that reported it
    count: int
    nbytes: int | None  # None: not known for every call (an object collective)
    exposed_ms: float  # summed over ranks and steps
    count_per_step: float
    bytes_per_step: float | None
    exposed_ms_per_step: float
    share_of_sync: float | None

    def to_json(self) -> dict[str, object]:
        return {"group": self.group, "op": self.op, "phase": self.phase, "ranks": self.ranks,
                "count": self.count, "bytes": self.nbytes,
                "exposed_ms": round(self.exposed_ms, 3),
                "count_per_step": round(self.count_per_step, 3),
                "bytes_per_step": (None if self.bytes_per_step is None
                                   else round(self.bytes_per_step, 1)),
                "exposed_ms_per_step": round(self.exposed_ms_per_step, 4),
                "share_of_sync": (None if self.share_of_sync is None
                                  else round(self.share_of_sync, 4))}


class CollectiveBook:
    """The run's collectives per (group, op, phase): [calls, bytes (-1 unknown), exposed
    ms], and the ranks that reported each key."""

    def __init__(self) -> None:
        self._keys: dict[tuple[str, str, str], list[float]] = {}
        self._ranks: dict[tuple[str, str, str], set[int]] = {}
        self._groups: set[str] = set()

    def add(self, rank: int, rows: Iterable[CollRow]) -> None:
        for row in rows:
            key = self._key(row)
            entry = self._keys.get(key)
            if entry is None:
                if len(self._keys) >= MAX_KEYS:
                    key = (OTHER, OTHER, OTHER)
                    entry = self._keys.get(key)
                if entry is None:
                    entry = self._keys[key] = [0, 0, 0.0]
                    self._ranks[key] = set()
            entry[0] = min(COUNT_MAX, entry[0] + row.count)
            entry[1] = (-1 if row.nbytes is None or entry[1] < 0
                        else min(COUNT_MAX, entry[1] + row.nbytes))
            entry[2] += row.exposed_ms
            self._ranks[key].add(rank)

    def _key(self, row: CollRow) -> tuple[str, str, str]:
        group = row.group
        if group not in self._groups:
            if len(self._groups) >= MAX_GROUPS:
                group = OTHER
            else:
                self._groups.add(group)
        return (group, row.op if row.op in OPS else OTHER,
                row.phase if row.phase in KNOWN_PHASES else OTHER)

    def stats(self, mean_steps: float) -> tuple[CollectiveStat, ...]:
        """Every key, most exposed time first. `mean_steps`: the job's steps per rank."""
        total = sum(e[2] for e in self._keys.values())
        out = []
        for (group, op, phase), (count, nbytes, exposed) in self._keys.items():
            ranks = len(self._ranks[(group, op, phase)])
            steps = max(1.0, ranks * mean_steps)
            out.append(CollectiveStat(
                group, op, phase, ranks, int(count), None if nbytes < 0 else int(nbytes),
                exposed, count / steps, None if nbytes < 0 else nbytes / steps,
                exposed / steps, exposed / total if total > 0 else None))
        out.sort(key=lambda s: (-s.exposed_ms, s.group, s.op, s.phase))
        return tuple(out)


def dominant(stats: tuple[CollectiveStat, ...]) -> CollectiveStat | None:
    """The key that holds most of the sync, when one does (DOMINANT_SHARE)."""
    top = stats[0] if stats else None
    if top is None or top.share_of_sync is None or top.share_of_sync < DOMINANT_SHARE:
        return None
    return top


def describe(s: CollectiveStat) -> str:
    """'all_reduce on group world (issued in backward)'."""
    where = "outside every phase" if s.phase == "none" else f"in {s.phase}"
    return f"{s.op} on group {s.group} (issued {where})"


def with_evidence(d: dx.Diagnosis, stats: tuple[CollectiveStat, ...]) -> dx.Diagnosis:
    """COMM-BOUND names the collective and group that dominate its sync (over the run);
    any other verdict, or no dominant key, is returned as it is."""
    top = dominant(stats)
    if d.label != dx.COMM_BOUND or top is None or top.share_of_sync is None:
        return d
    return replace(d, summary=(
        f"{d.summary} Most of the sync is {describe(top)}: "
        f"{top.exposed_ms_per_step:.2f} ms exposed per step, {top.share_of_sync:.0%} of "
        f"all collective wait."))
