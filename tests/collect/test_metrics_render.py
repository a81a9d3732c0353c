"""The /metrics text is written by metrics.render, byte for byte what prometheus_client's
generate_latest wrote over the former RunMetrics collector (commit 36da305), on canned
states: ranks past PER_RANK_ALL, a hang, a stale rank, label values that need escaping,
a Slurm job; and a render reuses nothing that changed (values, labels, job)."""

from __future__ import annotations

import math
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.utils import floatToGoString

from old_code import old_tree, run_json
from traceml_tui.collect import metrics
from traceml_tui.collect.canned import T0, make_state, make_view

ROOT = Path(__file__).resolve().parents[2]
BEFORE = "36da305"  # the last commit with the prometheus_client collector

SCRIPT = r'''
import json, os, sys
from traceml_tui.collect.canned import T0, make_hang_state, make_state, make_view
from traceml_tui.collect import metrics

def render(view, snap, job):
    if hasattr(metrics, "render"):
        return metrics.render(view, snap, job).decode()
    from prometheus_client import generate_latest
    from prometheus_client.registry import CollectorRegistry
    registry = CollectorRegistry(auto_describe=False)
    registry.register(metrics.RunMetrics(lambda: (view, snap), job))
    return generate_latest(registry).decode()

cases = {
    "small": lambda: make_state(),
    "1024": lambda: make_state(world_size=1024, nproc_per_node=8, steps=12, straggler=341,
                               phase="forward"),
    "2048": lambda: make_state(world_size=2048, nproc_per_node=8, steps=12, straggler=700,
                               phase="forward"),
    "hang": lambda: make_hang_state(),
    "odd": lambda: make_state(world_size=8, hosts='n"o\\d\ne', stale=(3,)),
}
out = {}
for name, make in cases.items():
    state = make()
    view, snap = make_view(state), state.snapshot(T0 + 75.0, 0.5)
    for job in ("demo", 'we"ird\\job\nname'):
        os.environ.pop("SLURM_JOB_ID", None)
        out[f"{name} {job}"] = render(view, snap, job)
        os.environ["SLURM_JOB_ID"] = "4242"
        out[f"{name} {job} slurm"] = render(view, snap, job)
json.dump(out, sys.stdout)
'''


# Families added since BEFORE, which its collector did not have: the memory's
# (docs/diagnosis.md, "Memory growth"; tests/judge/test_memory.py parses them).
ADDED = ("traceml_rank_rss_bytes", "traceml_rank_gpu_memory_bytes",
         "traceml_rank_memory_growth_bytes_per_second", "traceml_rank_memory_limit_seconds")


def _without_added(text: str) -> str:
    def added(line: str) -> bool:
        name = line.split(" ", 3)[2] if line.startswith("# ") else line.split("{")[0]
        return name in ADDED

    return "".join(line for line in text.splitlines(keepends=True) if not added(line))


def test_the_text_is_what_prometheus_client_wrote(tmp_path: Path) -> None:
    drop = ("SLURM_JOB_ID",)
    old = run_json(SCRIPT, old_tree(BEFORE, tmp_path), drop)
    new = run_json(SCRIPT, None, drop)
    assert sorted(old) == sorted(new)
    for key in old:
        assert _without_added(new[key]) == old[key], f"{key}: the exposition differs"


def test_a_render_follows_the_view() -> None:
    """Kept label sets never stand in for changed ones: another job name, another view."""
    slow = make_state(world_size=8, straggler=2, phase="dataloader")
    calm = make_state(world_size=8, straggler=None)
    first = metrics.render(make_view(slow), None, "a").decode()
    assert 'job="a"' in first and 'job="b"' not in first
    second = metrics.render(make_view(slow), None, "b").decode()
    assert second == first.replace('job="a"', 'job="b"')
    third = metrics.render(make_view(calm), calm.snapshot(T0 + 75.0, 0.5), "b").decode()
    assert third != second and 'label="BALANCED"' in third
    assert metrics.render(None, None, "a") == b""


def test_every_scraper_gets_the_bytes_rendered_once_per_view() -> None:
    """Two scrapers over real HTTP, several scrapes each: one render per published view,
    the same bytes to all; a new view (the next tick) renders once more."""
    import urllib.request

    state = make_state(world_size=16, straggler=3)
    published = [make_view(state)]
    server = metrics.serve(lambda: (published[0], None), "demo", "127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{server.port}/metrics"
        bodies = [urllib.request.urlopen(url, timeout=10).read() for _ in range(4)]
        assert len(set(bodies)) == 1 and b"traceml_rank_step_seconds" in bodies[0]
        assert server.renders == 1
        published[0] = make_view(make_state(world_size=16, straggler=None))
        again = urllib.request.urlopen(url, timeout=10).read()
        assert again != bodies[0] and server.renders == 2
    finally:
        server.stop()


FLOATS = st.floats(allow_nan=True, allow_infinity=True) | st.integers(-(2**53), 2**53)
EDGES = [0.0, -0.0, 1e-4, 9.999999999999999e-05, 5e-324, 1e6, 999999.9999999999, 1e16, 1e22,
         -1e-5, 12, 2**53, math.nan, math.inf, -math.inf, 0.1, 1 / 3]


@settings(max_examples=300, deadline=None)
@given(st.lists(FLOATS, max_size=64))
def test_values_are_written_as_prometheus_client_writes_each(values: list[float]) -> None:
    """Values are formatted all at once (msgspec's shortest digits, then repr's exponents
    below 1e-4 and Go's above 1e6): each as floatToGoString writes it alone."""
    values = values + EDGES
    assert metrics._go_floats(values) == [floatToGoString(v) for v in values]
