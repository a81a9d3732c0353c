"""The run's secret handed to the other nodes through torchrun's own store.

A multi-node run needs one secret on every node. With a shared run folder or
$TRACEML_SECRET that is the user's doing; without either (the seed guide's plain
command line on every node, no shared filesystem), node 0's launcher writes it into
the TCPStore torchrun already runs at --master-addr:--master-port, and the other
nodes read it from there. Nobody waits for it: torchrun starts at once on every node,
and a rank's sender thread (never the training thread) fetches the secret before it
connects; its steps queue meanwhile.

Trust: this is exactly torchrun's boundary. Whoever can reach the master port can
read the store, and could already join or disrupt the rendezvous. A shared run folder
(mode 0600 file) or $TRACEML_SECRET keeps the secret off the network (docs/security.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

SECRET_KEY = "traceml/secret"
RUN_DIR_KEY = "traceml/run_dir"  # node 0's run folder, for the other nodes' last message
CONNECT_TIMEOUT_S = 5.0
POLL_S = 1.0


def parse_address(value: str) -> tuple[str, int]:
    """'host:port' (the launcher's TRACEML_SECRET_STORE) -> (host, port)."""
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"not host:port: {value!r}")
    return host.strip("[]"), int(port)


def _client(host: str, port: int) -> Any:
    from torch.distributed import TCPStore

    # wait_for_workers=False: a client that does not count as one of torchrun's nodes.
    return TCPStore(host, port, is_master=False, wait_for_workers=False,
                    timeout=timedelta(seconds=CONNECT_TIMEOUT_S))


def publish(host: str, port: int, values: dict[str, str], until: Callable[[], bool]) -> bool:
    """Write `values` into torchrun's store once it listens; retried until `until()`."""
    while not until():
        try:
            store = _client(host, port)
            for key, value in values.items():
                store.set(key, value)
            return True
        except Exception:  # not listening yet (torchrun starting), or refused
            time.sleep(POLL_S)
    return False


def fetch_secret(address: str, until: Callable[[], bool]) -> str | None:
    """The run's secret from the store at 'host:port', checked; None once `until()` says
    to give up. Raises ValueError (a bad address) or keys.SecretError (a bad secret)."""
    from . import keys

    host, port = parse_address(address)
    fetched = fetch(host, port, SECRET_KEY, until)
    return None if fetched is None else keys.check_secret(fetched)


def fetch(host: str, port: int, key: str, until: Callable[[], bool]) -> str | None:
    """Read `key` from torchrun's store, waiting for it to be written; None once
    `until()` says to give up."""
    store = None
    while not until():
        try:
            if store is None:
                store = _client(host, port)
            store.wait([key], timedelta(seconds=POLL_S))
            return store.get(key).decode()
        except Exception:  # not there yet, or the store not up yet: try again
            time.sleep(0.2 if store is not None else POLL_S)
    return None
