"""Prometheus metrics: the collector's view of the run at /metrics, for the fleet's
Prometheus and Grafana (`traceml run --metrics-port PORT`; docs/metrics.md).

A scrape reads the frozen view and snapshot the collector publishes once per evaluation
tick (view_server.py): it never touches the live state, never blocks ingest for longer
than building the text, and never writes anything. Cardinality is bounded: per-rank
series for every rank up to PER_RANK_ALL ranks; above that, for the diagnosis subject
and the PER_RANK_WORST ranks furthest from the median rank only, with per-node worst
values for every node (docs/metrics.md has the arithmetic).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from .state import Snapshot
from .view_state import VIEW_PHASES, RankRow, ViewState, own_work

# Every rank gets its own series up to this many ranks (8 phase series + 2 per rank:
# ~10k series at 1,024 ranks, what one Prometheus takes per job without notice) ...
PER_RANK_ALL = 1024
# ... and above it only the subject and the ranks furthest from the median rank do.
PER_RANK_WORST = 64

Source = Callable[[], tuple[ViewState | None, Snapshot | None]]


def job_labels() -> dict[str, str]:
    """Labels that tie the series to the scheduler's job, as NCCL Inspector's exporter
    does (slurm_job_id under Slurm)."""
    job = os.environ.get("SLURM_JOB_ID")
    return {"slurm_job_id": job} if job else {}


def ranks_to_export(view: ViewState) -> list[RankRow]:
    """Every rank, or (past PER_RANK_ALL) the subject and the ranks whose own work is
    furthest from the median rank's."""
    rows = [r for r in view.rows if r.step_ms is not None]
    if len(rows) <= PER_RANK_ALL:
        return rows
    mid = own_work(view.median_phase_ms) or 0.0

    def far(r: RankRow) -> float:
        own = own_work(r.phase_ms)
        return 0.0 if own is None else abs(own - mid)

    subject = {view.rank} if view.node is None else {r.rank for r in rows if r.node == view.node}
    ranked = sorted(rows, key=lambda r: (r.rank not in subject, -far(r), r.rank))
    keep = [r for r in ranked if r.rank in subject]
    return keep + [r for r in ranked if r.rank not in subject][:PER_RANK_WORST]


class RunMetrics(Collector):
    """A prometheus_client collector over the latest published view."""

    def __init__(self, source: Source, run_name: str) -> None:
        self.source = source
        self.run_name = run_name

    def describe(self) -> list[Metric]:
        return []  # no fixed set: the registry must not call collect() at registration

    def collect(self) -> Iterator[Metric]:
        view, snap = self.source()
        if view is None:
            return
        base = {"job": self.run_name, **job_labels()}
        keys, values = list(base), list(base.values())

        def gauge(name: str, doc: str, labels: tuple[str, ...] | list[str] = ()
                  ) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=keys + list(labels))

        step = gauge("traceml_rank_step_seconds", "A rank's median step over its recent "
                     "steps.", ["rank", "node", "host"])
        phase = gauge("traceml_rank_phase_seconds", "A rank's median time per step in a "
                      "phase (sync: exposed collective wait).", ["rank", "node", "phase"])
        steps = CounterMetricFamily("traceml_rank_steps", "Steps a rank has completed.",
                                    labels=keys + ["rank", "node"])
        for r in ranks_to_export(view):
            rank, node = str(r.rank), str(r.node)
            if r.step_ms is not None:
                step.add_metric(values + [rank, node, r.host], r.step_ms / 1000.0)
            for name, v in zip(VIEW_PHASES, r.phase_ms, strict=True):
                if v is not None:
                    phase.add_metric(values + [rank, node, name], v / 1000.0)
            steps.add_metric(values + [rank, node], float(r.steps))
        yield step
        yield phase
        yield steps

        node_step = gauge("traceml_node_worst_step_seconds", "The slowest median step of "
                          "a node's ranks (every node, whatever the scale).", ["node", "host"])
        for _, row in view.node_rows or _nodes(view):
            if row.step_ms is not None:
                node_step.add_metric(values + [str(row.node), row.host], row.step_ms / 1000.0)
        yield node_step

        job = gauge("traceml_job_step_seconds", "The median rank's step.")
        if view.median_step_ms is not None:
            job.add_metric(values, view.median_step_ms / 1000.0)
        yield job
        total = CounterMetricFamily("traceml_job_steps", "Steps of the furthest rank.",
                                    labels=keys)
        total.add_metric(values, float(view.steps))
        yield total
        world = gauge("traceml_world_size", "Ranks the job was started with.")
        world.add_metric(values, float(view.world_size))
        yield world

        diag = gauge("traceml_diagnosis_info", "The live diagnosis (value 1): its label, "
                     "the rank or node it names, its severity.",
                     ["label", "rank", "node", "severity", "phase"])
        node = "" if view.node is None else str(view.node)
        if view.node is None and view.rank is not None and view.rank < len(view.rows):
            node = str(view.rows[view.rank].node)
        diag.add_metric(values + [view.label, "" if view.rank is None else str(view.rank),
                                  node, view.severity, view.phase or ""], 1.0)
        yield diag
        yield from _cost(view, gauge, values)

        status = gauge("traceml_ranks", "Ranks by state (ok, stale, failed, done, ...).",
                       ["state"])
        counts: dict[str, int] = {}
        for r in view.rows:
            counts[r.status] = counts.get(r.status, 0) + 1
        for name, n in sorted(counts.items()):
            status.add_metric(values + [name], float(n))
        yield status

        checks = gauge("traceml_setup_check_ranks", "Ranks a setup check found a mistake "
                       "on (docs/checks.md).", ["check", "severity"])
        for check_id, severity, ranks, _evidence, _fix in view.checks:
            checks.add_metric(values + [check_id, severity], float(len(ranks)))
        yield checks

        if snap is not None:
            counters = CounterMetricFamily("traceml_collector_messages", "The collector's "
                                           "ingest counters (dropped: agent_dropped, "
                                           "malformed, ...).", labels=keys + ["kind"])
            for name, n in sorted(snap.counters.items()):
                counters.add_metric(values + [name], float(n))
            yield counters


def _cost(view: ViewState, gauge: Callable[..., GaugeMetricFamily], values: list[str]
          ) -> Iterator[Metric]:
    c = view.cost
    share = gauge("traceml_cost_step_share", "Share of every step the diagnosed problem "
                  "costs (cost.py).")
    lost = gauge("traceml_cost_lost_seconds", "Job seconds the diagnosed problem cost so "
                 "far.")
    hours = gauge("traceml_cost_device_hours", "lost seconds x world size / 3600 (GPU-hours "
                  "on GPU jobs, rank-hours on CPU jobs).", ["unit"])
    whatif = gauge("traceml_whatif_step_seconds", "The step the job would have without the "
                   "diagnosed problem.")
    if c is not None:
        share.add_metric(values, c.share)
        whatif.add_metric(values, c.step_ms / 1000.0)
        if c.lost_s is not None:
            lost.add_metric(values, c.lost_s)
        if c.hours is not None:
            hours.add_metric(values + [c.unit], c.hours)
    yield from (share, lost, hours, whatif)


def _nodes(view: ViewState) -> list[tuple[int, RankRow]]:
    from .view_state import node_rows

    return list(node_rows(view.rows))


def serve(source: Source, run_name: str, host: str, port: int) -> Any:
    """Start the /metrics HTTP server on a daemon thread; returns the server."""
    from prometheus_client import start_http_server

    registry = CollectorRegistry(auto_describe=False)
    registry.register(RunMetrics(source, run_name))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server
