"""The torch engine's pipeline in the memory plan (``parallel.pp > 1``, ``train.engine=torch``).

The split is the engine's (``engine.native.schedules.stage_spans``: input and head counted as
``parallel.pp_input_head_layers`` layers each, ``pp * vpp`` stages, looped or V-shaped over the
ranks); the microbatches each stage holds in flight are the schedule's own (``parallel.bubble``,
from its action table). A rank holds the sum over its stages -- each stage at its own peak, an
upper bound where a rank's stages peak at different times. ``memory.estimate`` adds the model
states (FSDP2 keeps every working parameter unsharded under PP: no reshard after forward).

Pure arithmetic on byte counts handed in (``memory.py`` computes them), so this module imports
neither the memory model nor the engine's build.
"""
from __future__ import annotations


def stage_param_count(per_layer: list[int], span) -> int:
    """Parameters of one stage from the per-layer counts ``[input, block, ..., head]``."""
    blocks = span.end - span.first
    return (per_layer[0] if span.has_input else 0) + blocks * per_layer[1] + (per_layer[-1] if span.has_head else 0)


def pipeline_summary(m, layout, per_set: float, stored_input: float, logits: float) -> dict:
    """The schedule, its bubble (action table and formula), the split and, per stage, the bytes of
    the microbatches it holds in flight: ``per_set`` per block and microbatch (a layer's saved
    activations, or its stored input under activation checkpointing), ``stored_input`` for the
    input's output, ``logits`` on the last stage (one microbatch at a time)."""
    from ..engine.native.schedules import canonical_name, stage_spans
    from .bubble import bubble

    b = bubble(canonical_name(layout.schedule), layout.pp, layout.accum, layout.vpp)
    spans = stage_spans(m.n_layers, layout.pp * layout.vpp, layout.edge)
    acts = {}
    for s in spans:
        held = b.in_flight_per_stage.get(s.index, 0)
        act = held * (s.end - s.first) * per_set
        if s.has_input:
            act += held * stored_input  # input codes / embedding output
        if s.has_head:  # final norm input + fp32 logits for the loss
            act += stored_input + logits
        acts[s.index] = act
    return {**b.as_dict(), "stage_blocks": [[s.first, s.end] for s in spans],
            "activation_bytes_per_stage": {str(k): v for k, v in acts.items()}}
