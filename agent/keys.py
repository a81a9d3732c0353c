"""Per-run CURVE keys: one secret, shared by every process of a run, from which all keys derive.

ZeroMQ's CURVE (Curve25519 + an authenticated cipher) needs a server key pair and a
client key pair. Instead of shipping four keys around, a run has ONE random secret
(64 hex characters); both key pairs are derived from it with SHA-256, so every
process that holds the secret can take its part, and a process that does not can
neither read the traffic nor pass the collector's check of the client key.

The secret reaches a process one of two ways:
  * the environment variable TRACEML_SECRET (set it on every node yourself, e.g. in
    an sbatch script, when the run folder is not on a shared filesystem);
  * the file RUN_DIR/secret.key, created by node 0's `traceml run` with mode 0600
    (readable only by its owner), which other nodes see on a shared filesystem.

Imported inside training processes: only the standard library at import time.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import env, vocab

SECRET_FILE = vocab.SECRET_KEY
_HEX = frozenset("0123456789abcdef")


ZAP_DOMAIN = "traceml"  # the authenticator (traceml_tui/collect/auth.py) answers for this domain


class SecretError(ValueError):
    """A secret that is not one: reported to the user in one line."""


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """Z85-encoded CURVE keys (40 ASCII bytes each), as pyzmq's socket options take them."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def new_secret() -> str:
    return secrets.token_hex(32)


def check_secret(secret: str) -> str:
    secret = secret.strip().lower()
    if len(secret) != 64 or not set(secret) <= _HEX:
        raise SecretError("a traceml secret is 64 hex characters "
                        "(make one with: python -c 'import secrets; print(secrets.token_hex(32))')")
    return secret


def derive(secret: str) -> CurveKeys:
    import zmq
    from zmq.utils import z85

    def pair(role: bytes) -> tuple[bytes, bytes]:
        raw = hashlib.sha256(b"traceml-curve-" + role + b"\0" + secret.encode()).digest()
        private = z85.encode(raw)
        return zmq.curve_public(private), private

    spub, ssec = pair(b"server")
    cpub, csec = pair(b"client")
    return CurveKeys(spub, ssec, cpub, csec)


def secret_from_env() -> str | None:
    value = os.environ.get(env.SECRET)
    return check_secret(value) if value else None


def read_secret_file(path: Path) -> str:
    return check_secret(path.read_text())


def write_secret_file(path: Path, secret: str) -> bool:
    """Create the file readable by its owner only; False when it exists already (another
    node or an earlier attempt made it: then read that one instead)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secret + "\n")
    except OSError:
        path.unlink(missing_ok=True)  # never leave an empty secret for the next reader
        raise
    return True


def load_secret(run_dir: Path | None = None, secret_file: Path | None = None) -> str | None:
    """The run's secret for a process that is not a rank (collector, viewer, other nodes):
    an explicit file first, then TRACEML_SECRET, then the run folder's secret.key. None:
    the run has no secret (a plain, loopback-only collector started by hand)."""
    if secret_file is not None:
        return read_secret_file(secret_file)
    from_env = secret_from_env()
    if from_env:
        return from_env
    if run_dir is not None and (run_dir / SECRET_FILE).exists():
        return read_secret_file(run_dir / SECRET_FILE)
    return None


def secure_client(sock: Any, keys: CurveKeys) -> None:
    """Make a socket a CURVE client of the run's collector (before connect)."""
    sock.curve_secretkey = keys.client_secret
    sock.curve_publickey = keys.client_public
    sock.curve_serverkey = keys.server_public


def secure_server(sock: Any, keys: CurveKeys) -> None:
    """Make a socket a CURVE server (before bind). The ZAP domain routes its handshakes to
    the collector's authenticator, which admits only the run's client key."""
    sock.curve_server = True
    sock.curve_secretkey = keys.server_secret
    sock.zap_domain = ZAP_DOMAIN.encode()
