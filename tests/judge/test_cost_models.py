"""Pricing by model, not by label (issue 31): a rule names the model its label is priced
by (diagnosis.Rule.pricing), a straggler verdict carries the phases it compared, and
cost.py prices that, so a new label with a what-if is its word and its rule. Checked
in a scratch copy where a hypothetical label is added in exactly those two files."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_cost import job

from traceml_tui.judge import cost
from traceml_tui.judge import diagnosis as dx
from traceml_tui.judge.windows import nan_medians

ROOT = Path(__file__).resolve().parents[2]


def test_the_priced_labels_and_their_pricing_derive_from_the_rules():
    priced = {r.label: r.pricing for r in dx.RULES if r.pricing is not None}
    assert dx.PRICED == priced
    assert set(priced.values()) == set(cost.MODELS)  # every model prices some label
    assert cost.PRICING == {label: cost.MODELS[m] for label, m in priced.items()}
    assert cost.COSTED_LABELS == frozenset(priced)


def test_a_straggler_is_priced_on_the_phases_its_verdict_compared():
    """A label cost.py has never heard of, priced as a straggler in the phases its
    verdict names: the optimizer gap alone, not the label's (unknown) group."""
    data = job(optimizer={3: 8.0}, forward={3: 3.0})
    d = dx.Diagnosis("A NEW LABEL", 3, "optimizer", dx.WARNING, "", gap_ms=8.0,
                     phases=("optimizer",))
    s = cost.MODELS["straggler"](d, data, False, nan_medians(data.step_ms))
    assert s is not None and s.culprit == "rank"
    assert float(s.excess_ms.mean()) == pytest.approx(8.0, abs=0.3)
    # The same culprit compared on all of compute: its forward gap counts too.
    whole = dx.Diagnosis(dx.COMPUTE_STRAGGLER, 3, "optimizer", dx.WARNING, "", gap_ms=11.0)
    w = cost.MODELS["straggler"](whole, data, False, nan_medians(data.step_ms))
    assert w is not None and float(w.excess_ms.mean()) == pytest.approx(11.0, abs=0.3)


def test_a_live_straggler_verdict_carries_its_compared_phases():
    from traceml_tui.collect.canned import make_state

    state = make_state(world_size=16, nproc_per_node=4, straggler=5, phase="forward",
                       extra_ms=4.0)
    d = state.live.shown
    assert d.label == dx.COMPUTE_STRAGGLER and d.phases == dx.COMPUTE_PHASES
    assert state.what_if is not None and state.what_if.saving_ms == pytest.approx(4.0, 0.2)


ADD_LABEL = {  # file -> (old, new): a hypothetical OPTIMIZER STRAGGLER, priced as one
    "agent/vocab.py": [
        ('COMM_BOUND: Final = "COMM-BOUND"\n',
         'COMM_BOUND: Final = "COMM-BOUND"\nOPTIMIZER_STRAGGLER: Final = "OPTIMIZER STRAGGLER"\n'),
        ("PERIODIC_STALL, COMM_BOUND)", "PERIODIC_STALL, COMM_BOUND, OPTIMIZER_STRAGGLER)")],
    "traceml_tui/judge/diagnosis.py": [
        ("    OPTIMIZER,\n", "    OPTIMIZER,\n    OPTIMIZER_STRAGGLER,\n"),
        ("def _input_bound(w: WindowStats)",
         "def _optimizer_straggler(w: WindowStats) -> Diagnosis | None:\n"
         "    s = _skew(w.ready, (OPTIMIZER,), w.step_ms) if w.ready else None\n"
         "    if s is None or s.gap_ms < MIN_GAP_MS or s.share < SKEW_ENTER:\n"
         "        return None\n"
         "    return _straggler(OPTIMIZER_STRAGGLER, s.rank, OPTIMIZER, s.gap_ms, s.share,\n"
         "                      w.step_ms, w.ready, (OPTIMIZER,))\n\n\n"
         "def _input_bound(w: WindowStats)"),
        ('    Rule(STRAGGLER, _straggler_in_both, "straggler"),',
         '    Rule(OPTIMIZER_STRAGGLER, _optimizer_straggler, "straggler"),\n'
         '    Rule(STRAGGLER, _straggler_in_both, "straggler"),'),
        ("    STRAGGLER: \"input and compute are both uneven;",
         "    OPTIMIZER_STRAGGLER: \"check its optimizer\",\n"
         "    STRAGGLER: \"input and compute are both uneven;"),
        ("    STRAGGLER: \"the host is the cause, not one rank: compare",
         "    OPTIMIZER_STRAGGLER: \"the host is the cause\",\n"
         "    STRAGGLER: \"the host is the cause, not one rank: compare")],
}
CHECK = """
import traceml_tui, traceml_agent.vocab as v
from traceml_tui.collect.canned import make_state
from traceml_tui.judge import cost
assert traceml_tui.__file__.startswith({root!r}), traceml_tui.__file__
state = make_state(world_size=16, nproc_per_node=4, straggler=5, phase="optimizer",
                   extra_ms=4.0)
d, w = state.live.shown, state.what_if
print(d.label, d.rank, d.phases, round(w.saving_ms, 1), v.OPTIMIZER_STRAGGLER in cost.COSTED_LABELS)
"""


def test_a_new_label_with_a_what_if_is_its_word_and_its_rule(tmp_path):
    """Issue 31's count: the label added in a scratch copy, in two code files, is judged
    and priced (its what-if) by a canned state with an optimizer straggler."""
    scratch = tmp_path / "tree"
    for part in ("traceml_tui", "agent"):
        shutil.copytree(ROOT / part, scratch / part,
                        ignore=shutil.ignore_patterns("__pycache__"))
    for name, edits in ADD_LABEL.items():
        path = scratch / name
        text = path.read_text()
        for old, new in edits:
            assert text.count(old) == 1, (name, old)
            text = text.replace(old, new)
        path.write_text(text)
    (scratch / "agent").rename(scratch / "traceml_agent")
    env = {**os.environ, "PYTHONPATH": str(scratch)}
    done = subprocess.run([sys.executable, "-c", CHECK.format(root=str(scratch))], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["OPTIMIZER", "STRAGGLER", "5", "('optimizer',)", "4.0",
                                   "True"]
    assert len(ADD_LABEL) == 2  # the code files the change touched
