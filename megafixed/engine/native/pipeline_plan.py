"""The torch engine's pipeline in the memory plan (``parallel.pp > 1``): its planner's
``pipeline_estimate`` (``megafixed plan``, ``--dry-run``).

The split is the engine's (``schedules.stage_spans``: input and head counted as
``parallel.pp_input_head_layers`` layers each, ``pp * vpp`` stages, looped or V-shaped over the
ranks); the microbatches each stage holds in flight are the schedule's own (``engine/native/bubble.py``,
from its action table). A rank holds the sum over its stages -- each stage at its own peak, an
upper bound where a rank's stages peak at different times. FSDP2 keeps every working parameter
unsharded under PP (no reshard after forward: the schedule interleaves microbatches), so the
stage's parameters count once more in the compute dtype when they are sharded or cast.
"""
from __future__ import annotations


def stage_param_count(per_layer: list[int], span) -> int:
    """Parameters of one stage from the per-layer counts ``[input, block, ..., head]``."""
    blocks = span.end - span.first
    return (per_layer[0] if span.has_input else 0) + blocks * per_layer[1] + (per_layer[-1] if span.has_head else 0)


def pipeline_summary(m, layout, per_set: float, stored_input: float, logits: float, held_loss: float = 0.0) -> dict:
    """The schedule, its bubble (action table and formula), the split and, per stage, the bytes of
    the microbatches it holds in flight: ``per_set`` per block and microbatch (a layer's saved
    activations, or its stored input under activation checkpointing), ``stored_input`` for the
    input's output, ``logits`` on the last stage (the loss backward's working set, one microbatch at
    a time) and ``held_loss`` for each further microbatch whose loss waits there for its backward
    (``parallel.memory.loss_saved_bytes``: GPipe's last stage holds them all, 1F1B's none). Beside
    the most a stage holds (``activation_bytes_per_stage``), what it holds at its first backward, before
    any gradient exists, and the most at a later one, beside the gradients (``..._first_backward``,
    ``..._later_backward``)."""
    from .bubble import bubble
    from .schedules import canonical_name, stage_spans

    b = bubble(canonical_name(layout.schedule), layout.pp, layout.accum, layout.vpp)
    spans = stage_spans(m.n_layers, layout.pp * layout.vpp, layout.edge)

    def held_bytes(s, held: int) -> float:
        act = held * (s.end - s.first) * per_set
        if s.has_input:
            act += held * stored_input  # input codes / embedding output
        if s.has_head:  # final norm input + fp32 logits for the loss; the losses waiting for their backward
            act += stored_input + logits + max(held - 1, 0) * held_loss
        return act

    phases = b.held_at_backward or {}
    most = {s.index: held_bytes(s, b.in_flight_per_stage.get(s.index, 0)) for s in spans}
    first = {s.index: held_bytes(s, phases.get(s.index, (0, 0))[0]) for s in spans}
    later = {s.index: held_bytes(s, phases.get(s.index, (0, 0))[1]) for s in spans}
    return {**b.as_dict(), "stage_blocks": [[s.first, s.end] for s in spans],
            "activation_bytes_per_stage": {str(k): v for k, v in most.items()},
            "activation_bytes_first_backward": {str(k): v for k, v in first.items()},
            "activation_bytes_later_backward": {str(k): v for k, v in later.items()}}


def torch_pipeline_estimate(m, seq: int, layout, precision: str, masks: bool):
    """The most loaded pipeline rank's ``Estimate``, with the ``pipeline`` summary attached."""
    return max(pipeline_rank_estimates(m, seq, layout, precision, masks), key=lambda est: est.total)


def pipeline_rank_estimates(m, seq: int, layout, precision: str, masks: bool) -> list:
    """Each pipeline rank's ``Estimate`` (index: the rank's pp coordinate)."""
    from ...parallel.memory import (
        Estimate,
        layer_activation_bytes,
        layer_params,
        loss_phase_bytes,
        loss_saved_bytes,
        model_state_bytes,
    )
    from .schedules import is_v_shaped, stage_ids, stage_spans

    e = 4 if precision == "fp32" else 2
    t, b, sp = layout.tp, layout.micro_batch, layout.sequence_parallel
    layer = layer_activation_bytes(m, seq, b, t, sp, e, masks)
    stored_input = seq * b * m.d_model * e / (t if sp else 1)
    ac = layout.activation_checkpointing
    # the last stage's loss backward, one microbatch at a time (parallel.memory.loss_phase_bytes)
    loss = loss_phase_bytes(m, seq, b, t, sp)
    summary = pipeline_summary(m, layout, stored_input if ac else layer, stored_input, loss,
                               loss_saved_bytes(m, seq, b, t, e))
    spans = stage_spans(m.n_layers, layout.pp * layout.vpp, layout.edge)
    per_layer = layer_params(m, t)
    out = []
    for r in range(layout.pp):
        mine = [spans[i] for i in stage_ids(r, layout.pp, layout.vpp, is_v_shaped(layout.schedule))]
        n_params = sum(stage_param_count(per_layer, s) for s in mine)
        # at its first backward no gradient exists yet (the step before dropped them); at a later one the
        # fp32 accumulators below do (1F1B holds as much then as at its first; GPipe one microbatch fewer)
        recompute = layer if ac else 0
        act = sum(summary["activation_bytes_first_backward"][str(s.index)] for s in mine) + recompute
        act_later = sum(summary["activation_bytes_later_backward"][str(s.index)] for s in mine) + recompute
        p, g, o = model_state_bytes(n_params, layout, precision)
        if layout.dp_shard > 1 or precision != "fp32":
            p += n_params * e  # every working parameter unsharded (gathered or cast) under PP
        if layout.dp_cp > 1:
            # FSDP2 under the schedule accumulates the unsharded gradients across the microbatches, in
            # fp32 (its reduce dtype), and reduce-scatters once at the last (measured under plan --fake:
            # 6.0 of 11.2 GiB on a 7B PP4 first stage at 256 ranks)
            g += n_params * 4
        out.append(Estimate(layout, p, g, o, act, n_params, pipeline=summary, grads_in_backward=0.0,
                            reduction=act_later))
    return out
