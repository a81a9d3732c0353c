"""Modal screens: the help screen and the one-line prompt (rank number, filter)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label, Static


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
