"""The run's record (Collector.write_record): every part judged at the moment it is
written, whatever a live read left for later."""

from __future__ import annotations

import json
from pathlib import Path

from traceml_agent.protocol import Identity, decode, encode
from traceml_agent.requests import Finish
from traceml_tui.collect.collector import Collector
from traceml_tui.judge import memory as mem
from traceml_tui.judge.state import RunState
from traceml_tui.runfolder.layout import RunFolder

T0 = 1_700_000_000.0


def test_the_record_names_a_leak_a_live_read_had_not_judged_yet(tmp_path: Path, monkeypatch):
    """With reads bounded to one rank each, the leaking rank 1 waits behind rank 0; the
    final summary still names it, with its rate (before: only rank 0's trend)."""
    monkeypatch.setattr(mem, "TRENDS_PER_READ", 1)
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    coll = Collector(run_dir, RunState("run", world_size=2, started_at=T0))
    try:
        for i in range(60):
            for rank in (0, 1):
                ident = Identity(rank, rank, 0, f"host{rank}", 1000 + rank, 2)
                coll.state.ingest(decode(encode("sys", ident, 1, T0 + i,
                                                rss_mb=300.0 + 10.0 * i * rank,
                                                mem_avail_mb=6000.0)), now=float(i))
        coll.write_record(Finish(torchrun_exit=0, ended_at=T0 + 61, grace_s=0.0))
    finally:
        coll.close()
    doc = json.loads(RunFolder(run_dir).summary_json.read_text())
    assert doc["memory"]["growing"] == [1]
    assert {r["rank"] for r in doc["memory"]["ranks"]} == {0, 1}
