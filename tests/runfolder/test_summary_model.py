"""The summary's typed model (runfolder/summary_model.py), failures first, and the one
end-of-run reply.

final_summary.json is written through the model and read back through it; a file that is
not a summary is one line; a failed rank leads the summary, its text and the banner.
"""

from __future__ import annotations

import json
import time

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hostile
from jobs import traceml, validate_schema
from traceml_agent import protocol
from traceml_agent.protocol import Identity, StepRecord
from traceml_agent.vocab import PHASES
from traceml_tui.collect.canned import T0, StaticSource, make_state
from traceml_tui.judge.state import RunState
from traceml_tui.report import ending, summary
from traceml_tui.report.compare import compare
from traceml_tui.runfolder import summary_model as model
from traceml_tui.runfolder.step_log import StepLogWriter

EXTRA = {"run_dir": "/runs/x", "logs": "/runs/x/logs", "torchrun_exit_code": 1,
         "native_stack_refused": 0, "collector_restarted": {"earlier_record": "x.json"},
         "nodes_never_seen": [3]}
TRACEBACK = ('Traceback (most recent call last):\n  File "train.py", line 9, in <module>\n'
             '    raise RuntimeError("injected")\nRuntimeError: injected fault on rank 2\n')


def crashed_state(rank: int = 2, exit_code: int = 1, error: str | None = TRACEBACK):
    """A canned 8-rank run whose `rank` said goodbye with `exit_code` and `error`, through
    the wire decoder as a real agent's goodbye arrives."""
    state = make_state()
    ident = Identity(rank, rank % 4, rank // 4, f"node{rank // 4:03d}", 1000 + rank, 8)
    msg = hostile.template("goodbye", ident, seq=9)
    msg.update(exit_code=exit_code, error=error, steps=40)
    state.ingest(protocol.decode(hostile.pack(msg)), 0.0)
    return state


def doc_of(state, **meta) -> dict:
    """The summary as its JSON values (what a reader of the file sees)."""
    return model.to_doc(summary.build(state.snapshot(T0 + 75.0, 0.5, full=True),
                                      summary.RunMeta(**meta)))


@pytest.mark.parametrize("state, meta", [
    (make_state(), {"complete": False}),
    (make_state(straggler=None, stale=(3,)), {}),
    (make_state(16, 4, silent_nodes=(3,)), {"extra": EXTRA}),
    (crashed_state(), {"exit_code": 1, "failed_rank": 2, "extra": EXTRA}),
], ids=["straggler", "stale", "nodes-and-extras", "crashed"])
def test_written_through_the_model_every_key_in_order_and_read_back_the_same(state, meta):
    doc = doc_of(state, **meta)
    written = summary.to_json(doc)
    # The model keeps every key the builder writes, in the builder's order.
    assert written == msgspec.json.encode(doc).decode() + "\n"
    back = model.decode(written)
    assert model.to_doc(back) == json.loads(written)
    assert summary.to_json(model.to_doc(back)) == written  # round trip, byte for byte


def test_a_newer_file_with_unknown_keys_and_an_older_one_without_sections_both_read():
    doc = json.loads(summary.to_json(doc_of(crashed_state(), exit_code=1, failed_rank=2)))
    newer = json.loads(json.dumps(doc))
    newer["future_section"] = {"x": 1}
    newer["run"]["future_field"] = [1, 2]
    newer["ranks"][0]["future_field"] = "y"
    newer["diagnosis"]["future_field"] = None
    newer["failure"]["future_field"] = 3.5
    assert model.decode(json.dumps(newer)).failure.rank == 2
    older = {k: doc[k] for k in ("schema_version", "run", "phases", "diagnosis", "step_ms",
                                 "ranks")}
    older["run"] = {k: older["run"][k] for k in ("name", "world_size", "nnodes",
                                                 "started_at", "ended_at", "exit_code",
                                                 "command")}
    s = model.decode(json.dumps(older))
    assert s.failure is None and s.cost is None and s.timeline == []
    assert compare(s, model.decode(json.dumps(newer))).verdict == "unchanged"


@pytest.mark.parametrize("text, why", [
    ('{"run": {"name": "x"}}', "Object missing required field `diagnosis`"),
    ("[1, 2]", "Expected `object`, got `array`"),
    ("{not json", "not JSON"),
    ('{"run": {"name": 1}, "diagnosis": {"label": "X"}, "step_ms": {}, "ranks": []}',
     "Expected `str`, got `int` - at `$.run.name`"),
])
def test_a_file_that_is_not_a_summary_is_one_line_naming_why(tmp_path, text, why):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(model.NotASummary) as err:
        model.load(path)
    line = str(err.value)
    assert line.startswith(f"{path} is not a traceml summary: ") and why in line, line
    assert "\n" not in line
    with pytest.raises(model.NotASummary, match="no such file"):
        model.load(tmp_path / "missing.json")


def test_export_of_a_run_whose_summary_is_broken_is_one_line(tmp_path):
    run = tmp_path / "run"
    writer = StepLogWriter(run / "steps")
    writer.append_records(0, PHASES, [StepRecord(0, T0, 10.0, tuple(1.0 for _ in PHASES))])
    writer.close()
    (run / "final_summary.json").write_text('{"run": {"name": 1}}')
    proc = traceml("export", str(run), "--perfetto", str(tmp_path / "out.json"), timeout=60)
    assert proc.returncode != 0
    assert "final_summary.json is not a traceml summary: " in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


# --- failures first --------------------------------------------------------------------


def test_a_failed_rank_leads_the_summary_and_its_text():
    doc = doc_of(crashed_state(), exit_code=1, failed_rank=2)
    assert list(doc)[:3] == ["schema_version", "complete", "failure"]
    assert doc["failure"] == {
        "rank": 2, "exit_code": 1, "signal": None, "error": "RuntimeError: injected fault on "
        "rank 2", "step": 40, "others": [], "summary": "FAILED: rank 2 exited with code 1 "
        "after 40 steps: RuntimeError: injected fault on rank 2"}
    lines = summary.render_text(doc).splitlines()
    assert lines[0] == doc["failure"]["summary"]
    assert lines[3].startswith("Diagnosis of the steps before it: ")
    validate_schema(json.loads(summary.to_json(doc)))


def test_a_rank_killed_by_a_signal_leads_by_its_signal_and_an_interrupted_run_has_none():
    doc = doc_of(crashed_state(5, -9, None), exit_code=137, failed_rank=5)
    assert doc["failure"]["signal"] == "SIGKILL"
    assert summary.render_text(doc).startswith(
        "FAILED: rank 5 was killed by signal 9 (SIGKILL) after 40 steps\n")
    assert doc_of(crashed_state(), exit_code=130, failed_rank=2)["failure"] is None
    assert doc_of(make_state(), exit_code=0)["failure"] is None


def test_the_rank_that_failed_first_leads_the_others_follow():
    f = summary.failure_of([(0, 1, "RuntimeError: peer closed", 12), (1, 1, None, 12),
                            (2, 1, "x\nValueError: the cause", 12), (3, None, None, 12)], 2)
    assert f is not None
    assert (f.rank, f.error, f.others) == (2, "ValueError: the cause", [0, 1])
    assert f.summary == ("FAILED: rank 2 exited with code 1 after 12 steps: ValueError: "
                            "the cause (then rank(s) 0-1)")


async def test_the_banner_leads_with_the_failed_rank():
    from textual.widgets import Static

    from traceml_tui.view.dashboard import DashboardApp
    from traceml_tui.view.dashboard.banner import Banner

    app = DashboardApp(StaticSource(crashed_state()), refresh_s=3600)
    async with app.run_test(size=(140, 44)) as pilot:
        for _ in range(200):
            if app.state is not None:
                break
            await pilot.pause(0.05)
        banner = app.query_one(Banner)
        assert isinstance(banner, Static)
        shown = str(banner.render()).splitlines()
        assert shown[0].startswith("FAILED: rank 2 exited with code 1 after 40 steps: "
                                   "RuntimeError: injected fault on rank 2"), shown
        assert banner.has_class("-critical")


# --- the end-of-run reply --------------------------------------------------------------


def test_the_end_reply_says_where_the_record_went_or_why_not(tmp_path):
    doc = doc_of(crashed_state(), exit_code=1, failed_rank=2)
    ok = ending.summary_reply(tmp_path, doc, lambda: summary.write_summary(tmp_path, doc))
    assert (ok.exit_code, ok.failed_rank, ok.path) == (1, 2, str(tmp_path /
                                                                "final_summary.json"))
    assert (tmp_path / "final_summary.txt").read_text().startswith("FAILED: rank 2 ")
    assert ending.from_wire(json.loads(json.dumps(ok.to_wire()))) == ok

    def full() -> None:
        raise OSError(28, "No space left on device")

    lost = ending.summary_reply(tmp_path, doc, full, "note\n")
    assert lost.path is None and "No space left" in (lost.error or "")
    assert lost.text.startswith("FAILED: rank 2 ") and lost.text.endswith("note\n")
    assert ending.from_wire({"ok": True}) is None  # not a reply: the launcher falls back


def test_headless_progress_reads_the_live_snapshot_through_the_model(tmp_path, capsys):
    from traceml_tui.launch.job_output import Progress

    live = tmp_path / "live_snapshot.json"
    live.write_text('{"run": "not a run"}')  # half a run's garbage: no line, no traceback
    progress = Progress(tmp_path)
    progress.poll()
    assert capsys.readouterr().err == ""
    summary.write_summary(tmp_path, doc_of(crashed_state(), complete=False))
    (tmp_path / "final_summary.json").replace(live)
    progress.poll()
    line = capsys.readouterr().err
    assert line.startswith("[traceml] FAILED: rank 2 exited with code 1 after 40 steps: "
                           "RuntimeError: injected fault on rank 2 · step "), line


async def test_a_real_collectors_live_banner_leads_with_the_failed_rank(tmp_path):
    """A real collector process, real agent messages on its ingest socket, the real view
    socket and the dashboard: rank 2's goodbye with a traceback leads the banner at once,
    before the run has ended (the label below is the verdict of the steps before it)."""
    from test_fuzz_collector import CollectorProcess

    from traceml_tui.view.client import ViewClient
    from traceml_tui.view.dashboard import DashboardApp
    from traceml_tui.view.dashboard.banner import Banner

    coll = CollectorProcess(tmp_path / "run")
    try:
        sock = coll.dealer()
        now = time.time()
        for ident in hostile.IDENTS:
            sock.send(protocol.encode("hello", ident, 0, now, run="fuzz", device="cpu",
                                      env={}, auto=True))
            records = [[i, now - 1 + i * 0.01, 10.0, *[1.0] * 7] for i in range(40)]
            sock.send(protocol.encode("steps", ident, 1, now, phases=list(PHASES),
                                      records=records, dropped=0))
        sock.send(protocol.encode("goodbye", hostile.IDENTS[2], 2, now, exit_code=1,
                                  error=TRACEBACK, steps=40))
        app = DashboardApp(ViewClient(coll.info["view"]), coll.run_dir, refresh_s=0.1)
        async with app.run_test(size=(140, 44)) as pilot:
            banner = app.query_one(Banner)
            for _ in range(400):  # up to 20 s on a busy machine
                if str(banner.render()).startswith("FAILED"):
                    break
                await pilot.pause(0.05)
            first = str(banner.render()).splitlines()[0]
            assert first == ("FAILED: rank 2 exited with code 1 after 40 steps: RuntimeError: "
                             "injected fault on rank 2"), str(banner.render())
        sock.close()
    finally:
        coll.stop()


@settings(max_examples=60, derandomize=True, deadline=None, database=None)
@given(st.lists(hostile.HOSTILE_PAYLOADS | hostile.valid_messages(), max_size=25))
def test_the_summary_of_any_received_traffic_is_written_and_read_through_the_model(payloads):
    """Whatever the ranks sent, the document the builder makes fits the model: writing
    the record never fails on a field's type, and it reads back the same."""
    state, mono = RunState("props", hostile.WORLD, started_at=hostile.T0), 0.0
    for payload in payloads:
        mono += 0.1
        try:
            state.ingest(protocol.decode(payload), mono)
        except protocol.ProtocolError:
            state.intake.count_malformed()
    state.evaluate(hostile.T0 + mono, mono + 60.0)
    snap = state.snapshot(hostile.T0 + mono, mono + 60.0, full=True)
    doc = summary.build(snap, summary.RunMeta(complete=False))
    written = summary.to_json(doc)
    assert written == msgspec.json.encode(doc).decode() + "\n"
    assert summary.to_json(model.to_doc(model.decode(written))) == written
