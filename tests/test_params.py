"""Parameter counts: the paper configs' exact numbers, and meta counts equal real ones."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megafixed.config import load_config
from megafixed.model import GPT
from megafixed.model.params import count_model, count_params

CONFIGS = Path(__file__).resolve().parent.parent / "examples" / "configs"
FIXED_1P7B = 1_711_409_152  # hand count below
TABLE = 49152 * 2048


def test_hand_count_of_the_paper_backbone():
    d, L, V = 2048, 32, 49152
    block = 4 * d * d + 2 * d * 4 * d + 2 * d  # q,k,v,o + GELU MLP (4x) + two RMSNorm weights
    head = d + V * d  # final norm + untied projection
    assert L * block + head == FIXED_1P7B


@pytest.mark.parametrize("kind, expected", [("canonical", FIXED_1P7B), ("gf2", FIXED_1P7B),
                                            ("learned", FIXED_1P7B + TABLE)])
def test_paper_config_counts(kind, expected):
    cfg = load_config(str(CONFIGS / f"paper-1.7b-{kind}.yaml"))
    c = count_params(cfg.model)
    assert c.trainable == c.total == expected
    assert f"{c.trainable:,}".startswith("1,711," if kind != "learned" else "1,812,")
    assert c.input == (TABLE if kind == "learned" else 0)
    assert c.head == 2048 + TABLE and len(c.blocks) == 32 and c.other == 0
    assert c.input + sum(c.blocks) + c.head == c.total


@pytest.mark.parametrize("overrides", [
    ["model.input=learned", "model.tie_embeddings=true"],
    ["model.input=gf2", "model.mlp=swiglu", "model.n_kv_heads=2", "model.bias=true", "model.norm=layernorm"],
])
def test_meta_count_equals_an_allocated_model(overrides):
    cfg = load_config(None, ["model.vocab_size=256", "model.d_model=64", "model.n_layers=3", "model.n_heads=4",
                             "model.code_bits=8", "model.max_seq_len=32", "data.seq_len=32", *overrides])
    meta = count_params(cfg.model)
    real = GPT(cfg.model)
    unique = {id(p): p for p in real.parameters()}.values()
    assert meta.total == sum(p.numel() for p in unique)
    assert meta == count_model(real)
    if cfg.model.tie_embeddings:  # tied: the table is counted once, as the input's
        assert meta.total == meta.input + sum(meta.blocks) + meta.head - 256 * 64


def test_params_cli_json(capsys):
    from megafixed.cli import main

    assert main(["params", str(CONFIGS / "paper-1.7b-learned.yaml"), "model.input=canonical", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["trainable"] == FIXED_1P7B and data["input"] == 0 and data["input_kind"] == "canonical"
