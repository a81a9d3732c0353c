"""Which processes belong to the job: /proc's parent links, walked from a pid up.

A rank's pid is public (ps, the view, the summary) and a key holder may say hello with
any pid; only the kernel knows whose child a process is. The collector (node 0's) asks
here whether a new process claiming a rank of its own node descends from the launcher
that started it, and the launcher whether a pid it may dump with py-spy descends from
its torchrun (launch/native_stacks.py).
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

MAX_DEPTH = 64  # ancestors walked from a pid towards torchrun (ranks are 1-3 levels below)
# Answers kept per pid: a key holder repeating a refused hello costs one walk, not one a
# message; a pid is checked again after this many others (pids are reused).
CACHE_PIDS = 1024


def parent_pid(pid: int, proc: Path = Path("/proc")) -> int | None:
    """The parent of `pid` as the kernel says (/proc/PID/stat), None if it is gone."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[1])  # the name may hold spaces or ')'
    except (OSError, ValueError, IndexError):
        return None


def descends_from(pid: int, ancestor: int, proc: Path = Path("/proc")) -> bool:
    """True only when /proc shows `pid` below `ancestor` (its child, grandchild...)."""
    for _ in range(MAX_DEPTH):
        parent = parent_pid(pid, proc)
        if parent is None or parent <= 1:
            return False
        if parent == ancestor:
            return True
        pid = parent
    return False


class JobLineage:
    """Whether a pid is one of the job's processes: below `root` (the launcher that
    started the collector, and so torchrun and its ranks), remembered per pid."""

    def __init__(self, root: int, proc: Path = Path("/proc")) -> None:
        self.root = root
        self.proc = proc
        self._known: OrderedDict[int, bool] = OrderedDict()

    def __call__(self, pid: int) -> bool:
        known = self._known.get(pid)
        if known is None:
            known = descends_from(pid, self.root, self.proc)
            self._known[pid] = known
            if len(self._known) > CACHE_PIDS:
                self._known.popitem(last=False)
        return known
