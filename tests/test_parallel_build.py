"""Each rank materialises only its own shard and stage, with the single-process values."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megafixed.config import load_config
from megafixed.model import GPT
from megafixed.parallel.memory import Layout, stage_params
from megafixed.parallel.tensor import sharded_dim

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(ROOT / "tests" / "build_worker.py")
TINY = ["model.vocab_size=512", "model.d_model=64", "model.n_layers=4", "model.n_heads=4", "model.max_seq_len=32",
        "data.seq_len=32", "model.code_bits=9", "train.global_batch=4", "train.micro_batch=1", "train.seed=5"]


CASES = {"tp2 learned": ["model.input=learned", "parallel.tp=2"],
         "tp2 canonical": ["model.input=canonical", "parallel.tp=2"],
         "pp2 canonical": ["model.input=canonical", "parallel.pp=2"]}


@pytest.fixture(scope="module")
def built(torchrun, tmp_path_factory):
    """Every case of this file built in one 2-process world (one launch, not one per case):
    {case: [each rank's {"result", "params"}]}."""
    import json

    tmp = tmp_path_factory.mktemp("built")
    out, spec = tmp / "built.pt", tmp / "cases.json"
    spec.write_text(json.dumps(CASES))
    torchrun(2, [WORKER, str(out), "--cases", str(spec), *TINY])
    return torch.load(out, weights_only=False)


def _build(built, *overrides):
    case = next(name for name, o in CASES.items() if o == list(overrides))
    ranks = built[case]
    cfg = load_config(None, [*TINY, *overrides])
    for r in ranks:  # the world really ran this case's layout
        assert (r["result"]["tp"], r["result"]["pp"]) == (cfg.parallel.tp, cfg.parallel.pp), case
    return ranks


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["learned", "canonical"])
def test_a_tp2_rank_never_holds_the_full_model_and_its_shard_is_the_single_process_slice(built, kind):
    cfg = load_config(None, [*TINY, f"model.input={kind}"])
    full = GPT(cfg.model, seed=cfg.train.seed)
    full_params = {n: p.detach() for n, p in full.named_parameters()}
    total = sum(p.numel() for p in full_params.values())
    ranks = _build(built, f"model.input={kind}", "parallel.tp=2")
    for r in ranks:
        res = r["result"]
        # every GPT built during build_model was on the meta device: no full model was materialised
        assert res["gpts_built_on_meta"] and all(res["gpts_built_on_meta"])
        # this rank's parameters are its shard: half of every split matrix
        assert res["local_params"] == stage_params(cfg.model, Layout(tp=2))[0] < total
        # and nothing larger than one full parameter was ever allocated (Megatron's CPU init scale)
        assert res["largest_allocation"] <= max(p.numel() for p in full_params.values())
        for name, value in r["params"].items():
            dim = sharded_dim(name)
            ref = full_params[name] if dim is None else full_params[name].chunk(2, dim)[res["tp_rank"]]
            assert torch.equal(value, ref), f"tp rank {res['tp_rank']}: {name}"


@pytest.mark.multiprocess
def test_a_pipeline_stage_materialises_only_its_layers(built):
    from megafixed.parallel.pipeline import pipe_key_to_gpt

    cfg = load_config(None, [*TINY, "model.input=canonical"])
    full_params = {n: p.detach() for n, p in GPT(cfg.model, seed=cfg.train.seed).named_parameters()}
    ranks = _build(built, "model.input=canonical", "parallel.pp=2")
    expected = stage_params(cfg.model, Layout(pp=2))
    seen = set()
    for r in ranks:
        res = r["result"]
        assert all(res["gpts_built_on_meta"]) and res["local_params"] == expected[res["pp_rank"]]
        for local, value in r["params"].items():
            idx, rest = local.split(".", 1)
            name = pipe_key_to_gpt(int(idx), rest, cfg.model.n_layers)
            assert torch.equal(value, full_params[name]), name
            seen.add(name)
    assert seen == set(full_params)  # the stages together hold the whole model, once
