"""The diagnosis banner: label (coloured by severity), rank, phase, evidence, how long."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from traceml_agent.vocab import CRITICAL, SEVERITIES
from traceml_tui.viewmodel import CostView, RunView

from .cells import duration


def cost_text(cost: CostView) -> str:
    """The cost in one line: share of every step, what it cost so far, the what-if."""
    parts = [f"costs {cost.share:.0%} of every step"]
    if cost.hours is not None:
        parts.append(f"{hours(cost.hours)} {cost.unit}-h so far")
    approx = "~" if cost.weak else ""
    parts.append(f"{approx}{cost.speedup:.1f}x faster without it "
                 f"({cost.now_ms:.1f} -> {cost.step_ms:.1f} ms/step)")
    return " · ".join(parts)


def hours(h: float) -> str:
    return f"{h:.1f}" if h >= 10 else f"{h:.2g}" if h >= 0.01 else f"{h:.1g}"


class Banner(Static):
    def show(self, state: RunView) -> None:
        # Failures first (issue 32): a failed rank leads, the banner turns critical, and
        # the label below is the verdict of the steps before it.
        severity = CRITICAL if state.failure else state.severity
        for name in SEVERITIES:
            self.set_class(severity == name, f"-{name}")
        head = Text(f" {state.label} ", style="bold reverse")
        if state.node is not None:
            head.append(f"  node {state.node}", style="bold")
        elif state.rank is not None:
            head.append(f"  rank {state.rank}", style="bold")
        if state.phase:
            head.append(f"  {state.phase}")
        head.append(f"   for {duration(state.label_for_s)}", style="dim")
        if state.finished:
            head.append(f"   run ended (exit code {state.exit_code})", style="bold")
        head.append("\n")
        if state.cost is not None:
            head.append(cost_text(state.cost) + "\n", style="bold")
        head.append(state.summary)
        if state.failure:
            head = Text.assemble(Text(state.failure + "\n", style="bold"), head)
        self.update(head)
