"""`traceml export RUN_DIR --perfetto OUT.json`: the whole job's phase timeline for Perfetto.

Reads the collector's step log (RUN_DIR/steps/, bounded) and the run's summary (final,
or the live snapshot of a run still going) and writes one Chrome-trace file: a process
per rank, a track per phase, step markers, diagnosis episodes and hangs as events
(perfetto.py). Opens in https://ui.perfetto.dev beside the torch.profiler traces that
deep traces leave in RUN_DIR/traces/.
"""

from __future__ import annotations

from pathlib import Path

from traceml_agent.vocab import STEP_LOG_DIR
from traceml_tui.runfolder import summary_model as model
from traceml_tui.runfolder.layout import RunFolder
from traceml_tui.runfolder.step_log import read_steps

from . import perfetto


class ExportError(Exception):
    """A run folder that cannot be exported: one line for the user."""


def _summary(run_dir: Path) -> model.Summary | None:
    """The run's summary read through the model (runfolder/summary_model.py), final or
    live; None when the run has neither (the steps still export). One that is there but
    is not a summary is the user's one-line error, not a trace silently missing its
    episodes."""
    folder = RunFolder(run_dir)
    for path in (folder.summary_json, folder.live):
        if not path.is_file():
            continue
        try:
            return model.load(path)
        except model.NotASummary as exc:
            raise ExportError(str(exc)) from None
    return None


def export_perfetto(run_dir: Path, out: Path, last_steps: int | None = None) -> dict[str, int]:
    if not run_dir.is_dir():
        raise ExportError(f"no such run folder: {run_dir}")
    log_dir = RunFolder(run_dir).step_log
    if not log_dir.is_dir():
        raise ExportError(f"{run_dir} has no step log ({STEP_LOG_DIR}/): is it a traceml run "
                          f"folder from this version?")
    records = list(read_steps(log_dir))
    if not records:
        raise ExportError(f"the step log in {log_dir} is empty: no step was recorded")
    try:
        perfetto.write_trace(out, records, _summary(run_dir), last_steps_per_rank=last_steps)
    except OSError as exc:
        raise ExportError(f"cannot write {out}: {exc.strerror or exc}") from None
    return {"ranks": len({r.rank for r in records}), "records": len(records)}
