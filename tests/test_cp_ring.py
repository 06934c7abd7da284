"""Ring attention (``parallel.cp_method=ring``, ``megafixed/engine/native/ring.py``): what runs without CUDA.

torch's ring kernels take only CUDA SDPA (the GPU check's ``cp_ring`` stage compares CP2 ring with CP1
there). Here, in one process with torch's fake process group standing in for each rank of a cp world:

* the refusal on CPU is one line naming ``parallel.cp_method=ulysses`` (and CUDA plans pass it);
* ``ring_context`` hands each rank the positions of torch's causal load balancer (``_HeadTailLoadBalancer``:
  chunks ``r`` and ``2cp-1-r`` of ``2cp``), its inputs, labels and RoPE rows all at those positions, every
  position on exactly one rank; contiguous slices when the sequence does not split into ``2cp`` chunks;
  and on exit the caller's tensors, the RoPE tables and SDPA are as they were;
* under it the model's attention reaches SDPA as torch's ring dispatch needs it: q/k/v DTensors sharded on
  the sequence dimension over the cp mesh, ``is_causal`` and no mask, forward and backward;
* CP2 under ``ring_context`` equals one process (loss, gradient norm) with SDPA emulating the ring by a
  gather and a mask of the balancer's positions (``cp_ring_worker.py``: the stage's own comparison, one
  torchrun launch, Ulysses too); the stage's launch and read-back.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megafixed.config import load_config
from megafixed.engine.native.ring import ring_context
from megafixed.model.config import ModelConfig
from megafixed.model.gpt import GPT
from megafixed.parallel.layout import LayoutError
from megafixed.run_plan import RunPlan

ROOT = Path(__file__).resolve().parent.parent
TINY = ["model.vocab_size=256", "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.code_bits=8",
        "model.max_seq_len=32", "data.seq_len=32", "train.global_batch=8", "train.micro_batch=2",
        "train.engine=torch", "parallel.cp=2", "parallel.cp_method=ring"]


def test_ring_is_refused_on_cpu_in_one_line_naming_ulysses():
    cfg = load_config(None, TINY)
    with pytest.raises(LayoutError) as err:
        RunPlan.build(cfg, 2, gpu=False)
    msg = str(err.value)
    assert "\n" not in msg and "parallel.cp_method=ulysses" in msg and "parallel.cp_method=ring" in msg
    plan = RunPlan.build(cfg, 2, gpu=True)  # the same layout planned for CUDA GPUs passes it
    assert (plan.cp, plan.cp_method, plan.dp) == (2, "ring", 1)


def test_ring_in_compiled_blocks_is_refused_until_a_gpu_check_has_run_it():
    from megafixed.config import ConfigError

    with pytest.raises(ConfigError) as err:
        RunPlan.build(load_config(None, [*TINY, "train.compile=true"]), 2, gpu=True)
    msg = str(err.value)
    assert "\n" not in msg and "train.compile=false" in msg and "parallel.cp_method=ulysses" in msg
    RunPlan.build(load_config(None, [*TINY, "train.compile=true", "parallel.cp_method=ulysses"]), 2, gpu=True)


@pytest.fixture
def ran_alone(request) -> bool:
    """True when this test ran, and passed, in a fresh pytest process instead of this one: an earlier
    in-process run on this worker left its default process group, which later tests of that worker still
    use, and torch's fake group needs the default slot."""
    if not dist.is_initialized():
        return False
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                           request.node.nodeid], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and " passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]
    return True


@contextmanager
def fake_rank(rank: int, world: int):
    """This process as rank ``rank`` of ``world`` (torch's fake process group: no peer, no traffic) and
    the 1-D cp mesh over all of them."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield DeviceMesh("cpu", list(range(world)), mesh_dim_names=("cp",))
    finally:
        dist.destroy_process_group()


def head_tail(seq: int, rank: int, cp: int) -> list:
    """Positions of rank ``rank``: chunks ``rank`` and ``2cp-1-rank`` of ``2cp`` (contiguous when they don't split)."""
    if seq % (2 * cp):
        n = seq // cp
        return list(range(rank * n, (rank + 1) * n))
    k = seq // (2 * cp)
    return list(range(rank * k, (rank + 1) * k)) + list(range((2 * cp - 1 - rank) * k, (2 * cp - rank) * k))


def tiny_gpt(**fields) -> GPT:
    cfg = ModelConfig(**{"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                         "max_seq_len": 40, "input": "learned", **fields})
    return GPT(cfg, seed=1)


@pytest.mark.parametrize("seq,cp", [(16, 2), (24, 4), (18, 2)])
def test_each_rank_holds_torchs_load_balanced_positions_with_their_inputs_labels_and_rope_rows(seq, cp, ran_alone):
    if ran_alone:
        return
    from torch.distributed.tensor.experimental._attention import _HeadTailLoadBalancer

    model = tiny_gpt()
    cpu = torch.device("cpu")
    tokens = torch.randint(0, 64, (3, seq + 1), generator=torch.Generator().manual_seed(0))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]  # overlapping views, as split_tokens hands them
    before = tokens.clone()
    cos, sin = (t.clone() for t in model.rotary.table(cpu))
    tables = model.rotary.tables[str(cpu)]
    sdpa = F.scaled_dot_product_attention
    balanced = seq % (2 * cp) == 0
    order = _HeadTailLoadBalancer(seq, cp, cpu)._generate_indices()[0].view(cp, -1) if balanced else None
    seen = []
    for rank in range(cp):
        with fake_rank(rank, cp) as mesh, ring_context(mesh, model, inputs, labels) as shard:
            want = head_tail(seq, rank, cp)
            if balanced:
                assert order[rank].tolist() == want  # torch's balancer is the head-tail order
            assert shard.positions.tolist() == [want] * 3
            assert torch.equal(shard.inputs, inputs[:, want]) and torch.equal(shard.labels, labels[:, want])
            rc, rs = model.rotary(seq // cp, cpu)  # what GPT.forward asks for this rank's tokens
            assert torch.equal(rc, cos[want]) and torch.equal(rs, sin[want])
            assert F.scaled_dot_product_attention is not sdpa  # torch's ring wrapper, for the context only
            seen += want
        assert F.scaled_dot_product_attention is sdpa
        assert model.rotary.tables[str(cpu)] is tables and torch.equal(tokens, before)
    assert sorted(seen) == list(range(seq))  # every position on exactly one rank


def test_the_engines_batch_context_is_the_ring_only_under_cp_method_ring(ran_alone):
    if ran_alone:
        return
    from types import SimpleNamespace

    from megafixed.engine.native.ring import batch_context

    model = tiny_gpt()
    inputs, labels = torch.zeros(1, 8, dtype=torch.long), torch.ones(1, 8, dtype=torch.long)
    with fake_rank(1, 2) as mesh:
        for cp, method in ((1, "ring"), (2, "ulysses")):
            topo = SimpleNamespace(cp=cp, plan=SimpleNamespace(cp_method=method), mesh={"cp": mesh})
            with batch_context(topo)(model, inputs, labels) as shard:
                assert shard.inputs is inputs and shard.labels is labels and shard.positions is None
        topo = SimpleNamespace(cp=2, plan=SimpleNamespace(cp_method="ring"), mesh={"cp": mesh})
        with batch_context(topo)(model, inputs, labels) as shard:
            assert shard.positions.tolist() == [[2, 3, 4, 5]] and shard.inputs.shape == (1, 4)


def test_under_ring_the_models_attention_reaches_sdpa_as_torchs_ring_dispatch_needs_it(monkeypatch, ran_alone):
    if ran_alone:
        return
    """torch wraps whatever SDPA is when the context opens: a stand-in there sees the arguments its ring
    dispatch gets (and answers with local attention, so forward and backward complete on CPU)."""
    from torch.distributed.tensor import DTensor, Shard

    calls = []
    plain = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        calls.append((q, k, v, attn_mask, is_causal))
        out = plain(q.to_local(), k.to_local(), v.to_local(), attn_mask=attn_mask, dropout_p=dropout_p,
                    is_causal=is_causal, **kw)
        return DTensor.from_local(out, q.device_mesh, q.placements, run_check=False)

    spy.__name__ = plain.__name__  # torch puts its wrapper back under the name of what it wraps
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    model = tiny_gpt(input="gf2", code_bits=6, fused_first_layer=True)
    model.activation_checkpointing = True  # the backward's recomputation calls it again, inside the context
    tokens = torch.randint(0, 64, (2, 33), generator=torch.Generator().manual_seed(1))
    with fake_rank(1, 2) as mesh, ring_context(mesh, model, tokens[:, :-1], tokens[:, 1:]) as shard:
        loss = model(shard.inputs, shard.labels)
        loss.backward()
    assert len(calls) == 2 * model.cfg.n_layers  # each layer's forward, and again in the recomputation
    for q, k, v, mask, causal in calls:
        assert mask is None and causal is True
        for t in (q, k, v):
            assert isinstance(t, DTensor) and t.placements == (Shard(2),) and t.device_mesh is mesh
            assert t.shape[2] == 32 and t.to_local().shape[2] == 16  # [B, heads, T, hd]: all T, this rank's T/2
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.multiprocess
def test_cp2_under_ring_context_equals_one_process_on_cpu_with_an_emulated_ring(torchrun, tmp_path):
    """One torchrun launch (2 gloo ranks, tests/cp_ring_worker.py): the GPU stage's comparison, with Ulysses
    and with ``ring_context`` around an emulated ring (SDPA by gather and mask; torch's sharding, wrapper and
    dispatch as on CUDA): loss and gradient norm equal one process's (1e-5 fp32, 1e-3 bf16), balanced and not,
    the fused first layer under activation checkpointing."""
    out = tmp_path / "out.json"
    torchrun(2, [str(ROOT / "tests" / "cp_ring_worker.py"), str(out)], timeout=600)
    res = json.loads(out.read_text())
    for method, cases in (("ulysses", ["fp32"]), ("ring", ["fp32", "fp32_unbalanced", "bf16_gf2_fused_ac"])):
        results, failures = res[method]
        assert failures == [] and [c["case"] for c in results] == cases, (method, failures)
        for c in results:
            assert c["ok"] and c["loss_rel"] <= c["tolerance"] and c["grad_norm_rel"] <= c["tolerance"], (method, c)
            if c["dtype"] == "fp32":
                assert c["max_grad_rel_err"] <= 1e-4, (method, c)


def test_the_stage_launches_two_processes_and_reports_their_comparison(tmp_path, monkeypatch):
    """``gpu_stages.cp_ring``'s wiring, without the launch: the torchrun command, and a result read back (or,
    with none written, the launch's output named)."""
    from megafixed.bench import gpu_stages

    launched = []

    class FakeLaunch:
        def __init__(self, cmd, **_kw):
            launched.append(cmd)
            self.returncode = 0 if write else 1
            if write:
                (tmp_path / "cp_ring.json").write_text(json.dumps(
                    {"failures": [], "summary": {"ok": True}, "cases": [{"case": "fp32", "ok": True}]}))

        def communicate(self, timeout=None):
            return ("worker output" if write else "Traceback ... NCCL error"), None

    monkeypatch.setattr(gpu_stages.subprocess, "Popen", FakeLaunch)
    write = True
    res = gpu_stages.cp_ring(tmp_path)
    (cmd,) = launched
    assert cmd[1:] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
                       "megafixed.bench.gpu_cp_ring", str(tmp_path), "--method", "ring", "--device", "cuda"]
    assert res["summary"]["ok"] and res["cases"] == [{"case": "fp32", "ok": True}]
    write = False
    res = gpu_stages.cp_ring(tmp_path)
    assert not res["summary"]["ok"] and "exited 1 without a result" in res["failures"][0]
    assert "NCCL error" in res["failures"][0]
