"""Linear probes: how well each layer's hidden state still encodes the token's own code bits
(and the previous token's), i.e. how recoverable the immutable input stays through depth.

For each layer (0 = the input interface's output, l = after block l) a ridge-regression probe maps
the hidden state to the ``bits`` code bits (±1) of the token at that position, and separately of
the previous token; accuracy is the share of bits whose sign it predicts, on held-out positions.
The bits are the run's own code for a fixed-code model, and the canonical bits of the token id for
a learned table (what a fixed model would have been given).

The baseline is not 0.5: id bits are skewed (frequent tokens have small ids, so high bits are
mostly 0), and a probe that ignores the hidden state already scores each bit's majority share.
So every accuracy comes with the majority-class baseline of the same targets: per bit, the sign
that is commoner on the fit positions, scored on the held-out positions, averaged over the bits.

Why closed-form ridge and not a library (scikit-learn): one ``torch.linalg.solve`` per layer is
all it takes, it runs on the model's device, and it adds no dependency.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ProbeResult:
    run_dir: str
    interface: str
    layers: list = field(default_factory=list)
    own: list = field(default_factory=list)  # accuracy per layer, the token's own bits
    prev: list = field(default_factory=list)  # the previous token's bits
    tokens: int = 0
    own_baseline: float = 0.0  # majority-class accuracy of the own bits (the same at every layer)
    prev_baseline: float = 0.0
    own_baseline_bits: list = field(default_factory=list)  # per bit
    prev_baseline_bits: list = field(default_factory=list)


def target_bits(model, ids: torch.Tensor) -> torch.Tensor:
    """±1 code bits of ``ids`` [N] -> [N, bits]: the model's own code, or canonical bits (learned)."""
    from ..codes import FixedCode

    code = model.input.code if model.has_fixed_input else FixedCode.canonical(model.cfg.code_bits)
    return code.encode(ids, code.bits).sign()


def fit_probe(x: torch.Tensor, y: torch.Tensor, train_frac: float = 0.75, ridge: float = 1e-2) -> float:
    """Held-out sign accuracy of a ridge probe x [N, d] -> y [N, k] (±1)."""
    n = x.shape[0]
    cut = int(n * train_frac)
    x = x.double()
    mu, sd = x[:cut].mean(0), x[:cut].std(0).clamp_min(1e-6)
    x = torch.cat([(x - mu) / sd, torch.ones(n, 1, dtype=x.dtype)], dim=1)
    xt, yt = x[:cut], y[:cut].double()
    w = torch.linalg.solve(xt.T @ xt + ridge * cut * torch.eye(x.shape[1], dtype=x.dtype), xt.T @ yt)
    pred = x[cut:] @ w
    return float((pred.sign() == y[cut:].double().sign()).double().mean())


def majority_baseline(y: torch.Tensor, train_frac: float = 0.75) -> list[float]:
    """Per bit, the held-out accuracy of always predicting the sign commoner on the fit positions
    (the split of :func:`fit_probe`): what a probe scores without reading the hidden state."""
    cut = int(y.shape[0] * train_frac)
    majority = torch.where(y[:cut].double().mean(0) >= 0, 1.0, -1.0).to(torch.float64)
    return (y[cut:].double().sign() == majority).double().mean(0).tolist()


@torch.no_grad()
def hidden_states(model, windows: torch.Tensor) -> list[torch.Tensor]:
    """[layer 0 (input), after block 1, ..., after block L], each [B, T, d]."""
    outs = []
    hooks = [model.input.register_forward_hook(lambda _m, _i, o: outs.append(o.float()))]
    hooks += [b.register_forward_hook(lambda _m, _i, o: outs.append(o.float())) for b in model.blocks]
    try:
        model.eval()
        model(windows)
    finally:
        for h in hooks:
            h.remove()
    return outs


def probe_model(model, windows: torch.Tensor, layers=None) -> tuple[list, list, list, list, list]:
    """(layers, own accuracy, previous accuracy, own baseline per bit, previous baseline per bit)."""
    windows = windows[:, :model.cfg.max_seq_len]  # dataset windows carry one extra (target) token
    states = hidden_states(model, windows)
    layers = list(range(len(states))) if layers is None else layers
    bad = [v for v in layers if not 0 <= v < len(states)]
    if bad:
        from ..config import ConfigError
        raise ConfigError(f"--layers {bad}: this model has layers 0..{len(states) - 1} (0 = the input)")
    ids = windows[:, 1:].reshape(-1)
    prev = windows[:, :-1].reshape(-1)
    own_y, prev_y = target_bits(model, ids), target_bits(model, prev)
    own_acc, prev_acc = [], []
    for layer in layers:
        h = states[layer][:, 1:].reshape(-1, states[layer].shape[-1])  # positions with a previous token
        own_acc.append(fit_probe(h, own_y))
        prev_acc.append(fit_probe(h, prev_y))
    return layers, own_acc, prev_acc, majority_baseline(own_y), majority_baseline(prev_y)


def probe_run(run_dir, layers=None, tokens: int = 4096, split: str = "valid") -> ProbeResult:
    from ..config import load_config
    from ..data.gpt_dataset import build_datasets
    from ..run.run_dir import RunDirectory
    from ..train.evaluate import load_trained_model

    cfg = load_config(str(RunDirectory(run_dir).config_file))
    model, _ = load_trained_model(cfg, run_dir)
    data = build_datasets(cfg.data, seed=cfg.train.seed).get(split) or build_datasets(cfg.data, seed=0)["train"]
    per = cfg.data.seq_len
    n = max(1, min(len(data), -(-tokens // per)))
    # a fixed, shuffled-by-the-dataset sample of windows; positions within a window stay in order
    windows = torch.stack([torch.as_tensor(data[i].astype("int64")) for i in range(n)])
    layers, own, prev, own_base, prev_base = probe_model(model, windows, layers)
    return ProbeResult(run_dir=str(run_dir), interface=cfg.model.input, layers=layers, own=own, prev=prev,
                       tokens=int(windows[:, 1:].numel()), own_baseline=sum(own_base) / len(own_base),
                       prev_baseline=sum(prev_base) / len(prev_base), own_baseline_bits=own_base,
                       prev_baseline_bits=prev_base)
