"""The requests the collector answers besides the ranks' messages, and its replies.

Two sockets, each with its own small vocabulary, described once as msgspec Structs that
both sides import (this package is importable by every layer: the launcher sends control
requests, the viewers view requests, the collector decodes both):

  control  JSON on loopback, from the launcher: ping, native_stack (a stuck rank's py-spy
           dump, native_stacks.py) and finish (write the record, reply with the end of
           run). The launcher's own requests carry its control key (`key`): the run's
           secret is in every rank, so it admits a peer, not a launcher (collector.py).
  view     msgpack from viewers: view (the frozen state, and one rank's detail), capture
           (start a deep trace) and summary (the summary so far).

The decoder is the validator: a request of an unknown op, an unknown field, a wrong type
or a value out of its bound is refused with a RequestError before a handler sees it.
Requests are small; anything larger is refused unread.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct

from .protocol import MAX_WORLD_SIZE, Count, Epoch
from .vocab import MAX_CAPTURE_STEPS

MAX_REQUEST_BYTES = 64 << 10  # a view request, or a 16,000-character native stack
# A finish carries the user's command line (an argument may be 128 KiB on Linux): control
# requests may be as large as any frame the collector's sockets take (~1 MiB).
MAX_CONTROL_BYTES = 1 << 20
MAX_ARG_CHARS = 128 << 10
NATIVE_STACK_MAX = 16_000  # characters of one py-spy dump
MAX_GRACE_S = 600.0  # a finish waits at most this long for the ranks' last messages
MAX_CAPTURE_RANKS = 64  # ranks one capture request may name (a pinned rank and a few more)
DEFAULT_CAPTURE_STEPS = 5

Rank = Annotated[int, Meta(ge=0, lt=MAX_WORLD_SIZE)]
ExitCode = Annotated[int, Meta(ge=-(1 << 31), le=1 << 31)]
ControlKey = Annotated[str, Meta(max_length=128)]


class RequestError(ValueError):
    """A request that does not follow this vocabulary: answered with its one line."""


# --- control (launcher -> collector, JSON) --------------------------------------------------


class _Control(Struct, tag_field="op", forbid_unknown_fields=True, kw_only=True):
    key: ControlKey | None = None  # the launcher's control key (finish, native_stack)


class Ping(_Control, tag="ping", kw_only=True):
    pass


class NativeStack(_Control, tag="native_stack", kw_only=True):
    """A stuck rank's stack, dumped from outside by node 0's launcher (native_stacks.py).
    The rank is checked against the run's world size by the collector."""

    rank: Rank
    pid: Annotated[int, Meta(ge=1, le=1 << 31)]
    text: Annotated[str, Meta(max_length=NATIVE_STACK_MAX)]


class Finish(_Control, tag="finish", kw_only=True):
    """End the record: drain the ranks' last messages (up to `grace_s`), write the summary
    and reply with the end of run. `exit_code` overrides the job's (a signal's code)."""

    torchrun_exit: ExitCode | None = None
    interrupted: bool = False
    root_cause: tuple[Count, ExitCode] | None = None  # (rank, exit code) torchrun named
    command: Annotated[list[Annotated[str, Meta(max_length=MAX_ARG_CHARS)]],
                       Meta(max_length=1 << 16)] = []
    ended_at: Epoch | None = None
    extra: Annotated[dict[Annotated[str, Meta(max_length=64)], Any], Meta(max_length=32)] = {}
    exit_code: ExitCode | None = None
    grace_s: Annotated[float, Meta(ge=0.0, le=MAX_GRACE_S)] | None = None
    complete: bool = True


ControlRequest = Ping | NativeStack | Finish
# Ops only the launcher may ask for: with --control-key-stdin they must carry its key.
LAUNCHER_OPS = (NativeStack, Finish)


class ControlReply(Struct, omit_defaults=True):
    """The collector's answer to ping and native_stack, and to any refused request (a
    finish that is accepted is answered with the end of run: report/ending.py)."""

    ok: bool
    error: str | None = None
    ranks: int | None = None  # ping: ranks heard from


# --- view (viewer -> collector, msgpack) ----------------------------------------------------


class _View(Struct, tag_field="op", forbid_unknown_fields=True, kw_only=True):
    pass


class ViewRequest(_View, tag="view", kw_only=True):
    rank: Rank | None = None  # the pinned rank, whose detail comes in the second frame


class CaptureStart(_View, tag="capture", kw_only=True):
    """A deep trace of the ranks named (the pinned one; the median rank is added to
    compare with), else of the worst and the median rank."""

    ranks: Annotated[list[Rank], Meta(max_length=MAX_CAPTURE_RANKS)] | None = None
    steps: Annotated[int, Meta(ge=1, le=MAX_CAPTURE_STEPS)] = DEFAULT_CAPTURE_STEPS


class SummaryRequest(_View, tag="summary", kw_only=True):
    pass


ViewOp = ViewRequest | CaptureStart | SummaryRequest


class CaptureReply(Struct, omit_defaults=True):
    """Whether a deep trace started: its id, ranks and steps, or why not."""

    ok: bool
    error: str | None = None
    id: int | None = None
    ranks: list[int] = []
    steps: int = 0


class ErrorReply(Struct):
    """A view request that could not be answered, and why (one frame)."""

    error: str


# --- encoding and decoding ------------------------------------------------------------------

_CONTROL = msgspec.json.Decoder(ControlRequest)
_VIEW = msgspec.msgpack.Decoder(ViewOp)
_CAPTURE_REPLY = msgspec.msgpack.Decoder(CaptureReply)
_ERROR_REPLY = msgspec.msgpack.Decoder(ErrorReply)
_CONTROL_REPLY = msgspec.json.Decoder(ControlReply)
_JSON = msgspec.json.Encoder()
_MSGPACK = msgspec.msgpack.Encoder()


def _decode(decoder: Any, data: bytes, what: str, limit: int = MAX_REQUEST_BYTES) -> Any:
    if len(data) > limit:
        raise RequestError(f"{what} larger than {limit} bytes")
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise RequestError(f"bad {what}: {exc}"[:300]) from None
    except Exception as exc:  # not JSON/msgpack, or nested past the decoder's limit
        raise RequestError(f"bad {what}: {type(exc).__name__}") from None


def encode_control(request: ControlRequest) -> bytes:
    return _JSON.encode(request)


def decode_control(data: bytes) -> ControlRequest:
    """A control request, validated; RequestError otherwise."""
    return _decode(_CONTROL, data, "request", MAX_CONTROL_BYTES)


def encode_reply(reply: ControlReply) -> bytes:
    return _JSON.encode(reply)


def decode_control_reply(data: bytes) -> ControlReply:
    return _decode(_CONTROL_REPLY, data, "reply")


def encode_view(request: ViewOp | CaptureReply | ErrorReply) -> bytes:
    return _MSGPACK.encode(request)


def decode_view(data: bytes) -> ViewOp:
    """A viewer's request, validated; RequestError otherwise."""
    return _decode(_VIEW, data, "request")


def decode_capture_reply(data: bytes) -> CaptureReply:
    """The collector's answer to a capture request: started, refused (why), or an error
    reply (ErrorReply's text, as a refusal)."""
    try:
        return _decode(_CAPTURE_REPLY, data, "reply")
    except RequestError:
        return CaptureReply(False, decode_error(data))


def decode_error(data: bytes) -> str:
    """The text of an ErrorReply, or a one-line word on what came instead."""
    try:
        return str(_decode(_ERROR_REPLY, data, "reply").error)[:200]
    except RequestError:
        return "unreadable reply"
