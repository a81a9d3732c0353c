"""The text summary and the summary's JSON, pinned byte for byte on one rich summary.

tests/data/rich_summary.json holds every section the text reads (a hang with Python and
native stacks and NCCL logs, a failure, restarts, stalls, memory, checks, preflight,
untimed phases, relays, collectives, a what-if); tests/data/rich_summary.txt is its text
as render_text printed it BEFORE the report side was typed (issue 43, item 2): the typed
code must print the same bytes and write the same JSON.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from jobs import validate_schema
from traceml_tui.report import model, summary

DATA = Path(__file__).parent / "data"
DOC = DATA / "rich_summary.json"
GOLDEN = DATA / "rich_summary.txt"


def test_rich_summary_text_is_the_golden_text() -> None:
    doc = json.loads(DOC.read_text())
    assert summary.render_text(doc) == GOLDEN.read_text()


def test_rich_summary_json_round_trips_through_the_model_byte_for_byte() -> None:
    doc = json.loads(DOC.read_text())
    validate_schema(doc)
    written = summary.to_json(doc)
    assert written == msgspec.json.encode(doc).decode() + "\n"
    # read back through the model, then written again: the same bytes
    assert model.encode(model.decode(written)).decode() + "\n" == written
    validate_schema(json.loads(written))
