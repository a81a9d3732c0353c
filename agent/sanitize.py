"""Text from a rank is data, never terminal control.

Host names, errors, stacks, phase and thread names, findings: every string that
arrives from a rank (any key holder), or from whatever answers at a viewer's address,
is cleaned on receipt, before it reaches memory, files or a terminal. C0 controls (ESC
among them), DEL and C1 controls become U+FFFD; so do Unicode format characters
(category Cf: U+202E RIGHT-TO-LEFT OVERRIDE turns a line around on screen, U+200B ZERO
WIDTH SPACE hides text in a name). The line and paragraph separators (Zl, Zp: U+2028,
U+2029) are line breaks to some terminals and editors: a multi-line text (a stack, a
traceback) keeps its newlines and tabs and gets a newline for them, a one-line field
turns every line break into a space.

Fast, since it runs in the agent: a string that is printable (str.isprintable, in C:
every character above is non-printable) is returned as is; only the others go through
one precompiled translate table. The format characters are listed as ranges rather than
found by a scan of unicodedata at import (0.1 s); tests/agent/test_sanitize.py checks that the
list covers every Cf, Zl and Zp character of the running Python's Unicode database.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"
_CONTROLS = [*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0)]
# Unicode 15's format characters (Cf), as inclusive ranges; U+2028 and U+2029 (Zl, Zp)
# sit inside 0x2028-0x202E and are overridden below.
_FORMAT_RANGES = (
    (0x00AD, 0x00AD), (0x0600, 0x0605), (0x061C, 0x061C), (0x06DD, 0x06DD),
    (0x070F, 0x070F), (0x0890, 0x0891), (0x08E2, 0x08E2), (0x180E, 0x180E),
    (0x200B, 0x200F), (0x2028, 0x202E), (0x2060, 0x2064), (0x2066, 0x206F),
    (0xFEFF, 0xFEFF), (0xFFF9, 0xFFFB), (0x110BD, 0x110BD), (0x110CD, 0x110CD),
    (0x13430, 0x1343F), (0x1BCA0, 0x1BCA3), (0x1D173, 0x1D17A), (0xE0001, 0xE0001),
    (0xE0020, 0xE007F),
)
_FORMAT = [c for lo, hi in _FORMAT_RANGES for c in range(lo, hi + 1)]
_SEPARATORS = (0x2028, 0x2029)
_REPLACED = {c: REPLACEMENT for c in (*_CONTROLS, *_FORMAT)}
_LINE = _REPLACED | {0x09: " ", 0x0A: " ", 0x0D: " "} | {c: " " for c in _SEPARATORS}
_TEXT = {c: v for c, v in _REPLACED.items() if c not in (0x09, 0x0A)} | {
    c: "\n" for c in _SEPARATORS}


def clean_line(value: str) -> str:
    """One line of text: no control or format character, no line break."""
    return value if value.isprintable() else value.translate(_LINE)


def clean_text(value: str) -> str:
    """Multi-line text: newlines and tabs kept, every other control or format character
    replaced (a line or paragraph separator by a newline)."""
    return value if value.isprintable() else value.translate(_TEXT)
