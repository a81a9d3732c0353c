"""Two `traceml run` nodes of 2 ranks: node 1's heartbeats and sys samples reach node 0 in
its relay's typed lists (protocol.RelayBatch.beats, .samples), and the summary shows for
node 1's ranks what their heartbeats and samples say, as for node 0's direct ranks."""

from __future__ import annotations

import json

import pytest
from test_e2e_multinode import finish, node_args

from jobs import free_ports, spawn_traceml, validate_schema

pytestmark = pytest.mark.e2e


def test_relayed_heartbeats_and_samples_reach_the_summary(tmp_path):
    out, port = tmp_path / "runs", free_ports(3)
    args = ("--scenario", "input", "--delay-ms", "20", "--steps", "120")
    node1 = spawn_traceml(*node_args(out, "typed", 1, port, script_args=args))
    node0 = spawn_traceml(*node_args(out, "typed", 0, port, script_args=args))
    rc0, _, err0 = finish(node0)
    rc1, _, err1 = finish(node1)
    assert (rc0, rc1) == (0, 0), err0[-3000:] + err1[-3000:]
    doc = json.loads((out / "typed" / "final_summary.json").read_text())
    validate_schema(doc)
    assert doc["relays"]["nodes"] == [1] and doc["relays"]["dropped"] == 0
    assert doc["collector"]["malformed"] == 0
    rows = {r["rank"]: r for r in doc["ranks"]}
    for rank in (2, 3):  # node 1's, through its relay
        row = rows[rank]
        assert row["steps"] == 120
        assert row["sys"]["rss_mb"] is not None and row["sys"]["rss_mb"] > 0  # a sample
        assert row["progress"]["collectives"] > 0  # a heartbeat
    # The same figures, by the same rules, as node 0's direct ranks have.
    assert {k for k, v in rows[2]["sys"].items() if v is not None} == {
        k for k, v in rows[0]["sys"].items() if v is not None}
