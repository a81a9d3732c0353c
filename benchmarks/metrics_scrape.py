"""The cost of one Prometheus scrape of the collector's /metrics at N ranks: building the
exposition from the published view (the HTTP thread's CPU, which shares the collector's
GIL), its size and its series, in-process over canned states. One JSON line per size.

Usage: python benchmarks/metrics_scrape.py [--ranks 1024 16384]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from prometheus_client import generate_latest  # noqa: E402
from prometheus_client.registry import CollectorRegistry  # noqa: E402

from traceml_tui.collect import metrics  # noqa: E402
from traceml_tui.collect.canned import T0, make_state, make_view  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, nargs="+", default=[1024, 16384])
    args = p.parse_args()
    for world in args.ranks:
        state = make_state(world_size=world, nproc_per_node=8, steps=12, straggler=world // 3,
                           phase="forward")
        view, snap = make_view(state), state.snapshot(T0 + 75.0, 0.5)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(metrics.RunMetrics(lambda v=view, s=snap: (v, s), "bench"))
        times, text = [], b""
        for _ in range(7):
            t0 = time.process_time()
            text = generate_latest(registry)
            times.append((time.process_time() - t0) * 1000)
        series = sum(1 for line in text.splitlines() if line and not line.startswith(b"#"))
        print(json.dumps({"ranks": world, "scrape_ms": round(statistics.median(times), 1),
                          "bytes": len(text), "series": series}))


if __name__ == "__main__":
    main()
