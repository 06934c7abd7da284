"""The files beside a transformers model's weights that an import must keep: the tokenizer and the
generation config, whose ``eos_token_id`` says where generation stops.

Why: a model's end-of-turn token is the model's choice, not the tokenizer's. SmolLM2-Instruct's
tokenizer holds ``<|endoftext|>`` (id 0), but its ``generation_config.json`` ends a reply at
``<|im_end|>`` (id 2); a fixed list of EOD names picks the first and runs past the reply, where
transformers' ``generate`` stops. So generation reads ``eos_token_id`` (an int or a list) from
``generation_config.json``, then ``config.json``, and only then falls back to the tokenizer's EOD.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

# Every file save_pretrained writes for a tokenizer (fast, sentencepiece or GPT-2 BPE) and the chat template.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json")
GENERATION_CONFIG = "generation_config.json"


def _ids(value) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, (list, tuple)) else [value]
    return [int(v) for v in values if isinstance(v, int) and not isinstance(v, bool)]


def model_eos_ids(folder: str | Path) -> list[int]:
    """The EOS ids the model in ``folder`` declares: ``generation_config.json`` first (what
    transformers' ``generate`` uses), else ``config.json``; [] when neither names one."""
    for name in (GENERATION_CONFIG, "config.json"):
        path = Path(folder) / name
        if not path.is_file():
            continue
        try:
            ids = _ids(json.loads(path.read_text()).get("eos_token_id"))
        except (OSError, ValueError, AttributeError):
            continue
        if ids:
            return ids
    return []


def copy_model_files(src: Path, out: Path, hf_config: dict) -> Optional[Path]:
    """Copy the tokenizer files and the generation config from ``src`` to ``out``; return the
    tokenizer megafixed loads (``tokenizer.json``, else ``tokenizer.model``, else None). A model
    without ``generation_config.json`` gets one holding ``config.json``'s EOS, so the import keeps it."""
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
    if (src / GENERATION_CONFIG).is_file():
        shutil.copy2(src / GENERATION_CONFIG, out / GENERATION_CONFIG)
    elif _ids(hf_config.get("eos_token_id")):
        (out / GENERATION_CONFIG).write_text(json.dumps({"eos_token_id": hf_config["eos_token_id"]}, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer.model"):
        if (out / name).is_file():
            return out / name
    return None
