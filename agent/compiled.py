"""Compiled optimizer steps: the agent's optimizer hooks invisible to Dynamo, and a
compiled step still closing the step (issue 40, item 6; docs/agent-api.md, "Compiled
optimizer steps").

`torch.compile(opt.step)` (PyTorch's compiled-optimizer recipe) traces Optimizer.step's
wrapper, and with it the global step hooks: traced, the agent's perf_counter_ns() and
recorder calls were a graph break (the step ran eager), or with fullgraph=True an
exception raised in the user's code. The rule:
  * until the script first calls torch.compile, the plain hooks stay in torch's tables
    (a job that never compiles pays nothing per step for this);
  * then compile-aware hooks take their places (same keys: the handles still remove
    them). `torch.compile(opt.step)` returns a wrapper that runs the agent's pre and post
    hooks eagerly around the compiled step; while it runs (`_quiet`), the hooks in the
    tables do nothing, and Dynamo traces them as nothing (no break, fullgraph works).
    Any other compiled function that steps an optimizer inside: with fullgraph=True the
    hooks are quiet too (its steps are not seen: the explicit API counts them); without,
    they are `torch.compiler.disable`d, so Dynamo breaks the graph at the hook call only
    and runs it eagerly (the step closes as in eager);
  * a compiled model (an nn.Module) is returned untouched.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

Hook = Callable[[Any, Any, Any], None]

_quiet = 0  # compiled calls in progress whose optimizer steps the table hooks must not see


def install(torch: Any, opt: Any, pre_key: int, post_key: int, pre: Hook, post: Hook,
            dynamo_compiling: Callable[[], bool], ctx: Callable[[], tuple[Any, Any, Any]]
            ) -> None:
    """Wrap torch.compile; at its first call, put compile-aware versions of the agent's
    optimizer hooks (`pre`, `post`, registered under `pre_key`/`post_key` in torch's
    global tables) in their places. `ctx()` gives (recorder, fail, setattr) of hooks.py.

    Nothing is wrapped by Dynamo before that first call: with the hooks wrapped by
    `torch.compiler.disable` at the agent's start, a plain DDP job that never compiles
    (examples/faults/restart_job.py, 3 ranks on gloo) hung at exit in 4 runs of 6 beside a
    CPU hog, 0 of 6 without: gloo's worker thread, freeing its last work (and the Python
    context torch stashes for every backward), waited for the GIL that the main thread
    held while freeing DDP's process group and joining that thread."""
    if not callable(getattr(getattr(torch, "compiler", None), "disable", None)):
        return
    off: list[Hook] = []  # pre and post, disabled for Dynamo: made at the first compile

    def pre_off(optimizer: Any, args: Any, kwargs: Any) -> None:
        off[0](optimizer, args, kwargs)

    def post_off(optimizer: Any, args: Any, kwargs: Any) -> None:
        off[1](optimizer, args, kwargs)

    def compiled_pre(optimizer: Any, args: Any, kwargs: Any) -> None:
        if _quiet:
            return
        if dynamo_compiling():  # traced: a graph break here, and the hook runs eagerly
            return pre_off(optimizer, args, kwargs)
        pre(optimizer, args, kwargs)

    def compiled_post(optimizer: Any, args: Any, kwargs: Any) -> None:
        if _quiet:
            return
        if dynamo_compiling():
            return post_off(optimizer, args, kwargs)
        post(optimizer, args, kwargs)

    entries = ((getattr(opt, "_global_optimizer_pre_hooks", None), pre_key, compiled_pre),
               (getattr(opt, "_global_optimizer_post_hooks", None), post_key, compiled_post))

    def first_compile() -> None:
        disable = torch.compiler.disable
        off.extend((disable(pre), disable(post)))

    _patch_compile(torch, entries, pre, post, ctx, first_compile)


def _patch_compile(torch: Any, entries: tuple[tuple[Any, int, Hook], ...], pre: Hook,
                   post: Hook, ctx: Callable[[], tuple[Any, Any, Any]],
                   first_compile: Callable[[], None]) -> None:
    original = getattr(torch, "compile", None)
    if not callable(original):
        return
    module_cls = torch.nn.Module
    optimizer_cls = torch.optim.Optimizer
    swapped: list[bool] = []

    @functools.wraps(original)
    def compile(*args: Any, **kwargs: Any) -> Any:
        target = args[0] if args else kwargs.get("model")
        if target is None:  # @torch.compile(fullgraph=True): the decorator comes back
            return functools.partial(compile, **kwargs)
        compiled = original(*args, **kwargs)
        rec, fail, _ = ctx()
        if rec is None:
            return compiled
        try:
            if not swapped:
                swapped.append(True)
                first_compile()
                for table, key, hook in entries:
                    if table is not None and key in table:
                        table[key] = hook
            if isinstance(compiled, module_cls) or not callable(compiled):
                return compiled  # a compiled model: timed as a root (forward)
            owner = getattr(target, "__self__", None)
            step_of = owner if isinstance(owner, optimizer_cls) \
                and getattr(target, "__name__", "") == "step" else None
            if step_of is None and not kwargs.get("fullgraph"):
                return compiled
            return _compiled_call(compiled, step_of, pre, post, ctx)
        except Exception as exc:
            fail(exc)
            return compiled

    ctx()[2](torch, "compile", compile)


def _compiled_call(compiled: Callable[..., Any], step_of: Any, pre: Hook, post: Hook,
                   ctx: Callable[[], tuple[Any, Any, Any]]) -> Callable[..., Any]:
    """The user's compiled function, run with the optimizer hooks quiet; for a compiled
    `opt.step`, with the agent's pre and post hooks around it (eagerly, untraced)."""

    @functools.wraps(compiled)
    def call(*args: Any, **kwargs: Any) -> Any:
        global _quiet
        if step_of is not None and _quiet == 0:
            pre(step_of, args, kwargs)
        _quiet += 1
        try:
            out = compiled(*args, **kwargs)
        except BaseException:
            rec, fail, _ = ctx()
            if step_of is not None and _quiet == 1 and rec is not None:
                try:  # the step raised (its own error): its phase is closed
                    rec.end(step_of)
                except Exception as exc:
                    fail(exc)
            raise
        finally:
            _quiet -= 1
        if step_of is not None and _quiet == 0:
            post(step_of, args, kwargs)
        return out

    return call
