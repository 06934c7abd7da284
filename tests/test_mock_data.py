"""``data.mock=true``: deterministic synthetic samples of the right shape and vocabulary, wired into
config loading, ``prepare_data`` (nothing on disk is needed) and the trainer's dataset choice."""
from __future__ import annotations

import numpy as np
import pytest

from megafixed.config import load_config
from megafixed.data.errors import DataError
from megafixed.data.mock import MockGPTDataset, build_mock_datasets


def test_samples_are_deterministic_shaped_and_in_the_vocabulary():
    a, b = MockGPTDataset(31, 1000, seed=7), MockGPTDataset(31, 1000, seed=7)
    for i in (0, 1, 12345, 10**12):
        x = a[i]
        assert x.shape == (32,) and x.dtype == np.int64
        assert x.min() >= 0 and x.max() < 1000
        assert np.array_equal(x, b[i])  # same seed, same index: same tokens, in any access order
    assert not np.array_equal(a[0], a[1])
    assert not np.array_equal(a[0], MockGPTDataset(31, 1000, seed=8)[0])
    assert not np.array_equal(a[0], MockGPTDataset(31, 1000, seed=7, split="valid")[0])
    big = np.concatenate([MockGPTDataset(255, 50, seed=1)[i] for i in range(64)])
    assert set(np.unique(big)) == set(range(50))  # the whole vocabulary, nothing outside it
    with pytest.raises(IndexError):
        a[-1]
    with pytest.raises(DataError, match="split"):
        MockGPTDataset(8, 10, 0, split="dev")


def test_config_field_prepare_data_and_batches(tmp_path):
    from megafixed.data.gpt_dataset import micro_batches
    from megafixed.data.prepare import prepare_data

    cfg = load_config(None, ["data.mock=true", "data.seq_len=16", "model.vocab_size=300", "model.d_model=64",
                             "model.n_heads=4", "model.code_bits=9", "data.prefixes=[]", "data.tokenizer=null"])
    assert cfg.data.mock is True
    assert prepare_data(cfg).data.mock is True  # no shards, no tokenizer: nothing to prepare or check
    ds = build_mock_datasets(cfg.data, cfg.model.vocab_size, seed=3)
    assert set(ds) == {"train", "valid", "test"}
    batch = next(micro_batches(ds["train"], start_sample=0, micro_batch=4, dp_rank=0, dp_size=1))
    assert tuple(batch.shape) == (4, 17) and int(batch.max()) < 300
    again = next(micro_batches(build_mock_datasets(cfg.data, 300, seed=3)["train"], 0, 4, 0, 1))
    assert (batch == again).all()
