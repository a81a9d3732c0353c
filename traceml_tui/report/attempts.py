"""The summary's words for a job torchrun restarted (judge/attempts.py keeps the record).

A restart is what the reader of a summary most needs to know first: the failure that
caused it, what it cost, and how the job as a whole ended, in one line ahead of
everything else ("attempt 1: rank 2 raised ValueError at step 40; restarted after 3.1 s;
attempt 2 ran to the end; the job exited with code 0"). A job that ran in one attempt
says nothing of attempts.
"""

from __future__ import annotations

import re

from traceml_agent.vocab import format_ranks
from traceml_tui.runfolder.summary_model import Attempt, Episode, Failure, Summary

# The exception's class on the last line of a traceback ("ValueError: bad batch"), as
# Python prints it: a dotted name, then a colon (or nothing more).
_EXCEPTION = re.compile(r"^([A-Za-z_][\w.]*)(?::|$)")


def how_it_ended(failure: Failure) -> str:
    """'raised ValueError', 'was killed by signal 9 (SIGKILL)', 'exited with code 3'."""
    code = failure.exit_code
    if code is not None and code < 0:
        sig = failure.signal
        return f"was killed by signal {-code}" + (f" ({sig})" if sig else "")
    found = _EXCEPTION.match(failure.error or "")
    name = found.group(1) if found else ""
    if name and name.rsplit(".", 1)[-1][:1].isupper():  # a class, not "error: ..."
        return f"raised {name}"
    return f"exited with code {code}"


def _attempt_words(a: Attempt) -> str:
    failure = a.failure
    silent = [s.rank for s in a.silent]
    # Ranks with no goodbye: killed (perhaps first: the cause) or stopped by torchrun
    # after the failure; the record cannot tell which, so it says both.
    quiet = (f"rank(s) {format_ranks(silent)} ended without a word (killed by a signal, "
             f"or stopped by torchrun)") if silent else ""
    if failure is None:
        return f"attempt {a.attempt}: " + (quiet or "ended without a failure "
                                             "(a membership change)")
    others = failure.others
    return (f"attempt {a.attempt}: rank {failure.rank} {how_it_ended(failure)} at step "
            f"{failure.step}" + (f" (then rank(s) {format_ranks(others)})" if others else "")
            + (f"; {quiet}" if quiet else ""))


def lead(s: Summary) -> list[str]:
    """The summary text's first line when torchrun restarted the job (none otherwise)."""
    restarts = s.restarts
    attempts = s.attempts
    if not restarts or len(attempts) < 2:
        return []
    parts = []
    for a in attempts[:-1]:
        cost = a.restart_s
        parts.append(_attempt_words(a) + "; restarted"
                     + (f" after {cost:.1f} s" if cost is not None else ""))
    if restarts.dropped:
        parts.insert(1, f"{restarts.dropped} more attempt(s) not kept")
    last, code = attempts[-1], s.run.exit_code
    if code == 0:
        parts.append(f"attempt {last.attempt} ran to the end")
    elif last.failure is not None:
        parts.append(_attempt_words(last) + "; no restart left")
    else:
        parts.append(f"attempt {last.attempt} ended")
    return ["; ".join(parts) + f"; the job exited with code {code}"]


def step_range(e: Episode, several: bool) -> str:
    """An episode's step range in the text timeline, with its attempt when there were
    several (its steps are that attempt's: they start again at 0)."""
    until = f"-{e.end_step}" if e.end_step is not None else "-"
    steps = f"steps {e.start_step:>6}{until:<7}"
    return f"attempt {e.attempt}, {steps}" if several else steps
