"""Exit codes never lie (issue 42, item 6): whether a job failed is torchrun's word, never
a wire value's; a rank's code is what its process exits with; a second goodbye for a
finished rank is refused; `traceml run` never exits 0 for a job torchrun saw fail."""

from __future__ import annotations

import pytest

from traceml_agent.bootstrap import _exit_code
from traceml_agent.protocol import Identity, decode, encode
from traceml_tui.judge.state import RunState
from traceml_tui.runfolder.exit_codes import job_exit_code, process_exit_code


@pytest.mark.parametrize(("torchrun", "interrupted", "failures", "code", "rank"), [
    (0, False, [], 0, None),
    (0, False, [(1, 3)], 0, None),  # a failed attempt, then a restart that ran to the end
    (1, False, [(1, 3)], 3, 1),  # the rank's own code, not torchrun's 1
    (1, False, [(1, 256)], 1, 1),  # a shell reads 256 as success: the job failed
    (1, False, [(1, 0)], 1, 1),
    (1, False, [(2, -9)], 137, 2),  # killed by SIGKILL
    (1, False, [(2, 1 << 20)], 1, 2),
    (-15, False, [], 143, None),  # torchrun itself killed by SIGTERM
    (1, False, [], 1, None),
    (1, True, [(0, 3)], 130, 0),
])
def test_the_jobs_code_is_torchruns_verdict_with_the_ranks_own_code(
        torchrun, interrupted, failures, code, rank):
    assert job_exit_code(torchrun, interrupted, failures) == (code, rank)


@pytest.mark.parametrize(("code", "torchrun", "out"), [
    (0, 0, 0), (3, 1, 3), (256, 1, 1), (512, 2, 2), (-9, 1, 137), (None, 1, 1), (300, None, 1),
])
def test_traceml_run_never_exits_0_for_a_job_torchrun_saw_fail(code, torchrun, out):
    assert process_exit_code(code, torchrun) == out


@pytest.mark.parametrize(("raised", "code"), [(None, 0), (3, 3), (256, 0), (-1, 255),
                                              ("message", 1)])
def test_the_agent_reports_the_code_its_process_exits_with(raised, code):
    assert _exit_code(SystemExit(raised)) == code


def test_a_second_goodbye_for_a_finished_rank_is_refused_and_codes_are_clamped():
    state = RunState("codes", world_size=2)
    ident = Identity(1, 1, 0, "h", 101, 2)
    assert state.ingest(decode(encode("goodbye", ident, 1, 0.0, exit_code=70000)), now=1.0)
    assert state.ranks[1].exit_code == 255
    assert not state.ingest(decode(encode("goodbye", ident, 2, 0.0, exit_code=0)), now=2.0)
    assert state.ranks[1].exit_code == 255  # the first word stands


@pytest.mark.parametrize(("said", "error", "kept"), [
    (None, None, (-9, None)),  # killed by a signal: no goodbye
    (0, None, (-6, "died at exit")),  # its script returned, then it died (run 43)
    (0, "earlier words", (-6, "earlier words")),
    (3, "ValueError: x", None),  # its goodbye named its own failure: kept
])
def test_torchruns_first_failure_wins_over_a_goodbye_that_said_nothing_failed(
        said, error, kept):
    from traceml_tui.runfolder.exit_codes import root_cause_end

    code = -9 if said is None else -6
    end = root_cause_end(code, said, error)
    if kept is None:
        assert end is None
    else:
        assert end is not None and end[0] == kept[0]
        assert (end[1] or "").startswith(kept[1] or ""), end


def test_the_launchers_fallback_record_names_a_rank_that_died_after_its_goodbye(tmp_path):
    """The collector gone, the launcher promotes its last snapshot: a rank whose goodbye
    said 0 and that torchrun saw die is the failure there too, as in the collector's."""
    import json
    from pathlib import Path

    from traceml_agent.requests import Finish
    from traceml_tui.launch.launcher import _fallback_summary
    from traceml_tui.runfolder.layout import RunFolder

    doc = json.loads((Path(__file__).parents[1] / "data" / "rich_summary.json").read_text())
    for r in doc["ranks"]:  # every rank said goodbye with 0
        r["exit_code"], r["error"] = 0, None
    doc["failure"] = None
    doc.pop("attempts"), doc.pop("restarts")
    folder = RunFolder(tmp_path)
    folder.live.write_text(json.dumps(doc))
    reply = _fallback_summary(tmp_path, Finish(torchrun_exit=1, root_cause=(1, -6),
                                               command=["python", "train.py"]))
    written = json.loads(folder.summary_json.read_text())
    assert (written["failure"]["rank"], written["failure"]["signal"]) == (1, "SIGABRT")
    assert "died at exit, after its script returned" in written["failure"]["summary"]
    assert (reply.exit_code, reply.failed_rank) == (134, 1)
