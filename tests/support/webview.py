"""A real `traceml watch --web` server for tests: started in a session of its own (so its
viewers die with it), its stderr read as it comes, the tokened URL it prints taken from
there as a user would copy it."""

from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from jobs import kill_session, wait_for

URL = re.compile(r"http://\S+/\?token=\S+")


class WebServer:
    def __init__(self, target: str, port: int, *args: str, secret_file: Path | None = None,
                 cwd: Path | None = None, soft_nofile: int | None = None) -> None:
        """`soft_nofile`: the server's soft descriptor limit from its start (set in the
        child only: lowering this process's own would fail its next pipe whenever it
        already holds more, as a worker of a long test run does)."""
        cmd = [sys.executable, "-m", "traceml_tui", "watch", target, "--web", str(port), *args]
        if secret_file is not None:
            cmd += ["--secret-file", str(secret_file)]
        self.port = port
        self.lines: list[str] = []
        def limit() -> None:
            if soft_nofile is not None:
                hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft_nofile, hard))

        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True, cwd=cwd,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"},
                                     preexec_fn=limit if soft_nofile is not None else None)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    def url(self, timeout: float = 60) -> str:
        """The URL the server printed (waits for it; fails with what it said instead)."""
        wait_for(lambda: URL.search(self.stderr) or self.proc.poll() is not None, timeout,
                 "the web view's URL")
        found = URL.search(self.stderr)
        assert found, f"no tokened URL printed; stderr: {self.stderr[-2000:]!r}"
        return found.group(0)

    def viewers(self) -> list[int]:
        """Pids of the viewer processes the server runs now (its live children)."""
        import psutil

        try:
            kids = psutil.Process(self.proc.pid).children()
        except psutil.Error:
            return []
        alive = []
        for kid in kids:
            try:
                if kid.status() != psutil.STATUS_ZOMBIE:
                    alive.append(kid.pid)
            except psutil.Error:
                pass
        return alive

    def stop(self) -> None:
        """Ctrl-C, then SIGKILL of its whole session whatever happened."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            deadline = time.monotonic() + 15
            while self.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
        kill_session(self.proc)
        self.proc.wait(10)
