"""The torch-native engine's config record: what ``build.py`` makes of a config and its run plan, as JSON.

DeepSpeed runs from a JSON config (``ds_config.json``); FSDP2/DTensor have none, so this is the
equivalent record (torchtitan logs its parallel dims and FSDP settings the same way): the device
mesh (shape and dim names, in the plan's rank order), the FSDP2 settings (what is wrapped,
``reshard_after_forward``, the HSDP degrees), the ``MixedPrecisionPolicy`` dtypes, tensor/sequence
parallelism, compile and activation checkpointing, the optimizer and the batch arithmetic. It is
written beside ``config.yaml`` (``RunDirectory.engine_config_file``: ``torch_engine.json``) and printed
by ``megafixed train --dry-run`` -- on a CPU login node for the GPU run the plan is for.

It describes, it does not configure: ``build.py`` reads the config and the plan itself. Pure
arithmetic on the plan: no process group, no device (a dry run stays cheap).
"""
from __future__ import annotations

from .mesh import MESH_DIMS, mesh_shape

# FSDP2's MixedPrecisionPolicy per resolved precision: bf16 computes in bf16 from fp32 sharded
# parameters (the masters AdamW updates) and reduce-scatters gradients in fp32; fp32 has no policy.
_POLICY = {"bf16": {"param_dtype": "bfloat16", "reduce_dtype": "float32"},
           "fp32": {"param_dtype": "float32", "reduce_dtype": "float32"}}


def data_parallel_mode(dp: int, dp_replicate: int) -> str:
    """"fsdp2" (shard over every DP rank), "hsdp" (replicate x shard) or "replicate" (no sharding)."""
    if dp_replicate >= dp:
        return "replicate" if dp > 1 else "single"
    return "fsdp2" if dp_replicate == 1 else "hsdp"


def engine_config(cfg, plan) -> dict:
    """The JSON record of the torch-native engine for ``cfg`` on ``plan`` (``plan.engine == "torch"``)."""
    te = cfg.torch_engine
    dp, tp = plan.dp, plan.tp
    replicate, shard, _ = mesh_shape(dp, tp, te.dp_replicate)  # support.py refused a degree not dividing dp
    mode = data_parallel_mode(dp, replicate)
    b = plan.batch
    o = cfg.optimizer
    record = {
        "engine": "torch",
        "device": plan.device,
        "backend": plan.backend,
        "world_size": plan.world_size,
        # mesh.build_mesh's, in the plan's rank order; "dp" is the flattened (dp_replicate, dp_shard)
        "mesh": {"dim_names": list(MESH_DIMS), "shape": [replicate, shard, tp],
                 "flattened": {"dp": ["dp_replicate", "dp_shard"]},
                 "rank_order": "rank = tp_rank + tp * (dp_replicate_rank * dp_shard + dp_shard_rank)"},
        "data_parallel": {
            "mode": mode, "degree": dp, "replicate_degree": replicate, "shard_degree": shard,
            # what fully_shard wraps (build.py): each block, the head (a tied one stays with the input
            # table in the root's group), then the root; one data-parallel rank: no FSDP at all
            # under PP each stage module is a root (pipeline.py), its blocks and head wrapped inside it
            "fully_shard_units": ((["each block"] + ([] if cfg.model.tie_embeddings else ["head"])
                                   + (["each stage (its root)"] if plan.pp > 1 else ["root"])) if dp > 1 else []),
            # each block's; build.py keeps the head's; off under PP (the schedule interleaves microbatches)
            "reshard_after_forward": te.reshard_after_forward and plan.pp == 1,
            "head_reshard_after_forward": False,  # and the root's gathered: backward needs them first
            # params, grads and AdamW state are sharded over dp_shard, as ZeRO-3 (``megafixed plan``)
            "sharded_states": ["params", "grads", "optimizer"] if shard > 1 else [],
        },
        # FSDP2's MixedPrecisionPolicy; one data-parallel rank has no FSDP2 to cast, and bf16 runs the
        # forward under torch.autocast over the fp32 weights instead (build.py), with the same dtypes
        "mixed_precision": dict(_POLICY.get(plan.precision, {"param_dtype": plan.precision}),
                                master_dtype="float32", precision=plan.precision,
                                by="MixedPrecisionPolicy" if dp > 1 else (
                                    "torch.autocast" if plan.precision != "fp32" else "none")),
        "tensor_parallel": {"degree": tp, "sequence_parallel": plan.sequence_parallel,
                            "plan": "megafixed.parallel.tensor.TP_PLAN (DTensor parallelize_module)",
                            "vocab_parallel_loss": tp > 1},
        "pipeline_parallel": pipeline_record(cfg, plan),
        "float8": _float8_record(cfg, plan),
        "compile": {"enabled": cfg.train.compile, "unit": "each block"},
        "activation_checkpointing": {"enabled": cfg.train.activation_checkpointing, "unit": "each block"},
        "optimizer": {"type": "AdamW", "lr": o.lr, "betas": [o.beta1, o.beta2], "eps": o.eps,
                      "weight_decay": o.weight_decay, "grad_clip": o.grad_clip,
                      "grad_clip_over": "the whole mesh (DTensor total norm)"},
        "batch": {"global_batch": b.global_batch, "micro_batch": b.micro_batch, "accum": b.accum, "dp": b.dp,
                  "seq_len": b.seq_len,
                  # FSDP2 reduce-scatters every micro batch's gradients over the shard axis and all-reduces the
                  # replicas' once, after the last (step._reduce_replicas); under PP the schedule reduces both
                  # once per step (pipelining's PipelineStage drives the sync)
                  "gradient_sync": _gradient_sync(plan, b)},
    }
    return _with_context_parallel(record, cfg, plan) if plan.cp > 1 else record


def _with_context_parallel(record: dict, cfg, plan) -> dict:
    """``record`` under context parallelism (mesh.py): the cp mesh dimension before tp, FSDP2 over
    dp_shard x cp (each CP rank's gradients come from other tokens of the same sequences), Ulysses."""
    cp = plan.cp
    mesh = record["mesh"]
    mesh["dim_names"] = [*mesh["dim_names"][:2], "cp", mesh["dim_names"][2]]
    mesh["shape"] = [*mesh["shape"][:2], cp, mesh["shape"][2]]
    mesh["flattened"].update({"dp_shard_cp": ["dp_shard", "cp"], "dp_cp": ["dp_replicate", "dp_shard", "cp"]})
    mesh["rank_order"] = "rank = tp_rank + tp * (cp_rank + cp * (dp_replicate_rank * dp_shard + dp_shard_rank))"
    fsdp = record["data_parallel"]
    fsdp["fsdp_mesh"] = ["dp_replicate", "dp_shard_cp"] if fsdp["replicate_degree"] > 1 else ["dp_shard_cp"]
    fsdp["fully_shard_units"] = ((["each block"] + ([] if cfg.model.tie_embeddings else ["head"])
                                  + (["each stage (its root)"] if plan.pp > 1 else ["root"])))
    fsdp["sharded_states"] = ["params", "grads", "optimizer"]  # over dp_shard x cp >= 2 ranks
    record["mixed_precision"]["by"] = "MixedPrecisionPolicy"
    record["context_parallel"] = {"degree": cp, "method": plan.cp_method,
                                  "by": "megafixed.parallel.context.UlyssesAttention (all-to-all over mesh['cp'])",
                                  "loss_and_validation_mean_over": "dp_cp"}
    return record


def _float8_record(cfg, plan) -> dict:
    """train.float8 (float8.py): the recipe, how the GEMMs run, and FSDP2's all-gather dtype."""
    if cfg.train.float8 == "off":
        return {"recipe": "off"}
    from .float8 import float8_all_gather

    return {"recipe": cfg.train.float8, "by": "torchao convert_to_float8_training (the blocks' Linears)",
            "emulate": plan.device != "cuda", "fsdp_float8_all_gather": float8_all_gather(cfg, plan)}


def _gradient_sync(plan, b) -> str:
    if plan.pp > 1:
        return "once per step, after the last microbatch (the pipeline schedule)"
    if b.accum == 1:
        return "every step"
    replicate = plan.engine_plan.dp_replicate
    shard = "reduce-scatter every micro batch" if plan.dp * plan.cp // replicate > 1 else ""  # dp_shard x cp
    replicas = "all-reduce over the replicas once per step, after the last micro batch" if replicate > 1 else ""
    return "; ".join(x for x in (shard, replicas) if x) or "every step"


def pipeline_record(cfg, plan) -> dict:
    """The pipeline's schedule, split, bubble and microbatches in flight (``plan.pp > 1``); the
    activation bytes those hold are ``megafixed.parallel.pipeline_memory``'s (--dry-run prints them)."""
    if plan.pp == 1:
        return {"degree": 1}
    from .bubble import bubble
    from .schedules import canonical_name, stage_spans

    own = plan.engine_plan
    name = canonical_name(own.pp_schedule)
    spans = stage_spans(cfg.model.n_layers, plan.pp * own.vpp, own.pp_input_head_layers)
    return {"degree": plan.pp, "stages_per_rank": own.vpp, "input_head_layers": own.pp_input_head_layers,
            "by": "torch.distributed.pipelining (PipelineStage + the schedule class)",
            "stage_blocks": [[s.first, s.end] for s in spans],
            **bubble(name, plan.pp, plan.batch.accum, own.vpp).as_dict()}
