"""Busy scrapers against /metrics at N ranks: the serving process's CPU, before and after
the bounded server (issue 30 finding 6: four busy scrapers took the collector from 3 % to
58 % of a core).

A child process serves a canned N-rank view the way the collector does, publishing a new
view object every EVAL_INTERVAL_S (a collector tick): "before" is prometheus_client's
start_http_server (a thread per connection, the exposition rendered on every scrape),
"after" is metrics.MetricsServer (one thread, rendered once per published view). The
parent runs SCRAPERS threads scraping in a loop for SECONDS and reads the child's CPU time.

Usage: python benchmarks/metrics_busy.py [--ranks 1024] [--seconds 10] [--scrapers 4]
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import psutil  # noqa: E402

EVAL_INTERVAL_S = 0.5


def serve(mode: str, port: int, ranks: int) -> None:
    """The child: a canned view, republished every tick, served by `mode`."""
    from msgspec.structs import replace
    from prometheus_client.registry import CollectorRegistry

    from traceml_tui.collect import metrics
    from traceml_tui.collect.canned import T0, make_state, make_view

    state = make_state(world_size=ranks, nproc_per_node=8, steps=12, straggler=ranks // 3,
                       phase="forward")
    published = [make_view(state), state.snapshot(T0 + 75.0, 0.5)]

    def source() -> tuple:
        return published[0], published[1]

    if mode == "before":
        from prometheus_client import start_http_server

        registry = CollectorRegistry(auto_describe=False)
        registry.register(metrics.RunMetrics(source, "bench"))
        start_http_server(port, addr="127.0.0.1", registry=registry)
    else:
        metrics.serve(source, "bench", "127.0.0.1", port)
    print("ready", flush=True)
    while True:  # the collector's tick: a new frozen view object
        time.sleep(EVAL_INTERVAL_S)
        published[0] = replace(published[0])


def measure(mode: str, ranks: int, seconds: float, scrapers: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    child = subprocess.Popen([sys.executable, __file__, "--serve", mode, str(port),
                              str(ranks)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        url = f"http://127.0.0.1:{port}/metrics"
        urllib.request.urlopen(url, timeout=30).read()  # warm
        proc = psutil.Process(child.pid)
        cpu0 = sum(proc.cpu_times()[:2])
        stop = time.monotonic() + seconds
        counts = [0] * scrapers

        def scrape(i: int) -> None:
            while time.monotonic() < stop:
                urllib.request.urlopen(url, timeout=30).read()
                counts[i] += 1

        threads = [threading.Thread(target=scrape, args=(i,)) for i in range(scrapers)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - t0
        cpu = sum(proc.cpu_times()[:2]) - cpu0
    finally:
        child.kill()
        child.wait()
    n = sum(counts)
    return {"mode": mode, "ranks": ranks, "scrapers": scrapers, "seconds": round(wall, 1),
            "scrapes": n, "cpu_ms_per_scrape": round(cpu * 1000 / max(n, 1), 2),
            "cpu_share_of_a_core": round(cpu / wall, 3)}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--scrapers", type=int, default=4)
    args = p.parse_args()
    for mode in ("before", "after"):
        print(json.dumps(measure(mode, args.ranks, args.seconds, args.scrapers)), flush=True)


if __name__ == "__main__":
    main()
