"""The collector's side of the setup checks (agent/checks.py): findings from every rank,
merged, plus the comparisons only the collector can make across ranks.

Each rank reports a mistake once, and once its facts (a weights checksum, its
device). This board keeps them per rank (bounded: a dozen check ids per rank) and
merges them only when something changed, so the collector's tick stays cheap.
"""

from __future__ import annotations

from traceml_agent.checks import Finding, compare_checksums, compare_devices, merge_findings


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
            self._merged = tuple(merge_findings(found, world_size=self.world_size))
            self._dirty = False
