"""The setup checks' words: each check's id, default severity and fix, a finding as it
crosses the wire, and the facts a rank sends for the collector's cross-rank comparisons.

The agent's detectors (checks.py, inside every rank) make findings; the wire's decoder
(protocol.py) validates them on receipt, and the collector's judge (judge/setup_checks.py)
merges them. They share these words and nothing else: decoding a checks message imports
no detector, and this module imports no torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .sanitize import clean_line, clean_text
from .vocab import CRITICAL, INFO, SEVERITIES, WARNING

# --- finding ids (stable: the collector, the dashboard and docs/checks.md key on them) --

DATA_PARALLEL = "data-parallel"
NO_DISTRIBUTED_SAMPLER = "no-distributed-sampler"
SAMPLER_SHARD_MISMATCH = "sampler-shard-mismatch"
SET_EPOCH_NOT_CALLED = "set-epoch-not-called"
BATCHNORM_NOT_SYNCED = "batchnorm-not-synced"
FIND_UNUSED_UNNEEDED = "find-unused-parameters-unneeded"
ACCUMULATION_WITHOUT_NO_SYNC = "accumulation-without-no-sync"
SAME_DEVICE = "same-device"
PARAMS_DIFFER = "params-differ-across-ranks"
UNEVEN_SHARDS = "uneven-shards"
PARTIAL_FINAL_BATCH = "partial-final-batch"

# Longest evidence or fix text sent over the wire (one line on the dashboard).
MAX_TEXT = 200
MAX_ID = 64
MAX_FINDING_RANKS = 1024  # ranks one finding may name (an agent names its own)


@dataclass(frozen=True, slots=True)
class Finding:
    """One setup mistake seen on some ranks, with the numbers that show it."""

    id: str
    severity: str  # one of SEVERITIES
    ranks: tuple[int, ...]
    evidence: str  # one line: what was seen, with its numbers
    fix: str  # one line: what to change

    def to_wire(self) -> dict[str, Any]:
        """Plain dict for msgpack: strings cut to MAX_TEXT, ranks as a list."""
        return {
            "id": self.id[:MAX_ID],
            "severity": self.severity,
            "ranks": list(self.ranks),
            "evidence": self.evidence[:MAX_TEXT],
            "fix": self.fix[:MAX_TEXT],
        }

    @classmethod
    def from_wire(cls, raw: Any) -> Finding:
        """Validate a finding received from an agent. Raises ValueError on anything odd."""
        if not isinstance(raw, dict) or set(raw) != {"id", "severity", "ranks", "evidence",
                                                      "fix"}:
            raise ValueError("a finding is a map of id, severity, ranks, evidence, fix")
        ranks = raw["ranks"]
        if (not isinstance(ranks, list) or len(ranks) > MAX_FINDING_RANKS
                or not all(type(r) is int and 0 <= r < 1 << 31 for r in ranks)):
            raise ValueError(f"finding ranks must be a list of at most {MAX_FINDING_RANKS} "
                             f"non-negative ints")
        if raw["severity"] not in SEVERITIES:
            raise ValueError(f"unknown severity {raw['severity']!r:.20}")
        for name, limit in (("id", MAX_ID), ("evidence", MAX_TEXT), ("fix", MAX_TEXT)):
            if not isinstance(raw[name], str) or len(raw[name]) > limit:
                raise ValueError(f"finding {name} must be a string of at most {limit} chars")
        if raw["id"] not in CHECKS:  # only the checks this version knows: a bounded set
            raise ValueError(f"unknown check {raw['id']!r:.40}")
        return cls(raw["id"], raw["severity"], tuple(ranks), clean_text(raw["evidence"]),
                   clean_text(raw["fix"]))


# Default severity and fix of each check; a few checks raise or lower the severity
# from what they saw (DataParallel in one process, a tiny padding).
CHECKS: dict[str, tuple[str, str]] = {
    DATA_PARALLEL: (
        CRITICAL,
        "Launch one process per GPU with torchrun and wrap the model in "
        "DistributedDataParallel, not nn.DataParallel.",
    ),
    NO_DISTRIBUTED_SAMPLER: (
        CRITICAL,
        "Pass sampler=DistributedSampler(dataset) to the DataLoader (and shuffle in the "
        "sampler, not with shuffle=True).",
    ),
    SAMPLER_SHARD_MISMATCH: (
        CRITICAL,
        "Build DistributedSampler without num_replicas/rank (it reads the process group), "
        "or pass dist.get_world_size() and dist.get_rank().",
    ),
    SET_EPOCH_NOT_CALLED: (
        WARNING,
        "Call loader.sampler.set_epoch(epoch) at the start of every epoch, before "
        "iterating the loader.",
    ),
    BATCHNORM_NOT_SYNCED: (
        WARNING,
        "Use nn.SyncBatchNorm.convert_sync_batchnorm(model) before DDP (GPU backends), or "
        "a larger per-rank batch, or GroupNorm/LayerNorm.",
    ),
    FIND_UNUSED_UNNEEDED: (
        WARNING,
        "Construct DDP with find_unused_parameters=False (the default), or static_graph=True "
        "if the graph never changes.",
    ),
    ACCUMULATION_WITHOUT_NO_SYNC: (
        WARNING,
        "Run forward and backward of every micro-batch but the last inside "
        "`with model.no_sync():`.",
    ),
    SAME_DEVICE: (
        CRITICAL,
        "Pick each rank's GPU from LOCAL_RANK: torch.cuda.set_device(local_rank), "
        "model.to(local_rank), DDP(model, device_ids=[local_rank]).",
    ),
    PARAMS_DIFFER: (
        CRITICAL,
        "Give every rank the same weights before training: load checkpoints on every rank, "
        "or before wrapping in DDP (which broadcasts rank 0's).",
    ),
    UNEVEN_SHARDS: (
        INFO,
        "Use DistributedSampler(drop_last=True) or a dataset size divisible by the world "
        "size; count padded duplicates out of evaluation metrics.",
    ),
    PARTIAL_FINAL_BATCH: (
        INFO,
        "Pass drop_last=True to the DataLoader, or a batch size that divides each rank's "
        "share of the dataset.",
    ),
}


def finding(check: str, ranks: Iterable[int], evidence: str,
            severity: str | None = None) -> Finding:
    """A Finding with the check's default severity and fix."""
    default, fix = CHECKS[check]
    return Finding(check, severity or default, tuple(ranks), evidence[:MAX_TEXT], fix)


_DATA_FACTS = ("batch_digest", "dataset_digest", "sampler")
MAX_DIGEST = 64


def facts_from_wire(raw: Any) -> dict[str, Any]:
    """Validate the facts an agent sent (see StepObserver.take_facts). Raises ValueError."""
    if not isinstance(raw, dict) or not (
            {"param_checksum", "device"} <= set(raw)
            <= {"param_checksum", "device", "batch_size", *_DATA_FACTS}):
        raise ValueError("facts are a map of param_checksum, device, batch_size, "
                         "batch_digest, dataset_digest and sampler")
    data = {k: raw.get(k) for k in _DATA_FACTS}
    for name, value in data.items():
        if value is not None and (not isinstance(value, str) or len(value) > MAX_DIGEST):
            raise ValueError(f"{name} must be a string of at most {MAX_DIGEST} chars or null")
    data = {k: None if v is None else clean_line(v) for k, v in data.items()}
    checksum, device = raw["param_checksum"], raw["device"]
    batch = raw.get("batch_size")
    if batch is not None and (type(batch) is not int or not 1 <= batch <= 1 << 24):
        raise ValueError("batch_size must be a positive integer or null")
    if checksum is not None and type(checksum) not in (int, float):
        raise ValueError("param_checksum must be a number or null")
    if device is not None and (not isinstance(device, str) or len(device) > 128):
        raise ValueError("device must be a string of at most 128 chars or null")
    if device is not None:
        device = clean_line(device)
    return {"param_checksum": None if checksum is None else float(checksum), "device": device,
            "batch_size": batch, **data}
