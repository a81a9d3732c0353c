"""Worst first: the order that puts the anomaly on the first screen at any scale.

The diagnosis subject (a rank, or every rank of a node) leads, then ranks (or nodes)
whose own work is furthest from the median rank's, then alarming statuses; ties by
rank. Pure functions over the view model, used by the heat table.
"""

from __future__ import annotations

from traceml_tui.viewmodel import FAILED, OWN_COLUMNS, STALE, RankRow, ViewState, own_work

WORST = "worst"
# Columns that are a rank's own work (not time spent waiting for the others).
OWN = OWN_COLUMNS
assert len(OWN) == 5, "worst_first unrolls the own-work columns"
ALARMING = frozenset({FAILED, STALE})


def median_own(state: ViewState) -> float | None:
    return own_work(state.median_phase_ms)


def subject_ranks(state: ViewState) -> frozenset[int]:
    """The ranks the diagnosis names: its rank, or all ranks of the node it blames."""
    if state.node is not None:
        return frozenset(r.rank for r in state.rows if r.node == state.node)
    return frozenset() if state.rank is None else frozenset({state.rank})


def distance(row: RankRow, mid: float | None) -> float:
    """How far a rank's own work is from the median rank's (ms); 0 when unknown."""
    own = own_work(row.phase_ms)
    return 0.0 if own is None or mid is None else abs(own - mid)


def worst_first(rows: list[RankRow], state: ViewState) -> list[RankRow]:
    subject = subject_ranks(state)
    mid = median_own(state)
    a, b, c, d, e = OWN  # unrolled: this key runs for every rank on every frame

    def key(r: RankRow) -> tuple[bool, bool, float, int]:
        p = r.phase_ms
        vals = [v for v in (p[a], p[b], p[c], p[d], p[e]) if v is not None]
        far = 0.0 if not vals or mid is None else abs(sum(vals) - mid)  # unknown: not far
        return (r.rank not in subject, r.status not in ALARMING, -far, r.rank)

    return sorted(rows, key=key)


def subject_node(state: ViewState) -> int | None:
    """The node the diagnosis is about: the blamed node, or the blamed rank's node."""
    if state.node is not None:
        return state.node
    if state.rank is not None and 0 <= state.rank < len(state.rows):
        return state.rows[state.rank].node
    return None


def worst_nodes(nodes: list[tuple[int, RankRow]], state: ViewState
                ) -> list[tuple[int, RankRow]]:
    """Node pseudo-rows (count, worst values): the subject's node first, then by how far
    the node's worst own work is from the median rank's."""
    first = subject_node(state)
    mid = median_own(state)
    return sorted(nodes, key=lambda n: (n[1].node != first, n[1].status not in ALARMING,
                                        -distance(n[1], mid), n[1].node))
