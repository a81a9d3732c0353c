"""The run folder's layout (OUT/NAME/): where each of a run's files lies, said once.

Every module that reads or writes a file of a run asks a RunFolder for its path instead
of joining names itself, so the layout is this one page. The names that the agent also
writes (secret.key, traces/) or that several layers say (final_summary.json) are
traceml_agent.vocab's: the agent runs inside the ranks and cannot import this package,
so a name is written there once and joined here; the names only the product uses are
written here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from traceml_agent import vocab

TORCHRUN_LOG = "torchrun.log"  # torchrun's own output under the dashboard
NCCL_DIR = "nccl"              # under logs/: --nccl-debug's logs and flight-recorder dumps
# The dashboard's exports and SVG screenshots (README: `e`, `s`); the on-disk name
# predates the word "screenshot" and users' scripts may read it.
SCREENSHOTS_DIR = "snapshots"
REPORT_HTML = "report.html"  # `traceml report`'s default output (report/html_report.py)


@dataclass(frozen=True)
class RunFolder:
    """One run's folder. `node`: this node's rank on a multi-node run, whose nodes may
    share one folder (their own logs are then named -node<K>); None on a single node."""

    root: Path
    node: int | None = None

    def _own(self, name: str) -> Path:
        """This node's copy of a per-node file: relay.log -> relay-node1.log."""
        if self.node is None:
            return self.root / name
        stem, dot, suffix = name.rpartition(".")
        return self.root / f"{stem}-node{self.node}{dot}{suffix}"

    # --- written by the launcher ------------------------------------------------------
    @property
    def secret(self) -> Path:
        """The run's shared secret (0600; agent/keys.py)."""
        return self.root / vocab.SECRET_KEY

    @property
    def logs(self) -> Path:
        """The ranks' stdout/stderr (torchrun's --log-dir is rank_logs, below it)."""
        return self.root / vocab.LOGS_DIR

    @property
    def rank_logs(self) -> Path:
        """This node's ranks' stdout/stderr: logs/, or logs/node<K>/ on several nodes."""
        return self.logs / f"node{self.node}" if self.node is not None else self.logs

    @property
    def nccl_logs(self) -> Path:
        """--nccl-debug: NCCL's logs and the flight recorder's dumps (nccl_debug.py)."""
        return self.logs / NCCL_DIR

    @property
    def torchrun_log(self) -> Path:
        return self._own(TORCHRUN_LOG)

    @property
    def launcher_log(self) -> Path:
        """The launcher's output once the terminal hung up."""
        return self._own(vocab.LAUNCHER_LOG)

    @property
    def relay_log(self) -> Path:
        """A node relay's log (nodes other than 0)."""
        return self._own(vocab.RELAY_LOG)

    @property
    def relay_socket(self) -> Path:
        """Where a node relay listens for its ranks (a Unix socket; relay.py)."""
        return self._own(vocab.RELAY_SOCKET)

    @property
    def netcheck(self) -> Path:
        """`traceml netcheck`'s (or --preflight's) result."""
        return self.root / vocab.NETCHECK_JSON

    # --- written by the collector -------------------------------------------------------
    @property
    def collector_log(self) -> Path:
        return self.root / vocab.COLLECTOR_LOG

    @property
    def collector_json(self) -> Path:
        """Where viewers find the collector; there while it runs."""
        return self.root / vocab.COLLECTOR_JSON

    @property
    def live(self) -> Path:
        """The latest snapshot, shaped like the summary."""
        return self.root / vocab.LIVE_SNAPSHOT_JSON

    def kept_live(self, n: int) -> Path:
        """A restarted collector's n-th earlier live snapshot, kept beside the new one."""
        return self.root / f"{Path(vocab.LIVE_SNAPSHOT_JSON).stem}.before-restart-{n}.json"

    @property
    def summary_json(self) -> Path:
        return self.root / vocab.SUMMARY_JSON

    @property
    def summary_txt(self) -> Path:
        return self.root / vocab.SUMMARY_TXT

    @property
    def step_log(self) -> Path:
        """Every rank's per-step record (runfolder/step_log.py)."""
        return self.root / vocab.STEP_LOG_DIR

    @property
    def traces(self) -> Path:
        """Deep traces: each rank's trace (agent/capture.py) and the collector's analysis."""
        return self.root / vocab.TRACES_DIR

    def trace_report(self, capture_id: int, suffix: str) -> Path:
        """A deep trace's analysis, suffix ".txt" or ".json" (collect/deep_traces.py)."""
        return self.traces / f"capture{capture_id}{suffix}"

    # --- written by a viewer ----------------------------------------------------------
    @property
    def screenshots(self) -> Path:
        return self.root / SCREENSHOTS_DIR

    # --- written by `traceml report` ------------------------------------------------------
    @property
    def report_html(self) -> Path:
        """The run's self-contained HTML report (report/html_report.py)."""
        return self.root / REPORT_HTML
