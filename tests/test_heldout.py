"""The one held-out scorer (megafixed.model.heldout): token-weighted mean loss against an
independent cross entropy, the batch-mean equality for equal batches, ignored targets, a loss
callable (the trainer's shape), the stop poll, and the model's mode restored."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megafixed.config import ModelConfig
from megafixed.model import GPT
from megafixed.model.heldout import IGNORE_INDEX, score_heldout


def tiny() -> GPT:
    return GPT(ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, code_bits=6, max_seq_len=16,
                           init_std=0.2), seed=3)


def _tokens(*shape, seed=0):
    return torch.randint(0, 64, shape, generator=torch.Generator().manual_seed(seed))


def test_unequal_batches_weigh_every_token_the_same():
    model = tiny()
    batches = [_tokens(3, 9, seed=1), _tokens(1, 9, seed=2), _tokens(2, 5, seed=3)]
    score = score_heldout(model, batches)
    nll, count = 0.0, 0
    with torch.no_grad():
        for b in batches:
            logits = model(b[:, :-1])
            nll += float(F.cross_entropy(logits.flatten(0, 1), b[:, 1:].flatten(), reduction="sum"))
            count += b[:, 1:].numel()
    assert score.tokens == count == 3 * 8 + 8 + 2 * 4 and score.batches == 3
    assert score.loss == pytest.approx(nll / count, rel=1e-6)
    assert score.nll == pytest.approx(nll, rel=1e-6) and score.perplexity == pytest.approx(math.exp(nll / count))
    # the mean of the batch means would weigh the 1-row batch as much as the 3-row one
    with torch.no_grad():
        batch_mean = sum(float(model(b[:, :-1], b[:, 1:])) for b in batches) / 3
    assert abs(score.loss - batch_mean) > 1e-4


def test_equal_batches_give_exactly_the_mean_of_batch_means():
    model = tiny().eval()
    batches = [_tokens(4, 11, seed=s) for s in range(5)]
    with torch.no_grad():
        means = torch.stack([model(b[:, :-1], b[:, 1:]).double() for b in batches])
    assert score_heldout(model, batches).loss == float(means.sum()) / len(batches)  # bit for bit


def test_ignored_targets_are_not_scored():
    model = tiny()
    x = _tokens(2, 9, seed=4)
    inputs, targets = x[:, :-1], x[:, 1:].clone()
    targets[:, :5] = IGNORE_INDEX
    with torch.no_grad():
        ref = F.cross_entropy(model(inputs)[:, 5:].flatten(0, 1), targets[:, 5:].flatten())
    score = score_heldout(model, [(inputs, targets)])
    assert score.tokens == 2 * 3 and score.loss == pytest.approx(float(ref), rel=1e-6)


def test_a_loss_callable_its_token_counts_and_the_stop_poll():
    values = iter([2.0, 4.0, 6.0])
    score = score_heldout(lambda _: next(values), range(3), tokens_of=lambda _: 10)
    assert (score.loss, score.tokens, score.batches) == (4.0, 30, 3)
    polls = iter([False, True])
    assert score_heldout(lambda _: 1.0, range(3), tokens_of=lambda _: 1, should_stop=lambda: next(polls)) is None
    assert math.isnan(score_heldout(lambda _: 1.0, []).loss)


def test_the_model_mode_is_restored():
    model = tiny().train()
    score_heldout(model, [_tokens(1, 5)])
    assert model.training


def test_data_parallel_shares_reduce_to_the_whole_split(monkeypatch):
    """Two ranks' shares: rank 0 scores its half and the all-reduce adds rank 1's sums (played by a
    stand-in here, so no second process is needed); the result is the score of the whole split."""
    import megafixed.model.heldout as heldout

    model = tiny()
    batches = [_tokens(2, 9, seed=s) for s in range(4)]
    whole = score_heldout(model, batches)
    other = score_heldout(model, batches[1::2])  # rank 1's share (dp_rank 1 of 2)

    def all_reduce(t, group=None):
        assert group == "dp" and t.dtype == torch.float64
        t += torch.tensor([other.nll, other.tokens], dtype=torch.float64)

    monkeypatch.setattr(heldout.dist, "all_reduce", all_reduce)
    mine = score_heldout(model, batches[0::2], dp_size=2, dp_group="dp")
    assert mine.tokens == whole.tokens and mine.batches == 2
    assert mine.loss == pytest.approx(whole.loss, rel=1e-12)
