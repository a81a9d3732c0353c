"""The run's authenticator: only peers holding the run's client key get a message in.

CURVE encrypts; ZAP decides who may connect. Every server socket of a run (the
collector's, a node relay's) admits exactly the client key derived from the run's
secret (agent/keys.py), through one authenticator thread per ZeroMQ context.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import zmq

from traceml_agent import keys


def start_authenticator(ctx: zmq.Context, run_keys: keys.CurveKeys,
                        on_reject: Callable[[], None] | None = None,
                        capped: tuple[str, Callable[[], bool]] | None = None) -> Any:
    """Start pyzmq's ZAP thread on `ctx` for the run's key; returns it (call .stop()).
    `capped`: a ZAP domain whose peers, holding the key, are admitted only while its
    callable says so (the ingest socket's connection cap: connections.py)."""
    from zmq.auth.thread import ThreadAuthenticator

    class OnlyThisRun:
        def callback(self, domain: str, client_key: bytes) -> bool:
            ok = client_key == run_keys.client_public
            if not ok and on_reject is not None:
                on_reject()
            return ok

    class WhileRoom(OnlyThisRun):
        def __init__(self, room: Callable[[], bool]) -> None:
            self.room = room

        def callback(self, domain: str, client_key: bytes) -> bool:
            return super().callback(domain, client_key) and self.room()

    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(keys.ZAP_DOMAIN, credentials_provider=OnlyThisRun())
    if capped is not None:
        auth.configure_curve_callback(capped[0], credentials_provider=WhileRoom(capped[1]))
    return auth
