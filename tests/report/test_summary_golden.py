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
from traceml_tui.report import summary
from traceml_tui.runfolder import summary_model as model

DATA = Path(__file__).parents[1] / "data"
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


def test_the_launchers_fallback_summary_is_the_dict_paths_byte_for_byte(tmp_path: Path) -> None:
    """The launcher promotes the live snapshot when the collector does not answer: now
    through the model (structs replaced), before through a dict edited by key. The file,
    its text and the reply are the same bytes as the dict path gives."""
    from traceml_agent.requests import Finish
    from traceml_tui.launch.launcher import _fallback_summary
    from traceml_tui.runfolder.exit_codes import job_exit_code
    from traceml_tui.runfolder.layout import RunFolder

    folder = RunFolder(tmp_path)
    folder.live.write_text(DOC.read_text())
    request = Finish(torchrun_exit=1, command=["python", "train.py"], ended_at=1.7e9 + 80)
    reply = _fallback_summary(tmp_path, request)

    # The dict path, as the launcher had it before the report side was typed.
    doc = model.to_doc(model.load(folder.live))
    failures = [(r["rank"], r["exit_code"]) for r in doc["ranks"] if r["exit_code"]]
    code, failed_rank = job_exit_code(1, False, failures)
    meta = summary.RunMeta(exit_code=code, failed_rank=failed_rank)
    doc["complete"] = False
    doc["run"].update(exit_code=code, failed_rank=failed_rank,
                      ended_at=summary.iso(request.ended_at), command=request.command)
    failed = summary.rank_failure(model.load(folder.live).ranks, meta)
    doc["failure"] = model.plain(failed)

    assert folder.summary_json.read_text() == summary.to_json(doc, indent=2)
    assert folder.summary_txt.read_text() == summary.render_text(doc)
    assert reply.text == folder.summary_txt.read_text()
    assert (reply.exit_code, reply.failed_rank) == (code, failed_rank) == (1, 2)
    assert reply.text.startswith("attempt 1: rank 2 raised ValueError")
