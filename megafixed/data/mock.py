"""``data.mock=true``: deterministic synthetic token samples for throughput runs without a corpus.

Megatron's ``--mock-data`` in spirit: every sample is a pure function of ``(seed, split, index)``,
so two runs (or a resumed run) see the same tokens in the same order, and any data-parallel layout
covers the same samples, without a tokenizer or shards on disk. Tokens are uniform over
``[0, vocab_size)``: a throughput benchmark needs the right shapes and ids, not language.

Each sample draws from its own ``PCG64([seed, split, index])`` stream (numpy's seed sequence),
so random access costs the same at index 0 and 10**12 and no index needs building.
"""
from __future__ import annotations

import numpy as np

from .errors import DataError

SPLIT_IDS = {"train": 0, "valid": 1, "test": 2}
# Samples per "epoch": the sampler only needs len() for wrap-around, and 2**40 samples is more
# than any run consumes (1e12 x 2048 tokens), so a mock run never repeats a sample.
MOCK_SAMPLES = 1 << 40


class MockGPTDataset:
    """``dataset[i]`` -> int64 array of ``seq_len + 1`` token ids (inputs and shifted labels)."""

    def __init__(self, seq_len: int, vocab_size: int, seed: int, split: str = "train"):
        if seq_len < 1 or vocab_size < 1:
            raise DataError(f"mock data needs seq_len >= 1 and vocab_size >= 1, got {seq_len}, {vocab_size}")
        if split not in SPLIT_IDS:
            raise DataError(f"mock data split {split!r} is not one of {sorted(SPLIT_IDS)}")
        self.seq_len, self.vocab_size, self.seed, self.split = int(seq_len), int(vocab_size), int(seed), split

    def __len__(self) -> int:
        return MOCK_SAMPLES

    @property
    def num_tokens(self) -> int:
        return MOCK_SAMPLES * (self.seq_len + 1)

    def __getitem__(self, idx: int) -> np.ndarray:
        idx = int(idx)
        if idx < 0:
            raise IndexError(f"sample index {idx} < 0")
        rng = np.random.Generator(np.random.PCG64([self.seed, SPLIT_IDS[self.split], idx]))
        return rng.integers(0, self.vocab_size, self.seq_len + 1, dtype=np.int64)

    def __repr__(self) -> str:
        return f"MockGPTDataset({self.split}: {self.seq_len + 1} tokens per sample, vocab {self.vocab_size})"


def build_mock_datasets(data_cfg, vocab_size: int, seed: int) -> dict:
    """What ``build_datasets`` returns (train/valid/test), from nothing but shapes and a seed."""
    return {name: MockGPTDataset(data_cfg.seq_len, vocab_size, seed, name) for name in SPLIT_IDS}
