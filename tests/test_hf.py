"""Hugging Face transformers export and import: logits-equal both ways, greedy generation equal,
any TP layout, exact tokenizers, and refusals that name the option.

Everything offline: the tests build tiny random megafixed and transformers models and a tiny
tokenizer themselves; transformers only ever reads the folders written here.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from megafixed.config import Config, ModelConfig, load_config  # noqa: E402
from megafixed.interop.hf import InteropError, choose_arch, llama_model_config  # noqa: E402
from megafixed.model import GPT  # noqa: E402
from megafixed.model.generate import SamplingConfig, generate  # noqa: E402

VOCAB = 320  # >= the tiny tokenizer's 300 ids; 9 code bits


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    from megafixed.data.tokenizers import train_tokenizer

    d = tmp_path_factory.mktemp("tok")
    corpus = d / "corpus.jsonl"
    words = "the quick brown fox jumps over the lazy dog while seven wizards quietly hex jolly boxers".split()
    corpus.write_text("\n".join(json.dumps({"text": " ".join(words[i:] + words[:i]) * 3}) for i in range(len(words))))
    return train_tokenizer([str(corpus)], str(d / "tokenizer.json"), 300)


def model_cfg(norm="rmsnorm", mlp="gelu", input="canonical", bias=False, **kw) -> ModelConfig:
    base = dict(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, code_bits=9, max_seq_len=48,
                init_std=0.15, norm=norm, mlp=mlp, input=input, bias=bias, norm_eps=1e-6, rope_theta=500.0,
                ffn_hidden=96)
    base.update(kw)
    return ModelConfig(**base)


def random_state(m: ModelConfig, seed=0) -> dict:
    """A GPT state dict with non-trivial norm weights and biases (ones/zeros would hide a swapped map)."""
    model = GPT(m, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (1.0 if name.endswith("weight") else 0.0))
    return model.state_dict()


def write_run(run_dir: Path, m: ModelConfig, sd: dict, tokenizer: str, tp: int = 1, step: int = 7) -> Path:
    """A run directory as the trainer leaves it: checkpoints/<tag> in layout ``tp``, run.json, config.yaml."""
    from megafixed.config import save_config
    from megafixed.engine.weights import write_checkpoint
    from megafixed.train.resume import write_run_record

    cfg = Config(model=m)
    cfg.data.tokenizer, cfg.data.seq_len, cfg.train.run_dir = tokenizer, 32, str(run_dir)
    cfg.validate()
    tag = f"step_{step:08d}"
    tag_dir = write_checkpoint(sd, run_dir / "checkpoints", tp=tp, pp=1, tag=tag)
    write_run_record(tag_dir, {"config": cfg.to_dict(),
                               "layout": {"tp": tp, "pp": 1, "dp": 1, "zero_stage": 1, "precision": "fp32"}})
    save_config(cfg, str(run_dir / "config.yaml"))
    return run_dir


def export(run_dir, out, *extra) -> Path:
    from megafixed.cli import main

    assert main(["export", "hf", str(run_dir), str(out), *extra]) == 0
    return Path(out)


def hf_model(out):
    return transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32,
                                                             local_files_only=True).eval()


VARIANTS = [(norm, mlp, inp, bias) for norm, mlp, bias in
            [("rmsnorm", "gelu", False), ("rmsnorm", "swiglu", True), ("layernorm", "gelu", True),
             ("layernorm", "swiglu", False)]
            for inp in ("learned", "canonical", "gf2")]
ARCH = {("rmsnorm", "swiglu"): "llama", ("rmsnorm", "gelu"): "arcee", ("layernorm", "gelu"): "starcoder2",
        ("layernorm", "swiglu"): "stablelm"}


@pytest.mark.parametrize("norm,mlp,inp,bias", VARIANTS)
def test_export_same_logits_and_greedy_tokens(tmp_path, tokenizer_path, norm, mlp, inp, bias):
    # GQA everywhere; the learned rmsnorm/swiglu variant also ties its embeddings
    tie = inp == "learned" and mlp == "swiglu" and norm == "rmsnorm"
    m = model_cfg(norm, mlp, inp, bias, tie_embeddings=tie)
    model = GPT(m)
    model.load_state_dict(random_state(m))
    model.eval()
    out = export(write_run(tmp_path / "run", m, model.state_dict(), tokenizer_path), tmp_path / "hf")

    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == ARCH[(norm, mlp)] and config["tie_word_embeddings"] == tie
    hf = hf_model(out)
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    assert ours.abs().max() > 1.0  # a real signal, not near-zero logits that would hide a wrong map
    assert (ours - theirs).abs().max().item() <= 1e-5

    if inp != "learned":  # the embedding is the materialized code, exactly +-scale
        emb = load_file(str(out / "model.safetensors"))["model.embed_tokens.weight"]
        assert torch.equal(emb, model.input.code.encode(torch.arange(VOCAB), m.d_model))
        assert set(emb.unique().tolist()) == {-1.0, 1.0}
        card = (out / "README.md").read_text()
        assert f"bits: {m.code_bits}" in card and f"{list(model.input.code.rows)}" in card and "step 7" in card

    prompt = ids[0, :6]
    ours_greedy = generate(model, prompt, SamplingConfig(max_new_tokens=20))
    theirs_greedy = hf.generate(prompt[None], max_new_tokens=20, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, 6:].tolist()
    assert ours_greedy == theirs_greedy


def test_export_tokenizer_and_card(tmp_path, tokenizer_path):
    from megafixed.data.tokenizers import load_tokenizer

    m = model_cfg(input="gf2")
    out = export(write_run(tmp_path / "run", m, random_state(m), tokenizer_path), tmp_path / "hf", "--dtype", "bf16")
    names = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "README.md"} <= names
    ours = load_tokenizer(tokenizer_path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    text = "the lazy wizards jump<|endoftext|> quietly"
    assert theirs(text)["input_ids"] == ours.encode(text)  # no BOS added, EOS matched as in megafixed
    assert theirs.eos_token_id == ours.eod_id and theirs.bos_token is None
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == ours.eod_id
    weights = load_file(str(out / "model.safetensors"))
    assert all(v.dtype == torch.bfloat16 for v in weights.values())
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    card = (out / "README.md").read_text()
    assert "interface: **gf2**" in card and "b (shift):" in card and str(tmp_path / "run") in card


def test_export_from_tp2_equals_tp1(tmp_path, tokenizer_path):
    m = model_cfg(mlp="swiglu", input="learned", n_kv_heads=2, vocab_size=VOCAB)
    sd = random_state(m, seed=3)
    a = export(write_run(tmp_path / "tp1", m, sd, tokenizer_path, tp=1), tmp_path / "hf1")
    b = export(write_run(tmp_path / "tp2", m, sd, tokenizer_path, tp=2), tmp_path / "hf2")
    assert len(list((tmp_path / "tp2" / "checkpoints" / "step_00000007").glob("mp_rank_*"))) == 2
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert (a / "config.json").read_text() == (b / "config.json").read_text()


def test_export_refusals(tmp_path, tokenizer_path, capsys):
    from megafixed.cli import main

    with pytest.raises(InteropError, match="model.bias=true"):
        choose_arch(model_cfg("layernorm", "swiglu", bias=True))
    m = model_cfg("layernorm", "swiglu", "learned", bias=True)
    run = write_run(tmp_path / "run", m, random_state(m), tokenizer_path)
    assert main(["export", "hf", str(run), str(tmp_path / "out")]) == 2
    assert "StableLM" in capsys.readouterr().err and not (tmp_path / "out").exists()
    # an existing output needs --overwrite
    m = model_cfg()
    run = write_run(tmp_path / "ok", m, random_state(m), tokenizer_path)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("x")
    assert main(["export", "hf", str(run), str(tmp_path / "taken")]) == 2
    assert "--overwrite" in capsys.readouterr().err and (tmp_path / "taken" / "keep.txt").exists()
    export(run, tmp_path / "taken", "--overwrite")
    assert not (tmp_path / "taken" / "keep.txt").exists()  # replaced whole: no stale files


# ----------------------------------------------------------------------------------- import
@contextlib.contextmanager
def hf_rope_tables(model):
    """``model``'s RoPE tables computed the way transformers computes them (fp32 throughout)."""
    import megafixed.model.gpt as gpt

    def fp32_tables(head_dim, max_seq_len, theta):
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        angles = torch.outer(torch.arange(max_seq_len).float(), inv_freq)
        return angles.cos(), angles.sin()

    saved = (gpt.rope_cache, model.rotary.tables)
    gpt.rope_cache, model.rotary.tables = fp32_tables, {}
    try:
        yield
    finally:
        gpt.rope_cache, model.rotary.tables = saved


def tiny_llama(tmp_path, **kw):
    cfg = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=True,
               rope_parameters={"rope_type": "default", "rope_theta": 1234.0}, initializer_range=0.1)
    cfg.update(kw)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
    model.save_pretrained(str(tmp_path / "llama"))
    return model, tmp_path / "llama"


def test_import_llama_same_logits_and_trains(tmp_path):
    from _train_data import tiny_overrides, write_shards
    from megafixed.cli import main
    from megafixed.data.gpt_dataset import build_datasets, micro_batches
    from megafixed.parallel import setup_distributed
    from megafixed.run_plan import RunPlan
    from megafixed.train.evaluate import load_trained_model
    from megafixed.train.trainer import train

    hf, src = tiny_llama(tmp_path)
    assert "lm_head.weight" not in load_file(str(src / "model.safetensors"))  # really saved tied
    assert main(["import", "hf", str(src), str(tmp_path / "imported")]) == 0
    model, tag = load_trained_model(None, tmp_path / "imported")
    assert tag == "imported" and model.cfg.tie_embeddings and model.cfg.kv_heads == 2
    assert model.cfg.rope_theta == 1234.0 and model.cfg.norm_eps == 1e-6
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model.eval()(ids), hf(ids).logits
    assert ours.abs().max() > 1.0 and (ours - theirs).abs().max().item() <= 1e-5
    # The whole remaining difference is transformers' fp32 RoPE tables (ours are computed in fp64):
    # with its tables the logits are bit-identical, at any length.
    with hf_rope_tables(model):
        ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            assert torch.equal(model(ids), hf(ids).logits)

    # `megafixed train` continues from the imported weights: step 1's loss is the imported model's loss
    prefix = write_shards(tmp_path / "shards")
    overrides = [o for o in tiny_overrides(prefix, tmp_path / "run") if not o.startswith("model.")]
    cfg = load_config(str(tmp_path / "imported" / "config.yaml"),
                      overrides + ["data.seq_len=32", "train.max_steps=1", "train.global_batch=4",
                                   "validation.interval=0", f"train.init_from={tmp_path / 'imported'}"])
    batch = next(micro_batches(build_datasets(cfg.data, seed=cfg.train.seed)["train"], start_sample=0,
                               micro_batch=4, dp_rank=0, dp_size=1))
    with torch.no_grad():
        expected = model(batch[:, :-1], batch[:, 1:]).item()
    result = train(cfg, setup_distributed(RunPlan.for_launch(cfg)), log=lambda *_: None)
    assert result.step == 1 and result.history[0]["loss"] == pytest.approx(expected, abs=1e-5)
    trained, _ = load_trained_model(None, tmp_path / "run")
    after = trained.state_dict()
    assert not torch.equal(after["blocks.0.attn.wq.weight"], model.state_dict()["blocks.0.attn.wq.weight"])
    assert torch.equal(after["head.proj.weight"], after["input.embedding.weight"])  # still tied after the step


@pytest.mark.parametrize("option,value", [
    ("rope_scaling", {"rope_type": "linear", "factor": 2.0}),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0}),
    ("attention_bias", True),
    ("sliding_window", 16),
    ("head_dim", 32),
    ("hidden_act", "gelu"),
])
def test_import_refuses_unsupported_options(option, value):
    hf = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, hidden_act="silu",
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    llama_model_config(hf)  # the unchanged config imports
    hf[option] = value
    with pytest.raises(InteropError, match=option.split("_")[0]):
        llama_model_config(hf)


def test_import_cli_refusal_names_option(tmp_path, capsys):
    from megafixed.cli import main

    _, src = tiny_llama(tmp_path, attention_bias=True)
    assert main(["import", "hf", str(src), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "attention_bias" in err and not (tmp_path / "out").exists()
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = "mistral"
    (src / "config.json").write_text(json.dumps(cfg))
    assert main(["import", "hf", str(src), str(tmp_path / "out")]) == 2
    assert "mistral" in capsys.readouterr().err
