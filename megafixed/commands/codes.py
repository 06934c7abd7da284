"""``megafixed codes``: print fixed codes for token ids, and check the code is a bijection."""
from __future__ import annotations

import torch

from ..config import ModelConfig
from ..model.interfaces import INTERFACES, names

HELP = "show fixed codes for token ids and verify the code is invertible"

CHUNK = 1 << 20  # ids checked at once: memory stays ~ CHUNK * bits * 8 bytes (~250 MiB at 31 bits)
EXHAUSTIVE_MAX_BITS = 20  # 1M ids: about a second; 31 bits would take many minutes, so sample above


def add_arguments(p):
    p.add_argument("ids", nargs="*", type=int, default=[0, 1, 2, 65535])
    coded = names(lambda i: i.has_code)  # every interface with a fixed code
    p.add_argument("--kind", choices=coded, default=coded[0], help="the interface (model.input) whose code to show")
    p.add_argument("--bits", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--exhaustive", action="store_true",
                   help=f"check every id even above {EXHAUSTIVE_MAX_BITS} bits (in chunks; minutes at 31 bits)")


def _round_trips(code, ids: torch.Tensor) -> bool:
    return torch.equal(code.decode(code.encode(ids, code.bits)), ids)


def run(args) -> int:
    # the code a model config with these keys builds; CodeError for bits outside 1..31 etc.
    code = INTERFACES[args.kind].code(ModelConfig(input=args.kind, code_bits=args.bits, code_seed=args.seed))
    ids = torch.tensor(args.ids, dtype=torch.int64)
    x = code.encode(ids, args.width)
    for t, row in zip(args.ids, x.tolist()):
        print(f"{t:>8} " + "".join("+" if v > 0 else "-" for v in row))
    n = 1 << code.bits
    if code.bits <= EXHAUSTIVE_MAX_BITS or args.exhaustive:
        # In chunks: all 2**31 ids at once would need ~16 GiB for the codes alone.
        ok = all(_round_trips(code, torch.arange(a, min(a + CHUNK, n))) for a in range(0, n, CHUNK))
        print(f"{args.kind} code, {code.bits} bits: decode(encode(id)) == id for all {n} ids: {ok}")
    else:
        # A is invertible by construction (its GF(2) inverse is computed when the code is made);
        # the round trip on a sample plus every single-bit id and the extremes confirms decode.
        g = torch.Generator().manual_seed(0)
        sample = torch.cat([torch.randint(0, n, (CHUNK,), generator=g), torch.tensor([0, n - 1]),
                            torch.tensor([1 << i for i in range(code.bits)])])
        ok = _round_trips(code, sample)
        print(f"{args.kind} code, {code.bits} bits: decode(encode(id)) == id for {sample.numel()} sampled ids of "
              f"{n}: {ok} (--exhaustive checks all of them)")
    return 0 if ok else 1
