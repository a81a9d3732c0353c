"""What a dashboard draws: a frozen, compact view of the collector's state.

The collector builds one `ViewState` per evaluation tick (view_build.py) and
serves it to any number of viewers; a viewer decodes it and replaces its whole
state at once. Rows are plain tuples so 8,192 ranks encode and decode in a few
milliseconds. This module is the view model only: it imports neither the
dashboard nor the collector's state, so a viewer carries none of the collector.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from traceml_agent.vocab import PHASES

# Columns of the heat rows, in order.
VIEW_PHASES = PHASES
# A rank is stale when no message arrived for this long (agents send ~10 a second and a
# heartbeat every second, so 3 s of silence means its sender or its host is gone) ...
STALE_SILENCE_S = 3.0
# ... or when it made no step for this many of its median step times (and at least
# STALE_MIN_S): it is alive but not progressing.
STALE_STEPS = 5
STALE_MIN_S = 5.0

OK, STALE, DONE, FAILED, WAITING = "ok", "stale", "done", "failed", "waiting"
STOPPED = "stopped"
AGENT_OFF = "agent off"  # the agent turned its timing off (it said why): not a stall
# A rank that ended on the user's signal was stopped, not failed: KeyboardInterrupt
# (Ctrl-C, 130), SIGHUP (129) and SIGTERM (143) as exit codes, or the signal itself.
STOP_EXIT_CODES = frozenset({130, 129, 143, -2, -1, -15})


class RankRow(NamedTuple):
    """One rank's line. A tuple of plain values, not a dataclass: the cycle collector
    untracks such tuples, so decoding 8,192 rows a tick does not trigger long GC pauses."""

    rank: int
    node: int
    host: str
    steps: int
    step_ms: float | None
    phase_ms: tuple[float | None, ...]  # aligned with VIEW_PHASES
    cpu_pct: float | None
    rss_mb: float | None
    gpu_util: float | None
    gpu_mem_mb: float | None
    idle_s: float | None
    status: str

    def to_wire(self) -> list:
        w: list[Any] = list(self)
        w[5] = list(self.phase_ms)
        return w

    @classmethod
    def from_wire(cls, w: list) -> RankRow:
        w[5] = tuple(w[5])
        return cls._make(w)


@dataclass(frozen=True, slots=True)
class RankDetail:
    """One rank next to the median rank, for the worst-rank and pinned panels."""

    rank: int
    host: str
    step_ms: float | None
    median_step_ms: float | None
    phase_ms: tuple[float | None, ...]
    median_phase_ms: tuple[float | None, ...]
    recent_step_ms: tuple[float, ...]
    status: str
    error: str | None
    stack: str | None = None  # the training thread's stack, sent by a rank that is stuck

    def to_wire(self) -> dict[str, Any]:
        return {"rank": self.rank, "host": self.host, "step_ms": self.step_ms, "stack": self.stack,
                "median_step_ms": self.median_step_ms, "phase_ms": list(self.phase_ms),
                "median_phase_ms": list(self.median_phase_ms),
                "recent_step_ms": list(self.recent_step_ms), "status": self.status,
                "error": self.error}

    @classmethod
    def from_wire(cls, w: dict[str, Any]) -> RankDetail:
        return cls(w["rank"], w["host"], w["step_ms"], w["median_step_ms"],
                   tuple(w["phase_ms"]), tuple(w["median_phase_ms"]),
                   tuple(w["recent_step_ms"]), w["status"], w["error"], w.get("stack"))


@dataclass(frozen=True, slots=True)
class ViewState:
    run_name: str
    world_size: int
    nnodes: int
    elapsed_s: float
    steps: int
    steps_per_s: float | None
    label: str
    rank: int | None
    phase: str | None
    severity: str
    summary: str
    label_for_s: float
    rows: tuple[RankRow, ...]
    median_step_ms: float | None
    median_phase_ms: tuple[float | None, ...]
    worst: RankDetail | None
    device: str
    finished: bool = False
    exit_code: int | None = None
    node: int | None = None  # the diagnosis blames a whole node
    # Setup mistakes found (agent/checks.py), merged across ranks:
    # (id, severity, ranks, evidence, fix), most severe first.
    checks: tuple[tuple[str, str, tuple[int, ...], str, str], ...] = ()
    capture: dict[str, Any] | None = None  # the latest deep trace (captures.py to_wire)

    @property
    def reporting(self) -> int:
        return sum(1 for r in self.rows if r.status != WAITING)

    @property
    def nodes_waiting(self) -> tuple[int, ...]:
        """Nodes none of whose ranks has reported yet (started late, or not at all)."""
        seen: dict[int, bool] = {}
        for r in self.rows:
            seen[r.node] = seen.get(r.node, False) or r.status != WAITING
        return tuple(n for n, reported in sorted(seen.items()) if not reported)

    @property
    def stale(self) -> tuple[int, ...]:
        return tuple(r.rank for r in self.rows if r.status == STALE)

    def to_wire(self) -> dict[str, Any]:
        return {
            "run_name": self.run_name, "world_size": self.world_size, "nnodes": self.nnodes,
            "elapsed_s": self.elapsed_s, "steps": self.steps, "steps_per_s": self.steps_per_s,
            "label": self.label, "rank": self.rank, "phase": self.phase,
            "severity": self.severity, "summary": self.summary, "label_for_s": self.label_for_s,
            "rows": [r.to_wire() for r in self.rows], "median_step_ms": self.median_step_ms,
            "median_phase_ms": list(self.median_phase_ms),
            "worst": None if self.worst is None else self.worst.to_wire(),
            "device": self.device, "finished": self.finished, "exit_code": self.exit_code,
            "node": self.node, "checks": [list(c) for c in self.checks],
            "capture": self.capture,
        }

    @classmethod
    def from_wire(cls, w: dict[str, Any]) -> ViewState:
        return cls(
            w["run_name"], w["world_size"], w["nnodes"], w["elapsed_s"], w["steps"],
            w["steps_per_s"], w["label"], w["rank"], w["phase"], w["severity"], w["summary"],
            w["label_for_s"], tuple(RankRow.from_wire(r) for r in w["rows"]),
            w["median_step_ms"], tuple(w["median_phase_ms"]),
            None if w["worst"] is None else RankDetail.from_wire(w["worst"]), w["device"],
            w.get("finished", False), w.get("exit_code"), w.get("node"),
            tuple((c[0], c[1], tuple(c[2]), c[3], c[4]) for c in w.get("checks", ())),
            w.get("capture"))
