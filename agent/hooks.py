"""Zero-code instrumentation: the patches and hooks that time an unmodified script.

What is hooked, and why there:
  dataloader  `_BaseDataLoaderIter.__next__`: every DataLoader iterator, any worker count.
  h2d         `Tensor.to` / `Tensor.cuda` in the training loop, only when CUDA exists
              (on a CPU job there is no host-to-device copy to time, so nothing is patched).
  forward     the outermost module call. Global module hooks find the root modules
              (the DDP/FSDP wrapper, the loss) during the first step, then give way to
              a wrapper on those classes' forward, so later steps pay one Python call
              per root, not two hook calls per submodule.
  backward    `torch.autograd.backward` (Tensor.backward goes through it). A hook on the
              parameter whose gradient is ready first queues an autograd final
              callback, which runs once every gradient is computed and before DDP's
              reducer waits for its allreduces: backward = start..ready (local
              compute), sync = ready..return (the exposed collective wait, often
              waiting for another rank).
  optimizer   global optimizer step pre/post hooks; the first optimizer that steps
              closes each step, so gradient accumulation counts once.

Every hook guards the agent's own work: an exception there is reported once and
the agent uninstalls itself. The user's call always runs, and its exceptions
propagate untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .checks import StepObserver
from .recorder import BACKWARD, DATALOADER, FORWARD, H2D, OPTIMIZER, Recorder

_rec: Recorder | None = None
_obs: StepObserver | None = None  # the setup checks (checks.py), fed by the same hooks
_on_error: Callable[[BaseException], None] = print  # replaced by install()
_queue_callback: Callable[[Callable[[], None]], None] = print  # autograd's, bound at install
_undo: list[Callable[[], None]] = []
_learning = False
_roots: list[Any] = []
_global_forward: list[Any] = []
_grad_order: list[Any] = []  # learning: parameters in the order their gradients were ready
_grad_probes: list[Any] = []  # learning: temporary hooks on the roots' parameters
_step_optimizer: Any = None


def install(rec: Recorder, torch: Any, on_error: Callable[[BaseException], None],
            observer: StepObserver | None = None) -> None:
    global _rec, _on_error, _learning, _step_optimizer, _obs
    _rec, _on_error, _obs = rec, on_error, observer
    _learning, _step_optimizer = True, None
    _roots.clear()
    _global_forward.clear()
    _grad_order.clear()
    _grad_probes.clear()
    _patch_dataloader(torch)
    _hook_forward_global(torch)
    _patch_backward(torch)
    _hook_optimizer(torch)
    _patch_collectives(torch)
    if torch.cuda.is_available():
        _patch_h2d(torch)


def uninstall() -> None:
    """Restore everything. Safe to call twice and from inside a hook."""
    global _rec
    while _undo:
        undo = _undo.pop()
        try:
            undo()
        except Exception:
            pass
    _rec = None


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


# --- dataloader ---------------------------------------------------------------------


def _patch_dataloader(torch: Any) -> None:
    from torch.utils.data import dataloader as dl

    cls = dl._BaseDataLoaderIter
    original = cls.__next__

    def __next__(self: Any) -> Any:
        rec = _rec
        started = rec is not None and rec.begin(DATALOADER, self)
        try:
            batch = original(self)
            if _obs is not None:
                _obs.on_loader_batch(self)
            return batch
        finally:
            if started:
                try:
                    rec.end(self)
                except Exception as exc:
                    _fail(exc)

    _setattr(cls, "__next__", __next__)


# --- forward ------------------------------------------------------------------------


def _forward_pre(module: Any, args: Any) -> None:
    rec = _rec
    if rec is None:
        return
    try:
        if rec.begin(FORWARD, module) and _learning and module not in _roots:
            _roots.append(module)
            _probe_gradients(module)
            if _obs is not None:
                _obs.watch_model(module)
    except Exception as exc:
        _fail(exc)


def _forward_post(module: Any, args: Any, output: Any) -> None:
    rec = _rec
    if rec is None:
        return
    try:
        rec.end(module)
    except Exception as exc:
        _fail(exc)


def _hook_forward_global(torch: Any) -> None:
    from torch.nn.modules import module as mod

    _global_forward.append(mod.register_module_forward_pre_hook(_forward_pre))
    _global_forward.append(mod.register_module_forward_hook(_forward_post, always_call=True))
    _undo.extend(handle.remove for handle in _global_forward)


def _finish_learning() -> None:
    """After the first step: time the root modules' classes, drop the global hooks.

    A class-level `forward` wrapper keeps nn.Module's fast call path (instance hooks
    force the slow one) and stores nothing on the instances, so a model saved with
    torch.save(model) never references this package.
    """
    global _learning
    _learning = False
    while _global_forward:
        _global_forward.pop().remove()  # removing twice (again in uninstall) is harmless
    for cls in dict.fromkeys(type(root) for root in _roots):
        _wrap_forward(cls)
    if _rec is not None:
        _rec.parallel = parallel_kind(_roots)
    while _grad_probes:
        _grad_probes.pop().remove()
    if _grad_order:
        handle = _grad_order[0].register_post_accumulate_grad_hook(_on_first_grad)
        _undo.append(handle.remove)
    _grad_order.clear()


def parallel_kind(roots: list[Any]) -> str | None:
    """"fsdp" or "ddp" from the root modules' classes (by name: importing FSDP would cost
    every job the import). Under FSDP, parameter all-gathers run inside forward and
    gradient reduce-scatters inside backward, so the collector must not compare those
    phases across ranks as if they were local work (docs/fsdp.md)."""
    names = {c.__name__ for root in roots for c in type(root).__mro__}
    if names & {"FSDPModule", "FullyShardedDataParallel"}:
        return "fsdp"
    if "DistributedDataParallel" in names:
        return "ddp"
    return None


def _wrap_forward(cls: type) -> None:
    original = cls.forward

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        rec = _rec
        if rec is None or not rec.begin(FORWARD, self):
            return original(self, *args, **kwargs)
        try:
            return original(self, *args, **kwargs)
        finally:
            rec.end(self)

    forward.__wrapped__ = original  # type: ignore[attr-defined]
    _setattr(cls, "forward", forward)


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
        rec.grads_ready()


def _on_first_grad(param: Any) -> None:
    if _obs is not None:  # once per backward that reaches the model's parameters
        _obs.on_backward()
    rec = _rec
    if rec is not None and rec.active == BACKWARD:
        _queue_callback(_grads_ready)


def _patch_backward(torch: Any) -> None:
    global _queue_callback
    import torch.autograd as autograd

    original = autograd.backward
    _queue_callback = autograd.Variable._execution_engine.queue_callback

    def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        rec = _rec
        if rec is None or not rec.begin_backward():
            return original(tensors, *args, **kwargs)
        try:
            return original(tensors, *args, **kwargs)
        finally:
            try:
                rec.end_backward()
            except Exception as exc:
                _fail(exc)

    backward.__wrapped__ = original  # type: ignore[attr-defined]
    _setattr(autograd, "backward", backward)


# --- optimizer ----------------------------------------------------------------------


def _optimizer_pre(optimizer: Any, args: Any, kwargs: Any) -> None:
    rec = _rec
    if rec is None:
        return
    try:
        rec.begin(OPTIMIZER, optimizer)
    except Exception as exc:
        _fail(exc)


def _optimizer_post(optimizer: Any, args: Any, kwargs: Any) -> None:
    global _step_optimizer
    rec = _rec
    if rec is None:
        return
    try:
        rec.end(optimizer)
        if _obs is not None:  # every optimizer: a GAN's two each judge their backward
            _obs.on_optimizer_step()
        if _step_optimizer is None:
            _step_optimizer = optimizer
        if optimizer is _step_optimizer and not rec.explicit_steps:
            rec.close_step()
            if _learning:
                _finish_learning()
    except Exception as exc:
        _fail(exc)


def _hook_optimizer(torch: Any) -> None:
    from torch.optim import optimizer as opt

    pre = opt.register_optimizer_step_pre_hook(_optimizer_pre)
    post = opt.register_optimizer_step_post_hook(_optimizer_post)
    _undo.append(pre.remove)
    _undo.append(post.remove)


# --- collectives --------------------------------------------------------------------
#
# Counted for hang detection: a rank that entered fewer collectives than the others is
# the one they wait for (the opCount comparison of NCCL debug logs, live). Only explicit
# torch.distributed calls count; DDP's own allreduces happen in every backward of every
# rank alike, and the phase a rank is in (forward before backward) orders the rest.

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
               "reduce_scatter", "reduce_scatter_tensor", "broadcast", "broadcast_object_list",
               "barrier", "all_to_all", "all_to_all_single", "reduce", "gather", "scatter",
               "monitored_barrier")


def _patch_collectives(torch: Any) -> None:
    import torch.distributed as dist

    for name in COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None:
            continue

        def wrapper(*args: Any, __original: Any = original, __name: str = name,
                    **kwargs: Any) -> Any:
            rec = _rec
            if rec is None:
                return __original(*args, **kwargs)
            rec.collectives += 1
            outer = rec.in_collective
            rec.in_collective = __name
            try:
                return __original(*args, **kwargs)
            finally:
                rec.in_collective = outer

        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        _setattr(dist, name, wrapper)


# --- host-to-device -----------------------------------------------------------------


def _patch_h2d(torch: Any) -> None:
    cls = torch.Tensor
    for name in ("to", "cuda"):
        original = getattr(cls, name)

        def wrapper(self: Any, *args: Any, __original: Any = original, **kwargs: Any) -> Any:
            rec = _rec
            if rec is None or rec.active != -1 or self.is_cuda:
                return __original(self, *args, **kwargs)
            started = rec.begin(H2D, self)
            try:
                out = __original(self, *args, **kwargs)
            except BaseException:
                if started:
                    rec.cancel()
                raise
            if started:
                if out is not self and getattr(out, "is_cuda", False):
                    rec.end(self)
                else:  # a dtype cast or a CPU copy: not a host-to-device transfer
                    rec.cancel()
            return out

        _setattr(cls, name, wrapper)
