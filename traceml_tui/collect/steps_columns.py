"""A large steps message, checked as columns: one vectorised pass, not a Python check per
record (issue 42, finding 3).

A real agent sends a few records per message; a rank catching up, or a key holder, may
send up to 20,000 in one 1 MiB message. protocol.decode checks each record in Python and
makes a StepRecord of it, and the state took them one by
one: 32 key holders' connections sending such messages held the collector's drain, and
with it every viewer and the live file, for seconds. Here a message over LARGE_BYTES
is decoded by msgspec alone (its records as lists: C), turned into the same packed
columns a node relay sends (protocol.StepGroup and StepRow), and checked and ingested
as relay columns are (judge/ingest_columns.py): 7.7 ms of CPU for a 0.69 MiB message the
state refuses (another connection's rank: its records are never made into objects), 8.8
ms for one it takes (18.2 and 33.0 before; benchmarks/large_steps.py).

The checks are protocol._record's, record by record, with array operations: a record
of the wrong length, a step that is not an int in 0..MAX_COUNT, a time out of its
bounds, or NaN sent as a phase value (None is not measured; NaN is refused) costs
itself, counted in the rank's bad_records as the message path counts it.
"""

from __future__ import annotations

from itertools import repeat

import numpy as np

from traceml_agent.protocol import MAX_COUNT, ProtocolError, StepGroup, StepRow, Steps

# Payloads at least this large are decoded here when they are steps messages: an agent's
# ordinary message (~10 records, ~1 KiB) takes the per-message path, whose per-call cost
# is lower for a few records.
LARGE_BYTES = 16 << 10
_STEPS = b"\xa5steps"  # "steps" as msgpack writes it (a fixstr of 5)


def maybe_steps(payload: bytes) -> bool:
    """Whether a payload may be a large steps message (only those are decoded here)."""
    return len(payload) >= LARGE_BYTES and _STEPS in payload


def columns_of(wire: Steps) -> tuple[StepRow, StepGroup]:
    """The message as one column row and its group (group 0 of one), every record kept in
    place with the bad ones made invalid (step -1), so the flush counts them refused.
    ProtocolError where protocol.decode refuses the whole message (and, as decode, for
    anything unforeseen: a bad message must never raise out of the drain)."""
    try:
        return _columns_of(wire)
    except ProtocolError:
        raise
    except Exception as exc:
        raise ProtocolError(f"invalid steps: {type(exc).__name__}: {exc}"[:300]) from None


def _columns_of(wire: Steps) -> tuple[StepRow, StepGroup]:
    phases = wire.phases
    n = len(phases)
    if wire.forced is not None and len(wire.forced) != n:
        raise ProtocolError("forced must be a list with one count per phase")
    width = 3 + n
    raw = wire.records
    total = len(raw)
    lengths = set(map(len, raw))
    good = raw if lengths <= {width} else [r for r in raw if len(r) == width]
    at = None if good is raw else np.array([len(r) == width for r in raw], bool)
    step, floats = _arrays(good, width)
    if at is not None:  # records of the wrong length: in place, invalid
        full_step = np.full(total, -1, np.int64)
        full_step[at] = step
        full = np.full((total, width), np.nan)
        full[at] = floats
        step, floats = full_step, full
    group = StepGroup(list(phases), step.astype("<i8").tobytes(),
                      np.ascontiguousarray(floats[:, 1], "<f8").tobytes(),
                      np.ascontiguousarray(floats[:, 2], "<f8").tobytes(),
                      np.ascontiguousarray(floats[:, 3:], "<f8").tobytes())
    row = StepRow(wire.id, wire.seq, wire.t, 0, total, wire.dropped, wire.forced)
    return row, group


def _arrays(records: list[list[int | float | None]], width: int
            ) -> tuple[np.ndarray, np.ndarray]:
    """Steps (int64; -1 where the record is bad) and every value as float64 (None: NaN),
    for records of the right length."""
    if not records:
        return np.empty(0, np.int64), np.empty((0, width))
    steps = [r[0] for r in records]
    try:
        if set(map(type, steps)) <= {int}:
            step = np.array(steps, np.int64)
        else:
            raise OverflowError
    except OverflowError:  # a float or None step, or one past int64: that record is bad
        step = np.array([s if type(s) is int and 0 <= s <= MAX_COUNT else -1 for s in steps],
                        np.int64)
    floats = np.array(records, np.float64)  # None -> NaN; msgspec gave ints and floats only
    nan = np.isnan(floats)
    if nan.any():
        # None is "not measured"; a NaN on the wire is refused (protocol._record_ok): a
        # record with more NaN than None holds one.
        nones = np.fromiter(map(list.count, records, repeat(None)), np.int64, len(records))
        step[nan.sum(axis=1) != nones] = -1
    return step, floats
