"""Entry point that runs the user's script inside a rank with the agent installed.

`traceml run` starts `torchrun ... -m traceml_agent.bootstrap SCRIPT ARGS...`, so
the script needs no change. This module starts the agent, runs SCRIPT as
`__main__` exactly as `python SCRIPT` would (argv, sys.path[0]), and reports the
rank's exit code and the tail of any traceback in the agent's goodbye, so the
launcher can exit with the job's own exit code and name the rank that failed.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback

from . import init, shutdown

TRACEBACK_TAIL_CHARS = 4_000


def _exit_code(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code % 256  # what the process exits with: sys.exit(256) exits 0
    return 1  # sys.exit("message") prints the message and exits 1


def main() -> None:
    if len(sys.argv) < 2:
        print("usage: python -m traceml_agent.bootstrap SCRIPT [ARGS...]", file=sys.stderr)
        raise SystemExit(2)
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    init()
    code, error = 0, None
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = _exit_code(exc)
        raise
    except KeyboardInterrupt:
        code = 130
        raise
    except BaseException:
        code, error = 1, traceback.format_exc()[-TRACEBACK_TAIL_CHARS:]
        raise
    finally:
        shutdown(code, error)


if __name__ == "__main__":
    main()
