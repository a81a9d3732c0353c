"""Modal screens: help, the setup checks, the collectives, and the one-line prompt (rank
number, filter)."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Input, Label, Static

from traceml_tui.viewmodel import CollectiveRow, DeepTraceView


class HelpScreen(ModalScreen[None]):
    """Every key of the dashboard, built from the bindings themselves."""

    BINDINGS = [Binding("escape,q,question_mark", "dismiss", "Close")]

    def __init__(self, keys: list[tuple[str, str]]) -> None:
        super().__init__()
        self.keys = keys

    def compose(self) -> ComposeResult:
        lines = "\n".join(f"  {key:<14} {description}" for key, description in self.keys)
        with Vertical(id="help"):
            yield Label("traceml keys", id="help-title")
            yield Static(lines)
            yield Label("escape closes this screen", classes="hint")


class ChecksScreen(ModalScreen[None]):
    """The setup checks' findings: what was seen, on which ranks, and the fix."""

    BINDINGS = [Binding("escape,q,c", "dismiss", "Close")]

    def __init__(self, checks: tuple[tuple[str, str, tuple[int, ...], str, str], ...]) -> None:
        super().__init__()
        self.checks = checks

    def compose(self) -> ComposeResult:
        text = Text()
        if not self.checks:
            text.append("  No setup mistake found so far.\n")
        for check_id, severity, ranks, evidence, fix in self.checks:
            shown = ", ".join(map(str, ranks[:16])) + (" ..." if len(ranks) > 16 else "")
            text.append(f"  {severity.upper():<8} ", style="bold")
            text.append(f"{check_id}", style="bold")
            text.append(f"   rank(s) {shown}\n")
            text.append(f"    seen: {evidence}\n")
            text.append(f"    fix:  {fix}\n\n", style="italic")
        with Vertical(id="help"):
            yield Label("setup checks (docs/checks.md)", id="help-title")
            yield Static(text)
            yield Label("escape closes this screen", classes="hint")


class CollectivesScreen(ModalScreen[None]):
    """Which collective, on which process group, issued from which phase, took the sync
    time: per step of the ranks that issued it (docs/network.md, "Which collective")."""

    BINDINGS = [Binding("escape,q,o", "dismiss", "Close")]

    def __init__(self, rows: tuple[CollectiveRow, ...]) -> None:
        super().__init__()
        self.rows = rows

    def compose(self) -> ComposeResult:
        text = Text()
        if not self.rows:
            text.append("  No collective accounted so far.\n")
        else:
            text.append(f"  {'op':<24} {'group':<18} {'issued in':<10} {'calls':>6} "
                        f"{'bytes':>9} {'exposed':>9} {'of sync':>7}\n", style="bold")
        for group, op, phase, calls, nbytes, exposed_ms, share in self.rows:
            size = "-" if nbytes is None else _size(nbytes)
            part = "-" if share is None else f"{share:.0%}"
            text.append(f"  {op[:24]:<24} {group[:18]:<18} {phase[:10]:<10} {calls:>6.3g} "
                        f"{size:>9} {exposed_ms:>6.2f} ms {part:>7}\n")
        with Vertical(id="help"):
            yield Label("collectives per step (exposed wait)", id="help-title")
            yield Static(text)
            yield Label("escape closes this screen", classes="hint")


def _size(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


class TraceScreen(ModalScreen[None]):
    """A deep trace's analysis: the worst (or pinned) rank beside the median rank."""

    BINDINGS = [Binding("escape,q,T", "dismiss", "Close")]

    def __init__(self, capture: DeepTraceView) -> None:
        super().__init__()
        self.capture = capture

    def compose(self) -> ComposeResult:
        cap = self.capture
        with Vertical(id="trace"):
            yield Label(Text(f"deep trace {cap.id}: {cap.steps} steps "
                             f"(docs/deep-trace.md)"), id="help-title")
            with VerticalScroll():
                yield Static(Text(cap.text or ""))
            if cap.saved:
                yield Label(Text(f"saved: {cap.saved}; traces open in ui.perfetto.dev"),
                            classes="hint")
            yield Label("escape closes this screen", classes="hint")


class PromptScreen(ModalScreen[str | None]):
    """Asks one line (a rank number, a filter); dismisses with the text or None."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, question: str, value: str = "") -> None:
        super().__init__()
        self.question = question
        self.value = value

    def compose(self) -> ComposeResult:
        with Vertical(id="prompt"):
            yield Label(self.question)
            yield Input(value=self.value, id="prompt-input")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value)

    def action_cancel(self) -> None:
        self.dismiss(None)
