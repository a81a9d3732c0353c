"""Collectives accounted (issue 32, item 3): which collective, on which process group,
issued from which phase, took the sync time. The agent's per-step tables (real hooks on a
real one-rank gloo group), the sender's batch rows with DDP's all-reduce, the wire's
bounds, and the collector's bounded aggregation into the summary and COMM-BOUND."""

from __future__ import annotations

from collections import deque
from dataclasses import replace

import msgspec
import pytest
import torch
import torch.distributed as dist
from agent_installed import installed
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from traceml_agent import collective_names
from traceml_agent.protocol import PHASES, CollRow, Identity, ProtocolError, decode, encode
from traceml_agent.recorder import MAX_COLL_KEYS, MEASURED, SYNC, Recorder
from traceml_agent.transport import Sender
from traceml_tui.judge import collectives as coll
from traceml_tui.judge import diagnosis as dx
from traceml_tui.judge.state import RunState
from traceml_tui.report import summary
from traceml_tui.runfolder import summary_model as model

T0 = 1_700_000_000.0


@pytest.fixture
def group(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_step_keeps_each_group_and_op_with_its_bytes_and_phase(group):
    """A DDP step with an all-gather on a second group between backward and the optimizer,
    and an all-reduce of the loss inside forward: one table for the step, one key per
    (group, op, phase), with the calls' input bytes and exposed time; DDP's own reducer
    passes no wrapper."""
    metrics = dist.new_group([0])

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            y = self.lin(x)
            dist.all_reduce(torch.zeros(4))  # 16 bytes, world, in forward
            return y

    model = DDP(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with installed() as (rec, errors, out):
        for _ in range(3):
            model(torch.randn(4, 8)).sum().backward()
            gathered = [torch.empty(256)]
            dist.all_gather(gathered, torch.ones(256), group=metrics)  # 1 kB, outside phases
            dist.all_gather(gathered, torch.ones(256), group=metrics)
            opt.step()
            opt.zero_grad()
    assert errors == []
    tables = list(rec.coll_out)
    assert len(tables) == 3 and len(out) == 3
    last = tables[-1]
    forward = MEASURED.index("forward")
    assert last[("world", "all_reduce", forward)][:2] == [1, 16]
    count, nbytes, ns = last[("r0", "all_gather", -1)]
    assert (count, nbytes) == (2, 2048) and ns > 0
    # The step's sync holds the explicit calls' exposed time (and DDP's wait besides).
    assert out[-1][3][SYNC] >= ns


def test_a_step_keeps_at_most_k_keys_and_the_rest_as_other():
    rec = Recorder(deque())
    for i in range(MAX_COLL_KEYS + 5):
        rec.account(f"r{i}", "all_reduce", -1, 1000, 8)
    rec.account("r0", "all_gather_object", -1, 10, -1)  # a new key past the bound
    assert len(rec.coll) == MAX_COLL_KEYS + 1
    other = rec.coll[("other", "other", -1)]
    assert other == [6, -1, 5010]  # bytes unknown once any call's are
    rec.close_step()
    assert rec.coll == {} and len(rec.coll_out) == 1


def test_group_names_are_the_rank_lists_the_same_on_every_rank():
    name = collective_names.ranks_name
    assert name([3, 1, 0, 2, 8]) == name([8, 2, 0, 1, 3]) == "r0-3,8"
    long = name(range(0, 512, 2))
    assert long == name(list(range(510, -1, -2)))
    assert long.startswith("256r#") and len(long) <= 64


def test_the_sender_merges_a_batch_and_puts_backwards_unexplained_sync_down_to_ddp():
    out: deque = deque()
    rec = Recorder(out)
    rec.parallel, rec.grad_bytes = "ddp", 4096
    sender = Sender("tcp://127.0.0.1:1", Identity(0, 0, 0, "h", 1, 2), rec, out, {})
    for _ in range(4):  # each step: 10 ms of sync, 3 of them an explicit all-gather
        rec.account("r0,1", "all_gather", -1, 3_000_000, 1024)
        rec.acc[SYNC] = 10_000_000
        rec.close_step()
    rows = sender._wire_records(out, len(rec.names))
    wire = sender._colls(rows)
    assert wire[0] == ["r0,1", "all_gather", "none", 4, 4096, 12.0]
    group, op, phase, count, nbytes, ms = wire[1]
    assert (group, op, phase, count, nbytes) == ("world", "all_reduce", "backward", 4, 16384)
    assert ms == pytest.approx(28.0)
    assert rec.coll_out == deque() and sender._colls([]) == []


def _steps_msg(rank: int, colls: list, world: int = 2, first: int = 0, n: int = 10):
    phase_ms = [1.0, 0.0, 10.0, 20.0, 60.0, 5.0, 4.0]
    records = [[s, T0 + s, sum(phase_ms), *phase_ms] for s in range(first, first + n)]
    return encode("steps", Identity(rank, rank, 0, f"h{rank}", 100 + rank, world), 1, T0,
                  phases=list(PHASES), records=records, colls=colls)


def test_the_wire_bounds_and_cleans_the_rows():
    ok = decode(_steps_msg(0, [["r0\x1b[31m", "all_gather", "none", 2, None, 1.5]]))
    row = ok.body.colls[0]
    assert row.group.isprintable() and row.nbytes is None
    for bad in ([["w", "all_reduce", "backward", 1, 8, -1.0]],  # negative time
                [["w", "all_reduce", "backward", -1, 8, 1.0]],  # negative count
                [["w" * 65, "all_reduce", "backward", 1, 8, 1.0]],  # overlong group
                [["w", "all_reduce", "backward", 1, 8, 1.0]] * 19):  # too many rows
        with pytest.raises(ProtocolError):
            decode(_steps_msg(0, bad))


def test_the_book_is_bounded_and_figures_per_step_and_share():
    book = coll.CollectiveBook()
    rows = [msgspec.convert([f"r{i}", "all_reduce", "backward", 1, 8, 1.0], CollRow)
            for i in range(coll.MAX_GROUPS + 4)]
    rows.insert(0, msgspec.convert(["world", "made_up", "sideways", 1, None, 1.0], CollRow))
    for rank in range(2):
        book.add(rank, rows)
    stats = book.stats(mean_steps=10.0)
    assert len({s.group for s in stats}) == coll.MAX_GROUPS + 1  # the rest: "other"
    assert len(stats) <= coll.MAX_KEYS
    other = next(s for s in stats if s.group == "other")
    assert other.count == 10 and other.ranks == 2  # 5 groups past the bound, 2 ranks
    odd = next(s for s in stats if s.group == "world")
    assert (odd.op, odd.phase, odd.nbytes) == ("other", "other", None)
    assert sum(s.share_of_sync for s in stats) == pytest.approx(1.0)
    assert other.exposed_ms_per_step == pytest.approx(10.0 / 20)  # of the 2 ranks' 10 steps


def test_collector_summary_and_comm_bound_name_the_dominant_collective():
    """Two ranks, each step 60 ms of sync: the all-gather on the second group holds 45 of
    them, DDP's all-reduce 15. The summary lists both (per step, share), the text summary
    prints both, and COMM-BOUND's evidence names the all-gather and its group."""
    state = RunState("run", world_size=2)
    for rank in (0, 1):
        for batch in range(4):
            colls = [["r0-1", "all_gather", "none", 10, 10240, 450.0],
                     ["world", "all_reduce", "backward", 10, 40960, 150.0]]
            assert state.ingest(decode(_steps_msg(rank, colls, first=batch * 10)), now=5.0)
    state.evaluate(T0 + 50)
    snap = state.snapshot(T0 + 50, mono_now=6.0, full=True)
    gather, reduce = snap.collectives[:2]
    assert (gather.group, gather.op, gather.phase) == ("r0-1", "all_gather", "none")
    assert gather.exposed_ms_per_step == pytest.approx(45.0)
    assert gather.share_of_sync == pytest.approx(0.75)
    assert (reduce.group, reduce.op, reduce.phase) == ("world", "all_reduce", "backward")
    assert reduce.bytes_per_step == pytest.approx(4096)
    assert snap.final is not None and snap.final.label == dx.COMM_BOUND
    assert "all_gather on group r0-1" in snap.final.summary
    assert "all_gather on group r0-1" in snap.live.summary
    doc = model.to_doc(summary.build(snap, summary.RunMeta(command=["x"], exit_code=0)))
    assert [(c["group"], c["op"]) for c in doc["collectives"]] == [
        ("r0-1", "all_gather"), ("world", "all_reduce")]
    text = summary.render_text(doc)
    assert "all_gather on group r0-1 (outside phases)" in text
    assert "all_reduce on group world (in backward)" in text


def test_other_verdicts_and_spread_sync_name_no_collective():
    d = dx.Diagnosis(dx.COMM_BOUND, None, "sync", "warning", "text.")
    spread = tuple(coll.CollectiveStat(f"r{i}", "all_reduce", "none", 1, 1, 1, 1.0, 1.0,
                                       1.0, 1.0, 0.25) for i in range(4))
    assert coll.with_evidence(d, spread) is d  # no key holds half the sync
    balanced = dx.Diagnosis(dx.BALANCED, None, None, "info", "ok.")
    one = (replace(spread[0], share_of_sync=1.0),)
    assert coll.with_evidence(balanced, one) is balanced
    assert "all_reduce on group r0" in coll.with_evidence(d, one).summary
