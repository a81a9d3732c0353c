"""Exit codes, in one place: what a rank said, what the job did, what a shell reads.

A code travels three hops: a rank's goodbye (any integer a key holder can send), the
record (`final_summary.json`'s `exit_code`, per rank and for the job) and `traceml run`'s
own exit status (one byte, read by CI and Slurm as success or failure). Whether the job
failed is torchrun's word, never a wire value's; each hop clamps what it cannot trust.
The agent's side (a process's SystemExit as the byte it exits with) stays in the agent,
which imports nothing of the tool (agent/bootstrap.py).
"""

from __future__ import annotations

# The exit code `traceml run` gives an interrupted job (Ctrl-C), as shells do: its
# ranks' deaths are the user's doing, not a failure to lead with.
INTERRUPTED_EXIT = 130
# A rank that ended on the user's signal was stopped, not failed: KeyboardInterrupt
# (Ctrl-C, 130), SIGHUP (129) and SIGTERM (143) as exit codes, or the signal itself.
STOP_EXIT_CODES = frozenset({INTERRUPTED_EXIT, 129, 143, -2, -1, -15})


def wire_exit_code(code: int | None) -> int | None:
    """A rank's exit code as its goodbye says, clamped to what a process can exit with
    (-255..255, a signal's negative): the wire may say anything."""
    return None if code is None else max(-255, min(255, code))


def shell_exit_code(code: int, fallback: int = 1) -> int:
    """A failed job's code as a shell reads it: 1-255 as it is, a signal's negative code
    as 128 + the signal; anything else a failure must not be read as (0, a multiple of
    256, a value beyond a byte) is `fallback` (torchrun's own code), or 1."""
    if 1 <= code <= 255:
        return code
    if -127 <= code < 0:
        return 128 - code
    return fallback if 1 <= fallback <= 255 else 1


def job_exit_code(torchrun_exit: int | None, interrupted: bool,
                  failures: list[tuple[int, int]]) -> tuple[int | None, int | None]:
    """The training job's exit code and the rank that failed first.

    torchrun itself exits 1 whatever a rank's code was; the agents report each rank's
    own code, so a script that exits 3 on one rank makes `traceml run` exit 3. Whether
    the job failed is torchrun's word, never a wire value's: a rank's code that a shell
    would read as success or cannot exit with (0, 256, beyond a byte) is 1 when torchrun
    failed (shell_exit_code).
    """
    failed_rank = failures[0][0] if failures else None
    if interrupted:
        return INTERRUPTED_EXIT, failed_rank
    if torchrun_exit == 0:
        return 0, None
    if torchrun_exit is None:
        return (None, None) if not failures else (shell_exit_code(failures[0][1]),
                                                   failed_rank)
    if failures:
        return shell_exit_code(failures[0][1], torchrun_exit), failed_rank
    return shell_exit_code(torchrun_exit), None


def process_exit_code(code: int | None, torchrun_rc: int | None) -> int:
    """What `traceml run` exits with: the record's code, as a shell reads it; a job that
    torchrun saw fail never exits 0, whatever code the record holds (a wire value that
    is a multiple of 256, say)."""
    if code is None:
        return 1
    if torchrun_rc not in (None, 0) and not 1 <= code <= 255:
        return shell_exit_code(code, torchrun_rc)
    return code if 0 <= code <= 255 else shell_exit_code(code)


# The error said for a rank whose goodbye reported exit code 0 and whom torchrun then saw
# fail: its script had returned, and the process died at exit.
DIED_AFTER_GOODBYE = ("died at exit, after its script returned: a crash in teardown (an "
                      "atexit handler, a destructor, a library's thread)")


def root_cause_end(root_code: int, said: int | None, error: str | None
                   ) -> tuple[int, str | None] | None:
    """What the record keeps of the rank torchrun saw fail first (`root_code`: its exit
    code, a signal's negative), whose goodbye said `said` (None: it said none, as a rank
    killed by a signal): (exit code, error), or None to keep the goodbye's, a failure the
    rank named itself. A goodbye that said 0 followed by torchrun's failure is a death at
    exit (fresh-clone run 43's SIGABRT in teardown): torchrun's word on whether the rank
    failed wins, and the error says when it died."""
    if said:
        return None
    return root_code, (DIED_AFTER_GOODBYE if said == 0 and error is None else error)


def lead_with(failures: list[tuple[int, int]], rank: int, root_code: int
              ) -> list[tuple[int, int]]:
    """`failures` (rank, exit code) led by the rank torchrun saw fail first, its code as
    the job's (a signal's as 128 + it); the others keep their order."""
    code = 128 - root_code if root_code < 0 else root_code
    return [(rank, code)] + [f for f in failures if f[0] != rank]
