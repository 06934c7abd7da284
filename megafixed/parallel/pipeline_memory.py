"""Memory per GPU of a torch-engine pipeline layout (``parallel.pp > 1``, ``train.engine=torch``).

The split is the engine's (``engine.native.schedules.stage_spans``: input and head counted as
``parallel.pp_input_head_layers`` layers each, ``pp * vpp`` stages, looped or V-shaped over the
ranks); the microbatches each stage holds in flight are the schedule's own (``parallel.bubble``,
from its action table). A rank holds the sum over its stages -- each stage at its own peak, an
upper bound where a rank's stages peak at different times. FSDP2 keeps every working parameter
unsharded under PP (no reshard after forward: the schedule interleaves microbatches), so the
stage's parameters count once more in the compute dtype when they are sharded or cast.
"""
from __future__ import annotations


def _stage_params(per_layer: list[int], span) -> int:
    blocks = span.end - span.first
    return (per_layer[0] if span.has_input else 0) + blocks * per_layer[1] + (per_layer[-1] if span.has_head else 0)


def pipeline_summary(m, seq: int, layout, e: int = 2, masks: bool = False) -> dict:
    """The schedule, its bubble (action table and formula) and, per stage, the microbatches in flight
    and their activation bytes (what ``--dry-run`` and ``megafixed plan`` show)."""
    from ..engine.native.schedules import canonical_name, stage_spans
    from .bubble import bubble
    from .memory import layer_activation_bytes

    name = canonical_name(layout.schedule)
    b = bubble(name, layout.pp, layout.accum, layout.vpp)
    spans = stage_spans(m.n_layers, layout.pp * layout.vpp, layout.edge)
    t, mb, sp = layout.tp, layout.micro_batch, layout.sequence_parallel
    layer = layer_activation_bytes(m, seq, mb, t, sp, e, masks)
    stored_input = seq * mb * m.d_model * e / (t if sp else 1)
    per_set = stored_input if layout.activation_checkpointing else layer
    acts = {}
    for s in spans:
        held = b.in_flight_per_stage.get(s.index, 0)
        act = held * (s.end - s.first) * per_set
        if s.has_input:
            act += held * stored_input  # input codes / embedding output
        if s.has_head:  # final norm input + fp32 logits for the loss, one microbatch at a time
            act += stored_input + seq * mb * m.vocab_size * 4 / t
        acts[s.index] = act
    return {**b.as_dict(), "stage_blocks": [[s.first, s.end] for s in spans],
            "activation_bytes_per_stage": {str(k): v for k, v in acts.items()}}


def torch_pipeline_estimate(m, seq: int, layout, precision: str = "bf16", masks: bool = False):
    """The most loaded rank's ``Estimate`` (with its ``pipeline`` summary)."""
    from ..engine.native.schedules import is_v_shaped, stage_ids, stage_spans
    from .memory import Estimate, layer_activation_bytes, layer_params, model_state_bytes

    e = 4 if precision == "fp32" else 2
    summary = pipeline_summary(m, seq, layout, e, masks)
    spans = stage_spans(m.n_layers, layout.pp * layout.vpp, layout.edge)
    per_layer = layer_params(m, layout.tp)
    recompute = (layer_activation_bytes(m, seq, layout.micro_batch, layout.tp, layout.sequence_parallel, e, masks)
                 if layout.activation_checkpointing else 0)
    best = None
    for r in range(layout.pp):
        mine = [spans[i] for i in stage_ids(r, layout.pp, layout.vpp, is_v_shaped(layout.schedule))]
        n_params = sum(_stage_params(per_layer, s) for s in mine)
        act = sum(summary["activation_bytes_per_stage"][str(s.index)] for s in mine) + recompute
        p, g, o = model_state_bytes(n_params, layout, precision)
        if layout.dp_shard > 1 or precision != "fp32":
            p += n_params * e  # every working parameter unsharded (gathered or cast) under PP
        est = Estimate(layout, p, g, o, act, n_params, pipeline=summary)
        if best is None or est.total > best.total:
            best = est
    return best
