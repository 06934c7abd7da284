"""The torch engine's DTensor TP/SP against the plain single-process GPT, in one 2-rank gloo world.

Launched by torchrun (tests/test_native_tp.py). For every case (input kind x MLP x sequence
parallelism x GQA) each rank builds the plain GPT in-process from the seed (the independent
reference: no DTensor, no communication) and the TP model (``meta_gpt`` -> ``apply_tp`` ->
materialised shards of the same initial values), and trains both for a few AdamW steps on the
same batches with the whole-model gradient clip. Rank 0 writes, per case and step, both losses
and gradient norms and the worst gradient/weight difference (TP tensors gathered with
``full_tensor()``), as JSON: the test asserts on it.

    torchrun --nproc-per-node 2 tests/native_tp_worker.py OUT.json
"""
from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

STEPS = 3
CASES = {  # name -> (model overrides, sequence_parallel)
    "canonical_gelu": ({"input": "canonical"}, False),
    "canonical_gelu_sp": ({"input": "canonical"}, True),
    "learned_swiglu": ({"input": "learned", "mlp": "swiglu"}, False),
    "learned_swiglu_sp": ({"input": "learned", "mlp": "swiglu"}, True),
    # GQA (2 key/value heads over tp=2), LayerNorm with biases, tied table and head
    "learned_gqa_tied_sp": ({"input": "learned", "n_kv_heads": 2, "norm": "layernorm", "bias": True,
                             "tie_embeddings": True}, True),
    "gf2_swiglu_gqa_sp": ({"input": "gf2", "mlp": "swiglu", "n_kv_heads": 2}, True),
}


def model_config(**overrides):
    from megafixed.config import ModelConfig

    cfg = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, code_bits=8, max_seq_len=32, **overrides)
    cfg.validate()
    return cfg


def batches(vocab: int, n: int = 4, seq: int = 32, seed: int = 1234):
    g = torch.Generator().manual_seed(seed)
    for _ in range(STEPS):
        tokens = torch.randint(0, vocab, (n, seq + 1), generator=g)
        yield tokens[:, :-1], tokens[:, 1:]


def materialize(model, cfg, seed: int) -> None:
    """Storage and the single-process initial value for every (DTensor) parameter, sliced by its
    placements with no communication."""
    try:
        from megafixed.engine.native.materialize import materialize as engine_materialize
    except ImportError:
        engine_materialize = None
    if engine_materialize is not None:
        engine_materialize(model, cfg, seed, torch.device("cpu"))
        return
    from torch.distributed.tensor import distribute_tensor

    from megafixed.model.gpt import init_value

    model.to_empty(device="cpu")
    if cfg.tie_embeddings:
        model.head.proj.weight = model.input.get_parameter(model.interface.table)
    with torch.no_grad():
        for name, p in model.named_parameters():
            full = init_value(cfg, name, p.shape, seed)
            if isinstance(p, DTensor):
                full = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
                p.to_local().copy_(full)
            else:
                p.copy_(full)
    for sub in model.modules():
        if hasattr(sub, "reset_buffers"):
            sub.reset_buffers()


class CountCollectives(TorchDispatchMode):
    """Counts the functional collectives DTensor issues (its redistributions: the TP/SP
    all-reduces, all-gathers and reduce-scatters; loss_parallel's own small all-reduces run inside
    DTensor's dispatch and are not seen)."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional" and func._opname not in ("wait_tensor", "_wrap_tensor_autograd"):
            self.counts[func._opname] = self.counts.get(func._opname, 0) + 1
        return func(*args, **(kwargs or {}))


def count_collectives(model, cfg, tp_context) -> dict:
    """The collectives of one forward and one backward (gradients are dropped by the next step)."""
    x, y = next(batches(cfg.vocab_size, seed=5))
    with tp_context(model):
        with CountCollectives() as forward:
            loss = model(x, y)
        with CountCollectives() as backward:
            loss.backward()
    return {"forward": forward.counts, "backward": backward.counts}


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def rel_diff(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Worst elementwise difference, relative to the reference tensor's largest magnitude."""
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def train(model, cfg, tp_context, clip: float = 1.0):
    from megafixed.config import OptimizerConfig
    from megafixed.run.optim import build_optimizer

    # eps=1e-6, not 1e-8: Adam's first steps move each weight by ~lr*g/(|g|+eps), so with a tiny eps
    # an element whose gradient is ~0 turns fp32 summation-order noise (1e-9) into a visible
    # fraction of lr; the larger eps keeps the weights comparable at 1e-5 without hiding a real bug
    # (a wrong shard or a missed reduction moves weights by ~lr = 3e-3).
    opt = build_optimizer(model, OptimizerConfig(lr=3e-3, weight_decay=0.1, eps=1e-6))
    losses, norms, grads = [], [], []
    for x, y in batches(cfg.vocab_size):
        opt.zero_grad(set_to_none=True)
        with tp_context(model):
            loss = model(x, y)
            loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        grads.append({n: full(p.grad).clone() for n, p in model.named_parameters()})
        opt.step()
        losses.append(float(loss.detach()))
        norms.append(float(full(norm)))
    weights = {n: full(p.detach()).clone() for n, p in model.named_parameters()}
    # an evaluation forward (no autograd, eval mode) of the trained model on a held-out batch
    model.eval()
    x, y = next(batches(cfg.vocab_size, seed=99))
    with torch.no_grad(), tp_context(model):
        eval_loss = float(model(x, y))
    return losses, norms, grads, weights, eval_loss


def run_case(overrides: dict, sequence_parallel: bool, mesh) -> dict:
    import contextlib

    from megafixed.engine.native.tensor import apply_tp, loss_context
    from megafixed.model.gpt import GPT, meta_gpt

    cfg, seed = model_config(**overrides), 7
    ref = train(GPT(cfg, seed=seed), cfg, lambda _m: contextlib.nullcontext())
    model = meta_gpt(cfg)
    apply_tp(model, mesh, sequence_parallel=sequence_parallel)
    materialize(model, cfg, seed)
    seen = {}  # what really runs: the residual stream's local shape, the logits' layout

    def local_shape(t):
        return list((t.to_local() if isinstance(t, DTensor) else t).shape)

    def norm_input(_module, args):
        seen.setdefault("norm_input", local_shape(args[0]))  # a hook returning None keeps the input

    def logits(_module, _args, out):
        seen.setdefault("logits", [type(out).__name__, [str(p) for p in getattr(out, "placements", ())],
                                   local_shape(out)])

    model.blocks[0].norm1.register_forward_pre_hook(norm_input)
    model.head.proj.register_forward_hook(logits)
    seen["collectives"] = count_collectives(model, cfg, loss_context)
    got = train(model, cfg, loss_context)
    out = {"loss": got[0], "ref_loss": ref[0], "grad_norm": got[1], "ref_grad_norm": ref[1],
           "eval_loss": got[4], "ref_eval_loss": ref[4],
           "params": sorted(got[3]), "ref_params": sorted(ref[3]),
           "not_dtensor": [n for n, p in model.named_parameters() if not isinstance(p, DTensor)],
           # per step: the worst gradient difference relative to that parameter's largest gradient
           "grad_diff": [max(rel_diff(g[n], r[n]) for n in r) for g, r in zip(got[2], ref[2], strict=True)],
           "weight_abs_diff": max(float((got[3][n] - ref[3][n]).abs().max()) for n in ref[3]),
           "local_shapes": {n: list(p.to_local().shape) for n, p in model.named_parameters()
                            if isinstance(p, DTensor)}, **seen}
    if cfg.tie_embeddings:
        out["tied"] = model.head.proj.weight is model.input.embedding.weight
    return out


def main() -> None:
    out_path = sys.argv[1]
    only = sys.argv[2].split(",") if len(sys.argv) > 2 else list(CASES)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    results = {name: run_case(*CASES[name], mesh) for name in only}
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
