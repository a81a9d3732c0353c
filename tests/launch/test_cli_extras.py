"""Optional extras missing on the user's machine give their one-line error, not a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_watch_web_without_textual_serve_says_so(tmp_path: Path) -> None:
    # A textual_serve that cannot be imported, first on the path: as without the web extra.
    shadow = tmp_path / "shadow" / "textual_serve"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'textual_serve'\", name='textual_serve')\n")
    env = {**os.environ, "PYTHONPATH": str(shadow.parent)}
    done = subprocess.run([sys.executable, "-m", "traceml_tui", "watch", "tcp://127.0.0.1:9",
                           "--web"], env=env, capture_output=True, text=True, timeout=60,
                          cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines() == [
        "traceml watch: error: --web needs textual-serve (pip install traceml-tui[web])"]
