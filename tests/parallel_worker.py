"""A minimal DeepSpeed driver for parallel-layout tests (launched by torchrun, or run alone).

It uses the same seam as the trainer (``setup_distributed``, ``build_model``, ``topo.mpu``) and the
same step dispatch (``engine.train_batch`` for a PipelineModule, else forward/backward/step), on
synthetic token batches that depend only on (seed, step), so every layout sees the same global
batch. Rank 0 writes ``{"loss": [...], "grad_norm": [...]}`` as JSON.

    python tests/parallel_worker.py OUT.json [--save DIR] [--load DIR] [--steps N] key=value ...
"""
from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402


def global_batch(seed: int, step: int, n: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + step)
    tokens = torch.randint(0, vocab, (n, seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def ds_config(cfg, dp: int) -> dict:
    return {
        "train_batch_size": cfg.train.global_batch,
        "train_micro_batch_size_per_gpu": cfg.train.micro_batch,
        "gradient_accumulation_steps": cfg.train.global_batch // (cfg.train.micro_batch * dp),
        "gradient_clipping": cfg.optimizer.grad_clip,
        "zero_optimization": {"stage": cfg.zero.stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }


def run_one(cfg, topo, steps: int, save: str | None, load: str | None, start: int) -> dict:
    import deepspeed
    from deepspeed.pipe import PipelineModule

    from megafixed.parallel import build_model

    model = build_model(cfg, topo)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.optimizer.lr, betas=(cfg.optimizer.beta1, cfg.optimizer.beta2),
                            eps=cfg.optimizer.eps, weight_decay=cfg.optimizer.weight_decay)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, mpu=topo.mpu,
                                      config=ds_config(cfg, topo.dp))
    if load:  # weights only: how a checkpoint converted to another layout is loaded
        engine.load_checkpoint(load, load_module_only=True, load_optimizer_states=False,
                               load_lr_scheduler_states=False)
    per_rank = cfg.train.global_batch // topo.dp
    micro = cfg.train.micro_batch
    losses, norms = [], []
    for step in range(start, start + steps):
        x, y = global_batch(cfg.train.seed, step, cfg.train.global_batch, cfg.data.seq_len, cfg.model.vocab_size)
        mine = slice(topo.dp_rank * per_rank, (topo.dp_rank + 1) * per_rank)
        x, y = x[mine], y[mine]
        batches = [(x[i:i + micro], y[i:i + micro]) for i in range(0, per_rank, micro)]
        if isinstance(engine.module, PipelineModule):
            loss = engine.train_batch(iter(batches))  # averaged over micro batches and DP already
        else:
            loss = torch.zeros(())
            for xi, yi in batches:
                micro_loss = engine(xi, yi)
                engine.backward(micro_loss)
                engine.step()
                loss += micro_loss.detach() / len(batches)
            if topo.dp > 1:  # report the global-batch mean, as one process sees it
                group = topo.mpu.get_data_parallel_group() if topo.mpu else None
                torch.distributed.all_reduce(loss, group=group)
                loss = loss / topo.dp
        losses.append(float(loss))
        norm = engine.get_global_grad_norm()
        norms.append(float("nan") if norm is None else float(norm))
    if save:
        engine.save_checkpoint(save, tag="ckpt")
    return {"loss": losses, "grad_norm": norms, "dp": topo.dp, "tp": topo.tp, "pp": topo.pp,
            **measured_state(engine)}


def measured_state(engine) -> dict:
    """What this rank really holds after the steps, for the memory planner's check: its
    parameter count and the bytes of optimizer state tensors (ZeRO partitions included)."""
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    opt_bytes = sum(t.numel() * t.element_size() for st in inner.state.values() for k, t in st.items()
                    if torch.is_tensor(t) and k != "step")
    params = sum(p.numel() for p in engine.module.parameters())
    return {"local_params": params, "optimizer_bytes": opt_bytes}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--inputs", default="canonical,learned", help="model.input values, one run each")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--save", default=None, help="save a checkpoint to SAVE/<input>")
    ap.add_argument("--zero", default=None, help="comma list of zero.stage values, one run each")
    ap.add_argument("--load", default=None,
                    help="after the runs, load module weights from LOAD/<input> into a fresh engine and "
                         "record its loss on batch --load-step as 'loaded_loss'")
    ap.add_argument("--load-step", type=int, default=3)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args(argv)

    from megafixed.config import load_config
    from megafixed.parallel import setup_distributed

    results = {}
    topo = None
    stages = args.zero.split(",") if args.zero else [None]
    for name in args.inputs.split(","):
        for stage in stages:
            extra = [f"model.input={name}"] + ([f"zero.stage={stage}"] if stage else [])
            cfg = load_config(None, [*args.overrides, *extra])
            topo = topo or setup_distributed(cfg)
            key = name if stage is None else f"{name}/zero{stage}"
            results[key] = run_one(cfg, topo, args.steps, args.save and os.path.join(args.save, name),
                                   None, 0) if args.steps else {}
        if args.load:
            loaded = run_one(cfg, topo, 1, None, os.path.join(args.load, name), args.load_step)
            results[key]["loaded_loss"] = loaded["loss"][0]
    if topo.rank == 0:
        with open(args.out, "w") as fh:
            json.dump(results, fh)
    torch.distributed.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
