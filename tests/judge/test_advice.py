"""A periodic stall's advice fits its evidence (judge/advice.py's table), and says so
when the evidence picks no cause: table-driven over StallFindings and heartbeats."""

from __future__ import annotations

from dataclasses import replace

import msgspec
import pytest
from test_diagnosis import EVERY_30, logged, stalls, timing

from traceml_agent.protocol import NO_HEARTBEAT
from traceml_tui.judge.advice import ADVICE, advise
from traceml_tui.judge.diagnosis import diagnose, periodic_stall
from traceml_tui.judge.stalls import StallFinding


def finding(rank=0, phase="wait", period=30, periodic_ms=250.0, count=13) -> StallFinding:
    return StallFinding(rank, count, count * periodic_ms, count, period, count, periodic_ms,
                        phase, 30, 390, 0.3, True, 0, 0.0)


def hb(base=NO_HEARTBEAT, **fields):
    """A rank's heartbeat with the evidence fields given."""
    return msgspec.structs.replace(base, **fields)


GC = hb(gc_slow=14, gc_slow_ms=3500.0, gc_max_ms=300.0, gc_full=14)
LOADER = hb(loader_len=30, loader_epochs=13, loader_workers=2, loader_persistent=False)
CAUSES = [row.cause for row in ADVICE]

# (what, finding, every rank, heartbeat, cause or None, words in the advice, words not)
CASES = [
    ("rank 1's collector pauses explain its stalls: GC advice",
     finding(1, "forward"), False, GC, "garbage collection", "gc.freeze()", "async_save"),
    ("GC pauses win over the step-boundary pattern on rank 0",
     finding(0, "wait"), False, GC, "garbage collection", "paused rank 0 14 times", "async"),
    ("a collector that only nibbles is not the cause of 250 ms stalls",
     finding(0, "wait"), False, hb(GC, gc_max_ms=20.0), "checkpoint on rank 0",
     "async_save", "gc.freeze"),
    ("a collector's total far under the stalls' excess is not the cause",
     finding(0, "wait"), False, hb(GC, gc_slow_ms=500.0), "checkpoint on rank 0",
     "async_save", "gc.freeze"),
    ("three long pauses cannot explain thirteen stalls",
     finding(0, "wait"), False, hb(GC, gc_slow=3), "checkpoint on rank 0", "async_save",
     "gc.freeze"),
    ("stalls in dataloader on every rank every len(loader) steps: persistent workers",
     finding(0, "dataloader"), True, LOADER, "DataLoader workers restarted every epoch",
     "every 30 steps = the DataLoader's length (30 batches)", "async_save"),
    ("a period within the tolerance of the loader's length still matches",
     finding(0, "dataloader", period=32), True, LOADER,
     "DataLoader workers restarted every epoch", "persistent_workers=True", "gc.freeze"),
    ("workers that persist do not restart: no cause picked",
     finding(0, "dataloader"), True, hb(LOADER, loader_persistent=True), None,
     "does not pick a cause", "persistent_workers=True"),
    ("a loader without workers restarts none: no cause picked",
     finding(0, "dataloader"), True, hb(LOADER, loader_workers=0), None,
     "does not pick a cause", "persistent_workers=True"),
    ("a period other than the loader's length: no cause picked",
     finding(0, "dataloader", period=50), True, LOADER, None, "does not pick", "persistent"),
    ("one epoch seen is no rhythm of epochs",
     finding(0, "dataloader"), True, hb(LOADER, loader_epochs=1), None, "does not pick",
     "persistent"),
    ("rank 0 alone at the step boundary: checkpoint",
     finding(0, "wait"), False, hb(), "checkpoint on rank 0", "async_save",
     "evaluation"),
    ("rank 0 alone in the optimizer: checkpoint",
     finding(0, "optimizer"), False, None, "checkpoint on rank 0", "async_save", "gc."),
    ("rank 0 alone in forward: evaluation or logging",
     finding(0, "forward"), False, hb(), "evaluation or logging on rank 0",
     "Run evaluation on every rank", "async_save"),
    ("every rank at the step boundary: no cause picked (a save on all, evaluation?)",
     finding(0, "wait"), True, hb(), None, "does not pick a cause", "gc.freeze"),
    ("rank 3 alone at the step boundary: not the lead rank, no cause picked",
     finding(3, "wait"), False, hb(), None, "look at what rank 3 does every 30 steps",
     "gc.freeze"),
    ("no heartbeat yet: the patterns still answer",
     finding(0, "wait"), False, None, "checkpoint on rank 0", "async_save", "gc.freeze"),
]


@pytest.mark.parametrize("what, stall, everyone, beat, cause, words, not_words", CASES,
                         ids=[c[0] for c in CASES])
def test_the_advice_is_the_first_row_whose_evidence_holds(what, stall, everyone, beat, cause,
                                                          words, not_words):
    advice = advise(stall, everyone, beat)
    assert advice.cause == cause, advice.text
    assert cause is None or cause in CAUSES
    assert words in advice.text and not_words not in advice.text, advice.text


def test_the_diagnosis_carries_the_advice_and_drops_the_phase_hint_when_a_cause_is_picked():
    f = replace(finding(0, "dataloader"), heartbeat=LOADER)
    d = periodic_stall([replace(f, rank=r) for r in range(2)], None, 2)
    assert d is not None
    assert "about 250 ms each, in dataloader: the job lost" in d.summary, d.summary
    assert d.summary.endswith("the dataset's construction).")
    unknown = periodic_stall([replace(finding(0, "dataloader"), rank=r) for r in range(2)],
                             None, 2)
    assert unknown is not None and "a worker restart, a shard or file" in unknown.summary


def test_diagnose_reads_the_heartbeat_the_state_attaches():
    found = [replace(f, heartbeat=GC) if f.rank == 0 else f
             for f in logged([stalls(0, EVERY_30)] + [stalls(1, EVERY_30, phase="sync")])]
    d = diagnose([timing(0), timing(1)], stalls=found)
    assert "The garbage collector paused rank 0" in d.summary, d.summary


def test_the_gc_watch_counts_pauses_once_armed():
    import gc

    from traceml_agent import gcwatch

    watch = gcwatch.GcWatch()
    gc.callbacks.append(watch)
    try:
        gc.collect()
        assert watch.collections == 0  # the set-up's collections are not counted
        watch.armed = True
        keep = [[] for _ in range(200_000)]
        for x in keep:
            x.append(x)  # cycles: a full collection walks them all
        gc.collect()
        assert watch.collections >= 1 and watch.full >= 1  # gc.collect() and any on the way
        assert watch.max_ms > 0 and watch.slow_ms <= watch.slow * watch.max_ms
        del keep
    finally:
        gc.callbacks.remove(watch)
