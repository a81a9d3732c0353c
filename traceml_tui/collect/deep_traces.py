"""The collector's side of a deep-trace capture: one at a time, analysed when it lands.

A viewer asks for a capture of N steps on some ranks (by default the worst rank and
the median rank, to read side by side). The collector sends the request down each
rank's connection; each agent reports "started", then "done" with the trace file
(or "failed"/"refused"). When every rank is done, the traces are analysed
(trace_analysis.py) in a child process (`python -m traceml_tui.collect.deep_traces`): parsing
profiler traces of hundreds of MB is CPU work that would hold the collector's GIL
against ingest; a thread only waits for the child. The result is saved as
RUN_DIR/traces/captureN.json and .txt. While a capture runs, a second request is
refused politely.

Disk: a rank's trace of a few steps is tens of MB (103 MB in 16 s at 2 ranks, a key
holder asking again and again), so traces/ has a byte budget per run
(TRACES_BUDGET_BYTES, `TRACEML_TRACES_BUDGET_MB`): once it holds that much, or once the
disk under it has less than MIN_FREE_BYTES free, a new capture is refused with one line
that says which and what to do (delete old captures). A full disk (ENOSPC, EDQUOT) when
the analysis is saved is said in one line too; nothing here raises into the collector.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from traceml_agent import protocol
from traceml_agent.sanitize import clean_text
from traceml_tui import viewmodel
from traceml_tui.report import trace_analysis
from traceml_tui.runfolder import folders
from traceml_tui.runfolder.layout import RunFolder

# The analysis of one capture gets this long in its child process (a few large traces
# take seconds; a pathological one must not keep the slot forever).
ANALYSIS_TIMEOUT_S = 300.0
# A rank that has not finished its capture after this long (a step can be slow, and the
# profiler slows it further; a hung rank never gets there) frees the slot for a new one.
CAPTURE_TIMEOUT_S = 120.0
FINAL_STATES = ("done", "failed", "refused")
# traces/ may hold this much per run before new captures are refused: a few dozen
# captures of two ranks, far more than a person reads, and a bound on what a key holder
# asking for captures in a loop can put on the user's disk.
TRACES_BUDGET_BYTES = 2 << 30
# A capture needs room for its ranks' traces (tens of MB each) and the analysis: below
# this much free space, it is refused before the ranks fill the disk (ENOSPC).
MIN_FREE_BYTES = 1 << 30
DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})
_MB = 1 << 20


def traces_bytes(folder: Path) -> int:
    """Bytes of the regular files in traces/ and its scratch folders (a profiler's half-
    written trace), links not followed; 0 if it does not exist."""
    total = 0
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    total += traces_bytes(Path(entry.path)) if entry.name.startswith(".") else 0
                elif entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size
    except OSError:
        pass
    return total


def disk_note(folder: Path, budget: int, min_free: int = MIN_FREE_BYTES) -> str | None:
    """Why no capture may start for want of disk (one line), or None."""
    used = traces_bytes(folder)
    if used >= budget:
        return (f"deep traces are at their budget: {folder} holds {used // _MB} MB of "
                f"{budget // _MB} MB; delete old captures there (or raise "
                f"TRACEML_TRACES_BUDGET_MB) to take more")
    try:
        st = os.statvfs(folder if folder.exists() else folder.parent)
    except OSError:
        return None
    free = st.f_bavail * st.f_frsize
    if free < min_free:
        return (f"the disk under {folder} has {free // _MB} MB free (a capture needs "
                f"{min_free // _MB} MB): free some space to take a deep trace")
    return None


def save_problem(exc: OSError) -> str:
    """What a failed save of the analysis says: a full disk in words, else the error."""
    if exc.errno in DISK_FULL:
        return "the disk is full (no space left on device): the analysis was not saved"
    return f"could not save the analysis: {exc}"


def _budget_from_env() -> int:
    try:
        mb = float(os.environ.get("TRACEML_TRACES_BUDGET_MB", ""))
    except ValueError:
        return TRACES_BUDGET_BYTES
    return int(mb * _MB) if mb >= 0 else TRACES_BUDGET_BYTES


@dataclass
class DeepTrace:
    id: int
    steps: int
    ranks: tuple[int, ...]
    requested_at: float
    roles: dict[int, str]  # rank -> "worst", "median", "pinned"
    states: dict[int, str] = field(default_factory=dict)
    paths: dict[int, str] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    text: str = ""  # the analysis, once made
    saved: str | None = None
    analysing: bool = False

    def finished(self, now: float) -> bool:
        return (all(self.states.get(r) in FINAL_STATES for r in self.ranks)
                or now - self.requested_at > CAPTURE_TIMEOUT_S)

    def to_view(self) -> viewmodel.DeepTraceView:
        return viewmodel.DeepTraceView(
            self.id, self.steps, tuple(self.ranks),
            {str(r): v for r, v in self.roles.items()},
            {str(r): self.states.get(r, "requested") for r in self.ranks},
            {str(r): e for r, e in self.errors.items()},
            {str(r): p for r, p in self.paths.items()}, self.text, self.saved)


def deep_trace_roles(view: viewmodel.RunView | None, asked: list[int] | None
                  ) -> dict[int, str]:
    """Which ranks a capture covers, and why: the asked (pinned) rank or the worst one,
    plus the rank whose local work is the median's, to read beside it."""
    if view is None:
        return {}
    live = [r for r in view.rows if r.step_ms is not None]
    local = {r.rank: viewmodel.own_work(r.phase_ms) or 0.0 for r in live}
    roles: dict[int, str] = {}
    if asked:
        roles.update({r: "pinned" for r in asked if 0 <= r < view.world_size})
    elif view.worst is not None:
        roles[view.worst.rank] = "worst"
    others = sorted((v, r) for r, v in local.items() if r not in roles)
    if others and roles:
        roles[others[len(others) // 2][1]] = "median"
    return roles


class DeepTraceBoard:
    def __init__(self, run_dir: Path, budget_bytes: int | None = None) -> None:
        self.run_dir = run_dir
        self.budget_bytes = _budget_from_env() if budget_bytes is None else budget_bytes
        self.disk_refused = 0  # captures refused for the disk (disk_note)
        self.current: DeepTrace | None = None
        self._next_id = 1
        self._lock = threading.Lock()  # the analysis thread writes text and saved

    def start(self, roles: dict[int, str], steps: int, now: float | None = None
              ) -> tuple[DeepTrace | None, str | None]:
        """A new capture, or why not (one is running, nothing to capture)."""
        now = time.monotonic() if now is None else now
        cur = self.current
        if cur is not None and not (cur.finished(now) and not cur.analysing):
            busy = ", ".join(map(str, cur.ranks))
            return None, (f"a capture is already running (ranks {busy}, {cur.steps} steps); "
                          f"wait for it to finish")
        if not roles:
            return None, "no rank to capture yet (no rank has reported steps)"
        note = disk_note(RunFolder(self.run_dir).traces, self.budget_bytes)
        if note is not None:
            self.disk_refused += 1
            return None, note
        cap = DeepTrace(self._next_id, steps, tuple(sorted(roles)), now, dict(roles))
        self._next_id += 1
        self.current = cap
        return cap, None

    def on_event(self, rank: int, body: protocol.Capture) -> None:
        cap = self.current
        if cap is None or body.capture_id != cap.id or rank not in cap.ranks:
            return  # a late event of an older capture
        cap.states[rank] = body.state
        if body.path:
            cap.paths[rank] = body.path
        if body.error:
            cap.errors[rank] = body.error
        if all(cap.states.get(r) in FINAL_STATES for r in cap.ranks) and not cap.analysing:
            cap.analysing = True
            threading.Thread(target=self._analyse_in_child, args=(cap,),
                             name="traceml-analysis", daemon=True).start()

    def view(self) -> viewmodel.DeepTraceView | None:
        with self._lock:
            return None if self.current is None else self.current.to_view()

    # --- analysis: a thread that waits for a child process ----------------------------

    def _analyse_in_child(self, cap: DeepTrace) -> None:
        text, saved = "", None
        try:
            done = subprocess.run([sys.executable, "-m", "traceml_tui.collect.deep_traces",
                                   str(self.run_dir)], input=msgspec.json.encode(cap).decode(),
                                  capture_output=True, text=True,
                                  timeout=ANALYSIS_TIMEOUT_S, check=False)
            if done.returncode == 0:
                result = json.loads(done.stdout)
                text, saved = str(result["text"]), result["saved"]
            else:
                tail = done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]
                text = f"Deep trace {cap.id}: the analysis failed: {tail[0][:300]}\n"
        except (OSError, ValueError, KeyError, subprocess.TimeoutExpired) as exc:
            text = f"Deep trace {cap.id}: the analysis failed: {exc}\n"
        with self._lock:  # the child's words, and a rank's error, reach a terminal
            cap.text, cap.saved, cap.analysing = clean_text(text), saved, False

    def _analyse(self, cap: DeepTrace) -> tuple[str, str | None]:
        """In the child process: analyse the traces, save the report, return (text,
        where the JSON report was saved)."""
        analyses: dict[int, trace_analysis.TraceAnalysis] = {}
        problems = []
        for rank in cap.ranks:
            path = cap.paths.get(rank)
            if path is None:
                problems.append(f"rank {rank}: {cap.errors.get(rank) or cap.states.get(rank)}")
                continue
            try:
                # Only this run's own traces folder: the path is a rank's word.
                analyses[rank] = trace_analysis.analyze_file(path, RunFolder(self.run_dir).traces)
            except Exception as exc:  # a trace on another host's disk, or unreadable
                problems.append(f"rank {rank}: cannot analyse {path}: {exc}")
        text, doc = self._report(cap, analyses, problems)
        text = clean_text(text)  # trace contents are a rank's words (agent/sanitize.py)
        saved = None
        try:
            run = RunFolder(self.run_dir)
            run.traces.mkdir(mode=0o700, parents=True, exist_ok=True)
            folders.write_atomic(run.trace_report(cap.id, ".txt"), text)
            folders.write_atomic(run.trace_report(cap.id, ".json"), json.dumps(doc, indent=1))
            saved = str(run.trace_report(cap.id, ".json"))
        except OSError as exc:
            problems.append(save_problem(exc))
            text += f"problem: {save_problem(exc)}\n"
        return text, saved

    @staticmethod
    def _report(cap: DeepTrace, analyses: dict[int, trace_analysis.TraceAnalysis],
                problems: list[str]) -> tuple[str, dict[str, Any]]:
        parts = [f"Deep trace {cap.id}: {cap.steps} steps on rank(s) "
                 + ", ".join(f"{r} ({cap.roles.get(r, 'asked')})" for r in cap.ranks)]
        doc: dict[str, Any] = {"id": cap.id, "steps": cap.steps, "ranks": list(cap.ranks),
                               "roles": {str(r): v for r, v in cap.roles.items()},
                               "traces": {str(r): p for r, p in cap.paths.items()},
                               "problems": problems, "analyses": {}, "comparison": None}
        worst = next((r for r, role in cap.roles.items() if role in ("worst", "pinned")), None)
        median = next((r for r, role in cap.roles.items() if role == "median"), None)
        if worst in analyses and median in analyses and worst != median:
            comparison = trace_analysis.compare_ranks(analyses[worst], analyses[median])
            doc["comparison"] = comparison.to_dict()
            parts.append(_comparison_text(comparison, worst, median))
        for rank, analysis in sorted(analyses.items()):
            doc["analyses"][str(rank)] = analysis.to_dict()
            parts.append(f"--- rank {rank} ({cap.roles.get(rank, 'asked')}): "
                         f"{cap.paths.get(rank)}\n" + trace_analysis.render_text(analysis))
        parts += [f"problem: {p}" for p in problems]
        return "\n\n".join(parts) + "\n", doc


def _metric(name: str) -> tuple[str, float, str]:
    """How a comparison row reads: µs figures in ms, shares in %."""
    if "_us" in name:
        return name.replace("_us", "").replace("_", " ") + " (ms)", 1e-3, ".2f"
    if name.endswith("_share"):
        return name.replace("_", " ") + " (%)", 100.0, ".0f"
    return name.replace("_", " "), 1.0, ".0f"


def _comparison_text(comparison: Any, worst: int, median: int) -> str:
    lines = [f"{'per step, worst vs median':<34} {'rank ' + str(worst):>10} "
             f"{'rank ' + str(median):>10} {'delta':>10}"]
    for row in comparison.rows:
        label, scale, spec = _metric(row.metric)
        cells = ["-" if v is None else format(v * scale, spec)
                 for v in (row.worst, row.median, row.delta)]
        lines.append(f"{label:<34} {cells[0]:>10} {cells[1]:>10} {cells[2]:>10}")
    for f in comparison.findings:
        title = getattr(f, "title", str(f))
        lines.append(f"* {title}: {getattr(f, 'evidence', '')}")
    return "\n".join(lines)


def _child_main() -> None:
    """`python -m traceml_tui.collect.deep_traces RUN_DIR`: a capture (JSON) on stdin, its analysis'
    text and saved path on stdout (JSON)."""
    cap = msgspec.json.decode(sys.stdin.read(), type=DeepTrace)
    text, saved = DeepTraceBoard(Path(sys.argv[1]))._analyse(cap)
    json.dump({"text": text, "saved": saved}, sys.stdout)


if __name__ == "__main__":
    _child_main()
