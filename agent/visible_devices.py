"""CUDA_VISIBLE_DEVICES, parsed once, as CUDA reads it (one parser for this fact).

Entries are indices ("0,3"), GPU UUIDs ("GPU-8932f937-..." as Slurm's gres and
Kubernetes set it, or a unique prefix of one) or MIG instances ("MIG-..."). CUDA stops
at the first entry it cannot read. Unset means every device; set but empty means none.
NVML numbers devices physically, so a rank's torch index maps to an NVML handle
through this list: by index, or by UUID (NVML accepts GPU and MIG UUIDs alike).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GPU_PREFIX, MIG_PREFIX = "GPU-", "MIG-"


@dataclass(frozen=True, slots=True)
class VisibleDevice:
    kind: str  # "index", "uuid" (a GPU) or "mig" (a MIG instance)
    value: str  # the physical index as text, or the UUID (possibly a prefix)

    @property
    def is_mig(self) -> bool:
        return self.kind == "mig"


def parse(value: str | None) -> list[VisibleDevice] | None:
    """The visible devices in torch's order; None when the variable is unset (all)."""
    if value is None:
        return None
    out: list[VisibleDevice] = []
    for raw in value.split(","):
        item = raw.strip()
        if item.isdigit():
            out.append(VisibleDevice("index", str(int(item))))
        elif item.startswith(MIG_PREFIX):
            out.append(VisibleDevice("mig", item))
        elif item.startswith(GPU_PREFIX):
            out.append(VisibleDevice("uuid", item))
        else:  # CUDA ignores this entry and every one after it
            break
    return out


def nvml_handle(nvml: Any, cuda_index: int, visible: list[VisibleDevice] | None) -> Any:
    """The NVML handle of torch's device `cuda_index`. Raises if there is none."""
    if visible is None:
        return nvml.nvmlDeviceGetHandleByIndex(cuda_index)
    if not 0 <= cuda_index < len(visible):
        raise LookupError(f"cuda:{cuda_index} is not in CUDA_VISIBLE_DEVICES")
    dev = visible[cuda_index]
    if dev.kind == "index":
        return nvml.nvmlDeviceGetHandleByIndex(int(dev.value))
    try:
        return nvml.nvmlDeviceGetHandleByUUID(dev.value)
    except Exception:
        if dev.kind != "uuid":
            raise
    # A unique prefix of a GPU UUID, as CUDA accepts: find the one device it names.
    matches = []
    for i in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(i)
        uuid = nvml.nvmlDeviceGetUUID(handle)
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
        if uuid.startswith(dev.value):
            matches.append(handle)
    if len(matches) != 1:
        raise LookupError(f"{dev.value} names {len(matches)} devices")
    return matches[0]
