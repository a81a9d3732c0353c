"""The lock on `traceml watch --web` (issue 30, finding 1), tried as its attackers would:
another local user, a foreign web page (a websocket with a foreign Origin, or none of the
token), a DNS-rebound host name, a sixth browser tab; and the owner's printed URL, which
must keep working. Real servers on loopback, a real websocket client (aiohttp's); the
viewers' collector address is a closed port (the lock is what is under test)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from jobs import free_ports, wait_for
from webview import WebServer

pytest.importorskip("textual_serve", reason="traceml watch --web needs textual-serve")
import aiohttp  # noqa: E402  (textual-serve's own dependency)

FOREIGN = "http://evil.example"


@pytest.fixture
def server(tmp_path):
    """A web view with the default cap, its URL printed; stopped with its viewers after."""
    secret = tmp_path / "secret.key"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    closed = free_ports(2)
    srv = WebServer(f"tcp://127.0.0.1:{closed}", closed + 1, secret_file=secret)
    try:
        srv.url()
        yield srv
    finally:
        srv.stop()


def session() -> aiohttp.ClientSession:
    # Cookies are handled by hand: each test says exactly what it sends.
    return aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar())


async def get_cookie(http: aiohttp.ClientSession, url: str) -> str:
    """Open the printed URL as a browser does: the token buys a cookie and a redirect."""
    async with http.get(url, allow_redirects=False) as resp:
        assert resp.status == 303, await resp.text()
        assert resp.headers["Location"] == "/"
        raw = resp.headers["Set-Cookie"]
    assert "HttpOnly" in raw and "SameSite=Strict" in raw and "Path=/" in raw
    return raw.split(";", 1)[0]


async def ws_status(http: aiohttp.ClientSession, base: str, query: str = "width=100&height=30",
                    **headers: str) -> int:
    """The status a websocket handshake to the dashboard gets (101 when it opens)."""
    try:
        async with http.ws_connect(f"{base}/ws?{query}", headers=headers):
            return 101
    except aiohttp.WSServerHandshakeError as exc:
        return exc.status


async def first_frame(ws: aiohttp.ClientWebSocketResponse, timeout: float = 90) -> bytes:
    """The viewer's first terminal output (binary frames are the app's screen)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        msg = await ws.receive(timeout=max(0.1, deadline - loop.time()))
        if msg.type == aiohttp.WSMsgType.BINARY:
            return msg.data
        assert msg.type == aiohttp.WSMsgType.TEXT, f"socket ended: {msg}"


async def connect_when_free(http: aiohttp.ClientSession, url: str, headers: dict[str, str],
                            timeout: float = 30) -> aiohttp.ClientWebSocketResponse:
    """A websocket once a slot is free: the slot of a closed tab frees a moment after its
    viewer process has gone (the server reaps it first)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            return await http.ws_connect(url, headers=headers)
        except aiohttp.WSServerHandshakeError as exc:
            if exc.status != 503 or loop.time() > deadline:
                raise
            await asyncio.sleep(0.1)


def base_of(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def said(server: WebServer, line: str) -> None:
    """The server's log says `line`: read by a thread, so waited for, not looked at once."""
    wait_for(lambda: line in server.stderr, 10, repr(line))


def test_the_owner_url_opens_the_dashboard_and_its_viewer_ends_with_the_socket(server):
    url = server.url()

    async def probe() -> tuple[str, bytes]:
        base = base_of(url)
        async with session() as http:
            cookie = await get_cookie(http, url)
            async with http.get(f"{base}/", headers={"Cookie": cookie}) as resp:
                assert resp.status == 200
                page = await resp.text()
            async with http.get(f"{base}/static/js/textual.js",
                                headers={"Cookie": cookie}) as resp:
                assert resp.status == 200
            async with http.ws_connect(f"{base}/ws?width=100&height=30",
                                       headers={"Cookie": cookie, "Origin": base}) as ws:
                data = await first_frame(ws)
                assert len(server.viewers()) == 1
            return page, data

    page, data = asyncio.run(probe())
    assert f'data-session-websocket-url="ws://{urlsplit(url).netloc}/ws"' in page
    assert data  # the viewer's screen reached the socket
    wait_for(lambda: server.viewers() == [], 30, "the viewer to end with its socket")
    assert server.stderr.count("?token=") == 1  # printed once


def test_without_the_token_nothing_is_served(server):
    base = base_of(server.url())

    async def probe() -> None:
        async with session() as http:
            for path in ("/", "/static/js/textual.js", "/static/", "/?token=wrong",
                         "/?token=", "/download/x"):
                async with http.get(base + path, allow_redirects=False) as resp:
                    body = await resp.text()
                    assert resp.status == 403, (path, resp.status)
                    assert body.count("\n") == 1 and "token" in body
                    assert "textual" not in body.lower() and "Set-Cookie" not in resp.headers
            wrong = "traceml-web-x=" + "A" * 43
            async with http.get(base + "/", headers={"Cookie": wrong}) as resp:
                assert resp.status == 403
            name = (await get_cookie(http, server.url())).split("=", 1)[0]
            assert await ws_status(http, base, Origin=base) == 403
            assert await ws_status(http, base, Origin=base, Cookie=f"{name}=nope") == 403
            token = server.url().rsplit("=", 1)[1]
            assert await ws_status(http, base, f"token={token}", Origin=base) == 403

    asyncio.run(probe())
    assert server.viewers() == []
    said(server, "refused a request without the right token")


def test_a_foreign_page_cannot_open_the_websocket_even_with_the_cookie(server):
    """Cross-site websocket hijacking: the browser would send the owner's cookie along
    (SameSite aside); the Origin gives the page away."""
    url = server.url()
    base = base_of(url)

    async def probe() -> None:
        async with session() as http:
            cookie = await get_cookie(http, url)
            for origin in (FOREIGN, "null", f"https://{urlsplit(url).netloc}",
                           "http://localhost.evil.example"):
                assert await ws_status(http, base, Cookie=cookie, Origin=origin) == 403
            assert await ws_status(http, base, Cookie=cookie) == 403  # no Origin at all

    asyncio.run(probe())
    assert server.viewers() == []
    said(server, "refused a websocket from a foreign page")


def test_a_rebound_host_name_is_refused_even_with_the_cookie(server):
    """DNS rebinding: evil.example resolving to 127.0.0.1 puts its own name in Host."""
    url = server.url()
    base = base_of(url)
    rebound = f"evil.example:{server.port}"

    async def probe() -> None:
        async with session() as http:
            cookie = await get_cookie(http, url)
            async with http.get(f"{base}/", headers={"Cookie": cookie, "Host": rebound}) as r:
                assert r.status == 403
                assert "dashboard" not in (await r.text()).lower()
            async with http.get(f"{base}/?token={url.split('=')[-1]}",
                                headers={"Host": rebound}, allow_redirects=False) as r:
                assert r.status == 403 and "Set-Cookie" not in r.headers
            assert await ws_status(http, base, Cookie=cookie, Host=rebound,
                                   Origin=f"http://{rebound}") == 403

    asyncio.run(probe())
    assert server.viewers() == []
    said(server, "refused a request for a foreign host name")


def test_the_fifth_viewer_is_refused_and_spawns_nothing(server):
    url = server.url()
    base = base_of(url)

    async def probe() -> None:
        async with session() as http:
            cookie = await get_cookie(http, url)
            head = {"Cookie": cookie, "Origin": base}
            sockets = []
            try:
                for _ in range(4):
                    ws = await http.ws_connect(f"{base}/ws", headers=head)
                    sockets.append(ws)
                    await first_frame(ws)
                four = server.viewers()
                assert len(four) == 4
                with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                    await http.ws_connect(f"{base}/ws", headers=head)
                assert refused.value.status == 503
                async with http.get(f"{base}/ws", headers=head) as resp:
                    assert resp.status == 503  # also said as a page: one line
                    assert "viewers" in await resp.text()
                assert sorted(server.viewers()) == sorted(four)  # no fifth, not even briefly
                await sockets.pop().close()
                wait_for(lambda: len(server.viewers()) == 3, 30, "the closed tab's viewer")
                ws = await connect_when_free(http, f"{base}/ws", head)  # a slot again
                sockets.append(ws)
                await first_frame(ws)
                assert len(server.viewers()) == 4
            finally:
                for ws in sockets:
                    await ws.close()

    asyncio.run(probe())
    wait_for(lambda: server.viewers() == [], 30, "every viewer to end with its socket")
    said(server, "refused a viewer over the --web-viewers cap")


def test_a_stuck_viewer_is_killed_with_its_socket_and_ctrl_c_ends_them_all(server):
    """A viewer that cannot quit (stopped, here) still ends when its tab closes, so its
    slot frees; Ctrl-C on the server ends every viewer left."""
    url = server.url()
    base = base_of(url)

    async def probe() -> int:
        async with session() as http:
            cookie = await get_cookie(http, url)
            head = {"Cookie": cookie, "Origin": base}
            stuck = await http.ws_connect(f"{base}/ws", headers=head)
            await first_frame(stuck)
            (stuck_pid,) = server.viewers()
            os.kill(stuck_pid, signal.SIGSTOP)
            other = await http.ws_connect(f"{base}/ws", headers=head)
            await first_frame(other)
            (other_pid,) = set(server.viewers()) - {stuck_pid}
            await stuck.close()
            wait_for(lambda: server.viewers() == [other_pid], 30, "the stuck viewer's end")
            server.proc.send_signal(signal.SIGINT)
            wait_for(lambda: server.proc.poll() is not None, 30, "the server to stop")
            await other.close()
            return other_pid

    other_pid = asyncio.run(probe())
    assert server.proc.returncode == 0, server.stderr
    wait_for(lambda: not _alive(other_pid), 10, "the last viewer's end")


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _as_nobody_works() -> str | None:
    if os.geteuid() != 0:
        return "needs root to act as another user (runuser)"
    runuser = shutil.which("runuser")
    if runuser is None or not Path("/usr/bin/python3").exists():
        return "no runuser or /usr/bin/python3"
    probe = subprocess.run([runuser, "-u", "nobody", "--", "/usr/bin/python3", "-c", "1"],
                           capture_output=True)
    return None if probe.returncode == 0 else f"runuser failed: {probe.stderr[-200:]!r}"


# Runs as `nobody` with the system's Python (no aiohttp): looks for the token wherever
# another user can look (every process's command line), then asks for the page and the
# websocket by hand. The token comes on stdin, only to check it is nowhere to be seen.
NOBODY = r"""
import json, os, socket, sys
token, port = sys.stdin.read().split()
seen = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    for name in ("cmdline", "environ"):
        try:
            with open(f"/proc/{pid}/{name}", "rb") as f:
                if token.encode() in f.read():
                    seen.append(f"{pid}/{name}")
        except OSError:
            pass
def ask(request):
    with socket.create_connection(("127.0.0.1", int(port)), timeout=20) as s:
        s.sendall(request.encode())
        data = b""
        while b"\r\n\r\n" not in data and (chunk := s.recv(65536)):
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = [int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                  if line.startswith(b"content-length:")]
        while length and len(body) < length[0] and (chunk := s.recv(65536)):
            body += chunk
    return (head + b"\r\n\r\n" + body).decode("latin-1")
host = f"127.0.0.1:{port}"
page = ask(f"GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n")
ws = ask(f"GET /ws HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
         f"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
         f"Origin: http://{host}\r\n\r\n")
print(json.dumps({"uid": os.getuid(), "seen": seen, "page": page, "ws": ws}))
"""


def test_another_local_user_gets_nothing(server):
    reason = _as_nobody_works()
    if reason:
        pytest.skip(reason)
    token = server.url().rsplit("=", 1)[1]
    out = subprocess.run(["runuser", "-u", "nobody", "--", "/usr/bin/python3", "-c", NOBODY],
                         input=f"{token} {server.port}", capture_output=True, text=True,
                         timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["uid"] != os.getuid()
    assert got["seen"] == []  # the token is on no command line and in no readable environ
    assert got["page"].startswith("HTTP/1.1 403"), got["page"][:300]
    assert got["ws"].startswith("HTTP/1.1 403"), got["ws"][:300]
    assert "textual" not in (got["page"] + got["ws"]).lower()
    assert server.viewers() == []


def test_a_public_host_warns_and_still_needs_the_token(tmp_path):
    secret = tmp_path / "secret.key"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    closed = free_ports(2)
    srv = WebServer(f"tcp://127.0.0.1:{closed}", closed + 1, "--web-host", "0.0.0.0",
                    secret_file=secret)
    try:
        url = srv.url()
        assert "warning: --web-host 0.0.0.0: anyone who can reach this address" in srv.stderr
        assert "?token=" in url

        async def probe() -> int:
            async with session() as http:
                async with http.get(f"http://127.0.0.1:{srv.port}/") as resp:
                    return resp.status

        assert asyncio.run(probe()) == 403
    finally:
        srv.stop()


def test_without_textual_serve_one_line_error(tmp_path):
    """Not installed: a package of that name that fails to import shadows the real one."""
    fake = tmp_path / "shadow" / "textual_serve"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'textual_serve'\", name='textual_serve')\n")
    secret = tmp_path / "secret.key"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tmp_path / "shadow"), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "traceml_tui", "watch", "tcp://127.0.0.1:9",
                          "--secret-file", str(secret), "--web", str(free_ports(1))],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2
    assert out.stderr == ("traceml watch: error: --web needs textual-serve "
                          "(pip install traceml-tui[web])\n")


@pytest.mark.parametrize(("host", "ok"), [
    ("127.0.0.1:8000", True), ("localhost:9000", True), ("[::1]:8000", True),
    ("LOCALHOST:8000", True), ("127.0.0.1", True), ("evil.example:8000", False),
    ("127.0.0.1.evil.example:8000", False), ("localhost.:8000", False), ("", False),
    ("[::1].evil:8000", False), ("gpu-node:8000", True)])
def test_host_names_a_bound_server_answers_to(host, ok):
    from traceml_tui.view.web_lock import WebLock, served_names

    lock = WebLock("t" * 43, served_names("gpu-node"), lambda line: None)
    assert lock.host_ok(host) is ok
    assert lock.origin_ok(f"http://{host}", host) is True
    assert lock.origin_ok(f"http://{host}.evil", host) is False
