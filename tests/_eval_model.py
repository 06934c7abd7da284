"""A small trained checkpoint for the evaluation tests, in seconds and without DeepSpeed.

A 512-token byte-level BPE trained on a slice of the bundled corpus, a 2-layer fixed-code GPT
trained ~40 Adam steps on that corpus (its scores need not be good, only deterministic and not
flat), written as a module-only checkpoint with ``megafixed.engine.weights.write_checkpoint`` for
any TP degree, with the run record (``run.json``) that ``load_trained_model`` reads the config from.
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import torch

TINY = ["model.vocab_size=512", "model.code_bits=9", "model.d_model=64", "model.n_layers=2", "model.n_heads=4",
        "model.max_seq_len=128", "data.seq_len=128"]


def make_tokenizer(root: Path) -> str:
    from megafixed.data.tokenizers import train_tokenizer
    from megafixed.paths import bundled

    return train_tokenizer([str(bundled("wiki_vital_en.jsonl.gz"))], str(root / "tokenizer.json"), 512,
                           max_chars=600_000)


def train_model(tok_path: str, steps: int = 40, seed: int = 0):
    from megafixed.config import load_config
    from megafixed.data.tokenizers import load_tokenizer
    from megafixed.model import GPT
    from megafixed.paths import bundled

    cfg = load_config(str(bundled("quickstart.yaml")), TINY + [f"data.tokenizer={tok_path}"])
    tok = load_tokenizer(tok_path)
    texts = []
    with gzip.open(bundled("wiki_vital_en.jsonl.gz"), "rt") as fh:
        for line in fh:
            texts.append(json.loads(line)["text"])
            if len(texts) == 60:
                break
    ids = torch.tensor([t for text in texts for t in tok.encode(text) + [tok.eod_id]], dtype=torch.long)
    torch.manual_seed(seed)
    model = GPT(cfg.model, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - 129, (8,), generator=gen)
        batch = torch.stack([ids[s:s + 129] for s in starts])
        loss = model(batch[:, :-1], batch[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return cfg, model


def write_run(cfg, model, run_dir: Path, tp: int = 1, tag: str = "global_step40") -> Path:
    from megafixed.engine.weights import write_checkpoint
    from megafixed.train.resume import RUN_RECORD

    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    tag_dir = write_checkpoint(sd, Path(run_dir) / "checkpoints", tp=tp, pp=1, tag=tag)
    (tag_dir / RUN_RECORD).write_text(json.dumps({"config": cfg.to_dict()}))
    return Path(run_dir)
