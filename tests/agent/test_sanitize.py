"""agent/sanitize.py: no control or format character survives a cleaner (issue 42, 7b)."""

from __future__ import annotations

import sys
import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from traceml_agent.sanitize import REPLACEMENT, clean_line, clean_text

_BAD_CATEGORIES = {"Cc", "Cf", "Zl", "Zp"}


def _bad(ch: str, keep: str = "") -> bool:
    return ch not in keep and unicodedata.category(ch) in _BAD_CATEGORIES


@pytest.mark.parametrize("raw, line, text", [
    ("host-1", "host-1", "host-1"),
    ("r\u202eevil", f"r{REPLACEMENT}evil", f"r{REPLACEMENT}evil"),  # RIGHT-TO-LEFT OVERRIDE
    ("a\u2028b", "a b", "a\nb"),  # LINE SEPARATOR
    ("a\u2029b", "a b", "a\nb"),  # PARAGRAPH SEPARATOR
    ("zero\u200bwidth", f"zero{REPLACEMENT}width", f"zero{REPLACEMENT}width"),
    ("\u2066iso\u2069", f"{REPLACEMENT}iso{REPLACEMENT}", f"{REPLACEMENT}iso{REPLACEMENT}"),
    ("bom\ufeff", f"bom{REPLACEMENT}", f"bom{REPLACEMENT}"),
    ("tag\U000e0041", f"tag{REPLACEMENT}", f"tag{REPLACEMENT}"),
    ("\x1b]52;c;aGk=\x07", f"{REPLACEMENT}]52;c;aGk={REPLACEMENT}",
     f"{REPLACEMENT}]52;c;aGk={REPLACEMENT}"),  # OSC 52 clipboard write
    ("\x1b[2J\x9b2J\x7f", f"{REPLACEMENT}[2J{REPLACEMENT}2J{REPLACEMENT}",
     f"{REPLACEMENT}[2J{REPLACEMENT}2J{REPLACEMENT}"),  # screen clears (C0 and C1), DEL
    ("a\tb\nc\rd", "a b c d", f"a\tb\nc{REPLACEMENT}d"),
    ("naïve 東京 🚀 \u00a0", "naïve 東京 🚀 \u00a0", "naïve 東京 🚀 \u00a0"),  # kept
])
def test_cleaners_table(raw: str, line: str, text: str) -> None:
    assert clean_line(raw) == line
    assert clean_text(raw) == text


def test_every_format_and_separator_character_of_this_unicode_is_covered() -> None:
    """The cleaners list the format characters as ranges (no scan at import): every Cc, Cf,
    Zl and Zp character of the running Python's Unicode database must be in them."""
    bad = "".join(ch for c in range(sys.maxunicode + 1)
                  if unicodedata.category(ch := chr(c)) in _BAD_CATEGORIES)
    assert not [c for c in clean_line(bad) if _bad(c)]
    assert not [c for c in clean_text(bad) if _bad(c, keep="\t\n")]


@settings(max_examples=300, deadline=None)
@given(st.text(st.characters(codec="utf-8"), max_size=60))
def test_no_control_or_format_character_survives(raw: str) -> None:
    line, text = clean_line(raw), clean_text(raw)
    assert not [c for c in line if _bad(c)]
    assert not [c for c in text if _bad(c, keep="\t\n")]
    assert len(line) == len(raw) == len(text)  # one for one: nothing hidden by deletion
    if raw.isprintable():
        assert line is raw and text is raw  # the fast path
