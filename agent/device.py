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
  * Parameters offloaded to the host while CUDA is in use: the device of the first CUDA
    tensor the hooks see, else the current device, and the rule says so (`learn`).
"""

from __future__ import annotations

import weakref
from typing import Any

# Objects the hooks saw that may hold the training device (root modules, the stepping
# optimizer), by weak reference; a few are enough, the first CUDA one wins.
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


# Which rule chose the device (sent in hello and the summary: the user sees why).
RULE_PARAMETERS = "parameters"
RULE_OFFLOAD_TENSOR = "first CUDA tensor (parameters on CPU: offload)"
RULE_OFFLOAD_CURRENT = "current device (parameters on CPU: offload)"
RULE_NO_MODEL = "current device (no model seen)"


def live(sources: list[Any]) -> list[Any]:
    """The sources still alive: the hooks hold them by weak reference (a model the script
    dropped must be freed), a test may hand the objects themselves."""
    out = []
    for source in sources:
        obj = source() if isinstance(source, weakref.ref) else source
        if obj is not None:
            out.append(obj)
    return out


def learn(torch: Any, sources: list[Any], tensor_index: int | None = None,
          settled: bool = True) -> tuple[int, str] | None:
    """The rank's device once the script uses CUDA, and the rule that chose it:

      1. the first source whose parameters are on a CUDA device;
      2. parameters all on the host while CUDA is in use (FSDP CPUOffload, FSDP2's
         CPUOffloadPolicy, ZeRO-Infinity keep them there), once the learning steps are
         over (`settled`): the device of the first CUDA tensor the hooks saw (the batch
         moved there), else the current device;
      3. no model seen (the explicit API): the current device (set_device, or 0).

    None before the script's first CUDA use (and, for 2, before `settled`)."""
    if not cuda_in_use(torch):
        return None
    sources = live(sources)
    for source in sources:
        index = index_of(source)
        if index is not None:
            return index, RULE_PARAMETERS
    if sources:
        if not settled:
            return None
        if tensor_index is not None:
            return tensor_index, RULE_OFFLOAD_TENSOR
        rule = RULE_OFFLOAD_CURRENT
    else:
        rule = RULE_NO_MODEL
    try:
        return int(torch.cuda.current_device()), rule
    except Exception:
        return None
