"""Text from a rank is data, never terminal control.

Host names, errors, stacks, phase and thread names, findings: every string that
arrives from a rank (any key holder) is cleaned on receipt, before it reaches memory,
files or a terminal. C0 controls (ESC among them), DEL and C1 controls become U+FFFD;
a multi-line text (a stack, a traceback) keeps its newlines and tabs, a one-line field
turns them into spaces. Rich/Textual markup is escaped where text is rendered.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"
_CONTROLS = [*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0)]
_LINE = {c: REPLACEMENT for c in _CONTROLS} | {0x09: " ", 0x0A: " ", 0x0D: " "}
_TEXT = {c: REPLACEMENT for c in _CONTROLS if c not in (0x09, 0x0A)}


def clean_line(value: str) -> str:
    """One line of text: no control character, no line break."""
    return value if value.isprintable() else value.translate(_LINE)


def clean_text(value: str) -> str:
    """Multi-line text: newlines and tabs kept, every other control character replaced."""
    return value if value.isprintable() else value.translate(_TEXT)
