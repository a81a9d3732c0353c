"""Zero-code instrumentation: the patches and hooks that time an unmodified script.

What is hooked, and why there:
  dataloader  `_BaseDataLoaderIter.__next__`: every DataLoader iterator, any worker count.
  h2d         `Tensor.to` / `Tensor.cuda` between phases, only when torch is built with
              CUDA (on a CPU build there is no host-to-device copy to time, so nothing
              is patched). Asking whether a GPU is there would be a CUDA call.
  forward     the outermost module call. Until the first optimizer step, the agent
              learns the root modules (DDP/FSDP wrappers, `torch.compile`'s
              OptimizedModule, Lightning's strategy wrapper, the loss) by wrapping
              `nn.Module.__call__` itself; then it restores it and wraps `__call__` on
              the roots' classes only, so later steps pay one Python call per root.
              `__call__`, not `forward`: `torch.compile(model)` puts `forward` on the
              instance. No global module hook is ever installed (torch.compile warns
              about them and traces through them).
  backward    `torch.autograd.backward` (Tensor.backward goes through it). A hook on the
              parameter whose gradient is ready first queues an autograd final
              callback, which runs once every gradient is computed and before DDP's
              reducer waits for its allreduces: backward = start..ready (local
              compute), sync = ready..return (the exposed collective wait, often
              waiting for another rank).
  sync        also every explicit `torch.distributed` collective (an all-gather of a
              token count, an all-reduce of the loss for logging): exposed collective
              wait wherever it happens, not residual "wait".
  optimizer   global optimizer step pre/post hooks; the first optimizer that steps
              closes each step, so gradient accumulation counts once.

Phases nest (recorder.py): a forward inside an optimizer closure is forward, an
optimizer step inside a module's forward is optimizer. Inside code being compiled by
torch.compile every wrapper steps aside (`torch.compiler.is_compiling()`), so no hook
is traced into a graph.

Every hook guards the agent's own work: an exception there is reported once and
the agent uninstalls itself. The user's call always runs, and its exceptions
propagate untouched.

Threads: the phase stack is the training thread's (the thread that opens the first
step's forward, backward or optimizer). A hook on another thread passes through
untimed, except while the training thread is inside `backward` (on a GPU, autograd
runs gradient hooks, final callbacks and the collectives they start on its device
threads). A DataLoader fetched on another thread (a prefetch thread) is counted and
its running time is kept apart: the training thread's idle time while it runs is
input wait (recorder.py). The DataLoader, collective and h2d hooks always ask which
thread calls them (one `get_ident()`); the forward, backward and optimizer hooks, the
hottest, ask only while `rec.check_threads` says the job has a thread of its own
besides the training thread (one alive when the training thread is known, or started
later: `threading.Thread.start` is wrapped to notice it).

CUDA graphs (built with CUDA only): `CUDAGraph.capture_begin/capture_end` are wrapped
to count the captures in progress (the recorder makes no CUDA call while one is), and
`replay` to count replays, which are the job's progress when a whole step is a graph.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from threading import get_ident as _get_ident
from time import perf_counter_ns
from typing import Any

from . import collective_names, compiled, device, gcwatch, recorder
from .checks import StepObserver
from .recorder import BACKWARD, DATALOADER, FORWARD, H2D, NO_PHASE, OPTIMIZER, SYNC, Recorder

# Root module classes timed after learning; more is a sign of something odd (a model
# built anew every step), and each costs a class patch.
MAX_ROOT_CLASSES = 8
# Root forwards learned without any optimizer step (an evaluation loop, or a framework
# that steps later): learning stops here so the per-module wrapper does not stay on.
MAX_LEARNING_FORWARDS = 64
# Root modules remembered (weakly) at once; dead ones are dropped to make room.
MAX_ROOTS = 32
# Steps of another optimizer in a row, without one of the step optimizer's, after which
# that other optimizer closes the steps: the first one is still alive (held by the
# script, a scheduler, a results list) but no longer trains. Above 1, so that a GAN's two
# optimizers stepping in turn keep the first; 4, so that at most 3 steps of a new model
# merge into one before it is learned. A step optimizer that was garbage collected is
# replaced at the next step of any optimizer.
RELEARN_OTHER_STEPS = 4

_rec: Recorder | None = None
_obs: StepObserver | None = None  # the setup checks (checks.py), fed by the same hooks
_on_error: Callable[[BaseException], None] = print  # replaced by install()
_queue_callback: Callable[[Callable[[], None]], None] = print  # autograd's, bound at install
_is_compiling: Callable[[], bool] = bool  # torch.compiler.is_compiling, bound at install
# The hottest wrappers' cheaper form of it, bound at install: `_dynamo_compiling() or
# _compile_flags._is_compiling_flag`. torch.compiler.is_compiling() is that flag behind a
# torch.jit.is_scripting() call (two Python calls in eager); is_dynamo_compiling() is one
# call that returns False in eager, and Dynamo folds it to True when it traces the wrapper
# (so the flag is never read then); the flag is what export and a compile session set.
_dynamo_compiling: Callable[[], bool] = bool
_compile_flags: Any = None
_in_autograd: Callable[[], bool] = bool  # this thread runs a backward (bound at install)
# Nothing compiles before torch._dynamo is imported (torch.compile and torch.export do
# it), so the hottest wrappers ask is_compiling() (two Python calls) only after that.
_DYNAMO = "torch._dynamo"
_modules = sys.modules
_undo: list[Callable[[], None]] = []
_parents_objects: list[Any] = []  # in a forked child: the parent's recorder and observer
_learning = False
_finish_pending = False  # the first step closed inside a root forward: finish after it
_depth = 0  # module calls open on the training thread while learning
_learning_forwards = 0
# Everything learned about the user's objects is held weakly (docs/agent-api.md, "What
# the agent holds"): a script that trains one model, drops it and trains another (an HPO
# loop, k-fold, pretraining then fine-tuning) must get the first one's memory back.
_roots: list[Callable[[], Any]] = []  # the root modules learned, weakly
_wrapped: list[type] = []  # root classes whose __call__ is timed (at most MAX_ROOT_CLASSES)
_grad_order: list[Any] = []  # learning: parameters in the order their gradients were ready
_grad_probes: list[Any] = []  # learning: temporary hooks on the roots' parameters
# The process groups of the roots learned (DDP's and FSDP1's `process_group`), held
# strongly, the newest MAX_KEPT_GROUPS: a group is small (no parameters), and it must not
# die with its model. Freeing DDP frees its reducer, whose last reference to a gloo group
# then destroys the group on the user's thread, which holds the GIL while it joins gloo's
# worker threads; a worker still dropping a finished barrier (it holds the backward's
# all-reduces, whose saved thread state keeps the Python context torch 2.13 stashes for
# every backward) waits for that GIL: the process hangs at exit (py-spy --native, 1 run
# in 7 of a 3-rank DDP job beside a busy machine, once the model was held weakly). Kept
# here, the group outlives the reducer and goes at interpreter exit, its workers idle.
_groups: list[Any] = []
MAX_KEPT_GROUPS = 8


def _no_ref() -> Any:
    """The step optimizer's reference before one is learned."""
    return None


_step_ref: Callable[[], Any] = _no_ref  # the step optimizer, weakly
# Steps of other optimizers since the step optimizer's last one: at RELEARN_OTHER_STEPS
# the step optimizer is re-learned (the job moved on to another optimizer).
_other_steps = 0
_BACKWARD_OWNER = object()
_scaler_mark = 0  # the step count at the last GradScaler.update (a skipped step shows)
_end_learning_patch: Callable[[], None] = lambda: None  # noqa: E731 - restores Module.__call__
_start_learning_patch: Callable[[], None] = lambda: None  # noqa: E731 - wraps it again


def install(rec: Recorder, torch: Any, on_error: Callable[[BaseException], None],
            observer: StepObserver | None = None) -> None:
    global _rec, _on_error, _learning, _obs, _is_compiling
    global _finish_pending, _depth, _learning_forwards, _scaler_mark
    global _in_autograd, _dynamo_compiling, _compile_flags, _step_ref, _other_steps
    _rec, _on_error, _obs = rec, on_error, observer
    _learning, _step_ref, _finish_pending, _other_steps = True, _no_ref, False, 0
    _scaler_mark = rec.step
    _depth = _learning_forwards = 0
    _is_compiling = _compiling_probe(torch)
    _dynamo_compiling, _compile_flags = _dynamo_probe(torch, _is_compiling)
    _in_autograd = _autograd_probe(torch)
    _roots.clear()
    _wrapped.clear()
    _grad_order.clear()
    _grad_probes.clear()
    _patch_dataloader(torch)
    _learn_roots(torch)
    _patch_backward(torch)
    _hook_optimizer(torch)
    _patch_collectives(torch)
    _patch_grad_scaler(torch)
    _patch_thread_start()
    if device.cuda_built(torch):  # not is_available(): no CUDA call before the script's
        _patch_h2d(torch)
        _patch_graphs(torch)


def uninstall() -> None:
    """Restore everything. Safe to call twice and from inside a hook."""
    global _rec, _learning
    _learning = False
    while _undo:
        undo = _undo.pop()
        try:
            undo()
        except Exception:
            pass
    _rec = None


def go_inert() -> None:
    """Every wrapper passes straight through from now on (a forked child's state):
    nothing is restored or removed, which would touch the parent's objects' copies."""
    global _rec, _obs, _learning
    _parents_objects.append((_rec, _obs))  # never freed in the child (agent/__init__.py)
    _rec = None
    _obs = None
    _learning = False


def _live_roots() -> list[Any]:
    """The learned root modules still alive."""
    return [root for root in (ref() for ref in _roots) if root is not None]


def _fail(exc: BaseException) -> None:
    uninstall()
    _on_error(exc)


def _setattr(owner: Any, name: str, value: Any) -> None:
    original = owner.__dict__.get(name)
    setattr(owner, name, value)
    if original is None:
        _undo.append(lambda: delattr(owner, name))
    else:
        _undo.append(lambda: setattr(owner, name, original))


def _compiling_probe(torch: Any) -> Callable[[], bool]:
    compiler = getattr(torch, "compiler", None)
    probe = getattr(compiler, "is_compiling", None)
    return probe if callable(probe) else bool


class _NoFlags:
    _is_compiling_flag = False


def _dynamo_probe(torch: Any, is_compiling: Callable[[], bool]) -> tuple[Callable[[], bool],
                                                                       Any]:
    """(is_dynamo_compiling, the module holding _is_compiling_flag), or (is_compiling, a
    flag that is always False) on a torch without them."""
    compiler = getattr(torch, "compiler", None)
    dynamo = getattr(compiler, "is_dynamo_compiling", None)
    if callable(dynamo) and isinstance(getattr(compiler, "_is_compiling_flag", None), bool):
        return dynamo, compiler
    return is_compiling, _NoFlags


def _admit(rec: Recorder, idx: int) -> bool:
    """The slow path of every hook, for a call not on the known training thread: whether
    it is timed on the phase stack. Until the training thread is known, the first thread
    to open forward, backward or optimizer becomes it (a DataLoader fetch before that is
    timed provisionally for its thread); after, only autograd's threads while the
    training thread is inside backward."""
    ident = _get_ident()
    if rec.thread is None:
        if idx == DATALOADER or (rec.loader_thread == ident and rec.active == DATALOADER):
            if rec.loader_thread is None:
                rec.loader_thread = ident
            return rec.loader_thread == ident
        rec.claim_thread(ident)
        return True
    rec.check_threads = True  # a thread of the job's besides the training thread
    return idx != DATALOADER and _in_autograd() and _in_backward(rec)


def _in_backward(rec: Recorder) -> bool:
    """The training thread is inside a timed backward (its frame is on the stack)."""
    return any(frame[0] == BACKWARD for frame in list(rec.stack))


def _autograd_probe(torch: Any) -> Callable[[], bool]:
    """Whether this thread is running an autograd graph task (autograd's device threads
    during backward are; a thread of the user's beside it is not)."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    if task_id is None:
        return lambda: True
    return lambda: task_id() >= 0


def _timed(rec: Recorder, idx: int, owner: Any, call: Callable[..., Any], *args: Any,
           **kwargs: Any) -> Any:
    """Run `call` as phase `idx`. The agent's own failures never reach the caller."""
    try:
        started = rec.begin(idx, owner)
    except Exception as exc:
        _fail(exc)
        started = False
    if not started:
        return call(*args, **kwargs)
    try:
        return call(*args, **kwargs)
    finally:
        try:
            rec.end(owner)
        except Exception as exc:
            _fail(exc)


# --- dataloader ---------------------------------------------------------------------


def _patch_dataloader(torch: Any) -> None:
    from torch.utils.data import dataloader as dl

    cls = dl._BaseDataLoaderIter
    original = cls.__next__

    def __next__(self: Any) -> Any:
        rec = _rec
        if rec is None:
            return original(self)
        rec.batches += 1
        me = _get_ident()
        if me != rec.thread and not _admit(rec, DATALOADER):
            return _background_next(rec, self, original)
        try:  # _timed written out: once per batch
            started = rec.begin(DATALOADER, self)
        except Exception as exc:
            _fail(exc)
            started = False
        if not started:
            return original(self)
        try:
            batch = original(self)
        finally:
            try:
                if rec.thread == me or rec.thread is None:  # not dropped by a claim
                    rec.end(self)
            except Exception as exc:
                _fail(exc)
        obs = _obs
        if obs is not None:  # obs.on_loader_batch(self), written out (once per batch)
            obs.last_iter = self
            if obs.digest.left:  # the first batches' digest (datadigest.py), a few times
                obs.digest.add(batch)
        return batch

    _setattr(cls, "__next__", __next__)


def _background_next(rec: Recorder, it: Any, original: Callable[[Any], Any]) -> Any:
    """A fetch on a thread that is not the training thread (a prefetch thread): off the
    phase stack; its running time is what the training thread may be waiting for."""
    if rec.thread is None:  # another thread's fetch is being timed provisionally
        return original(it)
    try:
        rec.bg_begin()
    except Exception as exc:
        _fail(exc)
        return original(it)
    try:
        batch = original(it)
    finally:
        try:
            rec.bg_end()
        except Exception as exc:
            _fail(exc)
    obs = _obs
    if obs is not None:  # obs.on_loader_batch(it)
        obs.last_iter = it
        if obs.digest.left:
            obs.digest.add(batch)
    return batch


# --- forward ------------------------------------------------------------------------


def _learn_roots(torch: Any) -> None:
    """Until the first step: every module call passes here, and the outermost ones (no
    module call open around them) are the roots, timed as forward meanwhile."""
    module_cls = torch.nn.Module
    original = module_cls.__call__

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _is_compiling() or not _learning:
            return original(self, *args, **kwargs)
        return _learning_call(original, self, args, kwargs)

    global _end_learning_patch, _start_learning_patch
    _setattr(module_cls, "__call__", __call__)
    _end_learning_patch = lambda: setattr(module_cls, "__call__", original)  # noqa: E731
    _start_learning_patch = lambda: setattr(module_cls, "__call__", __call__)  # noqa: E731


def _learning_call(original: Callable[..., Any], module: Any, args: tuple,
                   kwargs: dict) -> Any:
    """A module call while learning: the outermost one is a root, learned and timed as
    forward; the ones inside it pass through. Also the timed root classes' path while the
    agent re-learns (a new step optimizer: `_relearn`), so that a new model of a class
    already timed is learned too."""
    global _depth
    rec = _rec
    if rec is not None and _get_ident() != rec.thread and not _admit(rec, FORWARD):
        return original(module, *args, **kwargs)  # another thread's module
    if _depth or rec is None or rec.active == DATALOADER or _compiled_code(module):
        _depth += 1  # a module inside a root, in a collate_fn, or a compiled graph's
        try:
            return original(module, *args, **kwargs)
        finally:
            _depth -= 1
    _depth = 1
    try:
        _learn(module)
        return _timed(rec, FORWARD, module, original, module, *args, **kwargs)
    finally:
        _depth = 0
        if _finish_pending and _learning:
            _finish_learning_guarded()


def _compiled_code(module: Any) -> bool:
    """A torch.fx GraphModule: the code torch.compile generated (an aot_eager compiled
    optimizer step runs one inside the optimizer phase), never the user's root."""
    return type(module).__module__.startswith("torch.fx")


def _weak(obj: Any) -> Callable[[], Any]:
    """A weak reference to a user's object (modules and optimizers allow one); a strong
    one only for an object that cannot be weakly referenced."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


def _learn(root: Any) -> None:
    global _learning_forwards
    try:
        _learning_forwards += 1
        if not any(r() is root for r in _roots):
            if len(_roots) >= MAX_ROOTS:
                _roots[:] = [r for r in _roots if r() is not None]
            if len(_roots) < MAX_ROOTS:
                _roots.append(_weak(root))
            _add_device_source(root)
            _keep_group(root)
            _probe_gradients(root)
            if _obs is not None:
                _obs.watch_model(root)
        if _learning_forwards >= MAX_LEARNING_FORWARDS:
            _schedule_finish()
    except Exception as exc:
        _fail(exc)


def _keep_group(root: Any) -> None:
    """Hold the root's process group to the process's end (see `_groups`)."""
    group = getattr(root, "process_group", None)
    base = getattr(sys.modules.get("torch.distributed"), "ProcessGroup", None)
    if base is None or not isinstance(group, base) or any(g is group for g in _groups):
        return
    _groups.append(group)
    del _groups[:-MAX_KEPT_GROUPS]


def _add_device_source(obj: Any) -> None:
    """The optimizer that steps and the root modules hold the parameters whose device
    the rank trains on; the recorder reads them only at a step boundary (device.py)."""
    rec = _rec
    if rec is None:
        return
    sources = rec.device_sources  # weak references (device.learn reads through them)
    if len(sources) >= device.MAX_SOURCES:
        sources[:] = [ref for ref in sources if ref() is not None]
    if len(sources) < device.MAX_SOURCES:
        try:
            sources.append(weakref.ref(obj))
        except TypeError:  # not a module or optimizer: it holds no device anyway
            pass


def _schedule_finish() -> None:
    """Stop learning now, or, inside a root forward, as soon as it returns (removing the
    learning wrapper while it is on the stack would leave that forward open)."""
    global _finish_pending
    if _depth:
        _finish_pending = True
    else:
        _finish_learning_guarded()


def _finish_learning_guarded() -> None:
    try:
        _finish_learning()
    except Exception as exc:
        _fail(exc)


def _finish_learning() -> None:
    """Time the root modules' classes from now on, and stop wrapping every module call.

    A class-level `__call__` wrapper keeps nn.Module's fast call path (instance hooks
    force the slow one) and stores nothing on the instances, so a model saved with
    torch.save(model) never references this package.
    """
    global _learning, _finish_pending
    _learning = _finish_pending = False
    _end_learning_patch()  # (uninstall puts it back again: harmless)
    roots = _live_roots()
    _roots[:] = [r for r in _roots if r() is not None]
    for cls in dict.fromkeys(type(root) for root in roots):
        if cls not in _wrapped and len(_wrapped) < MAX_ROOT_CLASSES:
            _wrapped.append(cls)
            _wrap_call(cls)
    if _rec is not None:
        _rec.parallel = parallel_kind(roots)
        if _rec.parallel == "ddp":
            _rec.grad_bytes = gradient_bytes(roots)
            _rec.ddp_group = _ddp_group(roots)
    while _grad_probes:
        _grad_probes.pop().remove()
    if _grad_order:
        handle = _grad_order[0].register_post_accumulate_grad_hook(_on_first_grad)
        _undo.append(handle.remove)
    _grad_order.clear()


def _relearn() -> None:
    """A new step optimizer (the first one was dropped, or stopped stepping): learn the
    roots again until its next step, as at the start (a new model, maybe of a new class,
    whose parameters need the backward/sync split's hook)."""
    global _learning, _learning_forwards, _finish_pending
    if _learning:
        return
    _learning, _learning_forwards, _finish_pending = True, 0, False
    _start_learning_patch()


def _ddp_group(roots: list[Any]) -> str:
    """The process group DDP's reducer all-reduces on (its `process_group`), named as the
    explicit collectives' groups are."""
    for root in roots:
        group = getattr(root, "process_group", None)
        if group is not None:
            return collective_names.group_name(group)
    return collective_names.WORLD_GROUP


def gradient_bytes(roots: list[Any]) -> int:
    """Bytes of the gradients DDP all-reduces every step: every parameter that needs a
    gradient, once (a parameter shared by two roots counts once). Read once, after the
    first step, for the achieved bus bandwidth (docs/network.md)."""
    seen: set[int] = set()
    total = 0
    for root in roots:
        try:
            for param in root.parameters():
                if param.requires_grad and id(param) not in seen:
                    seen.add(id(param))
                    total += param.numel() * param.element_size()
        except Exception:  # a root without parameters() (a loss function object)
            continue
    return total


def parallel_kind(roots: list[Any]) -> str | None:
    """"fsdp" or "ddp" from the root modules' classes (by name: importing FSDP would cost
    every job the import). Under FSDP, parameter all-gathers run inside forward and
    gradient reduce-scatters inside backward, so the collector must not compare those
    phases across ranks as if they were local work (docs/fsdp.md). A compiled model is
    judged by the module it wraps."""
    names: set[str] = set()
    for root in roots:
        inner = getattr(root, "_orig_mod", None)  # torch.compile's OptimizedModule
        for obj in (root, inner) if inner is not None else (root,):
            names.update(c.__name__ for c in type(obj).__mro__)
            module = getattr(obj, "module", None)  # Lightning's wrapper inside DDP etc.
            if module is not None:
                names.update(c.__name__ for c in type(module).__mro__)
    if names & {"FSDPModule", "FullyShardedDataParallel"}:
        return "fsdp"
    if "DistributedDataParallel" in names:
        return "ddp"
    return None


def _wrap_call(cls: type) -> None:
    original = cls.__call__

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        # _timed written out: this runs for every root call, the hottest wrapper.
        rec = _rec
        if rec is None or (_DYNAMO in _modules and (_dynamo_compiling()
                                                    or _compile_flags._is_compiling_flag)):
            return original(self, *args, **kwargs)
        if _learning:  # re-learning (a new step optimizer): this instance may be new
            return _learning_call(original, self, args, kwargs)
        if rec.check_threads and _get_ident() != rec.thread and not _admit(rec, FORWARD):
            return original(self, *args, **kwargs)
        try:
            started = rec.begin(FORWARD, self)
        except Exception as exc:
            _fail(exc)
            started = False
        if not started:
            return original(self, *args, **kwargs)
        try:
            return original(self, *args, **kwargs)
        finally:
            try:
                rec.end(self)
            except Exception as exc:
                _fail(exc)

    __call__.__wrapped__ = original  # type: ignore[attr-defined]
    _setattr(cls, "__call__", __call__)


# --- backward -----------------------------------------------------------------------
#
# The sync split needs one Python call inside each backward pass, early enough to queue
# an autograd final callback before DDP's reducer queues its own (it does so when the
# *last* gradient is ready, then waits for the allreduces). A hook registered on the
# loss every step costs ~30 us under DDP; a persistent post-accumulate-grad hook on the
# parameter whose gradient is ready *first* costs a few. The first step finds that
# parameter with temporary probes on the root modules' parameters.


def _probe_gradients(root: Any) -> None:
    for param in root.parameters():
        if param.requires_grad:
            _grad_probes.append(param.register_post_accumulate_grad_hook(_record_grad_order))


def _record_grad_order(param: Any) -> None:
    if _learning and not any(p is param for p in _grad_order):
        _grad_order.append(param)


def _grads_ready() -> None:
    rec = _rec
    if rec is not None:
        try:
            rec.grads_ready()
        except Exception as exc:
            _fail(exc)


def _host_ready() -> None:
    """`_grads_ready` for a recorder on the host clock: its grads_ready() written out (a
    slot store of an int, which cannot raise into autograd's final callback)."""
    rec = _rec
    if rec is not None:
        rec.t_ready = perf_counter_ns()


def _on_first_grad(param: Any) -> None:
    try:
        obs = _obs  # once per backward that reaches the model's parameters
        if obs is not None and obs.sync_src is not None:  # obs.on_backward(), written out
            try:
                ddp = obs.sync_src()  # a weak reference: None once the job dropped it
                if ddp is not None and ddp.require_forward_param_sync:
                    obs.synced += 1
            except Exception as exc:  # the observer's own failure: it turns itself off
                obs._fail(exc)
        rec = _rec
        if rec is not None and rec.active == BACKWARD:
            _queue_callback(_host_ready if rec.HOST_READY else _grads_ready)
    except Exception as exc:
        _fail(exc)


def _patch_backward(torch: Any) -> None:
    global _queue_callback
    import torch.autograd as autograd

    original = autograd.backward
    _queue_callback = autograd.Variable._execution_engine.queue_callback

    def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        rec = _rec
        if rec is None or (_DYNAMO in _modules and (_dynamo_compiling()  # never traced
                                                    or _compile_flags._is_compiling_flag)):
            return original(tensors, *args, **kwargs)
        if rec.check_threads and _get_ident() != rec.thread and not _admit(rec, BACKWARD):
            return original(tensors, *args, **kwargs)
        try:
            started = rec.begin_backward(_BACKWARD_OWNER)
        except Exception as exc:
            _fail(exc)
            started = False
        if not started:
            return original(tensors, *args, **kwargs)
        try:  # autograd's device threads may use the stack meanwhile (_admit)
            return original(tensors, *args, **kwargs)
        finally:
            try:
                rec.end_backward(_BACKWARD_OWNER)
            except Exception as exc:
                _fail(exc)

    backward.__wrapped__ = original  # type: ignore[attr-defined]
    _setattr(autograd, "backward", backward)


# --- optimizer ----------------------------------------------------------------------


def _optimizer_pre(optimizer: Any, args: Any, kwargs: Any) -> None:
    rec = _rec
    if rec is None or (rec.check_threads and _get_ident() != rec.thread
                       and not _admit(rec, OPTIMIZER)):
        return
    try:
        rec.begin(OPTIMIZER, optimizer)
    except Exception as exc:
        _fail(exc)


def _optimizer_post(optimizer: Any, args: Any, kwargs: Any) -> None:
    global _other_steps
    rec = _rec
    if rec is None:
        return
    # Its pre hook put it innermost on the training thread's stack (the common case,
    # without a thread query); else it must be a thread the stack admits.
    if rec.owner is not optimizer and rec.check_threads and _get_ident() != rec.thread \
            and not _admit(rec, OPTIMIZER):
        return
    try:
        relearn = False
        step_opt = _step_ref()
        if optimizer is not step_opt:
            _other_steps += 1
            if step_opt is None or _other_steps >= RELEARN_OTHER_STEPS:
                # (with explicit steps no step closes here to end a new learning)
                relearn = _adopt(optimizer) and not rec.explicit_steps
                step_opt = optimizer
        elif _other_steps:
            _other_steps = 0
        if optimizer is step_opt and not rec.explicit_steps:
            rec.end_step(optimizer)  # end(optimizer), then close_step(), in one call
            if _learning:
                _schedule_finish()
        else:
            rec.end(optimizer)
        if relearn:  # after the close: learning runs until the new optimizer's next step
            _relearn()
        if _obs is not None:  # every optimizer: a GAN's two each judge their backward
            _obs.on_optimizer_step()
    except Exception as exc:
        _fail(exc)


def _adopt(optimizer: Any) -> bool:
    """`optimizer` closes the steps from now on (held weakly). True when it replaces
    another one (dropped, or idle while this one stepped): the roots are re-learned."""
    global _step_ref, _other_steps
    first = _step_ref is _no_ref
    _step_ref = _weak(optimizer)
    _other_steps = 0
    _add_device_source(optimizer)  # before the close: a lazy recorder reads it there
    if first:
        gcwatch.arm()  # GC pauses count from the first step (gcwatch.py), once
    return not first


def _hook_optimizer(torch: Any) -> None:
    from torch.optim import optimizer as opt

    pre = opt.register_optimizer_step_pre_hook(_optimizer_pre)
    post = opt.register_optimizer_step_post_hook(_optimizer_post)
    _undo.append(pre.remove)
    _undo.append(post.remove)
    # torch.compile(opt.step): the hooks invisible to Dynamo, the step still closed
    # (compiled.py; nothing changes until the script first calls torch.compile).
    compiled.install(torch, opt, pre.id, post.id, _optimizer_pre, _optimizer_post,
                     _dynamo_compiling, _compiled_ctx)


def _compiled_ctx() -> tuple[Any, Callable[[BaseException], None],
                             Callable[[Any, str, Any], None]]:
    """What compiled.py needs of this module when it runs: the recorder, the agent's
    failure path and the undoable setattr."""
    return _rec, _fail, _setattr


# --- collectives --------------------------------------------------------------------
#
# Timed as "sync" (exposed collective wait) wherever they run, and counted for hang
# detection: a rank that entered fewer collectives than the others is the one they
# wait for (the opCount comparison of NCCL debug logs, live). Only explicit
# torch.distributed calls pass here; DDP's own allreduces run in its C++ reducer (the
# backward split above times their exposed wait). An async collective
# (async_op=True) is timed only for its launch; its wait() lands in whichever phase
# calls it.

def _patch_collectives(torch: Any) -> None:
    import torch.distributed as dist

    group_name, input_bytes = collective_names.group_name, collective_names.input_bytes
    for name in collective_names.COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None:
            continue

        def wrapper(*args: Any, __original: Any = original, __name: str = name.lstrip("_"),
                    __at: int | None = collective_names.group_position(original),
                    __src: int | None = collective_names.DATA_ARG.get(name.lstrip("_"), -1),
                    **kwargs: Any) -> Any:
            if _is_compiling():
                return __original(*args, **kwargs)
            rec = _rec
            if rec is None:
                return __original(*args, **kwargs)
            try:
                group = kwargs.get("group", kwargs.get("process_group"))
                if group is None and __at is not None and len(args) > __at:
                    group = args[__at]
                gname = group_name(group)
                rec.groups[gname] = rec.groups.get(gname, 0) + 1
            except Exception as exc:
                _fail(exc)
                return __original(*args, **kwargs)
            rec.collectives += 1
            if _get_ident() != rec.thread and not _admit(rec, SYNC):
                return __original(*args, **kwargs)  # counted, not timed: not our stack
            outer, outer_group = rec.in_collective, rec.in_group
            rec.in_collective, rec.in_group = __name, gname
            phase = rec.active  # the phase it is issued in (before sync opens)
            try:
                started = rec.begin(SYNC, __original)
            except Exception as exc:
                _fail(exc)
                started = False
            t0 = rec.t_mark
            try:
                return __original(*args, **kwargs)
            finally:
                rec.in_collective, rec.in_group = outer, outer_group
                try:
                    if started:
                        rec.end(__original)
                    # Per call, accounted per step (recorder.account): exposed host time.
                    rec.account(gname, __name, phase, rec.t_mark - t0 if started else 0,
                                input_bytes(args, kwargs, __src))
                except Exception as exc:
                    _fail(exc)

        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        _setattr(dist, name, wrapper)


# --- host-to-device -----------------------------------------------------------------
#
# Only between phases (the training loop moving its batch): inside forward, `.to()` is
# mostly a dtype cast or a layer's own work and stays forward.


def _patch_h2d(torch: Any) -> None:
    cls = torch.Tensor
    for name in ("to", "cuda"):
        original = getattr(cls, name)

        def wrapper(self: Any, *args: Any, __original: Any = original, **kwargs: Any) -> Any:
            if _is_compiling():
                return __original(self, *args, **kwargs)
            rec = _rec
            if rec is None or rec.active != NO_PHASE or self.is_cuda:
                return __original(self, *args, **kwargs)
            if _get_ident() != rec.thread and not _admit(rec, H2D):
                return __original(self, *args, **kwargs)
            try:
                started = rec.begin(H2D, self)
            except Exception as exc:
                _fail(exc)
                started = False
            try:
                out = __original(self, *args, **kwargs)
            except BaseException:
                if started:
                    _guarded(rec.cancel)
                raise
            if started:
                if out is not self and getattr(out, "is_cuda", False):
                    _guarded(rec.end, self)
                    if rec.device_tensor is None:  # the offload rule's device (device.py)
                        rec.device_tensor = device.index_of(out)
                else:  # a dtype cast or a CPU copy: not a host-to-device transfer
                    _guarded(rec.cancel)
            return out

        _setattr(cls, name, wrapper)


def _guarded(call: Callable[..., Any], *args: Any) -> None:
    try:
        call(*args)
    except Exception as exc:
        _fail(exc)


# --- threads ---------------------------------------------------------------------------


def _patch_thread_start() -> None:
    """A thread the job starts may call a hooked function: from then on the hottest hooks
    ask which thread calls them (recorder.py, `check_threads`). The agent's own threads
    ("traceml-*") never call one."""
    import threading

    original = threading.Thread.start

    def start(self: Any, *args: Any, **kwargs: Any) -> Any:
        rec = _rec
        if rec is not None and not str(self.name).startswith("traceml"):
            rec.check_threads = True
        return original(self, *args, **kwargs)

    start.__wrapped__ = original  # type: ignore[attr-defined]
    _setattr(threading.Thread, "start", start)


# --- GradScaler -----------------------------------------------------------------------
#
# With AMP, `scaler.step(optimizer)` skips optimizer.step() when gradients overflowed: no
# optimizer hook runs, and that step would merge into the next one. `scaler.update()`
# runs once per step either way: when no step closed since the last update, it closes
# the skipped one.


def _patch_grad_scaler(torch: Any) -> None:
    amp = getattr(torch, "amp", None)
    grad_scaler = getattr(amp, "grad_scaler", None)
    cls = getattr(grad_scaler, "GradScaler", None)
    if cls is None:
        return
    original = cls.update

    def update(self: Any, *args: Any, **kwargs: Any) -> Any:
        global _scaler_mark
        result = original(self, *args, **kwargs)
        rec = _rec
        if rec is None or rec.explicit_steps or _get_ident() != rec.thread:
            return result
        try:
            if rec.step == _scaler_mark and rec.active == NO_PHASE:
                rec.close_step()  # the optimizer step was skipped (inf/NaN gradients)
            _scaler_mark = rec.step
        except Exception as exc:
            _fail(exc)
        return result

    update.__wrapped__ = original  # type: ignore[attr-defined]
    _setattr(cls, "update", update)


# --- CUDA graphs ----------------------------------------------------------------------


def _patch_graphs(torch: Any) -> None:
    """Count captures in progress (torch.cuda.graph, make_graphed_callables and
    torch.compile's cudagraph trees all go through CUDAGraph.capture_begin/capture_end)
    and replays. The count is raised before the capture begins and lowered after it
    ends, so no agent CUDA call can fall inside it. Touches no CUDA."""
    cls = getattr(torch.cuda, "CUDAGraph", None)
    if cls is None or not all(hasattr(cls, n) for n in ("capture_begin", "capture_end",
                                                         "replay")):
        return
    begin, end, replay = cls.capture_begin, cls.capture_end, cls.replay

    def capture_begin(self: Any, *args: Any, **kwargs: Any) -> Any:
        recorder.capture_began()
        try:
            return begin(self, *args, **kwargs)
        except BaseException:
            recorder.capture_ended()
            raise

    def capture_end(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return end(self, *args, **kwargs)
        finally:
            recorder.capture_ended()

    def replay_(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = replay(self, *args, **kwargs)
        rec = _rec
        if rec is not None:
            try:
                rec.replayed(_get_ident() == rec.thread)
            except Exception as exc:
                _fail(exc)
        return result

    for name, wrapper, original in (("capture_begin", capture_begin, begin),
                                    ("capture_end", capture_end, end),
                                    ("replay", replay_, replay)):
        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        _setattr(cls, name, wrapper)
