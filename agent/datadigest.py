"""Digests of what a rank trains on, so the collector can prove ranks read the same data.

A DataLoader with no DistributedSampler is a mistake only when every rank then reads the
same samples; a job whose ranks each open their own shard (per-rank files, a dataset
built from the rank) needs no sampler. The loader object cannot tell the two apart, the
data can: each rank digests

- its first DIGEST_BATCHES batches (`BatchDigest`, fed by the DataLoader hook), and
- the in-memory tensors its dataset object holds (`dataset_digest`: a TensorDataset's,
  or the tensor attributes of a map-style dataset, read without calling user code),

and sends the hex digests with its facts; equal digests across ranks are the proof
(traceml_tui/judge/same_data.py). Only host tensors are read, a strided sample of at most
DIGEST_ELEMENTS elements each, a few times per run: tens of microseconds, no GPU sync.
Nothing here raises: anything odd makes the digest None ("not seen").
"""

from __future__ import annotations

import hashlib
from typing import Any

# Batches digested per rank: one identical batch could be a coincidence of a tiny
# dataset; three in a row are the same data in the same order.
DIGEST_BATCHES = 3
# Elements sampled from each tensor (evenly strided over its first dimension and its
# flattened rows): different data changes nearly every element, so a thousand suffice,
# and the cost stays a small copy per tensor whatever its size.
DIGEST_ELEMENTS = 1024
# Rows of a non-contiguous tensor read (flattening it copies what it reads).
DIGEST_ROWS = 4
# Tensors read per batch or dataset, and how deep a batch's nesting is followed.
MAX_TENSORS = 16
MAX_DEPTH = 4
DIGEST_SIZE = 8  # bytes of blake2b: 16 hex characters on the wire


def _tensors(obj: Any, out: list[Any], depth: int = 0) -> None:
    """The torch tensors of a batch (tensor, tuple/list, dict), in a stable order."""
    import torch

    if len(out) >= MAX_TENSORS or depth > MAX_DEPTH:
        return
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for item in obj[:MAX_TENSORS]:
            _tensors(item, out, depth + 1)
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str)[:MAX_TENSORS]:
            _tensors(obj[key], out, depth + 1)


def _update(h: Any, t: Any) -> bool:
    """Feed a strided sample of one host tensor to the hash; False for a device tensor
    (reading it would synchronize the GPU) or one of an unreadable kind."""
    import torch

    if t.device.type != "cpu" or t.is_sparse or t.is_complex():
        return False
    h.update(f"{tuple(t.shape)}|{t.dtype}|".encode())
    n = t.numel()
    if not n:
        return True
    if t.dim() > 1 and not t.is_contiguous():
        t = t[:DIGEST_ROWS]  # reshape copies: a few rows, never a whole batch
    flat = t.reshape(-1)
    sample = flat[:: max(1, flat.numel() // DIGEST_ELEMENTS)][:DIGEST_ELEMENTS]
    kind = torch.float64 if sample.is_floating_point() else torch.int64
    h.update(sample.detach().to(kind).numpy().tobytes())
    return True


def digest_of(obj: Any) -> str | None:
    """One object's digest (a batch, a tuple of tensors), None without a host tensor."""
    try:
        found: list[Any] = []
        _tensors(obj, found)
        h = hashlib.blake2b(digest_size=DIGEST_SIZE)
        if not found or not all(_update(h, t) for t in found):
            return None
        return h.hexdigest()
    except Exception:
        return None


def dataset_digest(dataset: Any) -> str | None:
    """The digest of the data a map-style dataset holds in memory: a TensorDataset's
    tensors, else the tensor attributes of the object itself (its own fields, no user
    code run), with its length. None when it holds none (it reads files, builds samples
    on the fly): then only the batches can tell."""
    try:
        import torch

        tensors = getattr(dataset, "tensors", None)
        if not (isinstance(tensors, tuple) and tensors
                and all(isinstance(t, torch.Tensor) for t in tensors)):
            fields = vars(dataset)
            tensors = tuple(fields[k] for k in sorted(fields)
                            if isinstance(fields[k], torch.Tensor))
        if not tensors:
            return None
        return digest_of(tensors)
    except Exception:
        return None


class BatchDigest:
    """The running digest of a rank's first DIGEST_BATCHES batches. `left` counts the
    batches still to read (the hook tests it inline: one attribute read per batch once
    done); `value` is the hex digest once they were all read, None before or when one
    held no host tensor."""

    __slots__ = ("left", "value", "_h")

    def __init__(self) -> None:
        self.left = DIGEST_BATCHES
        self.value: str | None = None
        self._h: Any = hashlib.blake2b(digest_size=DIGEST_SIZE)

    def add(self, batch: Any) -> None:
        if self.left <= 0:
            return
        try:
            found: list[Any] = []
            _tensors(batch, found)
            if not found or not all(_update(self._h, t) for t in found):
                self.left = 0  # unreadable: no digest ("not seen")
                return
            self.left -= 1
            if self.left == 0:
                self.value = self._h.hexdigest()
        except Exception:
            self.left = 0
