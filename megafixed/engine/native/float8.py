"""``train.float8``: the backbone's Linears in float8 through torchao (``convert_to_float8_training``).

torchtitan's recipe and order: the conversion runs on the meta-device GPT before tensor parallelism
and FSDP2 (``build.py``), so TP and FSDP2 wrap ``Float8Linear`` modules. What is converted:

* every Linear of every block (attention q/k/v/o, the MLP's) whose two dims are multiples of 16 --
  torchao's rule (``torch._scaled_mm`` needs them); any other stays in high precision, and the
  start line counts them;
* not the output head (``head.proj``: the logits feed the loss; torchtitan keeps its ``output`` out
  too), not the input (a table lookup or a fixed code has no matmul), and not block 0's q/k/v under
  ``model.fused_first_layer`` (the fused path reads their weights directly, not through the Linear).

On CUDA the GEMMs are ``torch._scaled_mm`` (SM 8.9+); anywhere else torchao's ``emulate=True``
(the same casts and scales, the matmul on dequantised values): CPU tests run the real conversion.
Tensorwise under FSDP2 all-gathers the float8 weights (``enable_fsdp_float8_all_gather``, with the
per-step amax precompute torchtitan runs after the optimizer; the pipeline's stages compute each
weight's amax in its pre-all-gather instead). Rowwise has no float8 all-gather in torchao (it
gathers the compute dtype).

``Float8Linear`` keeps ``weight``/``bias`` as ordinary parameters in the master dtype, so state-dict
keys and values are the unconverted model's: a float8 run resumes without float8 and the other way.
"""
from __future__ import annotations

from typing import NamedTuple

RECIPES = ("tensorwise", "rowwise")
_DIM_MULTIPLE = 16  # torch._scaled_mm's alignment: torchao converts only Linears whose dims divide by it
_FUSED_QKV = ("blocks.0.attn.wq", "blocks.0.attn.wk", "blocks.0.attn.wv")


class Float8Layers(NamedTuple):
    """What ``float8_layers`` picks: the converted Linears' paths, and those left in high precision
    (with why)."""
    converted: tuple
    kept: tuple  # ((path, reason), ...)


def float8_layers(model) -> Float8Layers:
    """Which of ``model``'s Linears the conversion takes (the block Linears with dims divisible by 16,
    except the fused first layer's q/k/v), without converting anything."""
    from torch import nn

    fused = bool(getattr(model, "fused_first_layer", False))
    converted, kept = [], []
    for path, module in model.named_modules():
        if not isinstance(module, nn.Linear) or not path.startswith("blocks."):
            continue
        out_features, in_features = module.weight.shape
        if fused and path in _FUSED_QKV:
            kept.append((path, "the fused first layer reads its weight directly"))
        elif out_features % _DIM_MULTIPLE or in_features % _DIM_MULTIPLE:
            kept.append((path, f"{out_features}x{in_features} not divisible by {_DIM_MULTIPLE}"))
        else:
            converted.append(path)
    return Float8Layers(tuple(converted), tuple(kept))


def float8_config(recipe: str, *, emulate: bool, fsdp_all_gather: bool):
    """torchao's ``Float8LinearConfig`` for ``recipe`` (``RECIPES``), emulated off CUDA; the float8
    all-gather only for tensorwise (torchao supports no other)."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, emulate=emulate,
                               enable_fsdp_float8_all_gather=fsdp_all_gather and recipe == "tensorwise")


def uses_float8_all_gather(recipe: str, *, dp_shard: int) -> bool:
    """FSDP2 gathers float8 weights: tensorwise (torchao supports no other), sharded over more than one
    rank. Gloo too: a block's group mixes float8 weights with its norms', so FSDP2 gathers one uint8
    buffer (gloo has no float8 dtypes; a group of float8 weights alone would not go through it)."""
    return recipe == "tensorwise" and dp_shard > 1


def convert_to_float8(model, recipe: str, *, emulate: bool, fsdp_all_gather: bool) -> Float8Layers:
    """Swap ``model``'s ``float8_layers`` for torchao's ``Float8Linear``, in place (any device,
    the meta device included); returns what was converted and what was not."""
    from torchao.float8 import convert_to_float8_training

    layers = float8_layers(model)
    chosen = set(layers.converted)
    convert_to_float8_training(model, config=float8_config(recipe, emulate=emulate, fsdp_all_gather=fsdp_all_gather),
                               module_filter_fn=lambda _module, path: path in chosen)
    return layers


def precompute_scales_after_step(model, optimizer) -> None:
    """With the float8 all-gather: one amax all-reduce for every weight's scale now and after each optimizer
    step (torchao's ``precompute_float8_dynamic_scale_for_fsdp``, as torchtitan hooks it), instead of
    one per weight in the next forward."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    optimizer.register_step_post_hook(lambda *_args, **_kwargs: precompute_float8_dynamic_scale_for_fsdp(model))
    # and for the first step: torchao's fallback (each weight's amax in its pre-all-gather) rounds the
    # scale apart from the precompute in the last bits, so a run that took it only at its first step
    # (or at a resume's: NativeEngine.load precomputes too) would not be the uninterrupted run bit for bit
    precompute_float8_dynamic_scale_for_fsdp(model)


def describe(recipe: str, layers: Float8Layers, *, emulate: bool, all_gather: bool) -> str:
    """``--dry-run``'s float8 line: ``float8 tensorwise: 8 Linears, ...; 2 kept in high precision: ...``."""
    names = ", ".join(f"{path} ({why})" for path, why in layers.kept)
    kept = f"; {len(layers.kept)} kept in high precision: {names}" if layers.kept else ""
    how = "emulated (no CUDA)" if emulate else "torch._scaled_mm"
    gather = ", float8 all-gather" if all_gather else ""
    return f"float8 {recipe}: {len(layers.converted)} Linears{kept}, {how}{gather}; head and input in high precision"


def apply_float8(model, cfg, topo):
    """``train.float8`` on this rank's meta-device ``model`` (``build.py``, ``pipeline.py``: before TP
    and FSDP2). Returns the ``Float8Layers``, or None when float8 is off."""
    recipe = cfg.train.float8
    if recipe == "off":
        return None
    return convert_to_float8(model, recipe, emulate=topo.device.type != "cuda",
                             fsdp_all_gather=float8_all_gather(cfg, topo.plan))


def float8_all_gather(cfg, plan) -> bool:
    """Whether this run's FSDP2 gathers float8 weights (``uses_float8_all_gather`` for its plan)."""
    from .mesh import mesh_shape

    _, shard, _ = mesh_shape(plan.dp, plan.tp, cfg.torch_engine.dp_replicate)
    return uses_float8_all_gather(cfg.train.float8, dp_shard=shard * plan.cp)  # FSDP2 shards over dp_shard x cp


def dry_run_line(cfg, plan) -> str:
    """``--dry-run``'s float8 line, from the meta GPT (no torchao needed: it only names Linears)."""
    from ...model.gpt import meta_gpt

    layers = float8_layers(meta_gpt(cfg.model))
    return "# " + describe(cfg.train.float8, layers, emulate=plan.device != "cuda",
                           all_gather=float8_all_gather(cfg, plan))
