"""Which CUDA device a rank trains on, learned from what the script itself uses.

The rules (docs/agent-api.md, "CUDA"):
  * No CUDA call before the script's own. `torch.cuda.is_available()` initialises the
    driver, which freezes CUDA_VISIBLE_DEVICES: a script that sets it per rank would
    silently land every rank on the same GPU. Until `torch.cuda.is_initialized()` (a
    flag, no CUDA call) the agent times on the host clock.
  * The device is the one the model's parameters are on, not the current device: many
    scripts do `model.to(f"cuda:{local_rank}")` without `torch.cuda.set_device`, which
    leaves the current device at 0 on every rank. Recording there would time GPU 0's
    work on every rank and open a CUDA context on GPU 0 in each of them.
  * A rank whose parameters span several GPUs (pipeline stages) is timed on the device
    of the first parameter the hooks see; the other devices' work shows only where it
    delays that one.
"""

from __future__ import annotations

from typing import Any

# Objects the hooks saw that may hold the training device (root modules, the stepping
# optimizer); a few are enough, the first CUDA one wins.
MAX_SOURCES = 8


def cuda_built(torch: Any) -> bool:
    """Whether this torch can use CUDA at all, answered without any CUDA call."""
    backends = getattr(torch, "backends", None)
    cuda = getattr(backends, "cuda", None)
    try:
        return bool(cuda is not None and cuda.is_built())
    except Exception:
        return False


def cuda_in_use(torch: Any) -> bool:
    """Whether the script has initialised CUDA in this process (a flag, no CUDA call)."""
    try:
        return bool(torch.cuda.is_initialized())
    except Exception:
        return False


def index_of(obj: Any) -> int | None:
    """The CUDA index of a tensor, or of the first parameter of a module or optimizer;
    None when it is not on a CUDA device. Reads attributes only: no CUDA call."""
    try:
        tensor = obj
        groups = getattr(obj, "param_groups", None)
        if groups is not None:  # an optimizer
            tensor = next((p for g in groups for p in g.get("params", ())), None)
        elif hasattr(obj, "parameters") and not hasattr(obj, "device"):  # a module
            tensor = next(obj.parameters(), None)
        dev = getattr(tensor, "device", None)
        if dev is None or getattr(dev, "type", None) != "cuda":
            return None
        return dev.index
    except Exception:
        return None


def learn(torch: Any, sources: list[Any]) -> int | None:
    """The rank's device once the script uses CUDA: the first source on a CUDA device,
    else the current device (set by the script with set_device, or 0). None before
    the script's first CUDA use."""
    if not cuda_in_use(torch):
        return None
    for source in sources:
        index = index_of(source)
        if index is not None:
            return index
    if sources:  # the model is known and on the host: keep timing on the host
        return None
    try:
        return int(torch.cuda.current_device())
    except Exception:
        return None
