"""A viewer's connection to a collector's view socket, and how `traceml watch` finds it.

REQ/REP with a timeout: if the collector does not answer (gone, restarting, a
tunnel dropped), the REQ socket is thrown away and a fresh one is made for the
next poll ("lazy pirate"), so a viewer never wedges. Data side: no textual here.

Whatever answers at the view address may not be our collector (a `tcp://` address
typed by hand, a run with no secret, a port taken over after the collector ended), so
every string a reply carries is cleaned here, once, before any widget, file or
terminal sees it (`received`): no escape sequence (an OSC 52 clipboard write, a screen
clear) and no format character reaches the owner's terminal from a view, a rank
detail, a capture reply, an error or a summary.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path
from typing import Any

import msgspec
import zmq

from traceml_agent import keys
from traceml_agent.requests import (
    CaptureReply,
    CaptureStart,
    ErrorReply,
    SummaryRequest,
    ViewOp,
    ViewRequest,
    decode_capture_reply,
    decode_error,
    encode_view,
)
from traceml_agent.sanitize import clean_line, clean_text
from traceml_agent.vocab import COLLECTOR_JSON
from traceml_tui.runfolder import folders
from traceml_tui.runfolder.layout import RunFolder
from traceml_tui.runfolder.summary_model import NotASummary, Summary, from_msgpack
from traceml_tui.viewmodel import RankDetail, RankRow, RunView, decode_detail, decode_view

REQUEST_TIMEOUT_S = 2.0


def received(value: Any) -> Any:
    """`value` with every string in it cleaned (keys of mappings included): a rank row's
    host and status as one line, any other string as text (a stack, an analysis keep
    their newlines). Objects are rebuilt only where something changed, and a rank row
    (8,192 a view at scale) costs two isprintable calls, so an honest view goes through
    at the cost of a walk."""
    if isinstance(value, str):
        return clean_text(value)
    if isinstance(value, RankRow):
        if value.host.isprintable() and value.status.isprintable():
            return value
        return msgspec.structs.replace(value, host=clean_line(value.host),
                                       status=clean_line(value.status))
    if isinstance(value, msgspec.Struct):
        changed = {}
        for name in value.__struct_fields__:
            old = getattr(value, name)
            new = received(old)
            if new is not old:
                changed[name] = new
        return msgspec.structs.replace(value, **changed) if changed else value
    if isinstance(value, (tuple, list)):
        items = [received(v) for v in value]
        if all(a is b for a, b in zip(items, value, strict=True)):
            return value
        return type(value)(items)
    if isinstance(value, dict):
        pairs = [(received(k), received(v)) for k, v in value.items()]
        if all(k is k0 and v is v0 for (k, v), (k0, v0) in zip(pairs, value.items(), strict=True)):
            return value
        return dict(pairs)
    return value


class ViewUnavailable(Exception):
    """The collector did not answer in time, or answered with an error."""


class ViewClient:
    def __init__(self, address: str, timeout_s: float = REQUEST_TIMEOUT_S,
                 secret: str | None = None) -> None:
        self.address = address
        self.keys = None if secret is None else keys.derive(secret)
        self.timeout_ms = int(timeout_s * 1000)
        self.ctx: zmq.Context = zmq.Context.instance()
        self.sock: zmq.Socket | None = None
        # The poller and an export may ask at once; a REQ socket takes one request at a time.
        self.lock = threading.Lock()

    def _socket(self) -> zmq.Socket:
        if self.sock is None:
            self.sock = self.ctx.socket(zmq.REQ)
            self.sock.setsockopt(zmq.LINGER, 0)
            # A REQ socket with no live pipe to its peer blocks a send: a viewer once sat
            # in one for minutes. A send that cannot leave within the timeout is a
            # collector that does not answer.
            self.sock.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
            if self.keys is not None:
                keys.secure_client(self.sock, self.keys)
            self.sock.connect(self.address)
        return self.sock

    def _request(self, request: ViewOp) -> list[bytes]:
        with self.lock:
            return self._request_locked(request)

    def _request_locked(self, request: ViewOp) -> list[bytes]:
        sock = self._socket()
        try:
            sock.send(encode_view(request))
            answered = sock.poll(self.timeout_ms)
        except zmq.Again:  # the send could not leave (SNDTIMEO)
            answered = False
        if not answered:
            sock.close(0)
            self.sock = None
            hint = "" if self.keys else " (if the run has a secret: set TRACEML_SECRET)"
            raise ViewUnavailable(f"no answer from the collector at {self.address}{hint}")
        return sock.recv_multipart()

    def fetch(self, pinned: int | None = None) -> tuple[RunView, RankDetail | None]:
        frames = self._request(ViewRequest(rank=pinned))
        if len(frames) == 1:  # a failed request: the collector says why
            raise ViewUnavailable(
                f"the collector could not answer: {clean_line(decode_error(frames[0]))}")
        try:
            return received(decode_view(frames[0])), received(decode_detail(frames[1]))
        except ValueError as exc:
            raise ViewUnavailable(
                f"unreadable view from the collector: {clean_line(str(exc))}") from None

    def summary(self) -> Summary:
        """The summary so far (typed, validated, its strings cleaned), or the collector's
        error reply as ViewUnavailable."""
        frames = self._request(SummaryRequest())
        try:
            doc: Summary = received(from_msgpack(frames[0]))
            return doc
        except NotASummary as exc:
            why = str(exc)
        try:  # not a summary: the collector's error reply, or neither
            error = msgspec.msgpack.decode(frames[0], type=ErrorReply).error
        except (msgspec.ValidationError, msgspec.DecodeError):
            raise ViewUnavailable(f"unreadable summary from the collector: {why}") from None
        raise ViewUnavailable(clean_line(error)[:200])

    def capture(self, ranks: list[int] | None = None, steps: int = 5) -> CaptureReply:
        """Ask for a deep trace (ranks None: the worst and the median rank): started (its id,
        ranks and steps) or not (why); progress comes in the view."""
        reply = decode_capture_reply(self._request(CaptureStart(ranks=ranks, steps=steps))[0])
        cleaned: CaptureReply = received(reply)
        return cleaned

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(0)
            self.sock = None


class WatchTargetError(Exception):
    """`traceml watch` could not find what to attach to: one clear line for the user."""


class RunIsOver(WatchTargetError):
    """The run has ended (its summary is written) or its collector is gone: `traceml watch`
    opens its record instead (collect/replay.py)."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(f"the run in {run_dir} is over")
        self.run_dir = run_dir


def collector_gone(info: Path) -> bool:
    """Whether the collector that wrote `info` (collector.json) is known to be dead: it
    ran on this host and its process is gone. On another host it cannot be told here."""
    try:
        doc = json.loads(info.read_text())
        pid, host = int(doc["pid"]), doc.get("host")
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if host != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, and not ours to signal
        return False
    return _zombie(pid)


def _zombie(pid: int) -> bool:
    """A dead child not yet reaped still answers a signal: its state says it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def resolve_target(target: str | None, base: Path = Path("traceml_runs"),
                   secret_file: Path | None = None) -> tuple[str, Path | None, str | None]:
    """(view address, run folder or None, the run's secret or None) for
    `traceml watch [RUN_DIR | tcp://HOST:PORT]`."""
    if target and target.startswith("tcp://"):
        return target, None, _secret(None, secret_file)
    if target is None:
        run_dir = newest_live_run(base)
        if run_dir is None:
            over = newest_record(base)
            hint = (f"; the newest run is over, its record opens with: traceml watch {over}"
                    if over is not None else "")
            raise WatchTargetError(f"no live run under {base}/ (give a run folder or "
                                   f"tcp://HOST:PORT){hint}")
    else:
        run_dir = Path(target)
        if not run_dir.is_dir():
            raise WatchTargetError(f"no such run folder: {run_dir}")
        folder = RunFolder(run_dir)
        # Over: its summary written, or its collector dead (or never said where it was,
        # a folder copied without it): the record opens instead (collect/replay.py).
        if folder.summary_json.exists() or (folder.step_log.is_dir() and (
                not folder.collector_json.exists() or collector_gone(folder.collector_json))):
            raise RunIsOver(run_dir)
    info = RunFolder(run_dir).collector_json
    if not info.exists():
        raise WatchTargetError(f"{run_dir} is not a traceml run folder (no {COLLECTOR_JSON})")
    for path, is_dir in ((run_dir, True), (info, False)):
        reason = folders.not_private(path, is_dir)
        if reason:
            raise WatchTargetError(f"{path} {reason}: not attaching (its address and secret "
                                   f"could be anyone's)")
    if RunFolder(run_dir).summary_json.exists():
        raise WatchTargetError(f"the run in {run_dir} has ended; its record is "
                               f"{RunFolder(run_dir).summary_json}")
    try:
        doc = json.loads(info.read_text())
        address = doc["view"]
    except (ValueError, KeyError, OSError) as exc:
        raise WatchTargetError(f"cannot read {info}: {exc}") from None
    if doc.get("view_remote") and doc.get("host") not in (None, socket.gethostname()):
        address = doc["view_remote"]  # a shared run folder, read on another node
    return address, run_dir, _secret(run_dir, secret_file)


def _secret(run_dir: Path | None, secret_file: Path | None) -> str | None:
    try:
        return keys.load_secret(run_dir, secret_file)
    except OSError as exc:
        raise WatchTargetError(f"cannot read the run's secret: {exc}") from None
    except keys.SecretError as exc:
        raise WatchTargetError(str(exc)) from None


def newest_live_run(base: Path) -> Path | None:
    """The most recently started run folder under `base` that has no final summary yet and
    whose collector is not known to be dead (that one's record opens by its folder)."""
    if not base.is_dir():
        return None
    # Only folders and collector.json files that are ours and private: on a shared --out,
    # another user's folder could point us at their address with their secret.
    live = [d for d in base.iterdir()
            if not folders.not_private(d)
            and not folders.not_private(RunFolder(d).collector_json, False)
            and not RunFolder(d).summary_json.exists()
            and not collector_gone(RunFolder(d).collector_json)]
    return max(live, key=lambda d: RunFolder(d).collector_json.stat().st_mtime, default=None)


def newest_record(base: Path) -> Path | None:
    """The most recently changed run folder under `base` that is ours and has a record
    (a summary or a step log): what `traceml watch` suggests when nothing is live."""
    if not base.is_dir():
        return None
    runs = [d for d in base.iterdir() if not folders.not_private(d)
            and (RunFolder(d).summary_json.exists() or RunFolder(d).step_log.is_dir())]
    return max(runs, key=lambda d: d.stat().st_mtime, default=None)
