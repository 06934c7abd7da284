"""megatron-core's tensor-parallel layers without the rest of megatron-core.

What the DeepSpeed engine uses of megatron-core is small: ``tensor_parallel.layers`` (Column/Row
parallel Linear, VocabParallelEmbedding, the TP attributes), ``tensor_parallel.cross_entropy``,
``parallel_state`` and ``ModelParallelConfig``. But ``import megatron.core.<anything>`` first runs
``megatron/core/__init__.py``, which imports its DDP, inference contexts (wandb), timers and every
``tensor_parallel`` export, and ``tensor_parallel.layers`` imports ``megatron.core.transformer``,
whose ``__init__`` builds ``TransformerConfig`` and the fused kernels (``torch.compile`` at import:
``torch._dynamo`` and ``torch._inductor``). About 9 s of a 2-core machine's wall time (3-4
CPU-seconds) per rank, before the first step; the modules we use need under a second of it.

``load()`` imports exactly those modules with the package ``__init__`` files of ``megatron.core``,
``megatron.core.tensor_parallel`` and ``megatron.core.transformer`` not yet run: each package is
registered as the module object its own import would make (``importlib.util.module_from_spec``:
same ``__path__``, ``__spec__``, ``__file__``), so that submodule imports find their files as usual.
Each such package completes itself on demand: asking it for a submodule imports that submodule;
asking it for any other name (``megatron.core.Timers``, ``tensor_parallel.checkpoint``) runs the
package's real ``__init__`` in that same module object first -- so a later user of the rest of
megatron-core sees the package exactly as ``import megatron.core`` would have made it, only later.

The one module-level compile on the path (``megatron.core.jit.jit_fuser``, ``torch.compile`` on this
torch, decorating two GELUs in ``transformer/utils.py`` that our layers never call) is deferred
while ``load()`` imports: the decorated function compiles on its first call instead of at import,
and ``jit_fuser`` is restored right after. ``tests/test_startup_imports.py`` checks all of this
against the real megatron-core: the same classes, the completed packages' names, what stays out.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
import types

# The packages whose __init__ is deferred, outermost first.
DEFERRED_PACKAGES = ("megatron.core", "megatron.core.tensor_parallel", "megatron.core.transformer")
# What the DeepSpeed engine takes from megatron-core, in the order megatron's own __init__ reaches them
# (parallel_state before utils: the two import each other, and only this order resolves).
MODULES = ("megatron.core.parallel_state", "megatron.core.model_parallel_config",
           "megatron.core.tensor_parallel.cross_entropy", "megatron.core.tensor_parallel.layers")


def _complete_on_demand(module: types.ModuleType, spec) -> None:
    def __getattr__(name: str):
        if name.startswith("__"):  # dunder probes (copy, pickle, inspect) never complete a package
            raise AttributeError(name)
        sub = f"{spec.name}.{name}"
        if importlib.util.find_spec(sub) is not None:
            return importlib.import_module(sub)
        complete(module)
        return getattr(module, name)
    module.__getattr__ = __getattr__
    module.__megafixed_deferred__ = spec


def complete(module: types.ModuleType) -> None:
    """Run a deferred package's own ``__init__`` in its module object (no-op for any other module)."""
    spec = module.__dict__.pop("__megafixed_deferred__", None)
    if spec is None:
        return
    module.__dict__.pop("__getattr__", None)
    spec.loader.exec_module(module)


def _deferred_package(name: str) -> None:
    if name in sys.modules:
        return  # imported already (deferred by us, or for real by someone who needs all of it)
    spec = importlib.util.find_spec(name)
    module = importlib.util.module_from_spec(spec)
    _complete_on_demand(module, spec)
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)


def _compile_on_first_call(decorator):
    """``decorator`` (``torch.compile``) applied when the decorated function is first called."""
    def defer(fn):
        compiled = []

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if not compiled:
                compiled.append(decorator(fn))
            return compiled[0](*args, **kwargs)
        return call
    return defer


@functools.cache
def load() -> types.SimpleNamespace:
    """``parallel_state``, ``ModelParallelConfig``, ``layers`` and ``cross_entropy`` of megatron-core
    (imported once per process; later calls return the same namespace)."""
    for name in DEFERRED_PACKAGES:
        _deferred_package(name)
    mods = {name.rsplit(".", 1)[1]: importlib.import_module(name) for name in MODULES[:2]}
    jit = importlib.import_module("megatron.core.jit")
    real_fuser = jit.jit_fuser
    jit.jit_fuser = _compile_on_first_call(real_fuser)
    try:
        mods.update({name.rsplit(".", 1)[1]: importlib.import_module(name) for name in MODULES[2:]})
    finally:
        jit.jit_fuser = real_fuser
    return types.SimpleNamespace(ModelParallelConfig=mods["model_parallel_config"].ModelParallelConfig, **mods)
