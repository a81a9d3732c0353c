"""`traceml watch --web [PORT]`: the same dashboard in a browser, served by textual-serve.

Each browser tab runs its own `traceml watch` process (textual-serve's web driver speaks
to the page over a websocket), which reaches the collector exactly as a terminal viewer
does: with the run's secret, read from the run folder or given by --secret-file. The
page itself has no login, so it binds to loopback by default; share it over an SSH
tunnel (`ssh -N -L 8000:127.0.0.1:8000 node0`), not by binding a public address.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

# textual-serve runs the app with this driver: the viewer is then not in a terminal.
WEB_DRIVER_ENV = "TEXTUAL_DRIVER"
DEFAULT_PORT = 8000


def viewer_command(target: str, secret_file: Path | None) -> str:
    """The shell command each browser tab runs: a plain `traceml watch` of the target."""
    parts = [sys.executable, "-m", "traceml_tui", "watch", target]
    if secret_file is not None:
        parts += ["--secret-file", str(secret_file)]
    return shlex.join(parts)


def serve(target: str, secret_file: Path | None, host: str, port: int, title: str) -> None:
    """Serve until interrupted (Ctrl-C)."""
    from textual_serve.server import Server

    Server(viewer_command(target, secret_file), host=host, port=port, title=title).serve()
