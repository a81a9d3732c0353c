"""What the agent reads from a collective call: which process group it runs on, named the
same on every rank (hang detection compares the sequences per group), and the bytes of
this rank's input. Pure functions over the call's arguments, apart from the bounded table
of group names; hooks.py wraps the calls and times them.
"""

from __future__ import annotations

from typing import Any

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
               "reduce_scatter", "reduce_scatter_tensor", "broadcast", "broadcast_object_list",
               "barrier", "all_to_all", "all_to_all_single", "reduce", "gather", "scatter",
               "monitored_barrier", "all_reduce_coalesced", "all_gather_coalesced",
               # Issued by the frameworks themselves, inside forward: DDP's buffer
               # broadcast (broadcast_buffers=True with BatchNorm statistics) and FSDP2's
               # all-gathers and reduce-scatters. Nested in forward/backward, their time
               # goes to sync (the innermost phase). FSDP2 issues most of them with
               # async_op=True: then only the launch is seen here, and the wait stays in
               # the phase that waits (docs/fsdp.md).
               "_broadcast_coalesced", "all_gather_single", "reduce_scatter_single")


# Process groups named in the sequences a hang compares: the default group is "world",
# another one its torch group_name. A job creating groups without end (one per step)
# cannot grow the heartbeat: past MAX_GROUPS names, the rest count as "other".
WORLD_GROUP = "world"
MAX_GROUPS = 32
_group_names: dict[int, str] = {}


def group_position(func: Any) -> int | None:
    """Where a collective takes its process group positionally (`group`, or
    `process_group` for DDP's `_broadcast_coalesced`), read once from its signature."""
    import inspect

    try:
        names = list(inspect.signature(func).parameters)
    except (TypeError, ValueError):  # a builtin without a signature
        return 0 if getattr(func, "__name__", "") == "_broadcast_coalesced" else None
    for key in ("group", "process_group"):
        if key in names:
            return names.index(key)
    return None


def group_name(group: Any) -> str:
    """The group's name, the same on every rank: "world", or its sorted global ranks
    ("r0,2", "r0-3,8-11"), or, when that is long, their count and a hash of the list."""
    if group is None:
        return WORLD_GROUP
    name = _group_names.get(id(group))
    if name is None:
        if len(_group_names) >= MAX_GROUPS:
            return "other"
        try:
            import torch.distributed as dist

            if group is dist.GroupMember.WORLD:
                name = WORLD_GROUP
            else:
                name = ranks_name(dist.get_process_group_ranks(group))
        except Exception:
            try:
                name = "g" + str(group.group_name)
            except Exception:
                name = f"group{len(_group_names)}"
        _group_names[id(group)] = name = name[:64]
    return name


def ranks_name(ranks: Any) -> str:
    """A group named by its sorted global ranks, contiguous runs folded: "r0-3,8"; past
    40 characters "<n>r#<8 hex of sha1>" (the same list gives the same name anywhere)."""
    import hashlib

    ordered = sorted(int(r) for r in ranks)
    runs: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        runs.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    name = "r" + ",".join(runs)
    if len(name) <= 40:
        return name
    digest = hashlib.sha1(",".join(map(str, ordered)).encode()).hexdigest()[:8]
    return f"{len(ordered)}r#{digest}"


# Where each collective takes the tensor(s) it sends (positional): its bytes are this
# rank's input. Absent: not known (an object collective pickles); barriers send none.
DATA_ARG = {"all_reduce": 0, "broadcast": 0, "reduce": 0, "gather": 0,
             "all_reduce_coalesced": 0, "all_gather": 1, "all_gather_into_tensor": 1,
             "all_gather_single": 1, "reduce_scatter": 1, "reduce_scatter_tensor": 1,
             "reduce_scatter_single": 1, "all_to_all": 1, "all_to_all_single": 1,
             "scatter": 1, "broadcast_coalesced": 1, "all_gather_coalesced": 1,
             "barrier": None, "monitored_barrier": None}
_DATA_KWARGS = ("tensor", "input_tensor", "input", "tensors", "input_tensor_list")


def input_bytes(args: tuple, kwargs: dict, at: int | None) -> int:
    """The bytes of a collective's input tensor(s); 0 for a barrier, -1 when not known."""
    if at is None:
        return 0
    if at < 0:
        return -1
    if at < len(args):
        data = args[at]
    else:
        data = next((kwargs[k] for k in _DATA_KWARGS if k in kwargs), None)
    n = getattr(data, "nbytes", None)
    if type(n) is int:
        return n
    if isinstance(data, (list, tuple)) and len(data) <= 4096:
        total = 0
        for t in data:
            n = getattr(t, "nbytes", None)
            if type(n) is not int:
                return -1
            total += n
        return total
    return -1
