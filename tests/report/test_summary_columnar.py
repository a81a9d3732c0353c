"""The summary, the live snapshot file and the view are the same, to the byte, whichever
code builds them: the columnar snapshot and rank rows (issue 33) against the per-rank code
of commit 36da305, on canned states, the old code run from that commit's tree in a
subprocess."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import numpy as np
import pytest

from old_code import old_tree, run_json, without_new_sentences
from traceml_tui.judge.windows import WindowBlock, whole_window_stats
from traceml_tui.report import summary

ROOT = Path(__file__).resolve().parents[2]
BEFORE = "36da305"  # the last commit with per-rank summary rows

# Builds each canned state, then its summary (live file and final record, JSON at both
# indents and the text), printed as one JSON object: the same script runs old and new.
SCRIPT = r'''
import json, sys
from traceml_tui import viewmodel
from traceml_tui.collect import view_build
from traceml_tui.collect.canned import T0, make_hang_state, make_state
from traceml_tui.report import summary

states = {
    "small": lambda: make_state(),
    "mixed": lambda: make_state(world_size=32, nproc_per_node=4, steps=80, straggler=5,
                                stale=(3, 9), silent_nodes=(6,), also_slow=(12,),
                                phase="forward"),
    "balanced": lambda: make_state(world_size=16, straggler=None, steps=50),
    "hang": lambda: make_hang_state(),
    "big": lambda: make_state(world_size=1024, nproc_per_node=8, steps=64, straggler=341),
}
out = {}
for name, make in states.items():
    state = make()
    for full in (False, True):  # the view of either snapshot, with two ranks' panels
        live = state.snapshot(T0 + 75.0, 0.5, full=full)
        view = view_build.build(live, state.recent_steps)
        out[f"{name} view {full}"] = [viewmodel.encode_view(view).hex()] + [
            viewmodel.encode_detail(view_build.detail(live, rank, view,
                                                      state.recent_steps(rank))).hex()
            for rank in (0, 5)]
    snap = state.snapshot(T0 + 75.0, 0.5, full=True)
    for kind, meta in (("live", summary.RunMeta(complete=False)),
                       ("final", summary.RunMeta(command=["train.py"], exit_code=0,
                                                 ended_at=T0 + 80.0))):
        doc = summary.build(snap, meta)  # a dict before the model was built directly
        out[f"{name} {kind}"] = [summary.to_json(doc), summary.to_json(doc, indent=2),
                                 summary.render_text(doc)]
json.dump(out, sys.stdout)
'''


# Fields added since BEFORE, whose code has none: a view panel's CPU line, a summary rank
# row's training-thread CPU shares over the run and its sys sample's latest (RankDetail.cpu,
# cpu_wait_pct, thread_cpu_pct); the memory a rank may still take (Sys.mem_avail_mb) and
# the summary's memory section (judge/memory.py); the attempts of a restarted job
# (attempts, restarts, each episode's attempt); steps sent on the host clock because the
# device lagged (late_steps, issue 40); the share of a sample's interval its steps filled
# (Sys.stepping_pct).
ADDED = ("cpu", "cpu_wait_pct", "thread_cpu_pct", "mem_avail_mb", "memory", "attempts",
         "restarts", "attempt", "late_steps", "stepping_pct")


def _strip(value: object) -> object:
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k not in ADDED}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    if isinstance(value, str):
        return without_new_sentences(value)
    return value


def _without_added(key: str, part: str) -> object:
    """A view part (msgpack, as hex) or a summary part (JSON) as plain data, less the
    fields added since BEFORE; the text as it is."""
    if " view " in key:
        return _strip(msgspec.msgpack.decode(bytes.fromhex(part)))
    if part.startswith("{"):  # written again: key order, ints and floats as they were
        return json.dumps(_strip(json.loads(part)))
    # the text less its memory lines (report/memory_report.py) and new sentences
    return without_new_sentences(
        "\n".join(line for line in part.split("\n") if not line.startswith("  Memory")))


def test_summary_bytes_match_the_per_rank_code(tmp_path: Path) -> None:
    old = run_json(SCRIPT, old_tree(BEFORE, tmp_path))
    new = run_json(SCRIPT, None)
    assert sorted(old) == sorted(new)
    for key in old:
        for part, (before, now) in enumerate(zip(old[key], new[key], strict=True)):
            if now != before:  # then only by the fields added since
                assert _without_added(key, now) == _without_added(key, before), \
                    f"{key}: part {part} differs"


@pytest.mark.parametrize("nd", [2, 3, 4])
def test_rounded_is_pythons_round(nd: int) -> None:
    """By column in numpy, the same digits as Python's round on every value: ties of the
    decimal (2.675 is 2.67499999...), huge and tiny values, NaN as None."""
    rng = np.random.default_rng(nd)
    ties = (np.arange(-2000, 2000) + 0.5) / 10 ** nd  # x.xxx5: binary values near a tie
    values = np.concatenate([ties, rng.random(5000) * 100, rng.random(500) * 1e9,
                             [0.0, -0.0, 1e-300, 2.675, 1.0005, 0.125, 1e15 + 0.3,
                              float("inf"), float("nan"), 3.0]]).reshape(-1, 2)
    got = summary.rounded(values, nd)
    want = [[None if v != v else round(v, nd) for v in row] for row in values.tolist()]
    assert json.dumps(got) == json.dumps(want)


@pytest.mark.parametrize("seed", range(4))
def test_whole_window_stats_is_block_stats(seed: int) -> None:
    """The snapshot file's whole-window pass gives WindowBlock.stats's figures to the bit:
    windows filling or full, the same or different counts, phases measured on every step,
    on some or never, ranks not reporting."""
    rng = np.random.default_rng(seed)
    for _ in range(60):
        size, world = int(rng.integers(1, 40)), int(rng.integers(1, 12))
        block = WindowBlock(world, size)
        same = rng.random() < 0.5  # every rank the same number of steps
        steps = int(rng.integers(0, 3 * size))
        partial = float(rng.choice([0.0, 0.3]))
        for rank in range(world):
            if not same and rng.random() < 0.2:
                continue
            for step in range(steps if same else int(rng.integers(0, 3 * size))):
                values = [None if rng.random() < p else float(rng.integers(0, 5))
                          for p in (0.0, partial, 1.0 if rank % 2 else 0.0)]
                block.append(rank, float(rng.integers(0, 9)), ("a", "b", "c"), values, step)
        ranks = [x for x in range(world) if rng.random() < 0.8]
        fast, slow = whole_window_stats(block, ranks), block.stats(ranks, None)
        assert fast.index == slow.index
        for name in ("steps", "median", "p95", "seen"):
            assert np.array_equal(getattr(fast, name), getattr(slow, name), equal_nan=True), name


def test_the_cycle_collector_is_paused_only_while_a_summary_is_built() -> None:
    import gc

    assert gc.isenabled()
    with pytest.raises(RuntimeError), summary.gc_paused():
        assert not gc.isenabled()
        raise RuntimeError("a failed build")
    assert gc.isenabled()  # back on, whatever happened inside
    gc.disable()
    try:
        with summary.gc_paused():
            pass
        assert not gc.isenabled()  # a caller's own pause is left as it was
    finally:
        gc.enable()
