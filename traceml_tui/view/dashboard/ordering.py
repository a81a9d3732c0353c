"""Worst first: the order that puts the anomaly on the first screen at any scale.

The diagnosis subject (a rank, or every rank of a node) leads, then alarming statuses,
then ranks (or nodes) whose own work is furthest from the median rank's; ties by rank
(or node). One key (worst_key) for ranks and nodes. Pure functions over the view model,
used by the heat table.
"""

from __future__ import annotations

from collections.abc import Callable

from traceml_tui.viewmodel import (  # noqa: F401 (subject_ranks re-exported)
    FAILED,
    STALE,
    RankRow,
    RunView,
    own_distance,
    own_work,
    subject_ranks,
)

WORST = "worst"
ALARMING = frozenset({FAILED, STALE})


def median_own(state: RunView) -> float | None:
    return own_work(state.median_phase_ms)


def worst_key(subject: frozenset[int], mid: float | None, by_node: bool = False
              ) -> Callable[[RankRow], tuple[bool, bool, float, int]]:
    """The one worst-first key, for ranks or (`by_node`) nodes' pseudo-rows: the diagnosis
    subject (ranks, or nodes) leads, then alarming statuses, then own work furthest from
    the median rank's `mid` (viewmodel.own_distance), then the rank or node ascending."""
    far, alarming = own_distance(mid), ALARMING

    def key(r: RankRow) -> tuple[bool, bool, float, int]:
        who = r.node if by_node else r.rank
        return (who not in subject, r.status not in alarming, -far(r), who)

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
