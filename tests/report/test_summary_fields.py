"""A field a rank sends, also in final_summary.json, declared once (issue 31): the heartbeat
fields flagged protocol.SUMMARIZED are the rank row's last fields (model.Rank), in the
heartbeat's order, and summary.build copies them from each rank's latest heartbeat."""

from __future__ import annotations

import json
from typing import Annotated

import msgspec

from traceml_agent.protocol import (
    NO_HEARTBEAT,
    PROTOCOL_VERSION,
    SUMMARIZED,
    Count,
    Heartbeat,
    Message,
)
from traceml_tui.collect.canned import T0, make_state
from traceml_tui.report import summary
from traceml_tui.runfolder import summary_model as model


def test_the_rank_row_ends_with_the_flagged_heartbeat_fields():
    flagged = [name for name, _, _ in model.summarized(Heartbeat)]
    assert flagged == ["replays", "batches", "timing_faults", "capture_skips", "late_steps"]
    fields = model.Rank.__struct_fields__
    assert list(fields[-len(flagged):]) == flagged
    assert list(fields[:-len(flagged)]) == list(model.RankBase.__struct_fields__)
    assert model.Rank.__struct_defaults__[-len(flagged):] == (0, 0, 0, 0, 0)


def test_a_newly_flagged_field_is_found_in_its_order_with_its_default():
    """What adding a field to the heartbeat does, on a scratch Struct: the row gets it."""
    Wider = msgspec.defstruct("Wider", [
        ("oom_retries", Annotated[Count, SUMMARIZED], 0),
        ("note", str | None, None),  # not flagged
        ("hosts_seen", Annotated[list[str], SUMMARIZED], msgspec.field(default_factory=list)),
    ], bases=(Heartbeat,), kw_only=True)
    found = model.summarized(Wider)
    assert [(name, kind) for name, kind, _ in found][-2:] == [("oom_retries", int),
                                                              ("hosts_seen", list[str])]
    assert found[-2][2] == 0 and found[-1][2].default_factory is list


def test_a_ranks_heartbeat_counters_reach_its_row():
    state = make_state(world_size=4, straggler=None)
    rs = state.ranks[2]
    beat = msgspec.structs.replace(NO_HEARTBEAT, v=PROTOCOL_VERSION, id=rs.ident, seq=9,
                                   t=T0 + 5, step=rs.steps, replays=7, batches=40,
                                   timing_faults=3, capture_skips=2, late_steps=5)
    assert state.ingest(Message("heartbeat", rs.ident, 9, T0 + 5, beat), 5.0)
    doc = model.to_doc(summary.build(state.snapshot(T0 + 75.0, 5.5, full=True), summary.RunMeta()))
    row = json.loads(summary.to_json(doc))["ranks"][2]
    assert list(row)[-5:] == ["replays", "batches", "timing_faults", "capture_skips",
                              "late_steps"]
    assert [row[k] for k in list(row)[-5:]] == [7, 40, 3, 2, 5]
    assert model.decode(summary.to_json(doc)).ranks[2].timing_faults == 3  # type: ignore[attr-defined]
