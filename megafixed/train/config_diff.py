"""The one config diff: which keys differ between two configs, the fixed code compared by value.

Used by the resume check (``resume.check_resume``: the whole config against the checkpoint's run
record) and by ``train.init_from`` (the model section against the source's). Both compare
*resolved* configs (``config.resolve_code``: a gf2 code's rows and shift spelled out), so a code
given by seed and the same code given by rows are equal: when the rows agree, the seed and the
affine flag that produced them do not count.
"""
from __future__ import annotations

# Resolved from other keys (model.input, model.code_seed, model.code_bits, model.code_affine) unless given.
DERIVED_KEYS = ("model.code_rows", "model.code_shift")
CODE_SOURCE_KEYS = ("model.code_seed", "model.code_affine")  # what the rows were drawn from


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def resolved(config_dict: dict) -> dict:
    """A config (or a part of one, e.g. ``{"model": ...}``) resolved and flattened to dotted keys."""
    from ..config import config_from_dict, resolve_code

    return flatten(resolve_code(config_from_dict(config_dict)).to_dict())


def resolved_cfg(cfg) -> dict:
    from ..config import resolve_code

    return flatten(resolve_code(cfg).to_dict())


def config_diff(old: dict, new: dict) -> dict[str, tuple]:
    """Dotted key -> (old, new) for every key whose value differs between two flattened resolved
    configs; the code's seed/affine flag are ignored when its rows agree (the rows are the code)."""
    old, new = dict(old), dict(new)
    if old.get("model.code_rows") is not None and old.get("model.code_rows") == new.get("model.code_rows"):
        for key in CODE_SOURCE_KEYS:
            old.pop(key, None), new.pop(key, None)
    return {k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)}
