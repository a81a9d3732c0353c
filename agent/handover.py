"""The run's secret on the other nodes, and what torchrun's store may carry of it.

A multi-node run needs one secret on every node. It comes, in this order:
  1. $TRACEML_SECRET on every node: the store carries nothing of traceml's.
  2. a shared run folder: node 0 makes OUT/NAME/secret.key (0600); every other node's
     launcher, relay and ranks poll for that file (POLL_S) while they wait. A node that
     read it writes a proof into the store, HMAC(secret, "shared by node K"), which
     tells node 0 the folder is shared without saying anything about the secret. Once
     every other node has proved it, node 0 publishes nothing.
  3. neither: node 0 waits SHARED_WAIT_S for those proofs (a node that never proves
     cannot read the file), then writes the secret and its run folder's path into the
     TCPStore torchrun already runs at --master-addr:--master-port, and says on its
     terminal, in one line, that the run is as private as the master port, with the
     remedy. The other nodes read it from there.
Nobody waits for any of this: torchrun starts at once on every node, and a rank's sender
thread (never the training thread) fetches the secret before it connects; its steps
queue meanwhile.

Only a proof made with the secret can stop node 0's publication, so nobody on the
network can talk it into publishing (a forged proof is checked with the secret) and a
node of a shared folder is never the reason the secret travels. In mode 3 whoever can
reach the master port can read the secret: torchrun's own boundary (its rendezvous has
no authentication either); docs/security.md says what each party can do.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from . import env

SECRET_KEY = "traceml/secret"
RUN_DIR_KEY = "traceml/run_dir"  # node 0's run folder, for the other nodes' last message
SHARED_KEY = "traceml/shared/{node}"  # a node's proof that it read the shared secret.key
CONNECT_TIMEOUT_S = 5.0
POLL_S = 1.0
# How long node 0 waits for every other node to prove it reads the shared run folder
# before the secret goes into the store (mode 3 above). A node of a shared folder polls
# every POLL_S and proves within a second or two of node 0 writing the file (srun and
# torchrun start the nodes together); the ranks of a node WITHOUT a shared folder cannot
# report before this wait ends, so a long wait costs every such run its first seconds of
# figures (a 12 s job lost all of them at 60 s). A node started later than this, or a
# network filesystem slower than this to show the file, falls back to the store, which
# both nodes say in one line with the remedy (TRACEML_SECRET): never less private than
# before proofs existed. The environment variable of that name changes it (seconds).
SHARED_WAIT_S = 8.0
SHARED_WAIT_ENV = "TRACEML_SHARED_WAIT_S"


def shared_wait_s() -> float:
    try:
        return max(0.0, float(os.environ.get(SHARED_WAIT_ENV, SHARED_WAIT_S)))
    except ValueError:
        return SHARED_WAIT_S


def shared_proof(secret: str, node: int) -> str:
    """What node `node` writes into the store once it has read the folder's secret.key:
    worthless to anyone without the secret, impossible to forge without it."""
    return hmac.new(bytes.fromhex(secret), f"traceml: node {node} shares the run folder"
                    .encode(), hashlib.sha256).hexdigest()


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


def read_file_secret(path: Path | None) -> str | None:
    """The secret from a shared run folder's file, or None while it is not there (or
    half-written: node 0 creates it in place, O_EXCL)."""
    from . import keys

    if path is None:
        return None
    try:
        return keys.read_secret_file(path)
    except (OSError, keys.SecretError):
        return None


def fetch_secret(address: str | None, until: Callable[[], bool],
                 secret_file: Path | None = None) -> str | None:
    """The run's secret, checked: from `secret_file` (a shared run folder) or the store
    at 'host:port', whichever has it first; None once `until()` says to give up. Raises
    ValueError (a bad address) or keys.SecretError (a bad secret in the store)."""
    from . import keys

    if secret_file is None and os.environ.get(env.RUN_DIR):  # a rank: its node's folder
        secret_file = Path(os.environ[env.RUN_DIR]) / keys.SECRET_FILE
    where = None if address is None else parse_address(address)
    store = None
    while not until():
        found = read_file_secret(secret_file)
        if found is not None:
            return found
        if where is not None:
            try:
                if store is None:
                    store = _client(*where)
                if store.check([SECRET_KEY]):
                    return keys.check_secret(store.get(SECRET_KEY).decode())
            except keys.SecretError:
                raise
            except Exception:  # the store not up yet, or gone: try again
                store = None
        time.sleep(POLL_S)
    return None


def joined_file(run_dir: Path, node: int) -> Path:
    """The file a node's launcher leaves in its run folder once it read the shared
    secret there: node 0 sees it when that folder is its own (shared), whatever the
    store says (nobody else can write in a 0700 folder)."""
    return run_dir / f"shared-node{node}"


def publish_unless_shared(host: str, port: int, secret: str, nnodes: int, run_dir: Path,
                          values: dict[str, str], until: Callable[[], bool],
                          on_publish: Callable[[list[int]], None],
                          on_planted: Callable[[], None] | None = None) -> str | None:
    """Node 0: wait (shared_wait_s()) for every other node to prove it read the shared
    secret.key; "shared" if all did (the store then carries nothing), else publish
    `values` and return "store" (`on_publish(nodes that did not prove)` first;
    `on_planted()` too if a secret other than ours was in the store already: someone at
    the master port wrote one, and a node that read it will not report). None if
    `until()` came first."""
    pending = set(range(1, nnodes))
    deadline = time.monotonic() + shared_wait_s()
    store = None
    while not until():
        try:
            if store is None:
                store = _client(host, port)
            for node in sorted(pending):
                key = SHARED_KEY.format(node=node)
                if joined_file(run_dir, node).exists() or (
                        store.check([key]) and hmac.compare_digest(
                            store.get(key), shared_proof(secret, node).encode())):
                    pending.discard(node)
            if not pending:
                return "shared"
            if time.monotonic() >= deadline:
                on_publish(sorted(pending))
                if (on_planted is not None and store.check([SECRET_KEY])
                        and store.get(SECRET_KEY).decode() != secret):
                    on_planted()
                for key, value in values.items():
                    store.set(key, value)
                return "store"
        except Exception:  # torchrun's store not up yet (or refused): try again
            store = None
        time.sleep(0.25)
    return None


def prove_shared(host: str, port: int, secret: str, node: int,
                 until: Callable[[], bool]) -> None:
    """Another node that read secret.key in its run folder (and left `joined_file`
    there): say so in the store too, until its torchrun ends (a proof deleted from the
    store comes back)."""
    proof = shared_proof(secret, node)
    store = None
    while not until():
        try:
            if store is None:
                store = _client(host, port)
            store.set(SHARED_KEY.format(node=node), proof)
        except Exception:
            store = None
        time.sleep(POLL_S)


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


def watch_secret(host: str, port: int, secret: str, until: Callable[[], bool],
                 on_changed: Callable[[], None]) -> None:
    """While torchrun runs: the secret in the store must stay the one this node took
    (node 0's, or the one it published). A change means two writers, one of them not
    node 0 (a secret planted before node 0 published, or rewritten after): a node that
    took the wrong one never reports, so `on_changed()` says so, once. One small get a
    POLL_S on one connection, made while the store is known up (it was just read); once
    the store fails, the watch ends: reconnecting to a store that is gone blocks for
    seconds in torch's client, and a thread inside it at exit aborts the process
    (launcher.let_handover_end)."""
    try:
        store = _client(host, port)
    except Exception:
        return
    while not until():
        try:
            if store.check([SECRET_KEY]) and store.get(SECRET_KEY).decode() != secret:
                on_changed()
                return
        except Exception:  # the store gone: torchrun's rendezvous is over
            return
        time.sleep(POLL_S)
