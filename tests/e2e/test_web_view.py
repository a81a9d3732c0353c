"""`traceml watch --web`: the dashboard served to a real headless browser (Debian's
Chromium, driven over the DevTools protocol) while a real job runs. The browser opens the
tokened URL the server printed (it trades the token for a cookie and lands on the clean
URL); the page's terminal stream must carry the banner's diagnosis, and a screenshot of
the page is taken."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from jobs import EXAMPLES, free_ports, kill_session, live_ranks_steps, spawn_traceml, wait_for
from webview import WebServer

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytest.importorskip("textual_serve", reason="traceml watch --web needs textual-serve")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium (Debian's chromium)")

# Keeps every binary websocket frame the page receives (the app's terminal output).
CAPTURE_JS = """
(() => {
  const Real = window.WebSocket;
  window.__traceml = [];
  window.WebSocket = function (url, protocols) {
    const ws = protocols ? new Real(url, protocols) : new Real(url);
    ws.addEventListener('message', (e) => {
      if (typeof e.data !== 'string') {
        window.__traceml.push(new TextDecoder().decode(new Uint8Array(e.data)));
      }
    });
    return ws;
  };
  window.WebSocket.prototype = Real.prototype;
})();
"""
ANSI = re.compile(r"\x1b\[[0-9;?<>=]*[A-Za-z]|\x1b[()][A-Z0-9]|\x1b[=>]")


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


async def browse(url: str, devtools: int, shot: Path, expect: str, timeout: float) -> str:
    """Open `url` in the browser, wait until its terminal stream shows `expect`, save a
    screenshot; returns the stream's text."""
    import aiohttp

    async with aiohttp.ClientSession() as http:
        pages = await (await http.get(f"http://127.0.0.1:{devtools}/json")).json()
        target = next(p for p in pages if p.get("type") == "page")
        async with http.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0) as ws:
            ids = iter(range(1, 1_000_000))

            async def call(method: str, **params):
                ident = next(ids)
                await ws.send_json({"id": ident, "method": method, "params": params})
                async for msg in ws:
                    data = json.loads(msg.data)
                    if data.get("id") == ident:
                        return data.get("result", {})
                raise AssertionError("the browser closed the DevTools connection")

            await call("Page.enable")
            await call("Page.addScriptToEvaluateOnNewDocument", source=CAPTURE_JS)
            await call("Page.navigate", url=url)
            deadline = time.monotonic() + timeout
            text = ""
            while time.monotonic() < deadline:
                got = await call("Runtime.evaluate", expression="(window.__traceml||[]).join('')",
                                 returnByValue=True)
                text = ANSI.sub("", got.get("result", {}).get("value") or "")
                if expect in text:
                    await asyncio.sleep(1.0)  # let the page draw the frame it received
                    png = await call("Page.captureScreenshot", format="png")
                    shot.write_bytes(base64.b64decode(png["data"]))
                    return text
                await asyncio.sleep(0.5)
            raise AssertionError(f"the page never showed {expect!r}; it got: {text[-2000:]!r}")


def test_the_dashboard_in_a_browser_shows_the_diagnosis(tmp_path):
    out = tmp_path / "runs"
    job = spawn_traceml("run", str(EXAMPLES / "ddp_toy.py"), "--nproc-per-node", "2",
                        "--headless", "--out", str(out), "--run-name", "web", "--",
                        "--scenario", "input", "--rank", "1", "--delay-ms", "30",
                        "--steps", "100000")
    procs: list[subprocess.Popen] = []
    servers: list[WebServer] = []
    try:
        run_dir = out / "web"
        wait_for(lambda: min(live_ranks_steps(run_dir) or [0]) >= 40, 120, "the job's steps")
        port = free_ports(2)
        web = WebServer(str(run_dir), port)
        servers.append(web)
        url = web.url()  # the tokened URL it printed, as the owner would copy it
        assert url.startswith(f"http://127.0.0.1:{port}/?token=")
        devtools = port + 1
        browser = subprocess.Popen(
            [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu",
             f"--remote-debugging-port={devtools}", "--window-size=1500,1000",
             f"--user-data-dir={tmp_path / 'chromium'}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        procs.append(browser)
        wait_for(lambda: port_open(devtools), 60, "Chromium's DevTools port")
        shot = tmp_path / "web-view.png"
        text = asyncio.run(browse(url, devtools, shot, "INPUT STRAGGLER", timeout=120))
        assert "rank 1" in text and "costs" in text
        assert shot.stat().st_size > 20_000  # a drawn page, not a blank one
        png = shot.read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        for server in servers:
            server.stop()  # and its viewers (its session)
        for proc in procs:
            kill_session(proc)  # its children (the tab's viewer) ...
            proc.kill()  # ... and itself: it is not a session leader
            proc.wait(10)
        job.send_signal(signal.SIGINT)
        try:
            job.wait(60)
        except subprocess.TimeoutExpired:
            kill_session(job)
