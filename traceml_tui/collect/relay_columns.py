"""A relay's plain steps messages as columns (protocol.StepColumns), and its heartbeats
and sys samples as typed lists (RelayBatch.beats, .samples), built per batch.

At 1,024 ranks most of what node 0 receives is steps messages of one record or a few,
and decoding each (a msgspec decode, then every record checked in Python) and ingesting
it record by record cost node 0 ~9 us a message. The relay has the time (its node's CPU,
not node 0's): it decodes each of its ranks' messages with the same protocol.decode, and
a plain one (no collectives, no refused record, few enough records) goes up as a row of
columns; node 0 checks the columns with array operations and ingests them a drain at a
time (judge/ingest_columns.py). Anything else goes up unchanged, and so does a message
the relay cannot decode: the collector judges it as it always has.

Heartbeats and sys samples were half of node 0's messages at 16,384 ranks, each decoded on
its own. The relay checks each with protocol.decode's own decoder and sends its bytes, as
they came, in the batch's list of its kind: node 0 decodes the whole list with the batch,
every field checked by its Struct as before, and ingests each without another decode.
"""

from __future__ import annotations

import sys
from array import array

from msgspec import Raw

from traceml_agent.protocol import (
    BEAT_MARK,
    MAX_COLUMN_GROUPS,
    RelayBatch,
    StepColumns,
    StepGroup,
    StepRow,
    Steps,
    decode_plain_steps,
    relayed_mark,
)

# Records of one message sent as a row; a larger batch (a rank catching up) goes up as it
# came: a decoded record costs the relay ~10 times its bytes while it waits for a tick.
MAX_ROW_RECORDS = 256
NAN = float("nan")
_STEPS = b"\xa5steps"  # "steps" as msgpack writes it (a fixstr of 5)
_BEAT = b"\xa9heartbeat"
_SYS = b"\xa3sys"


# A plain steps message, decoded, with its phase names checked.
Plain = tuple[Steps, tuple[str, ...]]
# A heartbeat or sys sample: its mark (protocol.BEAT_MARK, SYS_MARK) and its bytes.
Typed = tuple[bytes, bytes]
# A pending item: a payload as it came, a plain steps message with its bytes (sent as
# they came after all if its batch has no room for another phase list), or a Typed.
Item = bytes | tuple[Plain, bytes] | Typed


def item_of(payload: bytes) -> Item:
    """How a rank message travels in a batch: a plain steps message as a column row, a
    heartbeat or sys sample in its kind's list, anything else as it came."""
    if _STEPS in payload:
        plain = plain_steps(payload)
        if plain is not None:
            return plain, payload
    if _BEAT in payload or _SYS in payload:
        mark = relayed_mark(payload)
        if mark is not None:
            return mark, payload
    return payload


def plain_steps(payload: bytes) -> Plain | None:
    """The decoded message if it can travel as a column row, else None (sent as it came).
    A payload without the msgpack string "steps" in it is no steps message: not decoded."""
    if _STEPS not in payload:
        return None
    return decode_plain_steps(payload, MAX_ROW_RECORDS)


def item_bytes(item: Item) -> int:
    """An item's share of a batch's bytes, never less than it takes in the batch (a row: its
    envelope, which its message's bytes hold, and its records as packed columns): a batch
    past protocol.MAX_RELAY_BATCH_BYTES is refused whole, and a row's identity alone may
    hold a host name of 256 characters."""
    if isinstance(item, tuple):
        if isinstance(item[0], bytes):  # its bytes as they came, and its mark
            return len(item[1]) + len(item[0])
        (wire, phases), payload = item
        return len(payload) + len(wire.records) * 8 * (3 + len(phases))
    return len(item)


def relay_batch(node: int, batches: int, dropped: int, routes: list[int],
                items: list[Item]) -> RelayBatch:
    """One batch: payloads as they came, an empty payload for each column row, and a mark
    for each heartbeat and sample (their bytes in the batch's lists)."""
    if not any(isinstance(item, tuple) for item in items):
        return RelayBatch(node, batches, dropped, routes, items)  # type: ignore[arg-type]
    group_of: dict[tuple[str, ...], int] = {}
    recs: list[list[list[int | float | None]]] = []
    rows = []
    payloads: list[bytes] = []
    beats: list[Raw] = []
    samples: list[Raw] = []
    for item in items:
        if not isinstance(item, tuple):
            payloads.append(item)
            continue
        if isinstance(item[0], bytes):
            mark, raw = item
            payloads.append(mark)
            (beats if mark == BEAT_MARK else samples).append(Raw(raw))
            continue
        (wire, phases), payload = item
        g = group_of.get(phases)
        if g is None:
            if len(group_of) >= MAX_COLUMN_GROUPS:  # never with real agents: one list each
                payloads.append(payload)
                continue
            g = group_of[phases] = len(recs)
            recs.append([])
        payloads.append(b"")
        recs[g].extend(wire.records)
        forced = wire.forced if wire.forced and any(wire.forced) else None
        rows.append(StepRow(wire.id, wire.seq, wire.t, g, len(wire.records), wire.dropped,
                            forced))
    groups = []
    for phases, g in group_of.items():  # in order: g is the group's index
        records = recs[g]
        groups.append(StepGroup(
            list(phases), _packed("q", [r[0] for r in records]),
            _packed("d", [r[1] for r in records]), _packed("d", [r[2] for r in records]),
            _packed("d", [NAN if v is None else v for r in records for v in r[3:]])))
    # The lists hold each message's bytes (Raw): encoded as they are, decoded as Structs.
    return RelayBatch(node, batches, dropped, routes, payloads,
                      StepColumns(groups, rows) if rows else None,
                      beats or None, samples or None)  # type: ignore[arg-type]


def _packed(code: str, values: list) -> bytes:
    """Values as a little-endian packed array (the array module: a batch holds a few
    records, where numpy's per-call cost would be most of the work)."""
    arr = array(code, values)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()
