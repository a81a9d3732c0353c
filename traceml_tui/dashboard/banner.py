"""The diagnosis banner: label (coloured by severity), rank, phase, evidence, how long."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from traceml_agent.vocab import SEVERITIES

from ..view_state import ViewState
from .cells import duration


class Banner(Static):
    def show(self, state: ViewState) -> None:
        for severity in SEVERITIES:
            self.set_class(state.severity == severity, f"-{severity}")
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
        head.append(state.summary)
        self.update(head)
