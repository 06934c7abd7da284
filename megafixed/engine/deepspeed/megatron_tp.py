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

``megatron.core.utils`` also imports DTensor (``torch.distributed.tensor``: 0.7-0.8 CPU-seconds, sympy
included) for nothing but ``isinstance(x, DTensor)`` / ``isinstance(p, Shard)`` checks, none of which a
DeepSpeed run's tensors pass. While it imports, ``torch.distributed._tensor`` is made unimportable
(only when DTensor is not imported already), and afterwards its ``DTensor`` and ``Shard`` become
``_WhenImported`` stand-ins and ``HAVE_DTENSOR`` what the import would have said: an ``isinstance``
against a stand-in is False while the real class's module is not imported (no object can be an
instance of a class that does not exist yet) and the real check once it is; any other use of the name
(an attribute, a call) imports the real class and forwards to it.

The one module-level compile on the path (``megatron.core.jit.jit_fuser``, ``torch.compile`` on this
torch, decorating two GELUs in ``transformer/utils.py`` that our layers never call) is deferred
while ``load()`` imports: the decorated function compiles on its first call instead of at import,
and ``jit_fuser`` is restored right after. ``tests/test_startup_imports.py`` checks all of this
against the real megatron-core: the same classes, the completed packages' names, what stays out.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import sys
import types

# A patch of megatron-core's internals, kept because it saves about 2.3 s (wall) per rank of a TP/PP run with no
# public route (docs/benchmarks.md, "Start-up without patches"). Written against megatron-core 0.16.1: a test
# fails on another minor version (tests/test_startup_imports.py::test_kept_patches_name_the_installed_versions),
# and the behavioural tests named in the docstring fail if the internals it relies on change.
WRITTEN_AGAINST = ("megatron-core", "0.16.1")

# The packages whose __init__ is deferred, outermost first.
DEFERRED_PACKAGES = ("megatron.core", "megatron.core.tensor_parallel", "megatron.core.transformer")



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


class _WhenImported(type):
    """Metaclass of a stand-in for class ``real_name`` of module ``real_module`` (see the module docstring)."""

    def _real(cls, import_it: bool):
        if not import_it and cls.real_module not in sys.modules:
            return None
        return getattr(importlib.import_module(cls.real_module), cls.real_name)

    def __instancecheck__(cls, obj):
        real = cls._real(False)
        return real is not None and isinstance(obj, real)

    def __subclasscheck__(cls, sub):
        real = cls._real(False)
        return real is not None and issubclass(sub, real)

    def __getattr__(cls, name):
        return getattr(cls._real(True), name)

    def __call__(cls, *args, **kwargs):
        return cls._real(True)(*args, **kwargs)


def _stand_in(module: str, name: str) -> type:
    return _WhenImported(name, (), {"real_module": module, "real_name": name,
                                    "__doc__": f"megafixed's stand-in for {module}.{name} (megatron_tp.py)"})


DTENSOR_BLOCKED = "torch.distributed._tensor"  # what megatron.core.utils imports DTensor from


@contextlib.contextmanager
def _dtensor_deferred():
    """Around the first import of ``megatron.core.utils`` (through ``parallel_state``: see ``MODULES``):
    its DTensor import deferred (see the module docstring)."""
    if "megatron.core.utils" in sys.modules or "torch.distributed.tensor" in sys.modules:
        yield  # imported already, or DTensor is here anyway: nothing to defer
        return
    sys.modules[DTENSOR_BLOCKED] = None  # `from torch.distributed._tensor import ...` raises ImportError
    try:
        yield
    finally:
        del sys.modules[DTENSOR_BLOCKED]
    utils = sys.modules["megatron.core.utils"]
    if not utils.HAVE_DTENSOR:
        utils.HAVE_DTENSOR = importlib.util.find_spec("torch.distributed.tensor") is not None
        utils.DTensor = _stand_in("torch.distributed.tensor", "DTensor")
        utils.Shard = _stand_in("torch.distributed.tensor.placement_types", "Shard")


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
    (imported once per process; later calls return the same namespace). The imports below run with the
    packages deferred (``import megatron.core.X`` then finds them in ``sys.modules``), in the order
    megatron's own ``__init__`` reaches them: ``parallel_state`` before ``utils`` (the two import each
    other, and only that order resolves)."""
    for name in DEFERRED_PACKAGES:
        _deferred_package(name)
    with _dtensor_deferred():
        from megatron.core import model_parallel_config, parallel_state
    from megatron.core import jit

    real_fuser = jit.jit_fuser
    jit.jit_fuser = _compile_on_first_call(real_fuser)
    try:
        from megatron.core.tensor_parallel import cross_entropy, layers
    finally:
        jit.jit_fuser = real_fuser
    return types.SimpleNamespace(parallel_state=parallel_state, model_parallel_config=model_parallel_config,
                                 ModelParallelConfig=model_parallel_config.ModelParallelConfig,
                                 cross_entropy=cross_entropy, layers=layers)
