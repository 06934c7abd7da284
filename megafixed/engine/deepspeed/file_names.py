"""The names of the DeepSpeed engine's checkpoint files that hold weights, for its registered facts (``kind.py``,
light) and its readers (``convert.py``) alike: a module file per TP (and PP) rank (ZeRO-3 keeps the weights in
the partition files too)."""
from __future__ import annotations

MODEL_FILES = r"^(mp_rank_\d+_model_states|layer_\d+-model_\d+-model_states)\.pt$"
