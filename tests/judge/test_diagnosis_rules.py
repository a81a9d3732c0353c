"""The diagnosis rules as a table: the order of `RULES` is the priority docs/diagnosis.md
documents, a label is defined by its word (vocab) and its rule and nowhere else, and the
labels with a what-if are the keys of `cost.PRICING`, as the docs' table says."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from test_diagnosis import CASES

from traceml_agent import vocab
from traceml_tui.judge import cost
from traceml_tui.judge import diagnosis as dx

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "diagnosis.md"


def documented_rules() -> list[list[str]]:
    """The rows of the table under "## Rules, in order": [label, ..., what-if]."""
    text = DOC.read_text().split("## Rules, in order", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    return [[cell.strip().strip("`") for cell in row.strip("|").split("|")] for row in rows]


def test_the_rules_are_asked_in_the_documented_order():
    assert [row[0] for row in documented_rules()] == [rule.label for rule in dx.RULES]


def test_the_documented_what_ifs_are_the_priced_labels():
    documented = {row[0] for row in documented_rules() if row[-1] == "yes"}
    assert documented == set(cost.PRICING) == cost.COSTED_LABELS
    assert {row[-1] for row in documented_rules()} == {"yes", "no"}


def test_every_label_has_one_rule_and_hang_is_judged_from_progress():
    labels = [rule.label for rule in dx.RULES]
    assert len(labels) == len(set(labels))
    assert sorted(labels + [vocab.HANG]) == sorted(vocab.LABELS)
    assert set(cost.PRICING) <= set(labels)
    assert dx.RULES[-1].label == vocab.BALANCED  # the rule that always answers is last


@pytest.mark.parametrize("ranks, active", [c[1:3] for c in CASES], ids=[c[0] for c in CASES])
def test_a_rule_gives_only_its_own_label(ranks, active):
    """Every rule asked, not only up to the first that answers: whatever verdict a rule
    gives carries its label, so a label's verdict is made by its rule alone."""
    for fsdp in (False, True):
        window = dx.WindowStats.of(ranks, active, fsdp, None, None, None, None)
        verdicts = [(rule.label, rule.judge(window)) for rule in dx.RULES]
        assert all(v.label == label for label, v in verdicts if v is not None)
        assert dx.diagnose(ranks, active, fsdp) == next(v for _, v in verdicts if v)


def test_a_labels_word_is_written_only_in_the_vocabulary():
    """Code names a label by its vocabulary constant: its string appears in no other
    module of the collector or the agent."""
    words = set(vocab.LABELS)
    found = []
    for path in sorted([*(ROOT / "traceml_tui").rglob("*.py"), *(ROOT / "agent").rglob("*.py")]):
        if path == ROOT / "agent" / "vocab.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and node.value in words:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert not found
