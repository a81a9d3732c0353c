"""Worst first: the order that puts the anomaly on the first screen at any scale.

The diagnosis subject (a rank, or every rank of a node) leads, then alarming statuses,
then ranks (or nodes) whose own work is furthest from the median rank's; ties by rank
(or node). One key (worst_key) for ranks and nodes. Pure functions over the view model,
used by the heat table.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import itemgetter

from traceml_tui.viewmodel import FAILED, OWN_COLUMNS, STALE, RankRow, RunView, own_work

WORST = "worst"
ALARMING = frozenset({FAILED, STALE})
# A rank's own-work columns in one C call: the ordering key runs for every rank on every
# frame. (itemgetter of a single index returns the value, not a 1-tuple.)
_own_cells = (itemgetter(*OWN_COLUMNS) if len(OWN_COLUMNS) > 1
              else lambda p: tuple(p[i] for i in OWN_COLUMNS))


def median_own(state: RunView) -> float | None:
    return own_work(state.median_phase_ms)


def subject_ranks(state: RunView) -> frozenset[int]:
    """The ranks the diagnosis names: its rank, or all ranks of the node it blames."""
    if state.node is not None:
        return frozenset(r.rank for r in state.rows if r.node == state.node)
    return frozenset() if state.rank is None else frozenset({state.rank})


def worst_key(subject: frozenset[int], mid: float | None, by_node: bool = False
              ) -> Callable[[RankRow], tuple[bool, bool, float, int]]:
    """The one worst-first key, for ranks or (`by_node`) nodes' pseudo-rows: the diagnosis
    subject (ranks, or nodes) leads, then alarming statuses, then own work furthest from
    the median rank's `mid` (unknown: not far), then the rank or node ascending. It runs
    for every rank on every frame: one closure, no call per row but the C itemgetter."""
    cells, alarming = _own_cells, ALARMING

    def key(r: RankRow) -> tuple[bool, bool, float, int]:
        who = r.node if by_node else r.rank
        vals = [v for v in cells(r.phase_ms) if v is not None]
        far = 0.0 if not vals or mid is None else abs(sum(vals) - mid)
        return (who not in subject, r.status not in alarming, -far, who)

    return key


def worst_first(rows: list[RankRow], state: RunView) -> list[RankRow]:
    return sorted(rows, key=worst_key(subject_ranks(state), median_own(state)))


def subject_node(state: RunView) -> int | None:
    """The node the diagnosis is about: the blamed node, or the blamed rank's node."""
    if state.node is not None:
        return state.node
    if state.rank is not None and 0 <= state.rank < len(state.rows):
        return state.rows[state.rank].node
    return None


def worst_nodes(nodes: list[tuple[int, RankRow]], state: RunView
                ) -> list[tuple[int, RankRow]]:
    """Node pseudo-rows (count, worst values): the subject's node first, then by how far
    the node's worst own work is from the median rank's."""
    first = subject_node(state)
    key = worst_key(frozenset() if first is None else frozenset({first}), median_own(state),
                    by_node=True)
    return sorted(nodes, key=lambda n: key(n[1]))
