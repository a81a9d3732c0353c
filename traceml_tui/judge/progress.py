"""Every rank's progress as the hang rules read it (hang.py), from the intake's per-rank
state: the step it reached, how long since it closed one (its agent's own figure plus the
collector's silence since), what its agent says it is doing, and whether its messages are
merely waiting in the collector's queue or its node's relay fell silent.

`check` is the live evaluation's hang check: the common case, every running rank stepping
recently, is answered from one number per rank without building their progress."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

from . import hang
from .hang import HangReport
from .ingest import RankState, Relay
from .snapshot import RELAY_SILENT_S


def waiting(rs: RankState, routes: Collection[object]) -> bool:
    """Whether messages of the rank's connection wait in the collector's queue, not yet
    read (`routes`: the collector's waiting routes, set before each evaluation): a flood
    of other peers' messages delays its own, and it is not silent then."""
    conn = rs.conn
    return bool(routes) and isinstance(conn, tuple) and len(conn) == 2 and conn[0] in routes


def of_ranks(ranks: Iterable[RankState], relays: Mapping[int, Relay],
             routes: Collection[object], mono_now: float) -> list[hang.RankProgress]:
    """Each rank's progress now (`mono_now`, the collector's monotonic clock)."""
    out = []
    silent_relays = {node for node, r in relays.items()
                     if mono_now - r.last_seen > RELAY_SILENT_S}
    for rs in ranks:
        hb = rs.heartbeat
        # Relayed (its route at a node relay is set) through a relay now silent.
        relayed = isinstance(rs.conn, tuple) and len(rs.conn) == 2 and rs.conn[1] is not None
        queued = waiting(rs, routes)  # its messages not yet read: not silent
        out.append(hang.RankProgress(
            rs.ident.rank, rs.ident.host, max(rs.steps, hb.step),
            hb.collectives, hb.phase, hb.in_collective,
            0.0 if queued else rs.since_step_at_msg_s,
            0.0 if queued else max(0.0, mono_now - rs.last_seen), rs.finished,
            hb.agent_off is not None, tuple(sorted(hb.groups.items())), hb.in_group,
            None if rs.replays_at is None else max(0.0, mono_now - rs.replays_at),
            None if rs.batches_at is None else max(0.0, mono_now - rs.batches_at),
            hb.agent_busy,
            0.0 if rs.busy_since is None else max(0.0, mono_now - rs.busy_since),
            rs.ident.node, relayed and rs.ident.node in silent_relays))
    return out


def check(ranks: Mapping[int, RankState], relays: Mapping[int, Relay],
          routes: Collection[object], mono_now: float, median_step_ms: float | None,
          hang_after_s: float | None) -> tuple[HangReport | None, dict[int, str]]:
    """The hang report (None: no hang) and the ranks whose steps are not visible
    (hang.hidden_ranks). While every running rank stepped recently (hang.stepping)
    neither can name anything, and no rank's progress is built."""
    stalled = [0.0 if waiting(rs, routes) else
               rs.since_step_at_msg_s + max(0.0, mono_now - rs.last_seen)
               for rs in ranks.values()
               if not rs.finished and rs.heartbeat.agent_off is None]
    if hang.stepping(stalled, median_step_ms, hang_after_s):
        return None, {}
    progress = of_ranks(ranks.values(), relays, routes, mono_now)
    return (hang.detect(progress, median_step_ms, hang_after_s),
            hang.hidden_ranks(progress, median_step_ms, hang_after_s))
