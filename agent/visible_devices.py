"""Which physical GPU a rank's torch device is, for NVML (one parser for each fact).

CUDA_VISIBLE_DEVICES entries are indices ("0,3"), GPU UUIDs ("GPU-8932f937-..." as
Slurm's gres and Kubernetes set it, or a unique prefix of one) or MIG instances
("MIG-..."). CUDA stops at the first entry it cannot read. Unset means every device;
set but empty means none.

The surest key is the UUID torch reports for the device (`torch_uuid`, read on the
training thread): NVML finds a device by UUID whatever the numbering. Indices are a
weaker key: CUDA numbers devices fastest-first unless CUDA_DEVICE_ORDER=PCI_BUS_ID,
NVML always in PCI order, so on a node with mixed GPU models an index (torch's, or one
in CUDA_VISIBLE_DEVICES, which CUDA reads in its own order) names a different NVML
device. A MIG instance is found with its GPU: memory belongs to the instance, while
clocks, power and temperature belong to the GPU under it.

Lookup by UUID is one NVML call and comes first (issue 40). The per-index walks (MIG on
drivers whose lookup by UUID does not know MIG UUIDs, a UUID prefix, the index fallback)
guard every per-index call: on a node where Slurm's ConstrainDevices denies this job the
other GPUs, nvmlDeviceGetCount counts them all and nvmlDeviceGetHandleByIndex raises
NO_PERMISSION on the denied ones; they are skipped, never the end of the lookup. CUDA does
not see a denied GPU, so its indices then differ from NVML's: the index fallback refuses.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

GPU_PREFIX, MIG_PREFIX = "GPU-", "MIG-"
PCI_ORDER = "PCI_BUS_ID"  # the CUDA_DEVICE_ORDER value that makes CUDA number like NVML
MAX_UUID = 64  # a UUID is 36 characters; old MIG forms ("MIG-GPU-<uuid>/1/0") are longer
_UUID_CHARS = frozenset("0123456789abcdefABCDEF-")


@dataclass(frozen=True, slots=True)
class VisibleDevice:
    kind: str  # "index", "uuid" (a GPU) or "mig" (a MIG instance)
    value: str  # the physical index as text, or the UUID (possibly a prefix)

    @property
    def is_mig(self) -> bool:
        return self.kind == "mig"


@dataclass(frozen=True, slots=True)
class NvmlTarget:
    """The NVML handles of a rank's device: `gpu` is the physical GPU (clocks, power,
    temperature, throttling); `mig` the MIG instance when the device is one (its memory).
    `memory_ok` is False when the device sits on a MIG-enabled GPU but its instance could
    not be found: the GPU's memory figure would then be every instance's."""

    gpu: Any
    mig: Any = None
    how: str = ""
    memory_ok: bool = True


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


def from_env() -> list[VisibleDevice] | None:
    return parse(os.environ.get("CUDA_VISIBLE_DEVICES"))


def order_from_env() -> str | None:
    """CUDA_DEVICE_ORDER: "PCI_BUS_ID", or unset / "FASTEST_FIRST" (CUDA's default)."""
    value = os.environ.get("CUDA_DEVICE_ORDER")
    return value.strip() if value else None


def physical_name(cuda_index: int, visible: list[VisibleDevice] | None) -> str:
    """torch's cuda:N named by what CUDA_VISIBLE_DEVICES calls it ("cuda:3", or the UUID),
    comparable across ranks of one host that share a device order."""
    if visible is not None and 0 <= cuda_index < len(visible):
        dev = visible[cuda_index]
        return f"cuda:{dev.value}" if dev.kind == "index" else dev.value
    return f"cuda:{cuda_index}"


def torch_uuid(torch: Any, index: int) -> str | None:
    """The UUID torch reports for device `index` (bare hex, no prefix), or None. Call it
    on the training thread once the script has initialised CUDA: it reads the device's
    cached properties, no new context and no sync. Never raises."""
    try:
        text = str(torch.cuda.get_device_properties(index).uuid)
    except Exception:
        return None
    for prefix in (GPU_PREFIX, MIG_PREFIX):
        text = text.removeprefix(prefix)
    if not text or len(text) > MAX_UUID or not set(text) <= _UUID_CHARS:
        return None
    return text


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _by_uuid(nvml: Any, uuid: str) -> Any:
    try:
        return nvml.nvmlDeviceGetHandleByUUID(uuid)
    except Exception:
        return None


def _handles(nvml: Any) -> list[Any]:
    """Every NVML device's handle by index, None for one this process may not open
    (NO_PERMISSION under a cgroup device constraint) or that fails otherwise."""
    try:
        count = int(nvml.nvmlDeviceGetCount())
    except Exception:
        return []
    out = []
    for i in range(count):
        try:
            out.append(nvml.nvmlDeviceGetHandleByIndex(i))
        except Exception:
            out.append(None)
    return out


def _uuid_of(nvml: Any, handle: Any) -> str | None:
    try:
        return _text(nvml.nvmlDeviceGetUUID(handle))
    except Exception:
        return None


def _mig_by_walk(nvml: Any, uuid: str) -> Any:
    """A MIG instance's handle found through its GPU (drivers whose lookup by UUID does not
    know MIG UUIDs)."""
    for gpu in _handles(nvml):
        if gpu is None:
            continue
        try:
            if not nvml.nvmlDeviceGetMigMode(gpu)[0]:
                continue
            slots = nvml.nvmlDeviceGetMaxMigDeviceCount(gpu)
        except Exception:
            continue
        for j in range(slots):
            try:
                mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, j)
            except Exception:
                continue  # an empty slot
            if _uuid_of(nvml, mig) == uuid:
                return mig
    return None


def _mig_target(nvml: Any, uuid: str, how: str) -> NvmlTarget | None:
    mig = _by_uuid(nvml, uuid) or _mig_by_walk(nvml, uuid)
    if mig is None:
        return None
    gpu = nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)
    return NvmlTarget(gpu, mig, how)


def _gpu_by_prefix(nvml: Any, prefix: str) -> Any:
    """The one GPU whose UUID starts with `prefix`, as CUDA accepts a unique prefix."""
    matches = []
    for handle in _handles(nvml):
        text = None if handle is None else _uuid_of(nvml, handle)
        if text is not None and text.startswith(prefix):
            matches.append(handle)
    if len(matches) != 1:
        raise LookupError(f"{prefix} names {len(matches)} devices")
    return matches[0]


def _by_index(nvml: Any, index: int, order: str | None) -> Any:
    """NVML's device `index` when CUDA numbers as NVML does: in PCI order, or fastest-first
    on a node whose GPUs are all one model (no device is faster, so the order is PCI's)."""
    handles = _handles(nvml)
    if any(h is None for h in handles):
        denied = [i for i, h in enumerate(handles) if h is None]
        raise LookupError(f"NVML device(s) {denied} are off-limits to this job (a cgroup "
                          "device constraint): CUDA's indices differ from NVML's")
    if order != PCI_ORDER:
        names = {_text(nvml.nvmlDeviceGetName(h)) for h in handles}
        if len(names) > 1:
            raise LookupError(f"cuda:{index} is numbered fastest-first among {len(names)} GPU "
                              f"models, NVML by PCI bus (set CUDA_DEVICE_ORDER={PCI_ORDER})")
    return nvml.nvmlDeviceGetHandleByIndex(index)


def _mig_enabled(nvml: Any, gpu: Any) -> bool:
    try:
        return bool(nvml.nvmlDeviceGetMigMode(gpu)[0])
    except Exception:
        return False  # no MIG support on this GPU or driver


def nvml_target(nvml: Any, cuda_index: int, visible: list[VisibleDevice] | None,
                uuid: str | None = None, order: str | None = None) -> NvmlTarget:
    """The NVML handles of torch's device `cuda_index`: by torch's `uuid` (MIG instance
    first, then GPU), else through CUDA_VISIBLE_DEVICES (`visible`) and CUDA_DEVICE_ORDER
    (`order`). Raises LookupError, naming why, when there is no sure answer."""
    dev = None
    if visible is not None:
        if not 0 <= cuda_index < len(visible):
            raise LookupError(f"cuda:{cuda_index} is not in CUDA_VISIBLE_DEVICES")
        dev = visible[cuda_index]
    if uuid:  # one call: a GPU by torch's UUID (no walk; a MIG instance's is MIG-...)
        gpu = _by_uuid(nvml, GPU_PREFIX + uuid)
        if gpu is not None:
            return NvmlTarget(gpu, None, "torch's UUID", memory_ok=not _mig_enabled(nvml, gpu))
        found = _mig_target(nvml, MIG_PREFIX + uuid, "torch's MIG UUID")
        if found is not None:
            return found
    if dev is not None and dev.is_mig:
        found = _mig_target(nvml, dev.value, "CUDA_VISIBLE_DEVICES MIG UUID")
        if found is None:
            raise LookupError(f"NVML knows no MIG instance {dev.value[:48]}")
        return found
    gpu, how = None, ""
    if dev is not None and dev.kind == "uuid":
        gpu = _by_uuid(nvml, dev.value) or _gpu_by_prefix(nvml, dev.value)
        how = "CUDA_VISIBLE_DEVICES UUID"
    if gpu is None:
        index = cuda_index if dev is None else int(dev.value)
        gpu, how = _by_index(nvml, index, order), f"index {index}"
    # A device on a MIG-enabled GPU that no MIG UUID named: the instance is unknown, so
    # the GPU's memory (all instances together) must not pass for the rank's.
    return NvmlTarget(gpu, None, how, memory_ok=not _mig_enabled(nvml, gpu))
