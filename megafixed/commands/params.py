"""``megafixed params CONFIG [overrides] [--json]``: parameter counts on the meta device."""
from __future__ import annotations

import json

from ..config import load_config

HELP = "count parameters of a config on the meta device (total, trainable, input, head, per block)"


def add_arguments(p):
    p.add_argument("config", help="YAML run config (examples/configs/*.yaml)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. model.input=learned")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run(args) -> int:
    from ..model.params import count_params

    cfg = load_config(args.config, args.overrides)  # a ConfigError is reported by cli.main
    c = count_params(cfg.model)
    if args.json:
        print(json.dumps({"config": args.config, "input_kind": cfg.model.input, **c.to_dict()}))
        return 0
    m = cfg.model
    print(f"{args.config}: {m.n_layers} layers, d_model {m.d_model}, {m.n_heads} heads, vocab {m.vocab_size}, "
          f"input={m.input}")
    rows = [("total", c.total), ("trainable", c.trainable), ("input interface", c.input),
            ("output head (norm + proj)", c.head), (f"blocks ({len(c.blocks)})", sum(c.blocks))]
    if c.blocks:
        rows.append(("  per block", c.blocks[0]) if len(set(c.blocks)) == 1 else ("  per block", c.blocks))
    if c.other:
        rows.append(("other", c.other))
    if c.code_buffers:
        rows.append(("fixed-code buffers (not params)", c.code_buffers))
    for name, value in rows:
        text = f"{value:,}" if isinstance(value, int) else str(value)
        print(f"  {name:<34}{text:>18}")
    print(f"  = {c.trainable / 1e9:.3f}B trainable")
    return 0
