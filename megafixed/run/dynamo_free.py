"""torch's optimizers without ``import torch._dynamo`` in a process that compiles nothing.

torch 2.13's optimizers reach for ``torch._dynamo`` in two places, both no-ops unless ``torch.compile``
is tracing the call:

1. Every built-in ``step`` is wrapped by ``torch.optim.optimizer._use_grad_for_differentiable``, whose
   wrapper runs ``import torch._dynamo`` and ``torch._dynamo.graph_break()`` before and after the step
   (graph breaks are instructions to the compiler; outside a trace they do nothing).
2. ``Optimizer.add_param_group``, ``zero_grad``, ``state_dict`` and ``load_state_dict`` are wrapped by
   ``torch._disable_dynamo``, which imports ``torch._dynamo`` on its first call to build
   ``torch._dynamo.disable(fn)`` (run ``fn`` with the compiler's frame hook off), then caches that on
   ``fn.__dynamo_disable``.

Importing ``torch._dynamo`` pulls ``torch._inductor``, triton, sympy, FSDP and DTensor: about 1.1 s
(1 CPU-second) in every rank of a run with ``train.compile`` off, before its first step.

While ``torch._dynamo`` is not imported nothing can be compiling (``torch.compile`` imports it first) and
no frame hook is installed, so both wrappers reduce to calling the wrapped function. ``step`` therefore
calls the unwrapped step with the wrapper's own grad-mode handling and without the graph breaks, and
``defer_dynamo_disable`` pre-fills each ``__dynamo_disable`` cache with a function that calls ``fn``
directly until ``torch._dynamo`` is imported and hands over to the real ``torch._dynamo.disable`` from
then on. Both recognise torch's wrappers by their code objects; a torch whose wrappers differ gets the
real ones (slower, never wrong), and ``tests/test_startup_imports.py`` fails so the drift is seen.
"""
from __future__ import annotations

import functools
import inspect
import sys

import torch
from torch.optim import optimizer as _optimizer_module

# A patch of torch's internals, kept because together with engine/deepspeed/muon.py it saves about 1.8 s per
# DeepSpeed rank with no public route (docs/benchmarks.md, "Start-up without patches"). Written against torch
# 2.13.0: a test fails on another minor version
# (tests/test_startup_imports.py::test_kept_patches_name_the_installed_versions), and the behavioural tests
# named in the docstring fail if the internals it relies on change.
WRITTEN_AGAINST = ("torch", "2.13.0")


def _probe(*args, **kwargs):  # only its wrappers' code objects are used
    return None


# The code objects of torch's two wrappers: every wrapper they make runs this same code.
USE_GRAD_CODE = _optimizer_module._use_grad_for_differentiable(_probe).__code__
DISABLE_DYNAMO_CODE = torch._disable_dynamo(_probe).__code__
DEFERRED_METHODS = ("add_param_group", "zero_grad", "state_dict", "load_state_dict")


def dynamo_imported() -> bool:
    return "torch._dynamo" in sys.modules


def unwrapped_step(step):
    """The step inside torch's ``_use_grad`` wrapper (through any ``functools.wraps`` layers above it,
    e.g. the profiler hook), or None if ``step`` has no such wrapper."""
    wrapper = inspect.unwrap(step, stop=lambda f: getattr(f, "__code__", None) is USE_GRAD_CODE)
    if getattr(wrapper, "__code__", None) is not USE_GRAD_CODE:
        return None
    return wrapper.__wrapped__


def step_without_dynamo(optimizer: torch.optim.Optimizer, step, closure=None):
    """``step(optimizer, closure)`` as torch's ``_use_grad`` wrapper runs it, minus the graph breaks
    (nothing is compiling: see the module docstring); the real wrapper when that is not provable."""
    inner = None if dynamo_imported() else unwrapped_step(step)
    if inner is None:
        return step(optimizer, closure)
    previous = torch.is_grad_enabled()
    try:
        torch.set_grad_enabled(optimizer.defaults["differentiable"])
        return inner(optimizer, closure)
    finally:
        torch.set_grad_enabled(previous)


def _closure_of(wrapper) -> dict:
    return dict(zip(wrapper.__code__.co_freevars, (c.cell_contents for c in wrapper.__closure__ or ())))


def _until_dynamo(fn, recursive: bool):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if dynamo_imported():  # a compile may be tracing from now on: the real disable, cached as torch does
            import torch._dynamo

            real = torch._dynamo.disable(fn, recursive, wrapping=False)
            fn.__dynamo_disable = real
            return real(*args, **kwargs)
        return fn(*args, **kwargs)
    call.megafixed_until_dynamo = True
    return call


def defer_dynamo_disable(cls=torch.optim.Optimizer) -> list[str]:
    """Pre-fill the ``__dynamo_disable`` cache of ``cls``'s ``torch._disable_dynamo`` methods (idempotent).
    Returns the names of the methods it recognised (all of ``DEFERRED_METHODS`` on torch 2.13)."""
    done = []
    for name in DEFERRED_METHODS:
        wrapper = getattr(cls, name, None)
        if getattr(wrapper, "__code__", None) is not DISABLE_DYNAMO_CODE:
            continue
        cell = _closure_of(wrapper)
        fn = cell.get("fn")
        if fn is None or "recursive" not in cell:
            continue
        if getattr(fn, "__dynamo_disable", None) is None and not dynamo_imported():
            fn.__dynamo_disable = _until_dynamo(fn, cell["recursive"])
        done.append(name)
    return done
