"""Generation: the key/value cache reproduces the full forward, greedy equals the cache-free
reference, top-p sampling is seeded and never leaves the nucleus, and the CLI streams text."""
from __future__ import annotations

import io
import json

import pytest
import torch

from megafixed.config import ModelConfig
from megafixed.model import GPT
from megafixed.model.generate import GenerationError, KVCache, SamplingConfig, generate, next_token


def tiny(**kw) -> GPT:
    cfg = dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, code_bits=8, max_seq_len=32,
               init_std=0.2)
    cfg.update(kw)
    return GPT(ModelConfig(**cfg), seed=1).eval()


@pytest.mark.parametrize("input", ["learned", "gf2"])
def test_cache_matches_full_forward(input):
    model = tiny(input=input)
    ids = torch.randint(0, 256, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache(len(model.blocks), 30)
        # a prefill, a multi-token chunk on a non-empty cache (needs the offset mask), single steps
        parts = [model(ids[:, a:b], cache=cache) for a, b in [(0, 7), (7, 12), (12, 13), (13, 14), (14, 30)]]
    assert cache.length == 30
    assert (torch.cat(parts, 1) - full).abs().max().item() < 1e-5


@torch.no_grad()
def greedy_generate(model, prompt: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """The cache-free reference: a full forward over the (context-limited) sequence per new token."""
    ids = prompt.reshape(1, -1)
    for _ in range(max_new_tokens):
        nxt = model(ids[:, -model.cfg.max_seq_len:])[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids[0, prompt.numel():]


def test_greedy_equals_cache_free_reference():
    model = tiny()
    prompt = torch.tensor([5, 17, 99, 3])
    out = generate(model, prompt, SamplingConfig(max_new_tokens=20))
    assert out == greedy_generate(model, prompt, 20).tolist()
    # the context is the limit: 32 positions, so at most 32 - 4 + 1 new tokens
    assert len(generate(model, prompt, SamplingConfig(max_new_tokens=100))) == 29
    stop = out[3]
    assert generate(model, prompt, SamplingConfig(max_new_tokens=20, stop_id=stop)) == out[:out.index(stop) + 1]


def test_sampling_seeded_and_inside_nucleus():
    model = tiny()
    prompt = torch.tensor([1, 2, 3])
    a = generate(model, prompt, SamplingConfig(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=7))
    assert a == generate(model, prompt, SamplingConfig(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=7))
    assert a != generate(model, prompt, SamplingConfig(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=8))
    # a tiny nucleus holds only the top token: sampling becomes greedy
    assert generate(model, prompt, SamplingConfig(max_new_tokens=12, temperature=1.0, top_p=1e-6)) == \
        generate(model, prompt, SamplingConfig(max_new_tokens=12))
    # probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.7 keeps the first two only (0.5 < 0.7 <= 0.8)
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(4000, 1)
    gen = torch.Generator().manual_seed(0)
    drawn = next_token(logits, SamplingConfig(temperature=1.0, top_p=0.7), gen)
    assert set(drawn.tolist()) == {0, 1}
    assert abs((drawn == 0).float().mean().item() - 0.5 / 0.8) < 0.03
    with pytest.raises(GenerationError, match="--top-p"):
        SamplingConfig(top_p=0).validate()
    with pytest.raises(GenerationError, match="--temperature"):
        SamplingConfig(temperature=-1).validate()


def test_cli_streams_text(tmp_path, capsys):
    """`megafixed generate RUN --prompt` prints the prompt and the greedy continuation as it goes."""
    from test_hf import model_cfg, random_state, write_run

    from megafixed.cli import main
    from megafixed.commands.generate import TextStream
    from megafixed.data.tokenizers import load_tokenizer, train_tokenizer

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": f"alpha beta gamma {i} delta"}) for i in range(50)))
    tok_path = train_tokenizer([str(corpus)], str(tmp_path / "tokenizer.json"), 300)
    m = model_cfg(input="gf2")
    run = write_run(tmp_path / "run", m, random_state(m), tok_path)
    assert main(["generate", str(run), "--prompt", "alpha beta", "--max-new-tokens", "8", "--no-stop"]) == 0
    printed = capsys.readouterr().out
    tok = load_tokenizer(tok_path)
    model = GPT(m)
    model.load_state_dict(random_state(m))
    ids = generate(model.eval(), torch.tensor(tok.encode("alpha beta")), SamplingConfig(max_new_tokens=8))
    assert printed == "alpha beta" + tok.decode(ids) + "\n"

    # streaming writes as tokens arrive and holds back half a UTF-8 character
    class Tok:
        def decode(self, ids):
            return bytes(ids).decode("utf-8", errors="replace")
    out = io.StringIO()
    stream = TextStream(Tok(), out)
    for b in "é!".encode():
        stream(b)
        if b == 0xC3:
            assert out.getvalue() == ""
    stream.finish()
    assert out.getvalue() == "é!\n"
