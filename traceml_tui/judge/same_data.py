"""no-distributed-sampler earns its severity from the data, not from the loader object.

A rank's agent sees a DataLoader over a whole dataset with no DistributedSampler and
reports it as a hint (agent/checks.py): that is the classic mistake (every rank trains
on the same data) only if the ranks' datasets are the same. A job whose ranks each read
their own shard (per-rank files, a dataset built from the rank) is right without a
sampler, and a critical finding there is a false alarm where users look first. Each
rank sends digests of what it reads (agent/datadigest.py): its first batches and, where
its dataset holds its data in memory, that data. This module compares them:

| evidence across the reporting ranks            | finding                          |
|------------------------------------------------|----------------------------------|
| the same first batches on two or more ranks    | critical, naming them (proof)    |
| the same in-memory dataset on two or more      | critical, naming them (proof)    |
| different first batches, in-order sampler      | none (each rank reads its own)   |
| different datasets in memory                   | none                             |
| different first batches, shuffled, dataset     | hint: the order differs, whether |
|   not in memory                                |   the data does was not seen     |
| no digest from some rank                       | hint: what was not compared      |

A pure function of the ranks' findings and facts (no I/O, no clocks).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from traceml_agent.datadigest import DIGEST_BATCHES
from traceml_agent.findings import MAX_TEXT, NO_DISTRIBUTED_SAMPLER, Finding
from traceml_agent.vocab import CRITICAL, INFO, format_ranks

# The samplers that read their dataset in order: the same dataset gives the same first
# batches, so different batches prove different data.
IN_ORDER = frozenset({"SequentialSampler"})


def _alike(values: Mapping[int, str | None]) -> list[int]:
    """The ranks whose digest another rank shares (None never matches)."""
    groups: dict[str, list[int]] = {}
    for r, v in values.items():
        if v is not None:
            groups.setdefault(v, []).append(r)
    return sorted(r for rs in groups.values() if len(rs) > 1 for r in rs)


def judge_same_data(f: Finding, facts: Mapping[int, Mapping[str, Any]]) -> Finding | None:
    """The merged no-distributed-sampler finding `f` as the ranks' digests prove it:
    critical with the proof, dropped when they prove each rank reads its own data, else a
    hint saying what was not seen (module docstring's table). `facts`: rank -> its facts
    (findings.facts_from_wire), for any ranks; only those in `f.ranks` are read."""
    if f.id != NO_DISTRIBUTED_SAMPLER or len(f.ranks) < 2:
        return f
    mine = {r: facts.get(r, {}) for r in f.ranks}
    batches = {r: v.get("batch_digest") for r, v in mine.items()}
    datasets = {r: v.get("dataset_digest") for r, v in mine.items()}
    same = _alike(batches)
    if same:
        return _critical(f, same, f"the first {DIGEST_BATCHES} batches are identical on "
                                  f"ranks {format_ranks(same)} (digest {batches[same[0]]})")
    same = _alike(datasets)
    if same:
        return _critical(f, same, f"its data in memory is identical on ranks "
                                  f"{format_ranks(same)} (digest {datasets[same[0]]})")
    missing = sorted(r for r, v in batches.items() if v is None)
    if not missing:
        in_order = all(v.get("sampler") in IN_ORDER for v in mine.values())
        if in_order or all(v is not None for v in datasets.values()):
            return None  # each rank reads data of its own: no mistake to report
        return _hint(f, "the first batches differ (shuffled) and the dataset is not in "
                        "memory: whether ranks read the same data was not seen")
    return _hint(f, f"rank(s) {format_ranks(missing)} sent no digest of their first "
                    f"batches: whether ranks read the same data was not seen")


def _critical(f: Finding, ranks: list[int], proof: str) -> Finding:
    return Finding(f.id, CRITICAL, tuple(ranks), f"{f.evidence}; {proof}"[:MAX_TEXT], f.fix)


def _hint(f: Finding, why: str) -> Finding:
    return Finding(f.id, INFO, f.ranks, f"{f.evidence}; {why}"[:MAX_TEXT], f.fix)
