"""`traceml watch --web [PORT]`: the same dashboard in a browser, served by textual-serve.

Each browser tab runs its own `traceml watch` process (textual-serve's web driver speaks
to the page over a websocket), which reaches the collector exactly as a terminal viewer
does: with the run's secret, read from the run folder or given by --secret-file. Such a
viewer acts as the owner, so the server is locked (web_lock.py: a token, the page's own
Host and Origin) and the viewers are capped; textual-serve stays the engine, this module
only wraps its Server: the lock as middleware, a viewer service whose process always ends
with its socket, and a page that points its websocket at the host the browser used (an
SSH tunnel's local end, not the bound address).
"""

from __future__ import annotations

import asyncio
import shlex
import sys
from pathlib import Path
from typing import Any

# Imported here, not in serve(): without the `web` extra, `from . import web` fails and
# the command line says so in one line.
import aiohttp_jinja2
from aiohttp import web
from textual_serve.app_service import AppService
from textual_serve.server import Server

from .web_guard import ConnectionGuard, raise_limit
from .web_lock import WebLock, is_loopback, new_token, served_names, url_host

DEFAULT_VIEWERS = 4
MAX_VIEWERS = 64
# A viewer gets this long to quit after its socket closes, then it is killed.
STOP_GRACE_S = 3.0


def say(line: str) -> None:
    print(f"traceml watch: {line}", file=sys.stderr, flush=True)


def viewer_command(target: str, secret_file: Path | None) -> str:
    """The shell command each browser tab runs: a plain `traceml watch` of the target,
    exec'd so the process textual-serve holds is the viewer itself (killable)."""
    parts = [sys.executable, "-m", "traceml_tui", "watch", target]
    if secret_file is not None:
        parts += ["--secret-file", str(secret_file)]
    return "exec " + shlex.join(parts)


class ViewerService(AppService):
    """textual-serve's per-socket app process, with an end: when the socket closes the
    viewer is asked to quit, and killed if it has not within STOP_GRACE_S."""

    async def stop(self) -> None:
        try:
            await asyncio.wait_for(super().stop(), STOP_GRACE_S)
        except (asyncio.TimeoutError, OSError):
            pass
        process = self._process
        if process is not None and process.returncode is None:
            try:
                process.kill()
            except ProcessLookupError:
                pass
            await process.wait()


class LockedServer(Server):
    """textual-serve's Server behind the lock, with at most `max_viewers` viewers."""

    def __init__(self, command: str, host: str, port: int, title: str, max_viewers: int,
                 banner: str) -> None:
        super().__init__(command, host=host, port=port, title=title)
        self.token = new_token()
        self.guard = ConnectionGuard(lambda kind: self.lock.count(kind))
        self.lock = WebLock(self.token, served_names(host), say, self.guard.admit)
        self.max_viewers = max_viewers
        self.banner = banner
        self.viewers = 0
        self._sockets: set[web.WebSocketResponse] = set()

    def url(self) -> str:
        """The one URL that opens the page (printed once; the token is in nothing else)."""
        host = self.host
        if host in ("", "0.0.0.0", "::", "[::]"):
            import socket

            host = socket.gethostname()
        return f"http://{url_host(host)}:{self.port}/?token={self.token}"

    def initialize_logging(self) -> None:
        """Plain lines on stderr, errors only: the owner's terminal is not a log."""
        import logging

        logging.basicConfig(level=logging.ERROR, format="traceml watch: %(message)s")

    async def _make_app(self) -> web.Application:
        app = await super()._make_app()
        app.middlewares.append(self.lock.middleware)
        return app

    async def on_startup(self, app: web.Application) -> None:
        """textual-serve prints a logo here; the URL is printed once bound (serve)."""

    async def on_shutdown(self, app: web.Application) -> None:
        for ws in list(self._sockets):
            await ws.close()

    @aiohttp_jinja2.template("app_index.html")
    async def handle_index(self, request: web.Request) -> dict[str, Any]:
        """The page, its static files and websocket addressed through the Host the browser
        used (checked by the lock), so a tunnel's local port works."""
        try:
            font_size = int(request.query.get("fontsize", "16"))
        except ValueError:
            font_size = 16
        return {"font_size": font_size,
                "app_websocket_url": f"ws://{request.host}/ws",
                "config": {"static": {"url": f"http://{request.host}/static/"}},
                "application": {"name": self.title}}

    # Returns a 503 page instead of a socket when the viewers are all taken.
    async def handle_websocket(  # type: ignore[override]
            self, request: web.Request) -> web.StreamResponse:
        if self.viewers >= self.max_viewers:
            return self.lock.refuse("viewers", status=503)
        self.viewers += 1  # no await since the check: the cap holds under concurrency
        try:
            return await self._run_viewer(request)
        finally:
            self.viewers -= 1

    async def _run_viewer(self, request: web.Request) -> web.WebSocketResponse:
        """textual-serve's websocket handler, with ViewerService and the socket tracked."""
        websocket = web.WebSocketResponse(heartbeat=15)
        width = _int(request.query.get("width"), 80)
        height = _int(request.query.get("height"), 24)
        service: ViewerService | None = None
        self._sockets.add(websocket)
        try:
            await websocket.prepare(request)
            service = ViewerService(self.command, write_bytes=websocket.send_bytes,
                                    write_str=websocket.send_str,
                                    close=websocket.close,  # type: ignore[arg-type]
                                    download_manager=self.download_manager)
            await service.start(width, height)
            await self._process_messages(websocket, service)
        except asyncio.CancelledError:
            await websocket.close()
        except Exception as exc:  # a malformed message from the page ends its viewer
            say(f"a browser viewer ended: {type(exc).__name__}: {exc}")
        finally:
            self._sockets.discard(websocket)
            if service is not None:
                await service.stop()
        return websocket

    def serve(self, debug: bool = False) -> None:
        """Serve until Ctrl-C or SIGTERM; the URL is printed once the port is bound.
        aiohttp's run_app, but with every connection through the guard (web_guard.py),
        the descriptor limit raised and failed accepts counted, not logged each."""
        self.initialize_logging()
        raise_limit()
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        loop.set_exception_handler(self.guard.on_loop_error)
        main = loop.create_task(self._serve())
        try:
            loop.run_until_complete(main)
        except (web.GracefulExit, KeyboardInterrupt):
            pass
        finally:
            main.cancel()
            try:
                loop.run_until_complete(main)  # its cleanup: viewers ended, sockets closed
            except (asyncio.CancelledError, web.GracefulExit, KeyboardInterrupt):
                pass
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
            if (line := self.lock.summary()) is not None:
                say(line)

    async def _serve(self) -> None:
        runner = web.AppRunner(await self._make_app(), handle_signals=True,
                               shutdown_timeout=STOP_GRACE_S + 2)
        await runner.setup()
        assert runner.server is not None  # made by setup()
        host = None if self.host in ("", "0.0.0.0", "::", "[::]") else self.host
        try:
            server = await asyncio.get_running_loop().create_server(
                self.guard.watch(runner.server), host, self.port, reuse_address=True,
                backlog=128)
        except BaseException:
            await runner.cleanup()
            raise
        if not is_loopback(self.host):
            say(f"warning: --web-host {self.host}: anyone who can reach this address "
                f"and has the URL can open the dashboard and act as you in it")
        say(f"{self.banner} {self.url()} (Ctrl-C stops)")
        try:
            await asyncio.Event().wait()  # until Ctrl-C or SIGTERM (GracefulExit)
        finally:
            server.close()
            await runner.cleanup()


def _int(value: str | None, default: int) -> int:
    try:
        return max(1, min(1000, int(value or default)))
    except ValueError:
        return default


def serve(target: str, secret_file: Path | None, host: str, port: int, title: str,
          max_viewers: int = DEFAULT_VIEWERS) -> None:
    """Serve until interrupted (Ctrl-C)."""
    LockedServer(viewer_command(target, secret_file), host, port, title, max_viewers,
                 f"serving the dashboard of {target} on").serve()
