"""Steps messages that came as a relay's columns, ingested with array operations.

A node relay sends its ranks' plain steps messages as rows of packed columns
(protocol.StepColumns; collect/relay_columns.py). The relay is trusted with nothing: each
row is checked here as strictly as a steps message (protocol._record's bounds, the phase
list through protocol._phases and Intake.phases_fit), and attributed to the connection
and route it came on exactly as a relayed payload is (Intake.message's ownership, pid,
world-size, take-over and restart rules apply unchanged).

A row whose rank is already known on that very connection, as that very process, with
records before, is taken at once for its envelope (`take_row`: counters, last seen,
dropped and forced) and its records wait in `Pending` for the end of the collector's
drain, when `flush` takes every waiting rank's records together: validity, duplicates,
absurd steps, warm-up, window slots, stalls and the ranks' counts as array operations,
one pass for all of them. Any other row (a new or restarted process, an impostor, a
first record) is given back to the caller, which ingests it as a message (`message_of`).

Order: a rank's records are taken in the order it sent them, and before any later message
of the same rank: the collector flushes before ingesting another message of a rank that
has rows waiting, except a sys sample (nothing in it meets the records) and a heartbeat
(it only meets them in `since_step_at_msg_s`: the later of the two sets it, `flush` knows
which came last).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from traceml_agent.protocol import (
    MAX_COUNT,
    MAX_EPOCH_S,
    MAX_STEP_MS,
    PROTOCOL_VERSION,
    Identity,
    Message,
    ProtocolError,
    StepGroup,
    StepRecord,
    StepRow,
    Steps,
    column_phases,
)

from .ingest import in_window, next_steps
from .state import RunState

# Records waiting at most: the collector flushes early past it. A drain may hold 256 relay
# frames of ~1 MiB (from as many key holders' connections), and a flush builds a dozen
# arrays per record: ~8 MiB at this bound, not ~2 GiB. An honest drain holds far fewer.
MAX_PENDING_RECORDS = 32_768


@dataclass(slots=True)
class Group:
    """One batch's column group, its lengths checked; its bytes are read as arrays only at
    the flush, joined with the other batches' groups of the same phase list: at 16,384
    ranks a batch holds a row or two, and numpy's per-call cost would outweigh them."""

    phases: tuple[str, ...]
    n: int  # records
    src: StepGroup

    def arrays(self, start: int, end: int) -> tuple[np.ndarray, ...]:
        """step, t_end, step_ms and values (end - start, phases) of records [start, end)."""
        g, p = self.src, len(self.phases)
        return (np.frombuffer(g.step, "<i8")[start:end], np.frombuffer(g.t_end, "<f8")[start:end],
                np.frombuffer(g.step_ms, "<f8")[start:end],
                np.frombuffer(g.values, "<f8").reshape(self.n, p)[start:end])


def open_groups(groups: list[StepGroup], rows: list[StepRow]) -> list[tuple[Group, int] | None]:
    """Each row's group and its first record there, or None for a row that cannot be read
    (its group's phase list or array lengths are wrong, or it names no group)."""
    opened: list[Group | None] = [_open(g) for g in groups]
    starts = [0] * len(groups)
    out: list[tuple[Group, int] | None] = []
    for row in rows:
        g = opened[row.group] if row.group < len(opened) else None
        if g is None:
            out.append(None)
            continue
        out.append((g, starts[row.group]))
        starts[row.group] += row.n
    for i, g in enumerate(opened):  # the rows must account for the group's records exactly
        if g is not None and starts[i] != g.n:
            out = [None if o is not None and o[0] is g else o for o in out]
    return out


def _open(group: StepGroup) -> Group | None:
    try:
        phases = column_phases(group)
    except ProtocolError:
        return None
    n = len(group.step) // 8
    if (len(group.step) != 8 * n or len(group.t_end) != 8 * n or len(group.step_ms) != 8 * n
            or len(group.values) != 8 * n * len(phases)):
        return None
    return Group(phases, n, group)


def row_error(row: StepRow, group: Group) -> str | None:
    """What makes a row malformed as a message (protocol.decode's checks), or None."""
    if row.id.rank >= row.id.world_size:
        return "id.rank is not below id.world_size"
    if row.forced is not None and len(row.forced) != len(group.phases):
        return "forced must be a list with one count per phase"
    return None


def _valid(step: np.ndarray, t_end: np.ndarray, step_ms: np.ndarray, values: np.ndarray
           ) -> np.ndarray:
    """protocol._record's bounds, per record: an int step, finite non-negative times
    within their bounds (NaN fails every comparison; a NaN phase value is None)."""
    ok = _envelope_ok(step, t_end, step_ms)
    if values.shape[1]:
        ok &= _values_ok(values)
    return ok


def _envelope_ok(step: np.ndarray, t_end: np.ndarray, step_ms: np.ndarray) -> np.ndarray:
    return ((step >= 0) & (step <= MAX_COUNT) & (t_end >= 0.0) & (t_end <= MAX_EPOCH_S)
            & (step_ms >= 0.0) & (step_ms <= MAX_STEP_MS))


def _values_ok(values: np.ndarray) -> np.ndarray:
    return (np.isnan(values) | ((values >= 0.0) & (values <= MAX_STEP_MS))).all(axis=1)


def refused_in(row: StepRow, group: Group, start: int) -> int:
    """How many of a row's records protocol._record's bounds refuse."""
    return row.n - int(_valid(*group.arrays(start, start + row.n)).sum())


def message_of(row: StepRow, group: Group, start: int) -> Message:
    """The steps message a row stands for, as protocol.decode would give it: valid records
    only, the refused ones counted."""
    step, t_end, step_ms, values = group.arrays(start, start + row.n)
    ok = _valid(step, t_end, step_ms, values)
    records = tuple(
        StepRecord(int(step[i]), float(t_end[i]), float(step_ms[i]),
                   tuple(None if v != v else v for v in values[i].tolist()))
        for i in np.flatnonzero(ok).tolist())
    n = len(group.phases)
    forced = (0,) * n if row.forced is None else tuple(row.forced)
    body = Steps(v=PROTOCOL_VERSION, id=row.id, seq=row.seq, t=row.t, phases=list(group.phases),
                 records=[], dropped=row.dropped, forced=list(forced))
    return Message("steps", row.id, row.seq, row.t, body, group.phases, records, forced,
                   row.n - len(records))


@dataclass
class Pending:
    """Rows taken whose records wait for `flush`, in the order they came."""

    ranks: set[int] = field(default_factory=set)
    groups: list[Group] = field(default_factory=list)
    group_at: dict[int, int] = field(default_factory=dict)  # id(Group) -> index
    row_rank: list[int] = field(default_factory=list)
    row_group: list[int] = field(default_factory=list)
    row_start: list[int] = field(default_factory=list)
    row_n: list[int] = field(default_factory=list)
    # The order of rows and of heartbeats of waiting ranks: a rank's records and its
    # heartbeats each set `since_step_at_msg_s`, and the later one must win.
    row_mark: list[int] = field(default_factory=list)
    beat_mark: dict[int, int] = field(default_factory=dict)
    marks: int = 0
    records: int = 0  # the rows' records, together (MAX_PENDING_RECORDS)

    def add(self, rank: int, group: Group, start: int, n: int) -> None:
        g = self.group_at.get(id(group))
        if g is None:
            g = self.group_at[id(group)] = len(self.groups)
            self.groups.append(group)
        self.ranks.add(rank)
        self.row_rank.append(rank)
        self.row_group.append(g)
        self.row_start.append(start)
        self.row_n.append(n)
        self.records += n
        self.row_mark.append(self.marks)
        self.marks += 1

    def beat(self, rank: int) -> None:
        """A heartbeat of a waiting rank was ingested (after its waiting rows)."""
        self.beat_mark[rank] = self.marks
        self.marks += 1

    def clear(self) -> None:
        self.ranks.clear()
        self.groups.clear()
        self.group_at.clear()
        for rows in (self.row_rank, self.row_group, self.row_start, self.row_n, self.row_mark):
            rows.clear()
        self.beat_mark.clear()
        self.marks = self.records = 0


def take_row(state: RunState, pending: Pending, ident: Identity, conn: object, now: float,
             row: StepRow, group: Group, start: int) -> bool:
    """Take a row for its envelope, its records to wait in `pending`; False when it is not
    a plain next batch of a rank known on this connection (ingest it as a message)."""
    rs = state.ranks.get(ident.rank)
    if (rs is None or ident.world_size != state.world_size or rs.conn != conn
            or rs.ident.pid != ident.pid or rs.first_step < 0):
        return False
    phases = group.phases
    intake = state.intake
    if not intake.phases_fit(phases):
        return False
    intake.add_phases(phases)
    # As Intake.message and Intake._steps do for a message, less its records.
    state.counters["messages"] += 1
    rs.last_seen = now
    intake.take_counts(rs, row.dropped, phases, row.forced)
    if row.n:
        pending.add(ident.rank, group, start, row.n)
    return True


@dataclass(frozen=True, slots=True)
class LogRun:
    """Valid records of one phase list, in the order they came: for the step log."""

    phases: tuple[str, ...]
    rank: np.ndarray
    step: np.ndarray
    t_end: np.ndarray
    step_ms: np.ndarray
    values: np.ndarray


def flush(state: RunState, pending: Pending) -> list[LogRun]:
    """Take every waiting rank's records, as Intake._steps would have taken them message
    by message; the valid records for the step log."""
    if not pending.row_rank:
        pending.clear()
        return []
    try:
        return _flush(state, pending)
    finally:
        pending.clear()


def _flush(state: RunState, p: Pending) -> list[LogRun]:
    n = np.array(p.row_n, np.int64)
    total = int(n.sum())
    row_of = np.repeat(np.arange(len(n)), n)  # each record's row, in the order they came
    src = np.repeat(np.array(p.row_start, np.int64) - (np.cumsum(n) - n), n) + np.arange(total)
    grp = np.array(p.row_group, np.int64)[row_of]
    # The records as columns in the order they came; phase values per phase list (each
    # list's batches' bytes joined: one array per field and list).
    lists: dict[tuple[str, ...], list[int]] = {}
    for g, group in enumerate(p.groups):
        lists.setdefault(group.phases, []).append(g)
    base = np.zeros(len(p.groups), np.int64)  # a group's first record in its list's arrays
    joined: dict[tuple[str, ...], tuple[np.ndarray, ...]] = {}
    for phases, gs in lists.items():
        srcs = [p.groups[g].src for g in gs]
        sizes = [p.groups[g].n for g in gs]
        base[gs] = np.cumsum(sizes) - sizes
        joined[phases] = (
            np.frombuffer(b"".join(x.step for x in srcs), "<i8"),
            np.frombuffer(b"".join(x.t_end for x in srcs), "<f8"),
            np.frombuffer(b"".join(x.step_ms for x in srcs), "<f8"),
            np.frombuffer(b"".join(x.values for x in srcs), "<f8").reshape(-1, len(phases)))
    src += base[grp]
    sel_of: dict[tuple[str, ...], np.ndarray] = {}
    vals_of: dict[tuple[str, ...], np.ndarray] = {}
    if len(joined) == 1:
        [(phases, (a_step, a_end, a_ms, a_vals))] = joined.items()
        step, t_end, step_ms = a_step[src], a_end[src], a_ms[src]
        sel_of[phases], vals_of[phases] = np.arange(total), a_vals[src]
    else:
        step = np.empty(total, np.int64)
        t_end = np.empty(total)
        step_ms = np.empty(total)
        key_of = np.empty(len(p.groups), np.int64)
        for k, gs in enumerate(lists.values()):
            key_of[gs] = k
        rec_key = key_of[grp]
        for k, (phases, (a_step, a_end, a_ms, a_vals)) in enumerate(joined.items()):
            sel = np.flatnonzero(rec_key == k)
            s = src[sel]
            step[sel], t_end[sel], step_ms[sel] = a_step[s], a_end[s], a_ms[s]
            sel_of[phases], vals_of[phases] = sel, a_vals[s]
    valid = _envelope_ok(step, t_end, step_ms)
    for phases, sel in sel_of.items():
        valid[sel] &= _values_ok(vals_of[phases])
    rank = np.array(p.row_rank, np.int64)[row_of]
    if not valid.all():
        _count_bad(state, rank[~valid])
    key = np.empty(total, np.int64)  # each record's phase list, numbered
    names = list(sel_of)
    for k, phases in enumerate(names):
        key[sel_of[phases]] = k
    log = _log_runs(names, valid, key, rank, step, t_end, step_ms, sel_of, vals_of)
    _take(state, p, valid, rank, step, step_ms, key, names, sel_of, vals_of, row_of)
    return log


def _count_bad(state: RunState, ranks: np.ndarray) -> None:
    uniq, counts = np.unique(ranks, return_counts=True)
    for r, c in zip(uniq.tolist(), counts.tolist(), strict=True):
        state.intake.bad_records(state.ranks[r], c)


def _log_runs(names: list[tuple[str, ...]], valid: np.ndarray, key: np.ndarray,
              rank: np.ndarray, step: np.ndarray, t_end: np.ndarray, step_ms: np.ndarray,
              sel_of: dict[tuple[str, ...], np.ndarray],
              vals_of: dict[tuple[str, ...], np.ndarray]) -> list[LogRun]:
    """The valid records in the order they came, one run per stretch of one phase list."""
    idx = np.flatnonzero(valid)
    if not len(idx):
        return []
    if len(names) == 1:
        phases = names[0]
        return [LogRun(phases, rank[idx], step[idx], t_end[idx], step_ms[idx],
                       vals_of[phases][idx])]
    # Where each record sits in its phase list's value rows.
    row_in = np.empty(len(key), np.int64)
    for phases in names:
        sel = sel_of[phases]
        row_in[sel] = np.arange(len(sel))
    k = key[idx]
    cuts = np.flatnonzero(k[1:] != k[:-1]) + 1
    runs = []
    for part in np.split(idx, cuts):
        phases = names[int(key[part[0]])]
        runs.append(LogRun(phases, rank[part], step[part], t_end[part], step_ms[part],
                           vals_of[phases][row_in[part]]))
    return runs


def _take(state: RunState, p: Pending, valid: np.ndarray, rank: np.ndarray, step: np.ndarray,
          step_ms: np.ndarray, key: np.ndarray, names: list[tuple[str, ...]],
          sel_of: dict[tuple[str, ...], np.ndarray],
          vals_of: dict[tuple[str, ...], np.ndarray], row_of: np.ndarray) -> None:
    """The valid records into the ranks' windows and counts: a rank whose records are all
    the next steps within the step-rate bound in one pass for all; any other rank record
    by record (Intake.take_records, the per-message path's own code). The rule is the
    same, `ingest.next_steps`, in its array form."""
    idx = np.flatnonzero(valid)
    if not len(idx):
        return
    order = idx[np.argsort(rank[idx], kind="stable")]  # by rank, each in the order it came
    r_s, step_s = rank[order], step[order]
    starts = np.flatnonzero(np.r_[True, r_s[1:] != r_s[:-1]])
    counts = np.diff(np.r_[starts, len(order)])
    uniq = r_s[starts].tolist()
    ranks = [state.ranks[r] for r in uniq]
    # Each record must pass its rank's newest step so far and stay within the step-rate
    # bound (the same for all its records: they share the drain's clock).
    prev = np.empty_like(step_s)
    prev[1:] = step_s[:-1]
    prev[starts] = [rs.last_step for rs in ranks]
    bound = np.repeat(np.array([rs.step_bound() for rs in ranks], np.int64), counts)
    plain = np.logical_and.reduceat(next_steps(step_s, prev, bound), starts)
    window = in_window(step_s) & np.repeat(plain, counts)
    block = state.block
    if window.any():
        _to_windows(state, order, r_s, step_s, step_ms, window, starts, counts, key, names,
                    sel_of, vals_of)
    mark = np.array(p.row_mark, np.int64)[row_of[order]]
    ends = starts + counts
    # Per rank as Python lists: the loop below touches each rank's state once.
    w_counts = np.add.reduceat(window, starts).tolist()
    lasts = step_s[ends - 1].tolist()
    last_marks = mark[ends - 1].tolist()
    starts_l, ends_l, plain_l = starts.tolist(), ends.tolist(), plain.tolist()
    # Stalls: the window records at or past their rank's threshold (rare), in order.
    stall_at = np.array([np.inf if rs.stall_at_ms is None else rs.stall_at_ms for rs in ranks])
    stalled = window & (step_ms[order] >= np.repeat(stall_at, counts))
    hits: dict[int, list[int]] = {}
    for j in np.flatnonzero(stalled).tolist():
        hits.setdefault(int(np.searchsorted(starts, j, side="right")) - 1, []).append(j)
    intake = state.intake
    size = block.size
    for i, rs in enumerate(ranks):
        lo, hi = starts_l[i], ends_l[i]
        beat = p.beat_mark.get(uniq[i], -1)
        since = rs.since_step_at_msg_s
        if not plain_l[i]:  # record by record, as a message's
            last = -1
            for j in range(lo, hi):
                rec = int(order[j])
                phases, vals = _values(rec, key, names, sel_of, vals_of)
                one = StepRecord(int(step[rec]), 0.0, float(step_ms[rec]), vals)
                if intake.take_records(rs, (one,), phases):
                    last = int(mark[j])
            if last < 0:
                continue
        else:
            last = last_marks[i]
            intake.took(rs, hi - lo, lasts[i])
            nw = w_counts[i]
            if nw:
                r = uniq[i]
                block.pos[r] = (block.pos[r] + nw) % size
                block.count[r] = min(size, block.count[r] + nw)
            for j in hits.get(i, ()):
                rec = int(order[j])
                phases, vals = _values(rec, key, names, sel_of, vals_of)
                intake.stall_seen(rs, int(step[rec]), float(step_ms[rec]), phases, vals)
        if beat > last:  # a heartbeat came after its last records: the agent's figure
            intake.since_step(rs, since)
        intake.stepped_past_stacks(rs)


def _values(rec: int, key: np.ndarray, names: list[tuple[str, ...]],
            sel_of: dict[tuple[str, ...], np.ndarray],
            vals_of: dict[tuple[str, ...], np.ndarray]
            ) -> tuple[tuple[str, ...], tuple[float | None, ...]]:
    """One record's phase names and values as a message's record has them."""
    phases = names[int(key[rec])]
    vals = vals_of[phases][int(np.searchsorted(sel_of[phases], rec))]
    return phases, tuple(None if v != v else v for v in vals.tolist())


def _to_windows(state: RunState, order: np.ndarray, r_s: np.ndarray, step_s: np.ndarray,
                step_ms: np.ndarray, window: np.ndarray, starts: np.ndarray,
                counts: np.ndarray, key: np.ndarray, names: list[tuple[str, ...]],
                sel_of: dict[tuple[str, ...], np.ndarray],
                vals_of: dict[tuple[str, ...], np.ndarray]) -> None:
    """Every window record into its rank's ring (WindowBlock.append's writes, at once): a
    rank's newest `size` of them, each at its slot after the rank's write position."""
    block = state.block
    size = block.size
    cum = np.cumsum(window)
    before = np.repeat((cum - window)[starts], counts)
    ordinal = cum - 1 - before  # among the rank's window records
    n_win = np.repeat(cum[np.r_[starts[1:] - 1, len(cum) - 1]] - (cum - window)[starts], counts)
    keep = window & (ordinal >= n_win - size)
    rows = r_s[keep]
    pos0 = np.array(block.pos, np.int64)[rows]
    slots = (pos0 + ordinal[keep]) % size
    recs = order[keep]
    k = key[recs]
    # The series of every phase list, in the order they first came (as _plan adds them).
    for kk in dict.fromkeys(k.tolist()):
        block.plans.get(names[kk]) or block._plan(names[kk])
    n_series = len(block.series)
    values = np.full((len(recs), n_series), np.nan)
    values[:, 0] = step_ms[recs]
    for kk, phases in enumerate(names):
        at = np.flatnonzero(k == kk) if len(names) > 1 else np.arange(len(recs))
        if not len(at):
            continue
        cols = np.array([block.index[name] for name in phases], np.int64)
        values[np.ix_(at, cols)] = vals_of[phases][np.searchsorted(sel_of[phases], recs[at])]
    for s in range(n_series):
        block.series[s][rows, slots] = values[:, s]
    block.step_no[rows, slots] = step_s[keep]
    # The phases each rank sent (known) and its newest list (last_names), as append keeps
    # them: only a rank whose list changed needs a set update.
    stepped = np.flatnonzero(np.add.reduceat(window, starts)).tolist()
    if len(names) == 1:
        only = names[0]
        for r in r_s[starts[stepped]].tolist():
            if block.last_names[r] != only:
                block.known[r].update(only)
                block.last_names[r] = only
        return
    ends = np.r_[starts[1:], len(order)]
    for i in stepped:
        r = int(r_s[starts[i]])
        lo, hi = int(starts[i]), int(ends[i])
        used = key[order[lo:hi][window[lo:hi]]]
        newest = names[int(used[-1])]
        if block.last_names[r] != newest or (len(names) > 1 and (used != used[-1]).any()):
            for kk in set(used.tolist()):
                block.known[r].update(names[kk])
            block.last_names[r] = newest
