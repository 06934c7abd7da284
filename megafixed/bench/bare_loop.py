"""The bare torch loop ``megafixed bench train`` compares the framework with: the same numerics, no DeepSpeed.

What the DeepSpeed engine does per step, written out in plain torch, so that the overhead figure
measures the framework and not a difference of recipe:

* the model built as the engine's is (``build_model``: meta device, then this rank's storage; the
  fixed code written in the compute dtype), with the same activation checkpointing and compile;
* **fp32**: AdamW on the parameters, ``clip_grad_norm_``;
* **bf16 / fp16**: 16-bit weights for forward and backward (DeepSpeed casts the module), fp32
  master weights that AdamW updates, micro-batch gradients accumulated in fp32 (our DeepSpeed
  config sets ``grad_accum_dtype=fp32``), the masters copied back to 16 bits after the step;
* **fp16** also scales the loss dynamically (``torch.amp.GradScaler`` on the fp32 masters, initial
  scale 2^16 as in our DeepSpeed config), unscaling before the clip and skipping overflowed steps.
"""
from __future__ import annotations

import torch

from ..engine.dtypes import COMPUTE_DTYPES


class BareLoopState:
    """Model, masters and optimizer of the bare loop; ``step(micro_batches)`` runs one update."""

    def __init__(self, cfg, topo, precision: str):
        from ..engine.deepspeed.model import build_model
        from ..run.optim import build_optimizer

        self.device = topo.device
        self.precision, self.cfg = precision, cfg
        dtype = COMPUTE_DTYPES[precision]
        self.model = build_model(cfg.model, topo, seed=cfg.train.seed,
                                 activation_checkpointing=cfg.train.activation_checkpointing, compute_dtype=dtype)
        if cfg.train.compile:
            for block in self.model.blocks:
                block.compile()
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.mixed = dtype != torch.float32
        if self.mixed:
            self.masters = [p.detach().clone().float() for p in self.params]  # before the cast: exact
            self.model.to(dtype)
            for sub in self.model.modules():  # the fixed code's scale stays exact (restore_exact_buffers)
                if hasattr(sub, "reset_buffers"):
                    sub.reset_buffers()
            for m in self.masters:
                m.grad = torch.zeros_like(m)
            # AdamW's parameter groups are taken from the model; swap in the masters, same order.
            self.opt = build_optimizer(self.model, cfg.optimizer)
            index = {id(p): i for i, p in enumerate(self.params)}
            for group in self.opt.param_groups:
                group["params"] = [self.masters[index[id(p)]] for p in group["params"]]
            self.opt.state.clear()
        else:
            self.masters = self.params
            self.opt = build_optimizer(self.model, cfg.optimizer)
        self.scaler = (torch.amp.GradScaler(self.device.type, init_scale=2.0 ** 16, growth_interval=1000)
                       if precision == "fp16" else None)

    def step(self, micro_batches) -> float:
        """One optimizer step over ``micro_batches`` (a list of ``(inputs, labels)``); the mean loss."""
        accum = len(micro_batches)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for inputs, labels in micro_batches:
            loss = self.model(inputs, labels)
            scaled = loss / accum
            (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
            if self.mixed:  # fp32 accumulation of the 16-bit micro-batch gradients
                grads = [p.grad for p in self.params]
                torch._foreach_add_([m.grad for m in self.masters], [g.float() for g in grads])
                for p in self.params:
                    p.grad = None
            total += loss.detach().double()
        if self.scaler is not None:
            self.scaler.unscale_(self.opt)
        if self.cfg.optimizer.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.masters, self.cfg.optimizer.grad_clip)
        if self.scaler is not None:
            self.scaler.step(self.opt)  # skipped when the unscaled gradients hold an inf/NaN
            self.scaler.update()
        else:
            self.opt.step()
        if self.mixed:
            with torch.no_grad():
                torch._foreach_copy_([p.data for p in self.params], self.masters)  # rounds to 16 bits
                for m in self.masters:
                    m.grad.zero_()
        else:
            self.opt.zero_grad(set_to_none=True)
        return float(total) / accum  # the loss reaches the host every step, as in train_step

    def close(self) -> None:
        self.model = self.opt = self.params = self.masters = self.scaler = None
