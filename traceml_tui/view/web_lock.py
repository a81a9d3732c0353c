"""The lock on `traceml watch --web`: a token, the page's own Host and Origin, counted refusals.

Loopback is shared by every user of a login node, and any web page the owner visits may
open a websocket to 127.0.0.1 (browsers do not apply the same-origin rule to websockets).
Every viewer the page starts runs as the owner, with the run's secret and the owner's keys
(deep traces, exports into the run folder). So, as Jupyter does:

- a random token per server, printed once in the URL; a request carrying it in the URL is
  answered with an HttpOnly, SameSite=Strict cookie and a redirect to the clean URL (the
  token then stays out of the page's address, its Referer and the history); every route
  (page, static files, downloads, the websocket) needs the cookie, compared in constant
  time; a missing or wrong one gets a one-line 403 and no dashboard bytes;
- the Host header must name this server (loopback names, or the --web-host it was given),
  against DNS rebinding; the websocket's Origin must be the page's own (http:// + Host),
  against cross-site websockets.
Refusals are counted and said on the owner's terminal (at the 1st, 2nd, 4th, 8th... of
each kind, so a flood cannot flood the terminal).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
import socket
from collections import Counter
from collections.abc import Awaitable, Callable
from urllib.parse import urlencode

from aiohttp import web

TOKEN_PARAM = "token"
WS_PATH = "/ws"
LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "[::1]"})
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})

# What a refused browser sees: one line, nothing of the dashboard.
REFUSED_TEXT = {
    "token": "traceml: this web view needs the URL with its token that "
             "`traceml watch --web` printed\n",
    "host": "traceml: this web view answers only to its own host names\n",
    "origin": "traceml: this web view's websocket opens only from its own page\n",
    "viewers": "traceml: this web view has all the viewers it allows open; close a tab "
               "(or restart it with a higher --web-viewers)\n",
}
REFUSED_LOG = {
    "token": "a request without the right token",
    "host": "a request for a foreign host name (DNS rebinding?)",
    "origin": "a websocket from a foreign page (cross-site websocket)",
    "viewers": "a viewer over the --web-viewers cap",
    # Connections, not requests (web_guard.py): closed before the lock could see one.
    "stalled": "a connection that sent no request within 5 s (a browser's spare one, or a "
               "stalled client; closed)",
    "crowded": "the oldest of too many connections without a request yet (closed)",
    "accept": "a connection: out of descriptors",
}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def new_token() -> str:
    """256 random bits, URL-safe: the whole lock rests on this not being guessable."""
    return secrets.token_urlsafe(32)


def url_host(host: str) -> str:
    """A host as it appears in a URL or Host header: IPv6 literals in brackets."""
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]"
    except ValueError:
        pass
    return host.lower()


def is_loopback(host: str) -> bool:
    return url_host(host) in LOOPBACK_NAMES or host.startswith("127.")


def served_names(bind_host: str) -> frozenset[str]:
    """The names a browser may put in Host: loopback (also what an SSH tunnel's local end
    gives), the bound host as given, and for a wildcard bind this machine's own names."""
    names = set(LOOPBACK_NAMES) | {url_host(bind_host)}
    if bind_host in WILDCARD_HOSTS:
        for name in {socket.gethostname(), socket.getfqdn()}:
            names.add(name.lower())
            try:
                infos = socket.getaddrinfo(name, None)
            except OSError:
                infos = []
            names.update(url_host(str(info[4][0])) for info in infos)
        try:
            import psutil

            for addrs in psutil.net_if_addrs().values():
                names.update(url_host(a.address.split("%")[0]) for a in addrs
                             if a.family in (socket.AF_INET, socket.AF_INET6))
        except (ImportError, OSError):
            pass
    return frozenset(names - {""})


def split_host(header: str) -> str:
    """The name part of a Host header ("[::1]:8000" -> "[::1]", "a:8000" -> "a")."""
    header = header.strip().lower()
    if header.startswith("["):
        name, _, rest = header.partition("]")
        return name + "]" if rest == "" or rest[1:].isdigit() and rest[0] == ":" else ""
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class WebLock:
    """The checks every request passes before textual-serve sees it (an aiohttp middleware)."""

    def __init__(self, token: str, names: frozenset[str], say: Callable[[str], None],
                 admit: Callable[[web.Request], None] | None = None) -> None:
        """`admit`: told of each request the lock lets through (its connection is the
        owner's from then on: web_guard.py stops its deadline)."""
        self._token = token.encode()
        self.names = names
        self.say = say
        self.admit = admit
        self.refusals: Counter[str] = Counter()
        # A name of its own per server, so two servers tunnelled to one browser coexist;
        # it carries no part of the token (a hash of it).
        self.cookie = "traceml-web-" + hashlib.sha256(self._token).hexdigest()[:12]

    def token_ok(self, candidate: str | None) -> bool:
        return candidate is not None and hmac.compare_digest(candidate.encode(), self._token)

    def host_ok(self, host: str | None) -> bool:
        return bool(host) and split_host(host or "") in self.names

    @staticmethod
    def origin_ok(origin: str | None, host: str) -> bool:
        return origin is not None and origin.lower() == f"http://{host.strip().lower()}"

    def count(self, kind: str) -> None:
        """Count a refusal and say it (at powers of two)."""
        self.refusals[kind] += 1
        count = self.refusals[kind]
        if count & (count - 1) == 0:
            self.say(f"refused {REFUSED_LOG[kind]} ({count} so far)")

    def refuse(self, kind: str, status: int = 403) -> web.Response:
        """Count a refusal, say it (at powers of two), answer one line and close the
        connection (a refused peer keeps no kept-alive descriptor)."""
        self.count(kind)
        response = web.Response(status=status, text=REFUSED_TEXT[kind],
                                headers={"Cache-Control": "no-store"})
        if kind != "viewers":  # the owner's own tab over the cap keeps its connection
            response.force_close()
        return response

    def summary(self) -> str | None:
        if not self.refusals:
            return None
        parts = ", ".join(f"{kind} {n}" for kind, n in sorted(self.refusals.items()))
        total = sum(self.refusals.values())
        return f"refused {total} in all, requests and connections ({parts})"

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        host = request.headers.get("Host")
        if not self.host_ok(host):
            return self.refuse("host")
        if TOKEN_PARAM in request.query and request.path != WS_PATH:
            if not self.token_ok(request.query.get(TOKEN_PARAM)):
                return self.refuse("token")
            self._admit(request)
            return self._exchange(request)
        if not self.token_ok(request.cookies.get(self.cookie)):
            return self.refuse("token")
        if request.path == WS_PATH and not self.origin_ok(request.headers.get("Origin"),
                                                          host or ""):
            return self.refuse("origin")
        self._admit(request)
        response = await handler(request)
        if not isinstance(response, web.WebSocketResponse) and not response.prepared:
            response.headers.setdefault("X-Frame-Options", "DENY")
            response.headers.setdefault("Referrer-Policy", "no-referrer")
        return response

    def _admit(self, request: web.Request) -> None:
        if self.admit is not None:
            self.admit(request)

    def _exchange(self, request: web.Request) -> web.Response:
        """The tokened URL: set the cookie, send the browser to the same URL without it."""
        rest = [(k, v) for k, v in request.query.items() if k != TOKEN_PARAM]
        location = request.path + (f"?{urlencode(rest)}" if rest else "")
        response = web.Response(status=303, headers={"Location": location,
                                                     "Cache-Control": "no-store",
                                                     "Referrer-Policy": "no-referrer"})
        response.set_cookie(self.cookie, self._token.decode(), httponly=True,
                            samesite="Strict", path="/")
        return response
