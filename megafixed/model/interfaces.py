"""Input interfaces as a registry: each one says once what it is; callers ask, never test names.

An interface (``model.input``) is the map from token ids to the first residual stream. The study
compares three: a learned table (the control) and two fixed, parameter-free codes. Every part of
megafixed that depends on which one a run uses asks its ``InputInterface`` here:

* how it builds (``module(model_cfg)``: its code from the code config, then the module);
* whether it has a table (trainable ``vocab x d`` parameters, which ``model.tie_embeddings`` can
  tie to the head) or a fixed code (``make_code``; the fused first layer and the probe read the
  module's ``.code``);
* its tensor/sequence-parallel form (``tp_form``): ``VOCAB_PARALLEL`` (the table's vocabulary rows
  split across TP ranks, megatron's ``VocabParallelEmbedding``) or ``REPLICATED`` (every rank
  computes the input itself; under SP only its own positions). ``megafixed.parallel.tensor``
  implements the two forms, and ``sharded_dim`` (which our converter and DeepSpeed's universal
  checkpoint read) takes the sharded parameters from ``sharded()``;
* its Hugging Face embedding (``hf_embedding``: the ``vocab x d`` matrix an export writes as
  ``embed_tokens``; None: the export refuses it by name);
* how it describes itself (``describe``: the manifest, ``ckpt inspect``; ``summary``; ``colour``
  and ``control`` for the study report).

Adding an interface is one ``register(InputInterface(...))`` plus its tests (tests/test_interfaces.py
registers a toy one). This module imports only the code library and the input modules, never the
config, the parallel layer or interop (they import it), so it closes no import cycle.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..codes import FixedCode, make_code
from .inputs import FixedCodeInput, LearnedInput

VOCAB_PARALLEL = "vocab_parallel"
REPLICATED = "replicated"
TP_FORMS = (VOCAB_PARALLEL, REPLICATED)


class UnknownInterface(ValueError):
    """A ``model.input`` no registered interface has (the CLI reports it as bad input)."""


@dataclass(frozen=True)
class InputInterface:
    name: str  # the model.input value
    summary: str  # one line: what the input is
    # (model config, its code or None) -> the input module. A module of an interface with a code
    # exposes ``.code`` and ``.out_dtype``; one with a table holds it at ``table`` as an nn.Embedding.
    build: Callable[[Any, Optional[FixedCode]], nn.Module]
    make_code: Optional[Callable[[Any], FixedCode]] = None  # model config -> its fixed code; None: no code
    table: Optional[str] = None  # the vocab x d trainable table's parameter name in the module; None: none
    tp_form: str = REPLICATED
    # A and b are this interface's own (drawn from model.code_seed): model.code_rows/code_shift pin
    # them, save_config writes them out and describe() records them.
    affine_recoding: bool = False
    control: bool = False  # the study's baseline, the one paired differences are taken against
    colour: Optional[str] = None  # matplotlib colour of the study plots
    # (input module, model config) -> the fp32 vocab x d matrix a transformers export writes as
    # its embedding; None: it cannot be exported, and the export says so.
    hf_embedding: Optional[Callable[[nn.Module, Any], torch.Tensor]] = None

    def __post_init__(self):
        if self.tp_form not in TP_FORMS:
            raise ValueError(f"interface {self.name!r}: tp_form {self.tp_form!r} is not one of {TP_FORMS}")
        if self.tp_form == VOCAB_PARALLEL and self.table is None:
            raise ValueError(f"interface {self.name!r}: a vocab-parallel input needs a table to split")

    @property
    def has_table(self) -> bool:
        return self.table is not None

    @property
    def has_code(self) -> bool:
        return self.make_code is not None

    def code(self, m) -> Optional[FixedCode]:
        """The fixed code the model config ``m`` names (None for an interface without one)."""
        return self.make_code(m) if self.make_code is not None else None

    def module(self, m) -> nn.Module:
        """The input module of the model config ``m``."""
        return self.build(m, self.code(m))

    def check(self, m) -> None:
        """Raise ``CodeError`` if this interface's code does not fit ``m``'s vocabulary and width."""
        code = self.code(m)
        if code is not None:
            code.check_vocab(m.vocab_size)
            code.check_width(m.d_model)

    def id_bits(self, m) -> Optional[int]:
        """How many bits of a token id the input reads (a vocabulary beyond 2**bits collides); None: no cap."""
        return m.code_bits if self.has_code else None

    def sharded(self) -> dict[str, int]:
        """``{plain-GPT parameter name: TP-sharded dim}`` of the input (the vocabulary rows of a split table)."""
        return {f"input.{self.table}": 0} if self.tp_form == VOCAB_PARALLEL else {}

    def vocab_parameters(self) -> tuple[str, ...]:
        """Plain-GPT names of input parameters with one row per token id (padded/sliced by vocab size)."""
        return (f"input.{self.table}",) if self.has_table else ()

    def describe(self, m) -> dict:
        """What a checkpoint records about its input (the manifest's ``code``, ``ckpt inspect``)."""
        out: dict = {"input": self.name}
        code = self.code(m)
        if code is not None:
            out.update(bits=code.bits, scale=code.scale)
            if self.affine_recoding:
                out.update(A_rows=list(code.rows), b=code.shift)
        return out


INTERFACES: dict[str, InputInterface] = {}


def register(interface: InputInterface) -> InputInterface:
    """Add ``interface``; refuse a taken name or a sharded parameter another interface splits otherwise."""
    if interface.name in INTERFACES:
        raise ValueError(f"input interface {interface.name!r} is already registered")
    for other in INTERFACES.values():
        for name, dim in interface.sharded().items():
            if other.sharded().get(name, dim) != dim:
                raise ValueError(f"interface {interface.name!r} shards {name} on dim {dim} but {other.name!r} "
                                 f"on {other.sharded()[name]}: sharded_dim reads parameter names only")
    INTERFACES[interface.name] = interface
    return interface


def interface_of(model_cfg, error: type = UnknownInterface) -> InputInterface:
    """The interface ``model_cfg.input`` names; ``error`` (e.g. ``ConfigError``) if none is registered."""
    try:
        return INTERFACES[model_cfg.input]
    except KeyError:
        raise error(f"model.input={model_cfg.input!r} is not one of {list(INTERFACES)}") from None


def names(having: Callable[[InputInterface], bool] = lambda _i: True) -> list[str]:
    """Registered interface names, optionally only those ``having`` holds for (messages, choices)."""
    return [i.name for i in INTERFACES.values() if having(i)]


def control() -> Optional[InputInterface]:
    return next((i for i in INTERFACES.values() if i.control), None)


def sharded_parameters() -> dict[str, int]:
    """Every interface's sharded input parameters (``sharded_dim`` reads names, not configs)."""
    out: dict[str, int] = {}
    for interface in INTERFACES.values():
        out.update(interface.sharded())
    return out


def vocab_parameters() -> tuple[str, ...]:
    return tuple(dict.fromkeys(n for i in INTERFACES.values() for n in i.vocab_parameters()))


def build_input(m) -> nn.Module:
    """The input module a ``ModelConfig`` names."""
    return interface_of(m).module(m)


# ----------------------------------------------------------------------------------- the three
def _code_kind(kind: str) -> Callable[[Any], FixedCode]:
    def code(m) -> FixedCode:
        # Explicit rows/shift (as a saved config.yaml has them) win over the seed.
        return make_code(kind, m.code_bits, m.code_seed, m.code_affine, m.code_scale,
                         rows=m.code_rows, shift=m.code_shift)
    return code


def _code_module(m, code: FixedCode) -> nn.Module:
    return FixedCodeInput(code, m.d_model, m.vocab_size)


def _materialized_code(module: nn.Module, m) -> torch.Tensor:
    """The code of every id, ``encode(arange(V), d)``: exactly +-scale in fp32."""
    return module.code.encode(torch.arange(m.vocab_size), m.d_model, dtype=torch.float32)


def _table_weight(module: nn.Module, m) -> torch.Tensor:
    return module.get_parameter("embedding.weight").detach().float().clone()


LEARNED = register(InputInterface(
    name="learned", summary="a trainable vocab x d embedding table (the control)",
    build=lambda m, _code: LearnedInput(m.vocab_size, m.d_model), table="embedding.weight",
    tp_form=VOCAB_PARALLEL, control=True, colour="tab:blue", hf_embedding=_table_weight))
CANONICAL = register(InputInterface(
    name="canonical", summary="the token id's own bits as +-scale, tiled to the width (no parameters)",
    build=_code_module, make_code=_code_kind("canonical"), colour="tab:orange", hf_embedding=_materialized_code))
GF2 = register(InputInterface(
    name="gf2", summary="a seeded GF(2) affine recoding A.c XOR b of the id's bits as +-scale (no parameters)",
    build=_code_module, make_code=_code_kind("gf2"), affine_recoding=True, colour="tab:green",
    hf_embedding=_materialized_code))
