"""The plan knows context parallelism: its rows, its traffic on the ``cp`` axis, and a ranking that
chooses cp where data parallelism runs out (the measured side is tests/test_fake_measure.py's CP row)."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from megafixed.config import load_config

ROOT = Path(__file__).resolve().parents[1]
LONG = str(ROOT / "examples" / "configs" / "paper-1.7b-canonical-16k.yaml")
LINKS = SimpleNamespace(gpu_type="H100 80GB HBM3", gpus_per_node=8, inter="ib-ndr400")
BUDGET = 80 * 2 ** 30


def _rows(overrides: list):
    from megafixed.plan.rows import plan_rows

    cfg = load_config(LONG, ["train.engine=torch", *overrides])
    return cfg, plan_rows(cfg, 64, BUDGET, "bf16", LINKS)


def test_the_plan_picks_the_16k_configs_cp_and_cp_2_at_32k_where_64_ranks_outrun_32_sequences():
    from megafixed.plan.rank import overrides_of

    cfg, rows = _rows([])
    first = rows[0].layout
    assert first.cp == cfg.parallel.cp == 1 and rows[0].total <= BUDGET  # the example config says what the plan says
    assert any(r.layout.cp > 1 and r.total <= BUDGET for r in rows)  # cp rows are there, ranked after
    cfg, rows = _rows(["data.seq_len=32768", "model.max_seq_len=32768", "train.global_batch=32"])
    first = rows[0].layout
    # 32 sequences feed at most 32 data-parallel ranks: the other factor 2 is cp (all-to-alls inside the node)
    # or tp (all-reduces of whole activations); cp's cost less
    assert (first.cp, first.tp, first.dp) == (2, 1, 32)
    assert "parallel.cp=2" in overrides_of(first, "bf16", "bf16")
    best_tp = next(r for r in rows if r.layout.cp == 1 and r.total <= BUDGET)
    assert best_tp.layout.tp * best_tp.layout.pp > 1
    assert rows[0].step_time["step_s_lower_bound"] < best_tp.step_time["step_s_lower_bound"]
    # an activation per rank is of seq/cp positions: the cp 2 row holds what a cp 1 row of half the sequence does
    from dataclasses import replace

    from megafixed.parallel.memory import estimate
    half = estimate(cfg.model, 16384, replace(first, cp=1, dp=64), "bf16")
    assert rows[0].estimate.activations == half.activations and rows[0].estimate.optimizer == half.optimizer


def _layout(**kw):
    from megafixed.parallel.memory import Layout

    return Layout(**{"engine": "torch", "micro_batch": 2, "accum": 3, **kw})


@pytest.mark.parametrize("kv,ac", [(4, False), (2, True), (1, False)])
def test_ulysses_moves_four_tensors_a_layer_each_way_and_ring_passes_key_value_blocks(kv, ac):
    from megafixed.parallel.traffic import traffic

    m = load_config(None, [f"model.n_kv_heads={kv}"]).model  # 4 heads of 32, 2 layers
    b, s, hd, layers, accum, cp, e = 2, m.max_seq_len, m.head_dim, m.n_layers, 3, 2, 2
    local = b * (s // cp) * hd * e  # one head of [b, s/cp, heads, hd] on one rank
    kv_sent = kv if kv % cp == 0 else m.n_heads  # repeated to the query heads when they do not split
    per_layer = (2 * m.n_heads + 2 * kv_sent) * local  # q and the output; k and v
    t = traffic(m, s, _layout(cp=cp, activation_checkpointing=ac), "bf16")
    assert t.bytes[("cp", "all_to_all")] == accum * layers * per_layer * (3 if ac else 2)  # the recompute's too
    ring = traffic(m, s, _layout(cp=4, cp_method="ring"), "bf16")
    block = 2 * kv * b * (s // 4) * hd * e  # this rank's K and V
    assert ring.bytes[("cp", "p2p")] == accum * layers * 3 * block * 3  # 3 passes: K/V, again, and dK/dV
    assert ("cp", "all_to_all") not in ring.bytes and ring.group["cp"] == 4
