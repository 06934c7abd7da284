"""Keep DeepSpeed from importing its Muon optimizer in a process that never uses it.

DeepSpeed 0.19 asks "is the client optimizer Muon?" in several places (``is_zero_supported_optimizer``
at ``deepspeed.initialize`` under ZeRO, the bf16 optimizer, ZeRO 1/2's gradient partitioning every
step, ZeRO 3) by importing ``deepspeed.runtime.zero.muon.muon_optimizer`` (for ``MuonWithAuxAdam``,
an ``isinstance`` check) or ``...muon.original_muon`` (for ``muon_update``, called only for
parameters marked ``use_muon`` under an optimizer whose class name says "muon"). ``original_muon``
decorates its kernels with ``torch.compile`` at import, which imports ``torch._inductor``: about
1.5-2 s (3-4 CPU-seconds) per rank on a CPU machine, before the first step. megafixed's client
optimizer is always ``train.optim.SkippableAdamW`` and marks no parameter ``use_muon``, so every one
of those checks answers "no" whether the real modules are imported or not.

``skip_muon_import`` therefore registers stand-in modules: ``MuonWithAuxAdam`` is a class that nothing
is an instance of and that cannot be built, and ``muon_update`` raises if it is ever reached (it
cannot be, per the above). The checks answer exactly what they would with the real modules. It does
nothing if either real module is already imported (someone in this process uses Muon), so it never
shadows a Muon that exists.
"""
from __future__ import annotations

import sys
import types

# A patch of deepspeed's internals, kept because together with run/dynamo_free.py it saves about 1.8 s per
# DeepSpeed rank with no public route (docs/benchmarks.md, "Start-up without patches"). Written against
# deepspeed 0.19.8: a test fails on another minor version
# (tests/test_startup_imports.py::test_kept_patches_name_the_installed_versions), and the behavioural tests
# named in the docstring fail if the internals it relies on change.
WRITTEN_AGAINST = ("deepspeed", "0.19.8")

MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"
MUON_KERNELS = "deepspeed.runtime.zero.muon.original_muon"
_STAND_IN_DOC = "megafixed's stand-in: nothing here is Muon (megafixed/engine/deepspeed/muon.py)"


class _MuonNotImported:
    """Stands for DeepSpeed's ``MuonWithAuxAdam`` in a megafixed process (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        raise ImportError(_refusal())


def _muon_update_not_imported(*args, **kwargs):
    raise RuntimeError(_refusal())


def _refusal() -> str:
    return (f"megafixed registered stand-ins for {MUON_MODULE} and {MUON_KERNELS} (its engine never uses "
            f"Muon); import them before building a megafixed engine to use DeepSpeed's Muon")


def skip_muon_import() -> None:
    """Before ``deepspeed.initialize``: answer DeepSpeed's Muon checks without importing Muon (idempotent)."""
    if MUON_MODULE in sys.modules or MUON_KERNELS in sys.modules:
        return  # the real ones (or our stand-ins) are there already
    optimizer = types.ModuleType(MUON_MODULE, _STAND_IN_DOC)
    optimizer.MuonWithAuxAdam = _MuonNotImported
    kernels = types.ModuleType(MUON_KERNELS, _STAND_IN_DOC)
    kernels.MuonWithAuxAdam = _MuonNotImported
    kernels.muon_update = _muon_update_not_imported
    sys.modules[MUON_MODULE], sys.modules[MUON_KERNELS] = optimizer, kernels
