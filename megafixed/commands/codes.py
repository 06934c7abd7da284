"""``megafixed codes``: print fixed codes for token ids, and check the code is a bijection."""
from __future__ import annotations

import torch

from ..codes import make_code

HELP = "show fixed codes for token ids and verify the code is invertible"


def add_arguments(p):
    p.add_argument("ids", nargs="*", type=int, default=[0, 1, 2, 65535])
    p.add_argument("--kind", choices=["canonical", "gf2"], default="canonical")
    p.add_argument("--bits", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--width", type=int, default=32)


def run(args) -> int:
    code = make_code(args.kind, args.bits, args.seed)
    ids = torch.tensor(args.ids, dtype=torch.int64)
    x = code.encode(ids, args.width)
    for t, row in zip(args.ids, x.tolist()):
        print(f"{t:>8} " + "".join("+" if v > 0 else "-" for v in row))
    every = torch.arange(1 << code.bits)
    ok = torch.equal(code.decode(code.encode(every, code.bits)), every)
    print(f"{args.kind} code, {code.bits} bits: decode(encode(id)) == id for all {1 << code.bits} ids: {ok}")
    return 0 if ok else 1
