"""The DeepSpeed engine's model builder: this rank's part of the GPT (plain, megatron-core TP layers,
or a pipeline stage) with exactly the single-process initial values. ``megafixed.bench.bare_loop``
builds its bare model with it too, so the bare loop's model is the engine's."""
from __future__ import annotations


def build_model(model_cfg, topo, *, seed: int, pp_partition: str = "parameters",
                activation_checkpointing: bool = False, compute_dtype=None, build_stages=None):
    """This rank's part of the model, with exactly the single-process initial values.

    The GPT is built on the meta device (no memory), TP swaps its layers (still meta), the
    pipeline keeps this stage's layers, and only then does each rank give *its* parameters storage
    and fill them from the per-parameter generators (``model.gpt.init_parameters``), sliced for
    its TP shard. No rank ever holds the full model. Under PP the stages are the engine's:
    ``build_stages`` (e.g. ``megafixed.engine.deepspeed.pipeline.build_pipeline``) makes them.
    """
    from ...model.gpt import meta_gpt

    model = meta_gpt(model_cfg)
    full_shapes = {n: p.shape for n, p in model.named_parameters()}  # before TP shards them
    if topo.tp > 1:
        from .tp_layers import apply_tp
        apply_tp(model, topo)
    if model.has_fixed_input and compute_dtype is not None:
        model.input.out_dtype = compute_dtype  # the code is exactly +-scale in any float dtype

    def materialize(module, name_of=lambda n: n):
        _materialize(module, model_cfg, topo, seed, full_shapes, name_of)

    if topo.pp > 1:
        from ...parallel.pipeline import pipe_key_to_gpt

        if build_stages is None:  # a caller bug, not input: stages are built through megafixed.engine
            raise RuntimeError("parallel.pp > 1 needs an engine's build_stages (megafixed.engine.build_engine)")

        def stage_names(local: str) -> str:
            idx, rest = local.split(".", 1)
            return pipe_key_to_gpt(int(idx), rest, model_cfg.n_layers)

        return build_stages(model, topo, pp_partition, activation_checkpointing,
                            materialize=lambda stage: materialize(stage, stage_names))
    materialize(model)
    model.activation_checkpointing = activation_checkpointing
    return model


def _materialize(module, model_cfg, topo, seed, full_shapes, name_of) -> None:
    from ...model import init_parameters
    from ...model.empty import to_empty
    from ...parallel.tensor import sharded_dim

    # to_empty makes new Parameter objects; keep the attributes the parallel layers set on the
    # meta ones (tensor_model_parallel, partition_dim, sequence_parallel), which the gradient
    # norm, ZeRO and the SP gradient sum read.
    attrs = {name: dict(p.__dict__) for name, p in module.named_parameters()}
    # to_empty gives every module a new Parameter of its own, which would untie shared weights
    # (model.tie_embeddings: the head is the table); remember who shares what and tie them again.
    first_name, ties = {}, []
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first_name:
            ties.append((name, first_name[id(p)]))
        first_name.setdefault(id(p), name)
    to_empty(module, topo.device)  # Module.to_empty without torch's Python meta path (sympy): model/empty.py
    for name, first in ties:
        owner, attr = name.rsplit(".", 1)
        setattr(module.get_submodule(owner), attr, module.get_parameter(first))
    for name, p in module.named_parameters():
        p.__dict__.update(attrs.get(name, {}))

    def local_slice(name, full, param):
        dim = sharded_dim(name) if topo.tp > 1 else None
        value = full if dim is None else full.chunk(topo.tp, dim=dim)[topo.tp_rank]
        if value.shape != param.shape:  # a TP plan and sharded_dim that disagree: a bug, not input
            raise RuntimeError(f"{name}: shard {tuple(value.shape)} does not fit parameter {tuple(param.shape)}")
        return value

    init_parameters(module, model_cfg, seed, local_slice=local_slice, name_of=name_of,
                    full_shape=lambda name, p: full_shapes[name], device=topo.init_device)
    for sub in module.modules():
        if hasattr(sub, "reset_buffers"):
            sub.reset_buffers()
