"""The collector's side of the setup checks (agent/checks.py): findings from every rank,
merged, plus the comparisons only the collector can make across ranks.

Each rank reports a mistake once, and once its facts (a weights checksum, its
device). This board keeps them per rank (bounded: a dozen check ids per rank) and
merges them only when something changed, so the collector's tick stays cheap.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from traceml_agent.findings import (
    FIND_UNUSED_UNNEEDED,
    MAX_TEXT,
    PARAMS_DIFFER,
    SAME_DEVICE,
    Finding,
    finding,
)
from traceml_agent.vocab import SEVERITIES, format_ranks

from .same_data import judge_same_data

# Identical parameters give identical checksums on identical hardware; the tolerance only
# absorbs float64 summation-order noise (~1e-16 relative) across unlike nodes. Different
# weights move the sum by about sigma * sqrt(samples), far above it.
CHECKSUM_RTOL = 1e-9
# Checks whose finding is only true when every rank reports it: one rank that does have
# an unused parameter makes find_unused_parameters=True necessary for the whole job.
NEEDS_ALL_RANKS = frozenset({FIND_UNUSED_UNNEEDED})


class ChecksBoard:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.findings: dict[int, dict[str, Finding]] = {}
        self.facts: dict[int, tuple[str, dict]] = {}  # rank -> (host, facts)
        self._merged: tuple[Finding, ...] = ()
        self._batches: dict[int, int] = {}
        self._dirty = False

    def add(self, rank: int, host: str, findings: tuple[Finding, ...], facts: dict | None
            ) -> None:
        mine = self.findings.setdefault(rank, {})
        for f in findings:
            mine[f.id] = f  # a repeated report replaces, never accumulates
        if facts is not None:
            self.facts[rank] = (host, facts)
        self._dirty = self._dirty or bool(findings) or facts is not None

    def forget(self, rank: int) -> None:
        """The rank's process restarted: its old reports are no longer evidence."""
        self._dirty = self.findings.pop(rank, None) is not None or self._dirty
        self._dirty = self.facts.pop(rank, None) is not None or self._dirty

    def batch_sizes(self) -> dict[int, int]:
        """Each rank's DataLoader batch size, where its agent saw one (for samples/s)."""
        self._refresh()
        return self._batches

    def merged(self) -> tuple[Finding, ...]:
        """One finding per check, with all the ranks that reported it, most severe first."""
        self._refresh()
        return self._merged

    def _refresh(self) -> None:
        """Both views of the reports, rebuilt only when a report arrived since."""
        if self._dirty:
            self._batches = {r: facts["batch_size"] for r, (_, facts) in self.facts.items()
                             if facts.get("batch_size")}
            found = [f for per_rank in self.findings.values() for f in per_rank.values()]
            cross = (
                compare_checksums({r: facts["param_checksum"]
                                   for r, (_, facts) in self.facts.items()}),
                compare_devices({r: (host, facts["device"])
                                 for r, (host, facts) in self.facts.items()}),
            )
            found += [c for c in cross if c is not None]
            data = {r: facts for r, (_, facts) in self.facts.items()}
            judged = (judge_same_data(f, data)
                      for f in merge_findings(found, world_size=self.world_size))
            self._merged = tuple(sort_findings([f for f in judged if f is not None]))
            self._dirty = False


# --- comparisons across ranks ----------------------------------------------------------


def _same_checksum(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return math.isclose(a, b, rel_tol=CHECKSUM_RTOL, abs_tol=1e-300)


def compare_checksums(per_rank: Mapping[int, float | None]) -> Finding | None:
    """Ranks whose parameter checksum differs from the majority (ties: the group holding
    the lowest rank is the reference). Ranks that sent None are left out."""
    values = {r: v for r, v in per_rank.items() if v is not None}
    groups: list[list[int]] = []
    for r in sorted(values):
        for g in groups:
            if _same_checksum(values[g[0]], values[r]):
                g.append(r)
                break
        else:
            groups.append([r])
    if len(groups) < 2:
        return None
    reference = max(groups, key=lambda g: (len(g), -g[0]))
    odd = sorted(r for g in groups if g is not reference for r in g)
    first = odd[0]
    return finding(PARAMS_DIFFER, odd,
                   f"parameter checksum {values[first]:.9g} on rank {first} vs "
                   f"{values[reference[0]]:.9g} on rank(s) {format_ranks(reference)}; "
                   f"{len(odd)} of {len(values)} ranks differ")


def compare_devices(per_rank: Mapping[int, tuple[str, str | int | None]]) -> Finding | None:
    """Ranks sharing one GPU: the same (host, device) pair. Device None (CPU) is skipped.
    Devices should be `device_key` strings (GPU UUIDs), so two ranks that both call
    their GPU cuda:0 behind different CUDA_VISIBLE_DEVICES are not flagged."""
    groups: dict[tuple[str, Any], list[int]] = {}
    for r, (host, device) in per_rank.items():
        if device is not None:
            groups.setdefault((host, device), []).append(r)
    shared = sorted((sorted(rs) for rs in groups.values() if len(rs) > 1), key=lambda g: g[0])
    if not shared:
        return None
    ranks = sorted(r for g in shared for r in g)
    first = shared[0]
    host, device = next(k for k, v in groups.items() if sorted(v) == first)
    more = f"; {len(shared) - 1} more shared device(s)" if len(shared) > 1 else ""
    return finding(SAME_DEVICE, ranks,
                   f"ranks {format_ranks(first)} all run on {device} of host {host}{more}")


def merge_findings(findings: Iterable[Finding], world_size: int | None = None) -> list[Finding]:
    """One Finding per check id, with every rank that reported it, most severe first.
    Evidence is the lowest rank's; when other ranks saw other numbers, it says so.
    With world_size, checks in NEEDS_ALL_RANKS are kept only once every rank reported."""
    by_id: dict[str, list[Finding]] = {}
    for f in findings:
        by_id.setdefault(f.id, []).append(f)
    order = {s: i for i, s in enumerate(SEVERITIES)}
    out = []
    for fid, group in by_id.items():
        ranks = tuple(sorted({r for f in group for r in f.ranks}))
        if world_size is not None and fid in NEEDS_ALL_RANKS and len(ranks) < world_size:
            continue
        group.sort(key=lambda f: min(f.ranks, default=0))
        evidence = group[0].evidence
        if any(f.evidence != evidence for f in group[1:]):
            where = f"rank {min(group[0].ranks)}: " if group[0].ranks else ""
            evidence = f"{where}{evidence} (other ranks: other numbers)"
        severity = max((f.severity for f in group), key=lambda s: order.get(s, 0))
        out.append(Finding(fid, severity, ranks, evidence[:MAX_TEXT], group[0].fix))
    return sort_findings(out)


def sort_findings(findings: list[Finding]) -> list[Finding]:
    """Most severe first, then by id."""
    order = {s: i for i, s in enumerate(SEVERITIES)}
    return sorted(findings, key=lambda f: (-order.get(f.severity, 0), f.id))
