"""The cost of one Prometheus scrape of the collector's /metrics at N ranks: rendering the
exposition of the published view (the first scrape after a tick; the metrics thread's CPU,
which shares the collector's GIL) and serving the cached bytes (every other scrape of the
same tick), its size and its series, in-process over canned states. One JSON line per size.

Usage: python benchmarks/metrics_scrape.py [--ranks 1024 16384]
(Run it with PYTHONPATH=<a checkout of an older commit> to measure that code: before
metrics.render, the exposition was prometheus_client's generate_latest over RunMetrics.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

from traceml_tui.collect import metrics
from traceml_tui.collect.canned import T0, make_state, make_view
from traceml_tui.judge.snapshot import Snapshot
from traceml_tui.viewmodel import RunView


def renderer(view: RunView, snap: Snapshot) -> Callable[[], bytes]:
    if hasattr(metrics, "render"):
        return lambda: metrics.render(view, snap, "bench")
    from prometheus_client import generate_latest
    from prometheus_client.registry import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(metrics.RunMetrics(lambda: (view, snap), "bench"))  # type: ignore[attr-defined]
    return lambda: generate_latest(registry)


def cpu_ms(fn: Callable[[], object], n: int = 7) -> float:
    times = []
    for _ in range(n):
        t0 = time.process_time()
        fn()
        times.append((time.process_time() - t0) * 1000)
    return round(statistics.median(times), 2)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, nargs="+", default=[1024, 16384])
    args = p.parse_args()
    for world in args.ranks:
        state = make_state(world_size=world, nproc_per_node=8, steps=12, straggler=world // 3,
                           phase="forward")
        view, snap = make_view(state), state.snapshot(T0 + 75.0, 0.5)
        render = renderer(view, snap)
        text = render()
        server = metrics.MetricsServer(lambda v=view, s=snap: (v, s), "bench", "127.0.0.1", 0)
        server.exposition()  # the tick's first scrape renders; the others reuse its bytes
        cached = cpu_ms(server.exposition, 101)
        server.listener.close()
        series = sum(1 for line in text.splitlines() if line and not line.startswith(b"#"))
        print(json.dumps({"ranks": world, "scrape_ms": cpu_ms(render), "cached_scrape_ms": cached,
                          "bytes": len(text), "series": series}))


if __name__ == "__main__":
    main()
