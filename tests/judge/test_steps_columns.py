"""Large steps messages checked as columns (collect/steps_columns.py) change nothing but the
collector's cost: the same messages, through the per-message path and through the columns,
leave the same state, summary, view, step log and counters (issue 42, finding 3)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from test_relay_columns import T0, _run

from traceml_agent import protocol
from traceml_agent.protocol import PHASES, Identity
from traceml_tui.collect import steps_columns
from traceml_tui.collect.collector import Collector
from traceml_tui.judge.state import RunState


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    """The relay test's stream of rank messages (restarts, an impostor, duplicates, an
    absurd step, refused records, stalls...), every steps payload through the message path,
    then through the columns (LARGE_BYTES 0: every steps message counts as large)."""
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(steps_columns, "LARGE_BYTES", 1 << 40)
        old = _run(tmp_path_factory.mktemp("messages"), False)
        mp.setattr(steps_columns, "LARGE_BYTES", 0)
        new = _run(tmp_path_factory.mktemp("columns"), False)
    finally:
        mp.undo()
    return old, new


def test_large_steps_leave_the_same_state_summary_view_and_log(both: tuple[dict, dict]) -> None:
    old, new = both
    assert new["counters"] == old["counters"]
    for name in ("duplicate_records", "absurd_steps", "restarts", "not_owner", "bad_records"):
        assert old["counters"][name] > 0, name
    assert new["ranks"] == old["ranks"]
    assert new["stalls"] == old["stalls"]
    assert new["final"] == old["final"] and new["live"] == old["live"]
    assert new["view"] == old["view"]
    assert new["log"] == old["log"]


NAMES = list(PHASES)
GOOD = [10.0, 1.0, None, 2.0, 3.0, 1.0, 1.0][:len(NAMES)]


def _rec(step: Any, *, t: Any = T0, ms: Any = 10.0, vals: list | None = None) -> list:
    return [step, t, ms, *(vals if vals is not None else [v for v in GOOD])]


# Each case: a steps message's records, every kind of record protocol._record refuses
# among good ones (the message path refuses each alone).
CASES = {
    "good": [_rec(s) for s in range(5, 40)],
    "nan value": [_rec(5), _rec(6, vals=[math.nan] + GOOD[1:]), _rec(7)],
    "nan time": [_rec(5), _rec(6, ms=math.nan), _rec(7, t=math.nan), _rec(8)],
    "none times": [_rec(5), _rec(6, ms=None), _rec(7, t=None), _rec(8)],
    "short and long": [_rec(5), _rec(6)[:-1], [*_rec(7), 1.0], [], _rec(8)],
    "float step": [_rec(5), _rec(6.0), _rec(7)],
    "none step": [_rec(5), _rec(None), _rec(7)],
    "huge steps": [_rec(5), _rec(2**63 - 1), _rec(2**64 - 1), _rec(-3), _rec(7)],
    "negative value": [_rec(5), _rec(6, vals=[-1.0] + GOOD[1:]), _rec(7)],
    "too long a step": [_rec(5), _rec(6, ms=1e12), _rec(7)],
    "ints as times": [_rec(5, t=int(T0), ms=10), _rec(6, vals=[1] * len(GOOD))],
    "all bad": [_rec(None), _rec(6)[:2]],
    "none": [],
}


def _ingest(tmp: Path, large: bool, recs: list, monkeypatch: pytest.MonkeyPatch,
            colls: bool = False, other_conn: bool = False) -> dict[str, Any]:
    monkeypatch.setattr(steps_columns, "LARGE_BYTES", 0 if large else 1 << 40)
    state = RunState("cols", 2, started_at=T0)
    coll = Collector(tmp, state)
    try:
        ident = Identity(0, 0, 0, "h", 100, 2)
        body: dict[str, Any] = {"phases": NAMES, "dropped": 3, "forced": [1] * len(NAMES)}
        if colls:
            body["colls"] = [["world", "all_reduce", "backward", 4, 1024, 2.5]]
        first = protocol.encode("steps", ident, 1, T0, records=[_rec(s) for s in range(3)],
                                **body)
        coll._receive([b"conn0", first], 1.0)  # the rank known, with records before
        coll._receive([b"conn1" if other_conn else b"conn0",
                       protocol.encode("steps", ident, 2, T0, records=recs, **body)], 2.0)
        coll.flush_columns()
        rs = state.ranks[0]
        return {"counters": dict(state.counters), "steps": rs.steps, "last": rs.last_step,
                "bad": rs.bad_records, "dropped": rs.dropped, "forced": rs.forced,
                "window": [x for x in state.block.step_no[0].tolist() if x >= 0],
                "colls": repr(state.collectives.__dict__)}
    finally:
        coll.close()


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("colls", [False, True], ids=["plain", "with-colls"])
def test_each_refused_record_costs_itself_as_in_a_message(tmp_path, monkeypatch, case, colls):
    recs = CASES[case]
    old = _ingest(tmp_path / "a", False, recs, monkeypatch, colls)
    new = _ingest(tmp_path / "b", True, recs, monkeypatch, colls)
    assert new == old


def test_another_connections_rank_is_refused_before_its_records_are_made(tmp_path, monkeypatch):
    recs = CASES["good"]
    old = _ingest(tmp_path / "a", False, recs, monkeypatch, other_conn=True)
    new = _ingest(tmp_path / "b", True, recs, monkeypatch, other_conn=True)
    assert new == old and new["counters"]["not_owner"] == 1 and new["steps"] == 3
    from traceml_tui.judge import ingest_columns

    made = []
    real = ingest_columns.message_of

    def spy(row: Any, group: Any, start: int) -> Any:
        made.append(row.seq)
        return real(row, group, start)

    monkeypatch.setattr(ingest_columns, "message_of", spy)
    _ingest(tmp_path / "c", True, recs, monkeypatch, other_conn=True)
    assert made == [1]  # the rank's first message (a new process): not the refused one
