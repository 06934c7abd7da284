"""megafixed -> transformers -> megafixed: an export imports back with the same logits, and an
imported model generates until its own ``eos_token_id``, where transformers' ``generate`` stops.

Offline: tiny models and a tiny tokenizer built here; transformers only reads folders written here."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megafixed.cli import main  # noqa: E402
from megafixed.config import Config, ModelConfig  # noqa: E402
from megafixed.model import GPT  # noqa: E402


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A BPE tokenizer.json with the special tokens of a chat model (<|endoftext|> is id 0)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    words = "the quick brown fox jumps over the lazy dog while seven wizards quietly hex jolly boxers".split()
    text = [" ".join(words[i:] + words[:i]) for i in range(len(words))] * 3
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(text, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def write_run(run_dir: Path, m: ModelConfig, model: GPT, tokenizer: Path) -> Path:
    from megafixed.config import save_config
    from megafixed.engine.weights import write_checkpoint
    from megafixed.train.resume import write_run_record

    cfg = Config(model=m)
    cfg.data.tokenizer, cfg.data.seq_len, cfg.train.run_dir = str(tokenizer), 32, str(run_dir)
    cfg.validate()
    tag_dir = write_checkpoint(model.state_dict(), run_dir / "checkpoints", tp=1, pp=1, tag="step_00000005")
    write_run_record(tag_dir, {"config": cfg.to_dict(),
                               "layout": {"tp": 1, "pp": 1, "dp": 1, "zero_stage": 1, "precision": "fp32"}})
    save_config(cfg, str(run_dir / "config.yaml"))
    return run_dir


@pytest.mark.parametrize("mlp,input", [("gelu", "gf2"), ("swiglu", "learned")])
def test_an_export_imports_back_with_the_same_logits(tmp_path, tokenizer, mlp, input):
    from megafixed.train.evaluate import load_trained_model

    # the default backbone (RMSNorm + GELU) exports as Arcee; SwiGLU as Llama
    m = ModelConfig(vocab_size=320, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, code_bits=9, max_seq_len=48,
                    init_std=0.15, norm="rmsnorm", mlp=mlp, input=input, ffn_hidden=96, rope_theta=500.0)
    model = GPT(m, seed=3).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)  # ones would hide a swapped norm mapping
    run = write_run(tmp_path / "run", m, model, tokenizer)
    assert main(["export", "hf", str(run), str(tmp_path / "hf")]) == 0
    arch = json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"]
    assert arch == {"gelu": "arcee", "swiglu": "llama"}[mlp]
    card = (tmp_path / "hf" / "README.md").read_text()
    assert "https://github.com/)" not in card and "megafixed 0." in card  # no placeholder link

    assert main(["import", "hf", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    back, tag = load_trained_model(None, tmp_path / "back")
    assert tag == "imported" and back.cfg.mlp == mlp and back.cfg.input == "learned"
    assert {"tokenizer.json", "generation_config.json"} <= {p.name for p in (tmp_path / "back").iterdir()}
    ids = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, again = model(ids), back.eval()(ids)
    assert ours.abs().max() > 1.0 and (ours - again).abs().max().item() <= 1e-6


def test_an_arcee_with_another_activation_is_refused_naming_it():
    from megafixed.interop.hf import InteropError, hf_model_config

    hf = dict(model_type="arcee", vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=64, hidden_act="gelu")
    assert hf_model_config(hf).mlp == "gelu"
    with pytest.raises(InteropError, match=r"hidden_act='relu2'"):
        hf_model_config({**hf, "hidden_act": "relu2"})  # transformers' ArceeConfig default


def _greedy_reference(model, prompt: list[int], steps: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_an_imported_llama_stops_where_transformers_stops(tmp_path, tokenizer, capsys):
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer), eos_token="<|endoftext|>")
    vocab = len(fast)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False, initializer_range=0.3, eos_token_id=0)
    llama = transformers.LlamaForCausalLM(cfg).eval()
    prompt_text = "the lazy wizards"
    prompt = fast(prompt_text, add_special_tokens=False)["input_ids"]
    free = _greedy_reference(llama, prompt, 20)
    # The model's own end-of-turn token: the first greedy token not seen before (past the first, if
    # one is), listed after another id, as instruct models list several. Not <|endoftext|> (id 0),
    # which a fixed candidate list would pick.
    k = next((i for i in range(1, len(free)) if free[i] not in free[:i] and free[i] != 0), 0)
    assert free[k] != 0
    llama.generation_config.eos_token_id = [fast.convert_tokens_to_ids("<|im_end|>"), free[k]]
    src = tmp_path / "llama"
    llama.save_pretrained(str(src))
    fast.save_pretrained(str(src))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(src), local_files_only=True).eval()
    theirs = reloaded.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                               pad_token_id=0)[0, len(prompt):].tolist()
    assert theirs == free[:k + 1]  # transformers stops after the model's eos

    assert main(["import", "hf", str(src), str(tmp_path / "imported")]) == 0
    out = tmp_path / "imported"
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= {p.name for p in out.iterdir()}
    capsys.readouterr()
    assert main(["generate", str(out), "--prompt", prompt_text, "--max-new-tokens", "20"]) == 0
    printed = capsys.readouterr().out
    assert printed == prompt_text + fast.decode(theirs) + "\n"
    assert main(["generate", str(out), "--prompt", prompt_text, "--max-new-tokens", "20", "--no-stop"]) == 0
    assert capsys.readouterr().out == prompt_text + fast.decode(free) + "\n"


def test_the_eos_comes_from_generation_config_then_config_json(tmp_path):
    from megafixed.interop.hf_files import model_eos_ids

    assert model_eos_ids(tmp_path) == []
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert model_eos_ids(tmp_path) == [7]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert model_eos_ids(tmp_path) == [2, 0]
