"""Run status: elapsed, steps, steps/s, ranks reporting vs expected, stale ranks."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from traceml_agent.vocab import INFO
from traceml_tui.viewmodel import RunView

from .cells import duration


def _ranks(ranks: tuple[int, ...], limit: int = 8) -> str:
    shown = ", ".join(str(r) for r in ranks[:limit])
    return shown + (f" +{len(ranks) - limit}" if len(ranks) > limit else "")


class StatusBar(Static):
    def show(self, state: RunView, view_note: str = "", source_note: str = "") -> None:
        text = Text()
        text.append(f"{state.run_name}", style="bold")
        text.append(f"  {duration(state.elapsed_s)}  step {state.steps}")
        if state.steps_per_s:
            text.append(f"  {state.steps_per_s:.1f} steps/s")
        waiting = state.world_size - state.reporting
        text.append(f"  ranks {state.reporting}/{state.world_size}",
                    style="bold" if waiting else "")
        if waiting:
            text.append(f" ({waiting} not reporting yet)", style="dim")
        if state.nnodes > 1:
            silent = state.nodes_waiting
            text.append(f"  nodes {state.nnodes - len(silent)}/{state.nnodes}",
                        style="bold" if silent else "")
            if silent:
                text.append(f" (waiting for node {_ranks(silent)})", style="dim")
        if state.checks:
            worst = state.checks[0][1]
            text.append(f"  setup checks: {len(state.checks)} (c)",
                        style="bold reverse" if worst != INFO else "bold")
        cap = state.capture
        if cap is not None:
            if cap.text:
                text.append(f"  trace {cap.id} ready (T)", style="bold")
            elif cap.tracing:
                text.append(f"  tracing ranks {', '.join(map(str, cap.ranks))}...",
                            style="bold")
        stale = state.stale
        if stale:
            text.append(f"  stale: {_ranks(stale)}", style="bold reverse")
        if state.relays_silent:
            text.append(f"  relay of node {_ranks(state.relays_silent)} silent",
                        style="bold reverse")
        if view_note:
            text.append(f"  {view_note}", style="dim")
        if source_note:
            text.append(f"  {source_note}", style="bold")
        self.update(text)
