"""``megafixed bench <what>``: benchmarks that write JSON; each lives beside the code it measures."""
from __future__ import annotations

import importlib

HELP = ("benchmarks: 'preprocess' (tokenization), 'kernels' (fixed code vs tables), 'train' (step time, MFU, "
        "overhead), 'eval' (megafixed eval vs lm_eval --model hf), 'startup' (a 1-step run vs `import torch`), "
        "'cp' (context parallelism: activation memory and tokens/s vs sequence length)")

# sub-benchmark -> module exposing add_arguments(parser) and run(args)
BENCHES = {"preprocess": "megafixed.data.bench_preprocess",
           "kernels": "megafixed.bench.kernels",
           "train": "megafixed.bench.train",
           "eval": "megafixed.bench.eval",
           "startup": "megafixed.bench.startup",
           "cp": "megafixed.bench.cp",
           }


def add_arguments(p):
    sub = p.add_subparsers(dest="bench", metavar="WHAT", required=True)
    for name, mod in BENCHES.items():
        try:
            m = importlib.import_module(mod)
        except ModuleNotFoundError:
            continue
        # argparse %-formats help strings: a literal "%" (kernels: "% of peak") must reach it as "%%"
        m.add_arguments(sub.add_parser(name, help=getattr(m, "HELP", name).replace("%", "%%")))


def check_device(device) -> None:
    """Refuse a device this machine lacks before a benchmark imports kernels or allocates."""
    from ..config import ConfigError

    if not device or str(device) in ("cpu", "auto"):  # auto: the bench picks cuda if there is one
        return
    import torch

    if str(device).startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {device}: this machine has no CUDA GPU (torch.cuda.is_available() is "
                              f"False); run on a GPU machine or pass --device cpu")
        index = str(device).partition(":")[2]
        if index and (not index.isdigit() or int(index) >= torch.cuda.device_count()):
            raise ConfigError(f"--device {device}: there are {torch.cuda.device_count()} CUDA devices "
                              f"(cuda:0..cuda:{torch.cuda.device_count() - 1})")
    elif str(device) != "meta":
        raise ConfigError(f"--device {device} is not a device here; use cpu or cuda[:N]")


def check_args(args) -> None:
    """Counts every benchmark shares: refuse a zero or negative one before any timing starts."""
    from ..config import ConfigError

    for name, low in (("repeat", 1), ("seq_len", 1), ("index_tokens", 0), ("iters", 1), ("warmup", 0)):
        value = getattr(args, name, None)
        if isinstance(value, (int, float)) and value < low:
            raise ConfigError(f"--{name.replace('_', '-')} {value} must be >= {low}")
    workers = getattr(args, "workers", None)  # one count (bench preprocess) or a list (older sweeps)
    for w in (workers if isinstance(workers, (list, tuple)) else [workers]):
        if isinstance(w, int) and w < 1:
            raise ConfigError(f"--workers {w} must be >= 1")
    if getattr(args, "input", None):
        from ..data.readers import expand_inputs

        expand_inputs(list(args.input))  # a missing corpus fails now, not after tokenizer training


def run(args) -> int:
    check_device(getattr(args, "device", None))
    check_args(args)
    return int(importlib.import_module(BENCHES[args.bench]).run(args) or 0)
