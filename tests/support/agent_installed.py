"""The agent's hooks installed on a fresh Recorder for a test, and always taken out again:
the one set-up of the tests that drive real torch code under the hooks in-process."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from traceml_agent import hooks
from traceml_agent.recorder import Recorder


@contextmanager
def installed(observer: Any = None, maxlen: int | None = None
              ) -> Iterator[tuple[Recorder, list[BaseException], deque]]:
    """(recorder, errors the hooks reported, the recorder's step records)."""
    out: deque = deque(maxlen=maxlen)
    rec = Recorder(out)
    errors: list[BaseException] = []
    hooks.install(rec, torch, errors.append, observer)
    try:
        yield rec, errors, out
    finally:
        hooks.uninstall()
