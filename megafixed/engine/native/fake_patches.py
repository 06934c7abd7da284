"""What ``megafixed plan --fake`` changes in torch, and only while it measures: four private
internals that assume real tensors, each patched for the one phase of the measurement that meets it
(``fake_patches("build")`` around the engine's build, ``fake_patches("step", pp=...)`` around its
steps) and restored after.

Each was written against torch 2.13.0 (``WRITTEN_AGAINST``) and names the attribute it replaces;
one that a newer torch has moved refuses the measurement in one line naming it (``FakePatchError``,
the row's refusal), rather than measuring something else. The engine's step itself needs none: it
reads no device value but through ``engine.batches.host_values``, which knows fake tensors.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch

WRITTEN_AGAINST = "2.13.0"


class FakePatchError(RuntimeError):
    """A torch internal that ``--fake`` patches is not where it was (another torch version)."""


@dataclass(frozen=True)
class Patch:
    name: str
    phases: tuple  # "build", "step"
    target: Callable  # () -> (owner, attribute name)
    replacement: Callable  # original -> the replacement
    required: bool = True  # False: an older torch without it needs no patch
    pipeline_only: bool = False


def _mesh_target():
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh, "__init__"


def _mesh_outside_fake_mode(original):
    """A DeviceMesh made inside the fake mode (FSDP2's 2-D DP x TP mesh, ``DeviceMesh._concatenate``;
    slices) computes its coordinates with ``nonzero`` on its rank tensor, which a fake tensor cannot
    answer (its output shape depends on the values); the ranks are real, so a mesh is made with the
    fake mode set aside."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def real_init(self, *args, **kwargs):
        with unset_fake_temporarily():
            original(self, *args, **kwargs)

    return real_init


def _sharding_prop_target():
    from torch.distributed.tensor import _sharding_prop

    return _sharding_prop, "detect_fake_mode"


def _sharding_prop_in_its_own_mode(_original):
    """DTensor's sharding propagation (its uncached path: the first step's ``_foreach_norm`` over
    every gradient) builds global-shape tensors in the active fake mode, or in a fresh one when there
    is none, as in a real run. Borrowing ours, the tracker counted them as memory: the whole model in
    fp32 (6.4 GiB at 1.7B) that no real step allocates. A fresh mode per propagation, as eager has,
    keeps them out (the tracker skips every mode but the one it entered in)."""
    return lambda *args, **kwargs: None


def _vote_target():
    from torch.distributed.pipelining import schedules

    return schedules._PipelineSchedule, "_warmup_p2p"


def _vote_decided_locally(_original):
    """torch's pipeline schedules (2.12 on) open with a vote over the stages, STATIC (every stage was
    given its shapes) or DYNAMIC, passed along by point-to-point sends and read with ``.item()``,
    which a fake tensor cannot answer. Every stage of our pipeline is built with its shapes
    (``pipeline.build_schedule``), so the vote's outcome is each stage's own: decided here, locally,
    as the library would. Older torch has no vote, and nothing is patched."""
    from torch.distributed.pipelining._utils import InferenceMode

    def decided_locally(self, stages, has_backward, p2p_done):
        static = not any(InferenceMode.needs_dynamic(stage._user_meta, has_backward) for stage in stages)
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC if static else InferenceMode.DYNAMIC

    return decided_locally


def _to_empty_target():
    from torch import nn

    return nn.Module, "to_empty"


def _plain_parameters_replaced(original):
    """``to_empty`` swaps each parameter in place (``torch.utils.swap_tensors``) when the old one is
    a fake tensor (the meta model is built inside the fake mode), and the converter's weakref on it
    makes the swap refuse ("Couldn't swap RMSNorm.weight"). A model with no DTensor parameter (no
    FSDP2 or TP: a pipeline stage on dp 1, a lone GPU) gets new Parameters instead, as ``to_empty``
    with ``torch.__future__``'s overwrite switch would; nothing holds them yet (``materialize`` runs
    before the optimizer is built)."""
    from torch import nn
    from torch.distributed.tensor import DTensor

    def to_empty(self, *, device, recurse=True):
        if not recurse or any(isinstance(p, DTensor) for p in self.parameters()):
            return original(self, device=device, recurse=recurse)
        for module in self.modules():
            for key, p in module._parameters.items():
                if p is not None:
                    module._parameters[key] = nn.Parameter(torch.empty_like(p, device=device),
                                                           requires_grad=p.requires_grad)
            for key, b in module._buffers.items():
                if b is not None:
                    module._buffers[key] = torch.empty_like(b, device=device)
        return self

    return to_empty


PATCHES = (
    Patch("DeviceMesh.__init__ outside the fake mode", ("build", "step"), _mesh_target, _mesh_outside_fake_mode),
    Patch("DTensor sharding propagation in its own fake mode", ("step",), _sharding_prop_target,
          _sharding_prop_in_its_own_mode),
    Patch("pipeline warm-up vote decided locally", ("step",), _vote_target, _vote_decided_locally, required=False,
          pipeline_only=True),
    Patch("Module.to_empty: plain parameters replaced", ("build",), _to_empty_target, _plain_parameters_replaced),
)


@contextlib.contextmanager
def patched(patch: Patch):
    """``patch`` applied, restored on the way out (also on an error)."""
    owner, attr = patch.target()
    original = getattr(owner, attr, None)
    if original is None:
        if not patch.required:
            yield
            return
        raise FakePatchError(f"--fake's patch '{patch.name}' was written against torch {WRITTEN_AGAINST}; torch "
                             f"{torch.__version__} has no {getattr(owner, '__name__', owner)}.{attr}")
    setattr(owner, attr, patch.replacement(original))
    try:
        yield
    finally:
        setattr(owner, attr, original)


@contextlib.contextmanager
def fake_patches(phase: str, *, pp: int = 1):
    """Every patch of ``phase`` ("build" or "step"; the pipeline's only when ``pp > 1``)."""
    with contextlib.ExitStack() as stack:
        for patch in PATCHES:
            if phase in patch.phases and (pp > 1 or not patch.pipeline_only):
                stack.enter_context(patched(patch))
        yield
