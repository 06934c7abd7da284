"""Hugging Face transformers export and import, exact both ways.

EXPORT MAPPING (megafixed backbone -> transformers architecture; never approximate)
----------------------------------------------------------------------------------
Every megafixed backbone is pre-norm, RoPE over the whole head with the GPT-NeoX/Llama half
split (``rotate_half``: pairs ``(x[i], x[i + hd/2])``; our ``wq``/``wk`` outputs are heads x
head_dim in that layout, so no q/k permutation is needed), scaled dot-product attention with
1/sqrt(head_dim), grouped-query heads by ``repeat_interleave`` (HF's ``repeat_kv``), and an output
head (untied unless ``model.tie_embeddings``). The norm, the MLP and the bias set choose the class:

=========  =======  =====  ===========================================================
norm       mlp      bias   transformers class
=========  =======  =====  ===========================================================
rmsnorm    swiglu   any    LlamaForCausalLM (attention_bias = mlp_bias = model.bias)
rmsnorm    gelu     any    ArceeForCausalLM (non-gated up/down MLP, hidden_act "gelu" =
                           exact erf GELU like ``F.gelu``; attention_bias = mlp_bias = bias)
layernorm  gelu     any    Starcoder2ForCausalLM (sequential pre-norm, c_fc/c_proj MLP,
                           hidden_act "gelu", use_bias = bias, sliding_window None)
layernorm  swiglu   false  StableLmForCausalLM (partial_rotary_factor 1, no qk-norm, no
                           parallel residual, no qkv bias)
layernorm  swiglu   true   refused: StableLM has no o_proj/MLP biases and no other
                           transformers class has LayerNorm + SwiGLU + every bias
=========  =======  =====  ===========================================================

transformers' LayerNorms always carry a bias; a megafixed LayerNorm without one (``model.bias:
false``) is exported with a zero bias, which adds exactly nothing. The norm eps, RoPE theta, GQA
and tying carry over. Dropout is a training setting and is exported as 0.

A fixed-code model's embedding matrix is the materialized code ``code.encode(arange(V), d)``
(exactly +-scale in fp32), saved as an ordinary embedding: any transformers stack loads it
unchanged. Its README.md model card records the code (interface, bits, A, b, scale) and the run.

IMPORT (transformers Llama or Arcee -> megafixed learned interface)
------------------------------------------------------------------
Exactly the inverse of the Llama and Arcee rows (Arcee: so megafixed's own RMSNorm + GELU exports
come back), for options megafixed can represent; anything else (RoPE scaling, a partial bias set,
a sliding window, head_dim != hidden/heads, another activation, ...) is refused with the option
named. The tokenizer files and the generation config travel along (``hf_files.py``): generation
stops at the model's own ``eos_token_id``.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from ..config import ModelConfig
from ..model.interfaces import LEARNED, interface_of
from .hf_files import copy_model_files


class InteropError(ValueError):
    """A model, tokenizer or option that cannot be exported or imported exactly; names why."""


# ----------------------------------------------------------------------------------- architectures
_LLAMA_BLOCK = {"norm1": "input_layernorm", "norm2": "post_attention_layernorm",
                "attn.wq": "self_attn.q_proj", "attn.wk": "self_attn.k_proj", "attn.wv": "self_attn.v_proj",
                "attn.wo": "self_attn.o_proj",
                "mlp.w_in": "mlp.up_proj", "mlp.w_gate": "mlp.gate_proj", "mlp.w_out": "mlp.down_proj"}
_STARCODER2_BLOCK = {**{k: v for k, v in _LLAMA_BLOCK.items() if not k.startswith("mlp.")},
                     "mlp.w_in": "mlp.c_fc", "mlp.w_out": "mlp.c_proj"}
_TOP = {"head.norm": "model.norm", "head.proj": "lm_head"}
# Whatever the interface, a transformers model sees one embedding matrix (its hf_embedding).
HF_EMBEDDING = "model.embed_tokens.weight"


@dataclass(frozen=True)
class Arch:
    model_type: str  # transformers' model_type (config.json)
    class_name: str  # the *ForCausalLM class
    block: dict  # megafixed block sub-module -> transformers sub-module

    def hf_key(self, key: str) -> str:
        """megafixed state-dict key -> transformers key."""
        if key.startswith("blocks."):
            _, i, rest = key.split(".", 2)
            sub, leaf = rest.rsplit(".", 1)
            return f"model.layers.{i}.{self.block[sub]}.{leaf}"
        if key.startswith("input."):  # the interface's table, when it has one (import: the learned table)
            return HF_EMBEDDING
        sub, leaf = key.rsplit(".", 1)
        return f"{_TOP[sub]}.{leaf}"


ARCHES = {
    "llama": Arch("llama", "LlamaForCausalLM", _LLAMA_BLOCK),
    "arcee": Arch("arcee", "ArceeForCausalLM", {k: v for k, v in _LLAMA_BLOCK.items() if k != "mlp.w_gate"}),
    "starcoder2": Arch("starcoder2", "Starcoder2ForCausalLM", _STARCODER2_BLOCK),
    "stablelm": Arch("stablelm", "StableLmForCausalLM", _LLAMA_BLOCK),
}


def check_exportable_input(m: ModelConfig) -> None:
    """Refuse an input interface that has no transformers embedding, by name."""
    if interface_of(m).hf_embedding is None:
        raise InteropError(f"model.input={m.input} has no transformers embedding matrix (its interface defines "
                           f"no hf_embedding), so no transformers model computes what it computes; refusing to "
                           f"export it")


def choose_arch(m: ModelConfig) -> Arch:
    """The transformers architecture that computes exactly what ``m`` computes, or a refusal."""
    check_exportable_input(m)
    if m.norm == "rmsnorm":
        return ARCHES["llama" if m.mlp == "swiglu" else "arcee"]
    if m.mlp == "gelu":
        return ARCHES["starcoder2"]
    if m.bias:
        raise InteropError("model.norm=layernorm with model.mlp=swiglu and model.bias=true has no exact "
                           "transformers architecture: StableLM (the LayerNorm + SwiGLU class) has no o_proj or MLP "
                           "biases, and no other class has LayerNorm, SwiGLU and biases on every projection. "
                           "Refusing rather than exporting an approximation")
    return ARCHES["stablelm"]


def hf_config(m: ModelConfig, arch: Arch, *, eos_id: Optional[int], dtype: torch.dtype):
    """The transformers config of ``arch`` for the megafixed model ``m``."""
    import transformers

    common = dict(vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.ffn_dim,
                  num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads, num_key_value_heads=m.kv_heads,
                  max_position_embeddings=m.max_seq_len, initializer_range=m.init_std,
                  tie_word_embeddings=bool(m.tie_embeddings), bos_token_id=None, eos_token_id=eos_id,
                  pad_token_id=None, attention_dropout=0.0,
                  rope_parameters={"rope_type": "default", "rope_theta": float(m.rope_theta)})
    if arch.model_type == "llama":
        cfg = transformers.LlamaConfig(**common, hidden_act="silu", rms_norm_eps=m.norm_eps, head_dim=m.head_dim,
                                       attention_bias=m.bias, mlp_bias=m.bias, pretraining_tp=1)
    elif arch.model_type == "arcee":
        cfg = transformers.ArceeConfig(**common, hidden_act="gelu", rms_norm_eps=m.norm_eps, head_dim=m.head_dim,
                                       attention_bias=m.bias, mlp_bias=m.bias)
    elif arch.model_type == "starcoder2":
        cfg = transformers.Starcoder2Config(**common, hidden_act="gelu", norm_epsilon=m.norm_eps, use_bias=m.bias,
                                            sliding_window=None, residual_dropout=0.0, embedding_dropout=0.0)
    else:
        common["rope_parameters"]["partial_rotary_factor"] = 1.0
        cfg = transformers.StableLmConfig(**common, hidden_act="silu", layer_norm_eps=m.norm_eps,
                                          use_qkv_bias=False, qk_layernorm=False, use_parallel_residual=False,
                                          hidden_dropout=0.0)
    cfg.architectures = [arch.class_name]
    cfg.dtype = dtype
    return cfg


def _expected(cfg, arch: Arch) -> dict:
    """transformers' own parameter names and shapes for ``cfg``, built on the meta device."""
    import transformers

    with torch.device("meta"):
        model = getattr(transformers, arch.class_name)(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def export_state_dict(model, arch: Arch, cfg) -> dict:
    """The transformers state dict of a plain megafixed ``GPT`` (fp32, full tensors)."""
    m = model.cfg
    check_exportable_input(m)
    out = {}
    for key, value in model.state_dict().items():
        if key.startswith("input."):
            continue  # the input is exported as its one embedding matrix, below
        out[arch.hf_key(key)] = value.detach().float().clone()
    # a table as it is; a fixed code materialized, encode(arange(V), d), exactly +-scale in fp32
    out[HF_EMBEDDING] = interface_of(m).hf_embedding(model.input, m)
    if m.tie_embeddings:
        out.pop("lm_head.weight", None)  # transformers re-ties it to embed_tokens on load
    expected = _expected(cfg, arch)
    if m.tie_embeddings:
        expected.pop("lm_head.weight", None)
    for key, shape in expected.items():
        if key not in out and (key.endswith("layernorm.bias") or key == "model.norm.bias"):
            out[key] = torch.zeros(shape)  # transformers' LayerNorm always has a bias; ours may not
    missing = sorted(set(expected) - set(out))
    extra = sorted(set(out) - set(expected))
    wrong = [k for k in expected if k in out and tuple(out[k].shape) != expected[k]]
    if missing or extra or wrong:  # a mapping bug, never user input: fail loudly
        raise RuntimeError(f"export mapping to {arch.class_name} is incomplete: missing {missing[:5]}, "
                           f"unexpected {extra[:5]}, wrong shapes {wrong[:5]}")
    return out


# ----------------------------------------------------------------------------------- tokenizer
PROBES = ["Hello world", " leading space and  two spaces", "line one\nline two\n\n\tTabbed",
          "Numbers 12345 and 3.14159, punctuation: (a) [b] {c}!?", "Ünïcödé café — naïve 日本語 🙂",
          "<|endoftext|></s>", "x" * 40]


def _backend_of(tok):
    """A ``tokenizers.Tokenizer`` that encodes exactly like the megafixed tokenizer ``tok``."""
    from tokenizers import Tokenizer

    if tok.kind in ("hf", "gpt2"):
        backend = Tokenizer.from_str(tok._tok.to_str())
        probe = "Hello world"
        if backend.encode(probe, add_special_tokens=True).ids != backend.encode(probe, add_special_tokens=False).ids:
            # megafixed encodes with add_special_tokens=False (no BOS/EOS templates): so must the export
            backend.post_processor = None
        return backend
    if tok.kind == "sentencepiece":
        from transformers.convert_slow_tokenizer import SentencePieceExtractor, SpmConverter

        extractor = SentencePieceExtractor(tok.path)
        kwargs = extractor.extract(None)
        merges = None if isinstance(kwargs["vocab"], dict) else kwargs.get("merges")
        backend = SpmConverter.build_tokenizer_from_spm_proto(extractor.proto, kwargs["vocab"], merges)
        if backend is None:
            raise InteropError(f"sentencepiece model {tok.path} is neither BPE nor unigram; cannot convert it")
        return backend
    raise InteropError(f"tokenizer kind {tok.kind!r} cannot be exported")


def export_tokenizer(tok, out_dir: Path, max_len: int) -> dict:
    """Write tokenizer.json + tokenizer_config.json that ``AutoTokenizer`` loads, check it encodes
    and decodes the probe texts exactly like ``tok``, and return what the model card records."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    backend = _backend_of(tok)
    eos = backend.id_to_token(tok.eod_id)
    # sentencepiece never matches control pieces ("</s>") inside text; transformers does unless told
    # to split special tokens like ordinary text. HF tokenizers match them in both stacks.
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos, model_max_length=max_len,
                                   clean_up_tokenization_spaces=False,
                                   split_special_tokens=tok.kind == "sentencepiece")
    fast.save_pretrained(str(out_dir))
    loaded = AutoTokenizer.from_pretrained(str(out_dir), local_files_only=True)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the probes may exceed model_max_length; that warning is noise here
    try:
        pairs = [(text, list(tok.encode(text)), loaded(text)["input_ids"]) for text in PROBES]
    finally:
        hf_logging.set_verbosity(verbosity)
    for text, ours, theirs in pairs:
        if ours != theirs:
            raise InteropError(f"tokenizer {tok.path} ({tok.kind}) does not convert exactly: on {text!r} megafixed "
                               f"gives {ours[:12]} but the transformers tokenizer gives {theirs[:12]}; pass "
                               f"--tokenizer with a HF tokenizer.json of the same vocabulary")
        if tok.decode(ours) != loaded.decode(theirs):
            raise InteropError(f"tokenizer {tok.path} ({tok.kind}) decodes {text!r} differently after conversion")
    return {"kind": tok.kind, "source": tok.path, "eos_token": eos, "eos_token_id": tok.eod_id,
            "bos_token": None, "vocab_size": tok.vocab_size}


# ----------------------------------------------------------------------------------- export
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def export_hf(source: str, out_dir: str, *, dtype: str = "fp32", tag: Optional[str] = None,
              tokenizer: Optional[str] = None, overwrite: bool = False,
              log: Callable[[str], None] = print) -> Path:
    """``megafixed export hf``: write ``out_dir`` that ``AutoModelForCausalLM`` and ``AutoTokenizer`` load."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    from ..outputs import claim_output, writing
    from ..train.run_source import resolve_run, run_tokenizer

    if dtype not in DTYPES:
        raise InteropError(f"--dtype {dtype!r}: use one of {sorted(DTYPES)}")
    src = resolve_run(source, tag)
    cfg = src.config
    arch = choose_arch(cfg.model)  # refuse before reading any weights
    claim_output([out_dir], overwrite=overwrite, inputs=[str(src.run_dir)], what="export folder")
    tok = run_tokenizer(cfg, tokenizer)
    if tok is None:
        raise InteropError(f"the run {src.run_dir} names no tokenizer (data.tokenizer is unset and its shards "
                           f"record none); pass --tokenizer PATH (the tokenizer.json / .model it was trained with)")
    if tok.vocab_size > cfg.model.vocab_size:
        raise InteropError(f"tokenizer {tok.path} has {tok.vocab_size} ids but the model only "
                           f"{cfg.model.vocab_size} (model.vocab_size); pass the run's own tokenizer with --tokenizer")
    model = src.load_model()
    torch_dtype = DTYPES[dtype]
    hf_cfg = hf_config(cfg.model, arch, eos_id=tok.eod_id, dtype=torch_dtype)
    weights = {k: v.to(torch_dtype).contiguous() for k, v in export_state_dict(model, arch, hf_cfg).items()}

    out = Path(out_dir)
    tmp = out.parent / f".{out.name}.tmp.{os.getpid()}"
    with writing(dirs=[str(out)]):
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            hf_cfg.save_pretrained(str(tmp))
            GenerationConfig(eos_token_id=tok.eod_id, pad_token_id=tok.eod_id, bos_token_id=None,
                             max_length=cfg.model.max_seq_len, do_sample=False).save_pretrained(str(tmp))
            tok_info = export_tokenizer(tok, tmp, cfg.model.max_seq_len)
            (tmp / "README.md").write_text(model_card(src, arch, dtype, tok_info, model))
            if out.exists():
                shutil.rmtree(out)  # claim_output allowed it (--overwrite or empty): no stale files stay
            os.replace(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    log(f"exported {src.tag_dir} as {arch.class_name} ({dtype}) to {out}")
    return out


def model_card(src, arch: Arch, dtype: str, tok_info: dict, model) -> str:
    """README.md: the interface, the code (bits, A, b, scale) and the run, so the export describes itself."""
    import yaml

    from .. import __version__

    m = src.config.model
    lines = ["---", "library_name: transformers", "tags: [megafixed, causal-lm"
             + (", fixed-token-codes" if model.has_fixed_input else "") + "]", "---", "",
             f"# megafixed export: {src.run_dir.name} ({src.tag})", "",
             f"A GPT trained with megafixed {__version__} (fixed token codes instead of an input embedding "
             f"table; study: arXiv 2610.04002) and exported as a standard "
             f"`{arch.class_name}` (`model_type: {arch.model_type}`). It loads with "
             f"`AutoModelForCausalLM.from_pretrained(DIR)` and `AutoTokenizer.from_pretrained(DIR)`; no custom code.",
             "", "## Input interface", ""]
    if model.has_fixed_input:
        code = model.input.code
        exact = torch.tensor(code.scale, dtype=DTYPES[dtype]).item() == code.scale
        rounded = "" if exact else f" (rounded to {dtype} in this export; export fp32 for the exact values)"
        lines += [f"- interface: **{m.input}** fixed token code (not trained). The embedding matrix is the "
                  f"materialized code `encode(arange({m.vocab_size}), {m.d_model})`: every entry is exactly "
                  f"+-{code.scale}{rounded}. Keep it frozen when fine-tuning to stay a fixed-code model.",
                  f"- bits: {code.bits} (token id t, bit i = (t >> i) & 1, least significant first)",
                  f"- A (rows, bit j of row i is A[i][j]): {list(code.rows)}",
                  f"- b (shift): {code.shift}",
                  f"- scale: {code.scale}",
                  f"- code bit c_i = parity(A_i & t) XOR b_i; bit 1 -> +scale, 0 -> -scale; column j uses bit j mod "
                  f"{code.bits}"]
    else:
        lines += ["- interface: **learned** embedding table" + (" (tied to the output head)" if m.tie_embeddings
                                                                else "")]
    lines += ["", "## Backbone", "",
              f"- {m.n_layers} layers, d_model {m.d_model}, {m.n_heads} heads ({m.kv_heads} key/value heads), "
              f"head_dim {m.head_dim}, MLP {m.mlp} ({m.ffn_dim}), {m.norm} (eps {m.norm_eps}), bias {m.bias}, "
              f"RoPE theta {m.rope_theta}, context {m.max_seq_len}",
              f"- weights: {dtype}",
              "", "## Tokenizer", "",
              f"- {tok_info['kind']} tokenizer from `{tok_info['source']}`, {tok_info['vocab_size']} ids",
              f"- end of document / EOS: `{tok_info['eos_token']}` (id {tok_info['eos_token_id']}); no BOS token "
              f"(megafixed trains on documents separated by EOS, without BOS)",
              "", "## Training run", "",
              f"- run directory: `{src.run_dir.resolve()}`",
              f"- checkpoint: `{src.tag}`" + (f" (step {src.step})" if src.step is not None else "")]
    if src.record and src.record.get("layout"):
        lines.append(f"- trained layout: {json.dumps(src.record['layout'])}")
    lines += ["", "Full training config:", "", "```yaml",
              yaml.safe_dump(src.config.to_dict(), sort_keys=False).rstrip(), "```", ""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------- import
def _refuse(option: str, value, why: str) -> InteropError:
    return InteropError(f"cannot import: config.json {option}={value!r} {why}; megafixed would compute something "
                        f"else, so it refuses rather than approximating")


# What import reads: model_type -> (megafixed mlp, the hidden_act it computes exactly). Llama is the
# common checkpoint; Arcee is megafixed's own export of RMSNorm + GELU models (the paper backbone),
# so every RMSNorm export round-trips.
IMPORTABLE = {"llama": ("swiglu", "silu"), "arcee": ("gelu", "gelu")}


def hf_model_config(hf: dict) -> ModelConfig:
    """The megafixed ``ModelConfig`` (learned interface) equal to a transformers Llama or Arcee config."""
    arch = hf.get("model_type")
    if arch not in IMPORTABLE:
        raise InteropError(f"cannot import model_type {arch!r}: import reads {' and '.join(map(repr, IMPORTABLE))} "
                           f"models (LlamaForCausalLM, and ArceeForCausalLM as megafixed exports RMSNorm + GELU "
                           f"models)")
    mlp, act = IMPORTABLE[arch]
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    kv = hf.get("num_key_value_heads") or heads
    rope = hf.get("rope_parameters") or {}
    if hf.get("rope_scaling"):
        raise _refuse("rope_scaling", hf["rope_scaling"], "rescales RoPE (megafixed has plain RoPE only)")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise _refuse("rope_parameters.rope_type", rope_type, "rescales RoPE (megafixed has plain RoPE only)")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise _refuse("partial_rotary_factor", rope["partial_rotary_factor"], "rotates part of each head")
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    head_dim = hf.get("head_dim") or hidden // heads
    if head_dim * heads != hidden:
        raise _refuse("head_dim", head_dim, f"differs from hidden_size/num_attention_heads = {hidden}/{heads}")
    if hf.get("hidden_act", "silu" if arch == "llama" else None) != act:
        raise _refuse("hidden_act", hf.get("hidden_act"), f"is not {act!r} (what megafixed's {mlp} MLP computes "
                      f"for a {arch} model)")
    attn_bias, mlp_bias = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
    if attn_bias != mlp_bias:
        raise _refuse("attention_bias/mlp_bias", (attn_bias, mlp_bias), "is a partial bias set (megafixed's "
                      "model.bias puts biases on all of q, k, v, o and the MLP, or on none)")
    for option in ("sliding_window", "layer_types", "attention_chunk_size", "no_rope_layers"):
        if hf.get(option):
            raise _refuse(option, hf[option], "is not plain full causal attention with RoPE in every layer")
    if (hf.get("pretraining_tp") or 1) != 1:
        raise _refuse("pretraining_tp", hf["pretraining_tp"], "splits matmuls (transformers' own Llama ignores it "
                      "only in some versions)")
    cfg = ModelConfig(vocab_size=hf["vocab_size"], d_model=hidden, n_layers=hf["num_hidden_layers"], n_heads=heads,
                      n_kv_heads=kv if kv != heads else None, ffn_hidden=hf["intermediate_size"], mlp=mlp,
                      norm="rmsnorm", norm_eps=float(hf.get("rms_norm_eps", 1e-6)), bias=attn_bias,
                      max_seq_len=hf.get("max_position_embeddings", 2048), rope_theta=float(theta),
                      init_std=float(hf.get("initializer_range", 0.02)), dropout=0.0, input=LEARNED.name,
                      tie_embeddings=bool(hf.get("tie_word_embeddings", False)))
    try:
        cfg.validate()
    except ValueError as exc:
        raise InteropError(f"cannot import: the model does not fit megafixed's model config ({exc})") from None
    return cfg


llama_model_config = hf_model_config  # the name before Arcee was importable


def _read_safetensors(hf_dir: Path) -> dict:
    from safetensors.torch import load_file

    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise InteropError(f"{index} is unreadable or not a safetensors index ({type(exc).__name__}: {exc}); "
                               f"re-download it or save the model again with save_pretrained") from None
    elif (hf_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise InteropError(f"{hf_dir} holds no model.safetensors (or sharded model.safetensors.index.json); save "
                           f"the model with save_pretrained(safe_serialization=True)")
    sd = {}
    for name in files:
        path = hf_dir / name
        if not path.is_file():
            raise InteropError(f"{path} is missing (named by {index.name}); download every shard of the model")
        try:
            sd.update(load_file(str(path)))
        except Exception as exc:  # noqa: BLE001 -- SafetensorError, OSError: a truncated/corrupt/unreadable file
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise InteropError(f"{path} cannot be read as safetensors ({why}): it is truncated, corrupt or "
                               f"unreadable; re-download it or save the model again with save_pretrained") from None
    return sd


def import_state_dict(hf_sd: dict, m: ModelConfig, model_type: str = "llama") -> dict:
    """transformers Llama/Arcee state dict -> plain megafixed GPT state dict (fp32)."""
    arch = ARCHES[model_type]
    from ..model.gpt import meta_gpt

    names = list(meta_gpt(m).state_dict())
    if m.tie_embeddings:
        names.remove("head.proj.weight")  # tied: the same tensor as the embedding
    out, wanted = {}, set()
    for key in names:
        hf_key = arch.hf_key(key)
        wanted.add(hf_key)
        if hf_key not in hf_sd:
            raise InteropError(f"the checkpoint has no {hf_key} (needed for megafixed {key}); is it a complete "
                               f"{arch.class_name}?")
        out[key] = hf_sd[hf_key].float().contiguous()
    if m.tie_embeddings:
        out["head.proj.weight"] = out["input." + interface_of(m).table]
    extra = sorted(k for k in set(hf_sd) - wanted if not k.endswith("rotary_emb.inv_freq")
                   and not (m.tie_embeddings and k == "lm_head.weight"))
    if extra:
        raise InteropError(f"the checkpoint has weights megafixed's {arch.class_name} mapping does not use: "
                           f"{extra[:5]}")
    return out


def import_hf(hf_dir: str, out_dir: str, *, overwrite: bool = False, log: Callable[[str], None] = print) -> Path:
    """``megafixed import hf``: a run-shaped folder ``out_dir`` (``config.yaml`` +
    ``checkpoints/imported``) that ``generate``/``export`` read and ``train.init_from`` starts from."""
    from ..config import Config, save_config
    from ..engine.weights import write_checkpoint
    from ..outputs import claim_output, writing
    from ..run.manifest import describe
    from ..run.run_dir import RunDirectory

    src = Path(hf_dir)
    cfg_path = src / "config.json"
    if not cfg_path.is_file():
        raise InteropError(f"{src} has no config.json; pass a folder written by transformers' save_pretrained")
    try:
        hf = json.loads(cfg_path.read_text())
    except ValueError as exc:
        raise InteropError(f"{cfg_path} is not valid JSON ({exc})") from None
    m = hf_model_config(hf)  # refuse before reading weights
    claim_output([out_dir], overwrite=overwrite, inputs=[str(src)], what="import folder")
    sd = import_state_dict(_read_safetensors(src), m, hf["model_type"])
    cfg = Config(model=m)
    cfg.data.seq_len = min(cfg.data.seq_len, m.max_seq_len)
    out = Path(out_dir)
    with writing(dirs=[str(out)]):
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        tokenizer = copy_model_files(src, out, hf)  # tokenizer files, generation_config.json (its EOS)
        if tokenizer:
            cfg.data.tokenizer = str(tokenizer.resolve())
        cfg.train.run_dir = str(out.resolve())
        cfg.validate()
        rd = RunDirectory(out)
        save_config(cfg, str(rd.config_file))
        layout = {"tp": 1, "pp": 1, "dp": 1, "zero_stage": 0, "precision": "fp32"}
        write_checkpoint(sd, rd.checkpoints, tp=1, pp=1, tag="imported",  # with its manifest: readers verify
                         run_record={"config": cfg.to_dict(), "imported_from": str(src.resolve()), "layout": layout,
                                     "format": 1},
                         meta={**describe(cfg, layout, 0, 0), "imported_from": str(src.resolve())})
    log(f"imported {src} ({ARCHES[hf['model_type']].class_name}, {m.n_layers} layers, d_model {m.d_model}, "
        f"{m.n_heads} heads / {m.kv_heads} kv) to {out}; continue training with `megafixed train CONFIG "
        f"train.init_from={out}`")
    return out
