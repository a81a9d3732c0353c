"""traceml_agent: the code that runs inside every rank of a training job.

`traceml run` bootstraps it before the user's script, so an unmodified DDP/FSDP
script is timed with no change. For scripts started another way, or loops the
automatic hooks cannot see, the explicit API is::

    import traceml_agent

    traceml_agent.init()                 # reads TRACEML_ENDPOINT, or endpoint="tcp://..."
    for batch in loader:
        with traceml_agent.step():       # one optimizer update
            with traceml_agent.phase("forward"):
                loss = model(batch)
            ...

Rules the agent keeps, because it lives inside someone's expensive job:
it never blocks the training thread, never synchronizes the GPU from it, never
raises into user code (an internal error is printed once and the agent turns
itself off), and importing this package does not import torch.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from collections import deque
from typing import Any, Literal

# Only the words at import: a viewer or the collector that imports the vocabulary
# (traceml_agent.vocab runs this file first) loads no runtime module of the agent; each
# function below imports what it runs.
from . import env
from .vocab import PHASES, WAIT

__all__ = ["init", "step", "phase", "shutdown", "enabled", "PHASES"]

# Records waiting for the sender thread. At ~10 drains a second this holds
# minutes of steps even for very fast loops; beyond it, the oldest are dropped.
RECORD_QUEUE = 50_000

_lock = threading.Lock()
_state: dict[str, Any] = {"rec": None, "sender": None, "error_reported": False}
_parents_objects: list[Any] = []  # in a forked child: the parent's agent, kept (see below)


def _inert_in_child() -> None:
    """In a forked child (a DataLoader worker, a user's multiprocessing.Process): the
    agent is the parent's. Its hooks are inherited but must pass straight through: no
    recorder call (on CUDA one would create an event, and CUDA cannot be used after a
    fork), no sender (its thread did not survive the fork). Spawned and forkserver
    children start a fresh interpreter and never start an agent."""
    global _lock
    _lock = threading.Lock()  # it may have been held by another thread at the fork
    # Kept, never freed here: the parent's recorder and sender own CUDA resources (timing
    # events, the checksum's pinned buffer); freeing one in a forked child is a CUDA call,
    # which CUDA answers with std::terminate (the worker aborts). They stay referenced
    # for the child's life, which costs it nothing (copy-on-write pages it never touches).
    _parents_objects.append((_state["rec"], _state["sender"]))
    _state["rec"] = None
    _state["sender"] = None
    # Only a process that installed the hooks has any to quiet: a fork of the collector
    # (which imports the vocabulary only) must not import more, it may be out of
    # descriptors (descriptors.write_anyway).
    hooks = sys.modules.get(f"{__name__}.hooks")
    if hooks is not None:
        hooks.go_inert()


# At import, not when an agent starts: hooks installed by other paths (a test's, an
# embedding's) must go quiet in a forked child too. It imports nothing.
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_inert_in_child)


def enabled() -> bool:
    """True while the agent is timing this process."""
    return _state["rec"] is not None


def init(
    endpoint: str | None = None,
    *,
    run_name: str | None = None,
    auto: bool = True,
    secret: str | None = None,
) -> bool:
    """Start the agent in this process. Returns True when it is running.

    endpoint: the collector's ingest address; default $TRACEML_ENDPOINT.
    auto: install the zero-code hooks (DataLoader, forward, backward, optimizer).
    secret: the run's secret (docs/security.md); default $TRACEML_SECRET. With it, all
        traffic to the collector is authenticated and encrypted (ZeroMQ CURVE).
    Calling init() again is harmless. Failure to start only prints a warning.
    """
    with _lock:
        if _state["rec"] is not None:
            return True
        from . import keys

        if os.environ.get(env.DISABLE) == "1":
            return False
        endpoint = endpoint or os.environ.get(env.ENDPOINT)
        if not endpoint:
            _warn("no collector endpoint (set TRACEML_ENDPOINT or use `traceml run`); not timing")
            return False
        try:
            secret = keys.check_secret(secret) if secret else keys.secret_from_env()
        except keys.SecretError as exc:
            _warn(f"{exc}; not timing")
            return False
        try:
            _start(endpoint, run_name or os.environ.get(env.RUN_NAME, ""), auto, secret)
            return True
        except Exception as exc:
            _warn(f"could not start ({exc!r}); training continues without it")
            _teardown()
            return False


def _start(endpoint: str, run_name: str, auto: bool, secret: str | None) -> None:
    import torch

    from . import device, gcwatch, hooks, protocol
    from .capture import Capturer
    from .checks import StepObserver
    from .recorder import LazyCudaRecorder, Recorder
    from .transport import Sender

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    ident = protocol.Identity(
        rank=int(os.environ.get("RANK", "0")),
        local_rank=local_rank,
        node=int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "0"))),
        host=socket.gethostname()[: protocol.MAX_STR],
        pid=os.getpid(),
        world_size=int(os.environ.get("WORLD_SIZE", "1")),
    )
    out: deque = deque(maxlen=RECORD_QUEUE)
    # No CUDA call here: the device is learned from the script's own use (device.py).
    rec: Recorder = LazyCudaRecorder(out, torch) if device.cuda_built(torch) else Recorder(out)
    hello = {
        "run": run_name[: protocol.MAX_STR],
        "device": "cpu",  # until the rank's CUDA device is learned ("sys" then says it)
        "env": _distributed_env(),
        "auto": auto,
        "attempt": _attempt(),
    }
    observer = StepObserver(ident.rank, ident.world_size) if auto else None
    capturer = Capturer(ident.rank, os.environ.get(env.RUN_DIR), torch, rec)
    secret_store = None if secret else os.environ.get(env.SECRET_STORE)
    sender = Sender(endpoint, ident, rec, out, hello, secret, observer, capturer, secret_store)
    _state["rec"], _state["sender"] = rec, sender
    if auto:
        hooks.install(rec, torch, _on_internal_error, observer)
    gcwatch.install()  # garbage-collection pauses, the evidence of a stall's advice
    sender.start()
    if os.environ.get(env.DEBUG) == "1":
        print(f"[traceml] agent rank {ident.rank} reporting to {endpoint}", file=sys.stderr)


def _attempt() -> int | None:
    """torchrun's restart count in this worker's environment (None outside its agent)."""
    from . import protocol

    try:
        value = int(os.environ.get(env.RESTART_COUNT, ""))
    except ValueError:
        return None
    return value if 0 <= value <= protocol.MAX_ATTEMPT else None


def _distributed_env() -> dict[str, str]:
    from . import protocol

    keep = ("NCCL_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_DEBUG", "CUDA_VISIBLE_DEVICES", "OMP_")
    found = {k: v[:1024] for k, v in os.environ.items() if k.startswith(keep)}
    return dict(sorted(found.items())[: protocol.MAX_ENV_ENTRIES])


def shutdown(exit_code: int | None = None, error: str | None = None) -> None:
    """Flush what was measured and say goodbye to the collector. Safe to call twice."""
    with _lock:
        rec, sender = _state["rec"], _state["sender"]
        _teardown()
    if rec is not None:
        rec.flush()
    if sender is not None:
        sender.stop(exit_code, error)


def _teardown() -> None:
    from . import gcwatch, hooks

    hooks.uninstall()
    gcwatch.uninstall()
    _state["rec"] = None
    _state["sender"] = None


def _on_internal_error(exc: BaseException) -> None:
    from . import protocol
    from .recorder import is_sticky_cuda_error

    if is_sticky_cuda_error(exc):
        # The job's own GPU work failed (a device-side assert, an illegal access): CUDA
        # reports it to every later call, the agent's event query included. Not ours.
        what = f"the job's CUDA error (reported to the agent's event query): {exc}"
        _warn(f"{what}; timing turned off for this run")
    else:
        what = f"internal error: {exc!r}"
        _warn(f"internal error, timing turned off for this run: {exc!r}")
    _state["rec"] = None
    sender = _state["sender"]
    if sender is not None:  # the collector hears it: a frozen step count is not a hang
        sender.agent_off = what[: protocol.MAX_STR]


def _warn(message: str) -> None:
    if not _state["error_reported"]:
        _state["error_reported"] = True
        print(f"[traceml] agent: {message}", file=sys.stderr)


# --- explicit API ---------------------------------------------------------------------


class _Step:
    """`with step():` one optimizer update, for loops the hooks cannot see."""

    __slots__ = ()

    def __enter__(self) -> None:
        rec = _state["rec"]
        if rec is not None:
            rec.explicit_steps = True
            rec.open_step()

    def __exit__(self, *exc: Any) -> Literal[False]:
        rec = _state["rec"]
        if rec is not None and rec.explicit_steps:
            try:
                rec.close_step()
            except Exception as err:
                _on_internal_error(err)
        return False


class _Phase:
    __slots__ = ("name", "idx", "started")

    def __init__(self, name: str) -> None:
        self.name = name
        self.idx = -1
        self.started = False

    def __enter__(self) -> None:
        rec = _state["rec"]
        if rec is None:
            return
        if self.name == WAIT:
            _warn('"wait" is derived (step time minus the other phases); phase("wait") ignored')
            return
        try:
            idx = rec.phase_index(self.name)
            if idx is None:
                _warn(f"too many custom phases; phase({self.name!r}) ignored")
                return
            self.started = rec.begin(idx, self)
        except Exception as err:
            _on_internal_error(err)

    def __exit__(self, *exc: Any) -> Literal[False]:
        rec = _state["rec"]
        if self.started and rec is not None and rec.active != _NO_PHASE:
            try:
                rec.end(self)
            except Exception as err:
                _on_internal_error(err)
        self.started = False
        return False


_STEP = _Step()
_NO_PHASE = -1  # recorder.NO_PHASE, which a test checks this is (not imported: see above)


def step() -> _Step:
    """Context manager around one optimizer update. Using it turns off the automatic
    step boundary (optimizer.step), so each `with step()` is exactly one step."""
    return _STEP


def phase(name: str) -> _Phase:
    """Context manager timing a phase: one of the standard names or a custom one.
    Phases nest: time goes to the innermost open phase (a phase inside the DataLoader,
    or inside the same phase, is not timed separately)."""
    return _Phase(name)

