"""DeepSpeed's compiled ops (one cache folder per environment, no build for one rank, a line before a
build), its Muon modules not imported by a megafixed engine, and the megatron-core warnings that do
not apply to a megafixed run."""
from __future__ import annotations

import importlib.util
import re
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

from megafixed.engine.deepspeed import muon as ds_muon
from megafixed.engine.deepspeed import ops as ds_ops
from megafixed.engine.deepspeed.env import quiet_library_noise


def test_the_extensions_folder_changes_with_what_changes_the_build(monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    base = ds_ops.build_key()
    assert base == ds_ops.build_key()  # stable
    assert base.startswith(f"py{sys.version_info.major}{sys.version_info.minor}-torch") and "-deepspeed" in base
    monkeypatch.setenv("CXX", "clang++")
    assert ds_ops.build_key() != base
    monkeypatch.delenv("CXX")
    monkeypatch.setattr(ds_ops, "_cpu_signature", lambda: "model name: another CPU\nflags: sse2\n")
    assert ds_ops.build_key() != base


def test_no_world_size_builds_the_shm_op_and_gpus_are_left_alone(monkeypatch):
    table = {ds_ops.SHM_OP: True}
    fake_ops = types.ModuleType("deepspeed.ops")
    fake_ops.__compatible_ops__ = table
    monkeypatch.setitem(sys.modules, "deepspeed.ops", fake_ops)
    monkeypatch.setitem(sys.modules, "deepspeed", types.SimpleNamespace(ops=fake_ops))
    with ds_ops.prepare_ops(accelerator_is_cpu=False):
        assert table[ds_ops.SHM_OP] is True  # a GPU accelerator: DeepSpeed's table untouched
    with ds_ops.prepare_ops(accelerator_is_cpu=True):
        assert table[ds_ops.SHM_OP] is False  # DeepSpeed's build_shm_op returns None: no compile, one rank or many
    assert table == {ds_ops.SHM_OP: True}  # and DeepSpeed's table as it was once the engine is built
    del table[ds_ops.SHM_OP]
    with ds_ops.prepare_ops(accelerator_is_cpu=True):
        assert table[ds_ops.SHM_OP] is False
    assert table == {}


def _shown(message: str, module: str, cuda: bool) -> bool:
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        warnings.simplefilter("always")
        quiet_library_noise(cuda)
        warnings.warn_explicit(message, UserWarning, "x.py", 1, module=module)
    return bool(caught)


def test_deepspeeds_own_build_shm_op_builds_nothing_after_prepare_ops(monkeypatch):
    """The table entry ``prepare_ops`` sets is the one DeepSpeed 0.19.8's ``build_shm_op`` reads: a DeepSpeed
    that builds the op some other way fails here (its builder refuses to load), not with minutes of compiling."""
    pytest.importorskip("deepspeed")
    import importlib

    from deepspeed.accelerator import get_accelerator

    ds_comm_torch = importlib.import_module("deepspeed.comm.torch")  # the attribute is shadowed by torch itself

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None:
        pytest.skip("this accelerator has no shm comm op")

    def refuse(*args, **kwargs):
        raise AssertionError("DeepSpeed went to build the shm comm op")
    monkeypatch.setattr(type(builder), "load", refuse)
    monkeypatch.setattr(type(builder), "jit_load", refuse)
    with ds_ops.prepare_ops(accelerator_is_cpu=True):
        assert ds_comm_torch.build_shm_op() is None


def test_megatron_warnings_that_do_not_apply_are_filtered_precisely():
    te = "Transformer Engine and Apex are not installed. Falling back to Torch optimizers."
    cuda_hint = ("When using sequence parallelism it is recommended to set the environment variable "
                 "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup")
    assert not _shown(te, "megatron.core.optimizer", cuda=False)
    assert not _shown(te, "megatron.core.optimizer", cuda=True)
    assert _shown(te, "someone.else", cuda=False)  # the same words elsewhere still show
    assert not _shown(cuda_hint, "megatron.core.tensor_parallel.layers", cuda=False)
    assert _shown(cuda_hint, "megatron.core.tensor_parallel.layers", cuda=True)  # on GPUs it is advice
    assert _shown("some other megatron warning", "megatron.core.optimizer", cuda=False)


def _names_deepspeed_imports_from_muon() -> set[tuple[str, str]]:
    """(module, name) for every ``from <muon module> import name`` in DeepSpeed outside its muon package."""
    root = Path(importlib.util.find_spec("deepspeed").origin).parent
    pattern = re.compile(r"from (deepspeed\.runtime\.zero\.muon\.\w+) import (\w+)")
    found = set()
    for path in root.rglob("*.py"):
        if "muon" not in path.parent.name:
            found.update(pattern.findall(path.read_text(errors="replace")))
    return found


def test_deepspeeds_muon_checks_get_the_answers_they_would_without_importing_muon(monkeypatch):
    for name in (ds_muon.MUON_MODULE, ds_muon.MUON_KERNELS):
        monkeypatch.delitem(sys.modules, name, raising=False)
    ds_muon.skip_muon_import()
    imported = _names_deepspeed_imports_from_muon()
    # every name DeepSpeed imports at its Muon checks is answered by a stand-in (a DeepSpeed upgrade
    # that imports something new fails here, not with an ImportError mid-run)
    assert imported and {m for m, _ in imported} <= {ds_muon.MUON_MODULE, ds_muon.MUON_KERNELS}
    for module, name in imported:
        assert hasattr(sys.modules[module], name), (module, name)
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    from megafixed.run.optim import SkippableAdamW

    ours = SkippableAdamW([torch.nn.Parameter(torch.ones(2, 2))], lr=1e-3)
    assert not isinstance(ours, MuonWithAuxAdam)  # what the real class answers for our optimizer
    with pytest.raises(ImportError, match="stand-in"):
        MuonWithAuxAdam([])
    with pytest.raises(RuntimeError, match="stand-in"):
        sys.modules[ds_muon.MUON_KERNELS].muon_update(torch.ones(2, 2), torch.ones(2, 2), 0.9)


def test_a_real_muon_already_imported_is_never_shadowed(monkeypatch):
    real = types.ModuleType(ds_muon.MUON_KERNELS)
    monkeypatch.delitem(sys.modules, ds_muon.MUON_MODULE, raising=False)
    monkeypatch.setitem(sys.modules, ds_muon.MUON_KERNELS, real)
    ds_muon.skip_muon_import()
    assert sys.modules[ds_muon.MUON_KERNELS] is real and ds_muon.MUON_MODULE not in sys.modules
