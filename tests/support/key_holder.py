"""A key holder's connection: a DEALER with the run's client keys, as every rank has them."""

from __future__ import annotations

import zmq

from traceml_agent import keys


def rank_socket(ctx: zmq.Context, address: str, secret: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    keys.secure_client(sock, keys.derive(secret))
    sock.connect(address)
    return sock
