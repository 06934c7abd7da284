"""The input-interface registry: the three interfaces' facts, and a fourth added by one entry.

The toy interface is registered here, in the test, and nowhere else: if building, counting,
sharding, describing or the HF export needed an edit outside the registry entry, these fail.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megafixed.codes import make_code
from megafixed.config import ConfigError, load_config
from megafixed.model import GPT
from megafixed.model.interfaces import INTERFACES, REPLICATED, VOCAB_PARALLEL, InputInterface, interface_of, register
from megafixed.model.params import count_params
from megafixed.parallel.memory import tp_param_counts as planner_counts
from megafixed.parallel.tensor import is_vocab_parameter, keep_local_positions, sharded_dim

TINY = ["model.vocab_size=300", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.max_seq_len=16",
        "data.seq_len=16", "model.code_bits=9", "train.global_batch=2", "train.micro_batch=1"]


class RandomSignInput(nn.Module):
    """A fixed random +-1 vocab x d table: a buffer drawn from a seed, no parameters."""

    def __init__(self, vocab: int, d: int, seed: int):
        super().__init__()
        self.seed = seed
        self.register_buffer("code_table", torch.empty(vocab, d))
        self.reset_buffers()

    @torch.no_grad()
    def reset_buffers(self) -> None:  # after meta construction + to_empty (engine.deepspeed.model.build_model)
        if self.code_table.is_meta:
            return
        gen = torch.Generator().manual_seed(self.seed)
        signs = torch.randint(0, 2, tuple(self.code_table.shape), generator=gen).float() * 2 - 1
        self.code_table.copy_(signs)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.code_table)


class RandomSign(InputInterface):
    def describe(self, m) -> dict:
        return {**super().describe(m), "seed": m.code_seed}


@pytest.fixture
def toy():
    iface = register(RandomSign(name="random_sign", summary="a seeded random +-1 table, fixed (a buffer)",
                                build=lambda m, _code: RandomSignInput(m.vocab_size, m.d_model, m.code_seed)))
    yield iface
    del INTERFACES[iface.name]


def _cfg(*overrides):
    return load_config(None, [*TINY, *overrides])


def test_the_three_interfaces_say_what_they_are():
    learned, canonical, gf2 = (INTERFACES[n] for n in ("learned", "canonical", "gf2"))
    assert learned.has_table and not learned.has_code and learned.tp_form == VOCAB_PARALLEL and learned.control
    assert learned.sharded() == {"input.embedding.weight": 0} and learned.hf_embedding is not None
    for code in (canonical, gf2):
        assert code.has_code and not code.has_table and code.tp_form == REPLICATED and code.sharded() == {}
    m = _cfg("model.input=gf2", "model.code_seed=4").model
    want = make_code("gf2", 9, seed=4)
    assert interface_of(m).describe(m) == {"input": "gf2", "bits": 9, "scale": 1.0, "A_rows": list(want.rows),
                                           "b": want.shift}
    assert interface_of(m).id_bits(m) == 9 and learned.id_bits(m) is None
    # the parameter names the registry shards are the model's own
    names = dict(GPT(_cfg("model.input=learned").model).named_parameters())
    assert sharded_dim("input.embedding.weight") == 0 and is_vocab_parameter("input.embedding.weight")
    assert all(n in names for n in learned.sharded())


def test_the_registry_refuses_a_taken_name_and_a_conflicting_shard():
    with pytest.raises(ValueError, match="already registered"):
        register(InputInterface(name="learned", summary="again", build=lambda m, c: None))
    with pytest.raises(ValueError, match="shards input.embedding.weight on dim 1 but .learned. on 0"):
        # a second table under the same name, split the other way, would make sharded_dim ambiguous
        class Other(InputInterface):
            def sharded(self):
                return {"input.embedding.weight": 1}
        register(Other(name="other", summary="x", build=lambda m, c: None, table="embedding.weight"))
    assert "other" not in INTERFACES
    with pytest.raises(ValueError, match="needs a table"):
        InputInterface(name="x", summary="x", build=lambda m, c: None, tp_form=VOCAB_PARALLEL)


def test_a_fourth_interface_is_one_entry(toy, tmp_path, monkeypatch):
    from megafixed.engine.deepspeed.model import build_model
    from megafixed.interop.hf import InteropError, choose_arch
    from megafixed.parallel import Topology
    from megafixed.run.manifest import describe
    from megafixed.run_plan import RunPlan
    from megafixed.study.plan import plan_runs

    cfg = _cfg("model.input=random_sign", "model.code_seed=3")
    canonical = _cfg("model.input=canonical").model
    # build: the module, fixed (same values on every build), +-1, no parameters; the backbone is the
    # canonical model's at the same seed (parameters draw by name)
    model = GPT(cfg.model, seed=5)
    assert isinstance(model.input, RandomSignInput) and not model.has_fixed_input and not model.has_learned_input
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    x = model.input(ids)
    assert x.shape == (2, 16, 32) and set(x.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(GPT(cfg.model, seed=5).input(ids), x)
    assert torch.isfinite(model(ids, ids))
    ref = GPT(canonical, seed=5).state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in model.state_dict().items() if not k.startswith("input."))
    # the meta-device build (what every parallel rank does) gives the same model
    single = Topology(plan=RunPlan.build(cfg, 1, gpu=False), rank=0, local_rank=0)
    built = build_model(cfg.model, single, seed=5).state_dict()
    assert all(torch.equal(v, built[k]) for k, v in model.state_dict().items())

    # parameter counts: no input parameters, the table counted as fixed buffers
    counts = count_params(cfg.model)
    assert counts.input == 0 and counts.code_buffers == 300 * 32
    assert counts.trainable == count_params(canonical).trainable
    # sharding: replicated, so TP splits exactly what it splits for the canonical code
    assert not any(sharded_dim(n) is not None for n, _ in model.input.named_parameters(prefix="input"))
    assert planner_counts(cfg.model) == planner_counts(canonical)  # what `megafixed plan` splits over TP
    sp_rank1 = RandomSignInput(300, 32, 3)
    keep_local_positions(sp_rank1, tp=2, tp_rank=1)  # its sequence-parallel form: this rank's positions
    assert torch.equal(sp_rank1(ids), x[:, 8:])

    # describe: the manifest (and ckpt inspect) record what the interface says of itself
    assert describe(cfg, {"tp": 1}, 2, 4)["code"] == {"input": "random_sign", "seed": 3}
    assert [r.interface for r in plan_runs(tmp_path, ["learned", "random_sign"], [0], [])] == ["learned",
                                                                                             "random_sign"]
    from megafixed.study.report import write_report
    runs = [{"point": "base", "interface": name, "seed": 0, "steps": 4, "trainable_params": 10, "input_params": 0,
             "final_val_loss": loss, "test_loss": loss, "test_bpb": float("nan"), "val_curve": []}
            for name, loss in (("learned", 5.0), ("random_sign", 5.25))]
    monkeypatch.setattr("megafixed.plotting.have_matplotlib", lambda: False)  # the tables are the point here
    report = write_report(tmp_path, runs, "megafixed study").read_text()
    assert f"- `random_sign`: {toy.summary}" in report and "## Differences from the learned control" in report
    assert any(line.startswith("| base | random_sign | 0.2500 |") for line in report.splitlines())
    # what it is not is refused by name: no table to tie, no code to fuse, no HF embedding
    with pytest.raises(ConfigError, match=r"tie_embeddings=true needs model\.input=learned"):
        _cfg("model.input=random_sign", "model.tie_embeddings=true")
    with pytest.raises(ConfigError, match=r"needs a fixed code \(model\.input canonical or gf2\)"):
        _cfg("model.input=random_sign", "model.fused_first_layer=true")
    with pytest.raises(InteropError, match="model.input=random_sign has no transformers embedding"):
        choose_arch(cfg.model)
