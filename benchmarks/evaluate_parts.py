"""Where one live evaluation's time goes at N ranks, in-process (no traffic): the whole
evaluation with nothing new and with every rank new (as after a tick in which every rank
stepped), then its parts alone: the live refresh, the hang check, the diagnosis and the
cost model's count of one fresh step (with the live what-if due, and alone). A state of
synthetic records through the real protocol and RunState (traceml_tui/collect/canned.py).
CPU milliseconds, median of 5. One JSON line.

Usage: python benchmarks/evaluate_parts.py [--ranks N] [--steps K]
"""

from __future__ import annotations

import argparse
import json

from inprocess import MONO_NOW, NOW, canned_state, cpu_ms

from traceml_tui.judge import cost, progress
from traceml_tui.judge import diagnosis as dx
from traceml_tui.judge.timeline import LIVE_STEPS
from traceml_tui.judge.windows import finite_median


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=16384)
    p.add_argument("--steps", type=int, default=100, help="steps per rank")
    args = p.parse_args()
    state = canned_state(args.ranks, args.steps)
    now, mono_now = NOW, MONO_NOW
    state.evaluate(now, mono_now)

    def all_new() -> None:
        for rs in state.ranks.values():
            rs.dirty = True

    timings = state._live_table()
    shown = state.live.shown if state.live is not None else None
    assert shown is not None
    step_ms = timings.step_ms
    med = finite_median(step_ms[step_ms != 0])

    def diagnose() -> None:
        state._gather, state._reads = None, {}  # nothing gathered or read to reuse
        dx.diagnose(timings, shown.label, state.parallel == "fsdp", state.framework,
                    state._recent_timings, state.stall_findings(), state.preflight_busbw,
                    state._live_steps)

    timeline = state.timeline
    timeline.count_cost(shown, state.newest_step(), len(state.ranks), state._aligned,
                        state.parallel == "fsdp")
    counted_to = timeline.lost_mark  # the newest step every rank holds

    def count_cost(due: bool) -> None:
        """One evaluation's count with one step taken since the last: with the live
        what-if due (each evaluation below ~2,000 ranks), or only the fresh step."""
        state._gather, state._reads = None, {}
        timeline.lost_mark = counted_to - 1
        timeline.what_if_age = 10**6 if due else 0
        timeline.count_cost(shown, state.newest_step(), len(state.ranks), state._aligned,
                            state.parallel == "fsdp")

    print(json.dumps({
        "ranks": args.ranks, "steps": args.steps, "label": shown.label,
        "evaluate_nothing_new_ms": cpu_ms(lambda: state.evaluate(now, mono_now)),
        "evaluate_all_new_ms": cpu_ms(lambda: state.evaluate(now, mono_now), all_new),
        "live_refresh_ms": cpu_ms(lambda: state._refresh_live(keep=True), all_new),
        "hang_check_ms": cpu_ms(lambda: progress.check(
            state.ranks, state.relays, state.waiting_routes, mono_now, med,
            state.hang_after_s)),
        "diagnose_ms": cpu_ms(diagnose),
        "count_cost_what_if_ms": cpu_ms(lambda: count_cost(True)),
        "count_cost_fresh_ms": cpu_ms(lambda: count_cost(False)),
        "what_if_every": cost.what_if_every(len(state.ranks), LIVE_STEPS),
    }))


if __name__ == "__main__":
    main()
