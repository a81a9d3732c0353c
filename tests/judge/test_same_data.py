"""no-distributed-sampler earns its severity from the ranks' data digests
(traceml_tui/judge/same_data.py, agent/datadigest.py): critical only with the proof that
ranks read the same data, none when the digests prove each reads its own, else a hint
that says what was not seen."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from traceml_agent.checks import StepObserver
from traceml_agent.datadigest import DIGEST_BATCHES, BatchDigest, dataset_digest, digest_of
from traceml_agent.findings import NO_DISTRIBUTED_SAMPLER, finding
from traceml_tui.judge.same_data import judge_same_data
from traceml_tui.judge.setup_checks import ChecksBoard

HINT = finding(NO_DISTRIBUTED_SAMPLER, (0, 1, 2),
               "RandomSampler over all 320 samples on each of 3 ranks, no DistributedSampler",
               severity="info")
A, B, C = "a" * 16, "b" * 16, "c" * 16


def facts(batch=None, dataset=None, sampler="RandomSampler"):
    return {"batch_digest": batch, "dataset_digest": dataset, "sampler": sampler}


# (what, per-rank facts, expected severity or None, ranks, words in the evidence)
CASES = [
    ("the same first batches on every rank: critical, with the proof",
     [facts(A), facts(A), facts(A)], "critical", (0, 1, 2),
     "the first 3 batches are identical on ranks 0-2 (digest aaaaaaaaaaaaaaaa)"),
    ("two ranks alike, one not: the two are named",
     [facts(A), facts(B), facts(A)], "critical", (0, 2), "identical on ranks 0,2"),
    ("the same dataset in memory, shuffled differently: critical (the data is the same)",
     [facts(A, C), facts(B, C), facts(C, C)], "critical", (0, 1, 2),
     "its data in memory is identical on ranks 0-2"),
    ("per-rank shards read in order: the batches differ, no finding",
     [facts(A, sampler="SequentialSampler"), facts(B, sampler="SequentialSampler"),
      facts(C, sampler="SequentialSampler")], None, None, ""),
    ("per-rank shards in memory, shuffled: the datasets differ, no finding",
     [facts(A, A), facts(B, B), facts(C, C)], None, None, ""),
    ("shuffled, not in memory, batches differ: a hint (order or data, not seen)",
     [facts(A), facts(B), facts(C)], "info", (0, 1, 2),
     "whether ranks read the same data was not seen"),
    ("a rank sent no digest: a hint naming it",
     [facts(A), facts(B), facts(None)], "info", (0, 1, 2), "rank(s) 2 sent no digest"),
    ("an older agent (no facts at all): a hint",
     [{}, {}, {}], "info", (0, 1, 2), "rank(s) 0-2 sent no digest"),
]


@pytest.mark.parametrize("what, per_rank, severity, ranks, words", CASES,
                         ids=[c[0] for c in CASES])
def test_the_finding_earns_its_severity(what, per_rank, severity, ranks, words):
    got = judge_same_data(HINT, dict(enumerate(per_rank)))
    if severity is None:
        assert got is None
        return
    assert got is not None
    assert (got.severity, got.ranks) == (severity, ranks), got
    assert got.evidence.startswith(HINT.evidence) and words in got.evidence, got.evidence
    assert len(got.evidence) <= 200


def test_other_findings_pass_through():
    other = finding("uneven-shards", (0,), "x")
    assert judge_same_data(other, {}) is other


def test_the_board_merges_ranks_then_judges_their_digests():
    board = ChecksBoard(world_size=2)
    for rank in (0, 1):
        board.add(rank, "h", (finding(NO_DISTRIBUTED_SAMPLER, (rank,), HINT.evidence,
                                      severity="info"),),
                  {"param_checksum": 1.0, "device": None, **facts()})
    [f] = board.merged()
    assert f.severity == "info" and "sent no digest" in f.evidence
    for rank in (0, 1):  # the digest arrives later, with the facts sent again
        board.add(rank, "h", (), {"param_checksum": 1.0, "device": None, **facts(A)})
    [f] = board.merged()
    assert (f.severity, f.ranks) == ("critical", (0, 1)) and "identical on ranks 0-1" in f.evidence


# --- the agent's digests ----------------------------------------------------------------------


def test_digests_tell_data_apart_and_equal_data_alike():
    x = torch.arange(4096, dtype=torch.float32).reshape(64, 64)
    assert digest_of((x, x[:, 0])) == digest_of((x.clone(), x[:, 0].clone()))
    assert digest_of((x, x[:, 0])) != digest_of((x + 1, x[:, 0]))
    assert digest_of({"a": x.t()}) is not None  # not contiguous
    assert digest_of("text") is None and digest_of([]) is None
    assert dataset_digest(TensorDataset(x)) == dataset_digest(TensorDataset(x.clone()))
    assert dataset_digest(TensorDataset(x)) != dataset_digest(TensorDataset(x * 2))

    class Files(Dataset):  # reads its samples on the fly: nothing in memory to digest
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return torch.zeros(2)

    assert dataset_digest(Files()) is None


def test_the_batch_digest_reads_the_first_batches_only():
    d = BatchDigest()
    for i in range(DIGEST_BATCHES):
        assert d.value is None
        d.add((torch.full((4, 2), float(i)), torch.tensor([i])))
    assert d.left == 0 and d.value is not None
    first = d.value
    d.add(torch.ones(3))
    assert d.value == first


def test_the_observer_sends_its_facts_again_once_the_digest_is_complete():
    """Facts go at the first optimizer step; the batches' digest needs DIGEST_BATCHES."""
    obs = StepObserver(0, 2)
    model = torch.nn.Linear(2, 2)
    loader = DataLoader(TensorDataset(torch.randn(32, 2)), batch_size=4, shuffle=True)
    it = iter(loader)
    obs.watch_model(model)
    sent = []
    for _ in range(DIGEST_BATCHES + 1):
        batch = next(it)
        obs.on_loader_batch(it, batch)
        obs.on_optimizer_step()
        sent.append(obs.take_facts())
    assert sent[0]["batch_digest"] is None and sent[0]["sampler"] == "RandomSampler"
    assert sent[0]["dataset_digest"] == dataset_digest(loader.dataset)
    assert sent[1] is None
    assert sent[DIGEST_BATCHES - 1]["batch_digest"] == obs.digest.value is not None
    assert sent[DIGEST_BATCHES] is None
    assert [f.id for f in obs.drain()] == [NO_DISTRIBUTED_SAMPLER]
