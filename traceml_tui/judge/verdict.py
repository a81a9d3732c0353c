"""A verdict, as every layer reads it: the typed `Diagnosis` a rule returns (diagnosis.py)
and the live label's hysteresis over evaluations (`settle`): a new label must win
CONFIRM_TICKS evaluations in a row before it replaces the one on display."""

from __future__ import annotations

from dataclasses import dataclass, replace

from traceml_agent.vocab import HANG, WARMUP

# Consecutive evaluations a new live label must win before it replaces the old one.
CONFIRM_TICKS = 2
# Consecutive evaluations a new cause for the shown label's culprit must hold (its own
# CPU wait explains its gap, or no longer does) before the timeline opens a new episode
# for it: one episode is one cause with one advice, and the CPU wait is noisy around its
# threshold (CPU_WAIT_EXPLAINS). The banner's words follow at once, as its evidence does.
CAUSE_CONFIRM_TICKS = 6
# A straggler's cause, where its evidence names one the advice follows: its cores (its
# training thread waited for a CPU long enough to explain the gap, cpu_wait).
CORES = "cores"


@dataclass(frozen=True, slots=True)
class Diagnosis:
    label: str
    rank: int | None
    phase: str | None
    severity: str
    summary: str
    # Evidence: the worst-vs-median gap, in ms and as a share of the median step.
    gap_ms: float | None = None
    gap_share: float | None = None
    # Set when every rank of one node is behind (a host-level cause): its index and ranks.
    node: int | None = None
    node_ranks: tuple[int, ...] = ()
    # PERIODIC STALL: the steps between the stalls (cost.py spreads their excess over them).
    period: int | None = None
    # The phases it compared across ranks (a straggler's group: cost.py prices its gap
    # there); empty for labels judged on something else. Not part of the JSON.
    phases: tuple[str, ...] = ()
    # What its evidence says caused it, where the advice follows that (CORES), else None:
    # one episode is one cause (Timeline.cause_changed). Not part of the JSON (the
    # summary's words say it).
    cause: str | None = None

    @property
    def subject(self) -> tuple[str, str, int | None]:
        """What the label is about: a node when a whole node is behind (its worst rank may
        change from tick to tick without anything changing for the user), else a rank.
        Its cause may change under it (a new episode, not a new label: Timeline.cause)."""
        if self.node is not None:
            return (self.label, "node", self.node)
        return (self.label, "rank", self.rank)

    def to_json(self) -> dict:
        return {
            "label": self.label,
            "rank": self.rank,
            "phase": self.phase,
            "severity": self.severity,
            "summary": self.summary,
            "gap_ms": None if self.gap_ms is None else round(self.gap_ms, 3),
            "gap_share": None if self.gap_share is None else round(self.gap_share, 4),
            "node": None if self.node is None else {"index": self.node,
                                                   "ranks": list(self.node_ranks)},
        }


# --- hysteresis over time ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LiveLabel:
    """The label on display and the challenger that must win CONFIRM_TICKS times to replace it."""

    shown: Diagnosis
    challenger: str | None = None
    wins: int = 0


def settle(live: LiveLabel | None, candidate: Diagnosis) -> LiveLabel:
    """Advance the displayed label by one evaluation. A new label (or a new rank for the
    same label) must win CONFIRM_TICKS evaluations in a row; the shown label's own
    evidence refreshes at once. Leaving WARMUP needs no confirmation, nor does leaving
    HANG: it is shown from progress, not a window (hang.py), and a step taken is its end;
    kept for the confirming evaluations, it would be shown with no hang behind it."""
    if live is None:
        return LiveLabel(candidate)
    if candidate.subject == live.shown.subject:
        return LiveLabel(candidate)
    if live.shown.label in (WARMUP, HANG):
        return LiveLabel(candidate)
    key = "|".join(map(str, candidate.subject))
    wins = live.wins + 1 if live.challenger == key else 1
    if wins >= CONFIRM_TICKS:
        return LiveLabel(candidate)
    return replace(live, challenger=key, wins=wins)
