"""The cost model (cost.py) on synthetic step data: table tests of what a culprit costs and
the step the job would have without it, and the windows lined up step by step."""

from __future__ import annotations

import numpy as np
import pytest

from traceml_tui.judge import cost
from traceml_tui.judge import diagnosis as dx
from traceml_tui.judge.timeline import LIVE_STEPS, Timeline
from traceml_tui.judge.windows import AlignedSteps, WindowBlock

N = 40  # steps
RNG = np.random.default_rng(0)


def job(world: int = 4, *, every: dict | None = None, sync: float = 2.0, wait: float = 0.3,
        noise: float = 0.05, sync_measured: bool = True, stall: dict | None = None,
        **per_rank: dict) -> AlignedSteps:
    """A synchronous job, step by step: each rank's local work, then the collective that
    waits for the last rank to arrive. `every`: a phase's ms on every rank; `per_rank`:
    extra ms per phase on given ranks, e.g. dataloader={2: 30.0} (a callable gives the
    extra per step index); `stall`: {rank: ms per step index} of work after the optimizer
    (a checkpoint), which the other ranks wait for in their next step's sync."""
    base = {"dataloader": 0.3, "forward": 1.0, "backward": 1.5, "optimizer": 0.4,
            **(every or {})}
    phases = {p: np.full((world, N), v) + RNG.normal(0, noise, (world, N)).clip(-v, None)
              for p, v in base.items()}
    for phase, extra in per_rank.items():
        for rank, ms in extra.items():
            phases[phase][rank] += ms if not callable(ms) else np.array([ms(i) for i in range(N)])
    extra_wait = np.zeros((world, N))
    for rank, fn in (stall or {}).items():
        extra_wait[rank] = [fn(i) for i in range(N)]
    local = sum(phases.values())
    arrive = local.max(axis=0)
    phases["sync"] = sync + (arrive[None, :] - local)
    late = extra_wait.max(axis=0)  # the others wait for a stalled rank in the next step
    phases["sync"][:, 1:] += late[None, :-1] - extra_wait[:, :-1] * 0
    for rank in (stall or {}):
        phases["sync"][rank, 1:] -= late[:-1]
    phases["wait"] = np.full((world, N), wait) + extra_wait
    step = sum(phases.values())
    if not sync_measured:
        phases["sync"] = np.full((world, N), np.nan)
    return AlignedSteps(np.arange(world), np.arange(100, 100 + N), step, phases)


def straggler(label: str, rank: int, node: int | None = None, ranks: tuple[int, ...] = ()
              ) -> dx.Diagnosis:
    return dx.Diagnosis(label, rank, None, dx.WARNING, "", node=node, node_ranks=ranks)


CASES = [
    # (name, diagnosis, data, expected saving ms (None: no what-if), weak?)
    ("input straggler", straggler(dx.INPUT_STRAGGLER, 2), job(dataloader={2: 30.0}), 30.0,
     False),
    ("compute straggler", straggler(dx.COMPUTE_STRAGGLER, 1), job(forward={1: 12.0}), 12.0,
     False),
    ("optimizer straggler", straggler(dx.COMPUTE_STRAGGLER, 3), job(optimizer={3: 8.0}), 8.0,
     False),
    ("both phases", straggler(dx.STRAGGLER, 0), job(dataloader={0: 5.0}, backward={0: 6.0}),
     11.0, False),
    # Two stragglers: fixing the named one leaves the other pacing the job.
    ("second straggler as slow", straggler(dx.INPUT_STRAGGLER, 2),
     job(dataloader={2: 30.0, 3: 30.0}), None, False),
    ("second straggler smaller", straggler(dx.INPUT_STRAGGLER, 2),
     job(dataloader={2: 30.0, 3: 10.0}), 20.0, False),
    ("whole node", straggler(dx.COMPUTE_STRAGGLER, 2, node=1, ranks=(2, 3)),
     job(forward={2: 9.0, 3: 10.0}), 10.0, False),
    ("input on every rank", dx.Diagnosis(dx.INPUT_BOUND, None, "dataloader", dx.WARNING, ""),
     job(every={"dataloader": 25.0}), 25.0, True),
    ("no sync measured", straggler(dx.INPUT_STRAGGLER, 2),
     job(dataloader={2: 30.0}, sync_measured=False), 30.0, True),
    ("balanced", dx.Diagnosis(dx.BALANCED, None, None, dx.INFO, ""), job(), None, False),
    ("comm-bound has no culprit to remove",
     dx.Diagnosis(dx.COMM_BOUND, None, "sync", dx.WARNING, ""), job(sync=30.0), None, False),
    ("stalls of one rank", dx.Diagnosis(dx.PERIODIC_STALL, 1, "wait", dx.WARNING, ""),
     job(stall={1: lambda i: 300.0 if i % 10 == 5 else 0.0}), 30.0, False),
    # The stall log's verdict: 300 ms every 50 steps, over the run, whether or not this
    # window holds one (it holds none here): 6 ms a step on average, on top of the
    # window's step.
    ("stalls of the run, none in the window",
     dx.Diagnosis(dx.PERIODIC_STALL, 1, "wait", dx.WARNING, "", gap_ms=300.0, period=50),
     job(), 6.0, False),
    ("residual wait on every rank", dx.Diagnosis(dx.WAIT_HEAVY, None, "wait", dx.WARNING, ""),
     job(wait=12.0), 12.0, True),
]


@pytest.mark.parametrize(("name", "d", "data", "saving", "weak"), CASES,
                         ids=[c[0] for c in CASES])
def test_what_if(name, d, data, saving, weak):
    w = cost.what_if(d, data)
    if saving is None:
        assert w is None
        return
    assert w is not None
    assert w.saving_ms == pytest.approx(saving, rel=0.05, abs=0.3)
    assert w.step_ms == pytest.approx(w.now_ms - w.saving_ms)
    assert w.speedup == pytest.approx(w.now_ms / w.step_ms)
    assert (w.weak is not None) == weak, w.weak
    assert w.steps == N
    assert w.to_json()["speedup"] == round(w.speedup, 3)


def test_a_periodic_stall_is_priced_at_its_rate_over_the_run():
    """The window holds no stall of the log's checkpoint (300 ms every 50 steps): the job's
    step now is the window's plus 6 ms of stall a step, and without it the window's."""
    data = job()
    d = dx.Diagnosis(dx.PERIODIC_STALL, 1, "wait", dx.WARNING, "", gap_ms=300.0, period=50)
    w = cost.what_if(d, data)
    assert w is not None
    window = float(np.median(data.step_ms, axis=0).mean())
    assert w.now_ms == pytest.approx(window + 6.0, rel=0.02)
    assert w.step_ms == pytest.approx(window, rel=0.02)
    assert "about 300 ms every 50 steps" in w.reasoning
    # A window that happens to hold one stall of a checkpoint every 200 steps: 1.5 ms a
    # step over the run, not the 7.5 ms of one stall in these 40 steps.
    held = job(stall={1: lambda i: 300.0 if i == 20 else 0.0})
    d = dx.Diagnosis(dx.PERIODIC_STALL, 1, "wait", dx.WARNING, "", gap_ms=300.0, period=200)
    w = cost.what_if(d, held)
    assert w is not None and w.saving_ms == pytest.approx(1.5)
    # Step by step it is still the stall's own excess (the episode's evidence and lost time).
    saved = cost.savings(d, held)
    assert saved is not None and saved.saving_ms.sum() == pytest.approx(300.0, rel=0.05)


def test_the_job_step_now_is_the_median_ranks():
    data = job(dataloader={2: 30.0})
    w = cost.what_if(straggler(dx.INPUT_STRAGGLER, 2), data)
    assert w is not None
    assert w.now_ms == pytest.approx(float(np.median(data.step_ms, axis=0).mean()))
    assert "rank 2 doing the median rank's dataloader/h2d" in w.reasoning


def test_extra_work_that_overlaps_communication_is_not_promised():
    """The culprit is 30 ms slower in forward but the others wait only 10 ms more than
    it: the other 20 ms were hidden behind the collective (say, an overlapped bucket)."""
    data = job(forward={2: 30.0})
    data.phase_ms["sync"][[0, 1, 3]] -= 20.0
    w = cost.what_if(straggler(dx.COMPUTE_STRAGGLER, 2), data)
    assert w is not None
    assert w.saving_ms == pytest.approx(10.0, abs=0.3)
    assert w.excess_ms == pytest.approx(30.0, abs=0.3) and w.paid_ms == pytest.approx(10.0, abs=0.3)
    assert w.weak is not None and "overlaps communication" in w.weak


def test_fsdp_compares_only_phases_without_collectives():
    w = cost.what_if(straggler(dx.COMPUTE_STRAGGLER, 1), job(optimizer={1: 6.0}), fsdp=True)
    assert w is not None and w.saving_ms == pytest.approx(6.0, abs=0.3)
    assert w.weak is not None and w.weak.startswith("FSDP")


def test_too_few_steps_give_no_estimate():
    data = job(dataloader={2: 30.0}).tail(cost.MIN_STEPS - 1)
    assert cost.what_if(straggler(dx.INPUT_STRAGGLER, 2), data) is None


def test_lost_time_counts_each_step_once():
    s = cost.savings(straggler(dx.INPUT_STRAGGLER, 2), job(dataloader={2: 30.0}))
    assert s is not None
    lost, counted = s.lost_ms_after(100 + N - 11)
    assert counted == 10 and lost == pytest.approx(300.0, rel=0.05)
    assert s.lost_ms_after(10_000) == (0.0, 0)


# --- the windows lined up step by step -----------------------------------------------


def test_aligned_lines_up_ranks_at_different_steps():
    block = WindowBlock(3, 16)
    for rank, newest in ((0, 30), (1, 28), (2, 31)):
        for step in range(newest - 15, newest + 1):
            block.append(rank, float(step), ("forward",), (rank + step / 100,), step)
    data = block.aligned([0, 1, 2], 8)
    assert data is not None
    assert data.steps.tolist() == list(range(21, 29))
    assert data.step_ms.tolist() == [[float(s) for s in range(21, 29)]] * 3
    assert data.phase_ms["forward"][1].tolist() == pytest.approx(
        [1 + s / 100 for s in range(21, 29)])


def test_aligned_marks_dropped_records_and_leaves_out_ranks_far_behind():
    block = WindowBlock(3, 16)
    for step in range(100, 116):
        if step != 110:  # rank 0's agent dropped step 110
            block.append(0, 10.0, ("forward",), (1.0,), step)
        block.append(1, 11.0, ("forward",), (1.0,), step)
    for step in range(10):  # rank 2 stopped long ago
        block.append(2, 12.0, ("forward",), (1.0,), step)
    data = block.aligned([0, 1, 2], 16)
    assert data is not None and data.ranks.tolist() == [0, 1]
    assert data.steps[-1] == 115
    row = dict(zip(data.steps.tolist(), data.step_ms[0].tolist(), strict=True))
    assert np.isnan(row[110]) and row[111] == 10.0  # not shifted by the drop
    # The slots before the drop are not where a gapless ring puts them: left out (NaN)
    # rather than attributed to the wrong step, until they leave the window.
    assert np.isnan(row[109])


def _upto(full: AlignedSteps, newest: int, n: int) -> AlignedSteps:
    """The newest `n` of `full`'s steps up to step `newest`."""
    end = int(np.searchsorted(full.steps, newest)) + 1
    cols = slice(max(0, end - n), end)
    return AlignedSteps(full.ranks, full.steps[cols], full.step_ms[:, cols],
                        {p: a[:, cols] for p, a in full.phase_ms.items()})


def _count_run(ranks: int, d: dx.Diagnosis, full: AlignedSteps, switch_at: int | None = None
               ) -> tuple[list[int], list, float]:
    """Evaluations of a Timeline over `full`'s steps, one new step each, as a job of
    `ranks` ranks: (steps read per evaluation, the what-if after each, the lost seconds
    of the open episode). From step `switch_at` the label names another rank."""
    tl = Timeline(0.0, 64)
    asked: list[int] = []
    at = {"newest": int(full.steps[0]) + 15}

    def read(want: int, reuse: bool) -> AlignedSteps:
        asked.append(want)
        return _upto(full, at["newest"], want)

    tl.new_episode(d, 0.0, at["newest"], 0, ranks, read, False)
    asked.clear()
    what_ifs = []
    for newest in range(at["newest"] + 1, int(full.steps[-1]) + 1):
        at["newest"] = newest
        shown = d if switch_at is None or newest < switch_at else straggler(d.label, 1)
        tl.count_cost(shown, newest, ranks, read, False)
        what_ifs.append(tl.what_if)
    return asked, what_ifs, tl.episodes[-1].lost_s or 0.0


def test_past_the_budget_the_what_if_is_refreshed_less_often_and_no_step_goes_uncounted():
    """At 16,384 ranks 32 steps of every rank are 8x VALUE_BUDGET: the what-if is computed
    afresh every 8th evaluation (and says so), the others read only enough steps to count
    the fresh one; the lost time is the one a small job's evaluations count."""
    d, full = straggler(dx.INPUT_STRAGGLER, 2), job(dataloader={2: 30.0})
    assert cost.what_if_every(4, LIVE_STEPS) == 1
    assert cost.what_if_every(2048, LIVE_STEPS) == 1
    assert cost.what_if_every(16384, LIVE_STEPS) == 8
    small_reads, small_ifs, small_lost = _count_run(4, d, full)
    large_reads, large_ifs, large_lost = _count_run(16384, d, full)
    assert set(small_reads) == {LIVE_STEPS}  # each evaluation its what-if
    assert large_reads == [LIVE_STEPS if i % 8 == 0 else cost.MIN_STEPS
                           for i in range(len(large_reads))]
    assert large_lost == pytest.approx(small_lost, rel=0.02) and small_lost > 0.024 * 24 * 0.9
    assert all(w is not None for w in small_ifs + large_ifs)
    assert "refreshed every 8 evaluations" in large_ifs[0].reasoning
    assert "refreshed" not in small_ifs[0].reasoning
    assert large_ifs[3] is large_ifs[0]  # held between refreshes
    assert large_ifs[0].saving_ms == pytest.approx(small_ifs[0].saving_ms)


def test_a_what_if_about_another_culprit_is_computed_at_once():
    d = straggler(dx.INPUT_STRAGGLER, 2)
    full = job(dataloader={2: lambda i: 30.0 if i < 20 else 0.0,
                           1: lambda i: 0.0 if i < 20 else 30.0})
    first = int(full.steps[0])
    reads, ifs, _ = _count_run(16384, d, full, switch_at=first + 20)
    switched = 20 - 16  # the evaluation of step first + 20
    assert reads[switched] == LIVE_STEPS and ifs[switched].rank == 1
    assert ifs[switched - 1].rank == 2
