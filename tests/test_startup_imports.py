"""No process imports what it does not use, and the stand-ins that make that so match the real libraries.

Commands run in ``tests/import_probe.py`` (forked children of one interpreter: a few seconds in all); each
asserts the heavy modules its command must not load. The stand-ins are checked against what they
replace: ``run/dynamo_free.py`` against torch's own optimizer step, ``engine/deepspeed/megatron_tp.py``
against the completed megatron-core packages, ``engine/deepspeed/ops.py``'s table against DeepSpeed's probe,
``model/empty.py`` against ``Module.to_empty``.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PROBE = Path(__file__).resolve().parent / "import_probe.py"

# Loaded only by what uses them: DeepSpeed and megatron-core by the DeepSpeed engine; the compiler stack
# by train.compile; wandb by wandb.enabled; lm-eval and transformers by evaluation and HF interop.
ENGINES = ("deepspeed", "megatron")
COMPILER = ("torch._dynamo", "torch._inductor")
EXTRAS = ("wandb", "lm_eval", "transformers")
TINY = ("model.vocab_size=256 model.d_model=64 model.n_layers=2 model.n_heads=4 model.code_bits=8 "
        "model.max_seq_len=32 data.seq_len=32 data.mock=true train.max_steps=1 train.global_batch=8 "
        "train.micro_batch=4 validation.interval=0 metrics.tensorboard=false schedule.warmup_steps=0")


def probe(tmp_path: Path, cmds: list[str], env: dict | None = None) -> dict:
    out = tmp_path / "modules.json"
    proc = subprocess.run([sys.executable, str(PROBE), str(out), *cmds], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def loaded(modules: list[str], roots) -> list[str]:
    return sorted(m for m in modules if any(m == r or m.startswith(r + ".") for r in roots))


def test_help_and_dry_run_import_no_engine(tmp_path):
    from megafixed.cli import VERBS

    helps = [f"{verb} --help" for verb in VERBS]
    dry = [f"train /dev/null --dry-run {TINY}", f"train /dev/null --dry-run {TINY} train.engine=torch",
           f"train /dev/null --dry-run {TINY} parallel.tp=2 --world-size 2",
           f"train /dev/null --dry-run {TINY} parallel.tp=2 train.engine=torch --world-size 2"]
    results = probe(tmp_path, helps + dry)
    for cmd in helps + dry:
        assert results[cmd]["code"] == 0, cmd
        assert loaded(results[cmd]["modules"], ENGINES + COMPILER + EXTRAS) == [], cmd


def test_training_imports_only_its_engine(tmp_path):
    ds, native = (f"train /dev/null {TINY} train.run_dir={tmp_path / name} train.engine={name}"
                  for name in ("deepspeed", "torch"))
    results = probe(tmp_path, [ds, native])
    assert results[ds]["code"] == 0 and results[native]["code"] == 0
    # DeepSpeed without TP: no megatron-core at all, no compiler stack (train.compile is off), no wandb.
    assert "deepspeed" in results[ds]["modules"]
    assert loaded(results[ds]["modules"], ("megatron",) + COMPILER + EXTRAS) == []
    # torch.fx's symbolic shapes (sympy) came from Module.to_empty's meta path: not needed (model/empty.py).
    assert loaded(results[ds]["modules"], ("sympy",)) == []
    assert loaded(results[native]["modules"], ENGINES + ("wandb", "lm_eval", "transformers")) == []


def test_the_torch_engines_plan_and_accelerator_never_touch_deepspeed(tmp_path):
    """`megafixed plan` prepares the run's engine's environment only, and the torch engine's answer to
    ``accelerator_name`` is torch's: neither imports DeepSpeed or sets its variables (the DeepSpeed
    engine's plan does, which shows the probe sees them)."""
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("DS_ACCELERATOR", "TORCH_EXTENSIONS_DIR")}
    torch_plan, ds_plan = (f"plan /dev/null --gpus 8 {TINY} train.engine={name}" for name in ("torch", "deepspeed"))
    results = probe(tmp_path, [torch_plan, ds_plan], env=env)
    assert results[torch_plan]["code"] in (0, 1) and results[ds_plan]["code"] in (0, 1), results
    assert loaded(results[torch_plan]["modules"], ENGINES) == []
    assert not {"DS_ACCELERATOR", "TORCH_EXTENSIONS_DIR"} & set(results[torch_plan]["env_added"])
    assert {"DS_ACCELERATOR", "TORCH_EXTENSIONS_DIR"} <= set(results[ds_plan]["env_added"])
    code = ("import sys; from megafixed.engine import accelerator_name; print(accelerator_name('torch'), "
            "sorted(m for m in sys.modules if m.startswith(('deepspeed', 'megatron'))))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split(None, 1) == ["cpu", "[]\n"], proc.stdout + proc.stderr[-2000:]


MEGATRON_CHECK = """
import json, sys, torch
from megafixed.engine.deepspeed.megatron_tp import load
ns = load()
light = sorted(sys.modules)
import megatron.core, megatron.core.tensor_parallel as tp, megatron.core.jit as jit
same = [tp.ColumnParallelLinear is ns.layers.ColumnParallelLinear,
        tp.RowParallelLinear is ns.layers.RowParallelLinear,
        tp.VocabParallelEmbedding is ns.layers.VocabParallelEmbedding,
        tp.vocab_parallel_cross_entropy is ns.cross_entropy.vocab_parallel_cross_entropy,
        megatron.core.ModelParallelConfig is ns.ModelParallelConfig,
        megatron.core.parallel_state is ns.parallel_state, megatron.core.mpu is ns.parallel_state,
        jit.jit_fuser is torch.compile]
missing = {name: [n for n in sys.modules[name].__all__ if not hasattr(sys.modules[name], n)]
           for name in ("megatron.core", "megatron.core.tensor_parallel")}
from megatron.core.transformer import TransformerConfig  # completes the third deferred package
# megatron.core.utils' DTensor checks through the stand-ins, against a real DTensor (1-rank gloo world)
import megatron.core.utils as mu, torch.distributed as dist
plain_is_dtensor = isinstance(torch.zeros(1), mu.DTensor)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
dt = DTensor.from_local(torch.arange(4.0), init_device_mesh("cpu", (1,)), [Shard(0)])
dtensor = [mu.HAVE_DTENSOR, not plain_is_dtensor, isinstance(dt, mu.DTensor), isinstance(dt.placements[0], mu.Shard),
           not isinstance(torch.zeros(1), mu.DTensor), mu.to_local_if_dtensor(dt).equal(dt.to_local()),
           mu.DTensor.from_local is DTensor.from_local]
deferred = ("megatron.core", "megatron.core.tensor_parallel", "megatron.core.transformer")
print(json.dumps({"light": light, "same": same, "missing": missing, "dtensor": dtensor,
                  "leftover": [n for n in deferred if "__megafixed_deferred__" in vars(sys.modules[n])]}))
"""


def test_megatron_tp_layers_without_the_rest_of_megatron_core():
    """``load()`` gives megatron-core's own TP classes without its __init__'s imports (nor DTensor), a later
    use of the rest completes each package into exactly what ``import megatron.core`` makes, and megatron's
    DTensor checks answer through the stand-ins as through the real classes."""
    proc = subprocess.run([sys.executable, "-c", MEGATRON_CHECK], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert loaded(got["light"], COMPILER + ("wandb", "megatron.core.distributed", "megatron.core.inference",
                                            "megatron.core.transformer.transformer_config",
                                            "torch.distributed.tensor", "sympy")) == []
    assert all(got["same"]), got["same"]
    assert all(got["dtensor"]), got["dtensor"]
    assert got["missing"] == {"megatron.core": [], "megatron.core.tensor_parallel": []}
    assert got["leftover"] == []


def test_compile_on_first_call_defers_the_decorator():
    from megafixed.engine.deepspeed.megatron_tp import _compile_on_first_call

    applied = []

    def decorator(fn):
        applied.append(fn)
        return lambda x: fn(x) * 10

    def f(x):
        return x + 1
    g = _compile_on_first_call(decorator)(f)
    assert applied == [] and g.__wrapped__ is f and g.__name__ == "f"
    assert g(1) == 20 and g(2) == 30 and applied == [f]  # applied once, at the first call


DYNAMO_CHECK = """
import copy, json, sys, torch
from megafixed.run.dynamo_free import DEFERRED_METHODS, defer_dynamo_disable, unwrapped_step
from megafixed.run.optim import SkippableAdamW
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))
twin = copy.deepcopy(model)
grads = [[torch.randn_like(p) for p in model.parameters()] for _ in range(3)]
def steps(opt, params):
    for g in grads:
        opt.zero_grad()
        for p, gp in zip(params, g):
            p.grad = gp.clone()
        opt.step()
    opt.load_state_dict(opt.state_dict())
groups = lambda m: [{"params": list(m[0].parameters()), "weight_decay": 0.1}, {"params": list(m[1:].parameters()),
                                                                              "weight_decay": 0.0}]
ours = SkippableAdamW(groups(model), lr=1e-2)
steps(ours, list(model.parameters()))
free = "torch._dynamo" not in sys.modules
recognised = [defer_dynamo_disable(), unwrapped_step(torch.optim.AdamW.step) is not None]
ref = torch.optim.AdamW(groups(twin), lr=1e-2)  # torch's own wrappers (they import torch._dynamo)
steps(ref, list(twin.parameters()))
equal = all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
moments = all(torch.equal(ours.state[a][k], ref.state[b][k]) for a, b in zip(model.parameters(), twin.parameters())
              for k in ("exp_avg", "exp_avg_sq", "step"))
ours.zero_grad()  # torch._dynamo is imported now: the deferred disable hands over to the real one
fn = torch.optim.Optimizer.zero_grad.__wrapped__
handed = not getattr(fn.__dynamo_disable, "megafixed_until_dynamo", False)
print(json.dumps({"free": free, "recognised": recognised, "equal": equal, "moments": moments, "handed": handed,
                  "all": list(DEFERRED_METHODS)}))
"""


def test_optimizer_without_dynamo_matches_torch():
    """SkippableAdamW steps, zeroes, saves and loads without importing torch._dynamo, bit for bit as torch's
    AdamW with its own wrappers; the wrappers are recognised on this torch (else the stand-ins have drifted)."""
    proc = subprocess.run([sys.executable, "-c", DYNAMO_CHECK], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["free"], "torch._dynamo was imported by the optimizer"
    assert got["recognised"] == [got["all"], True]
    assert got["equal"] and got["moments"]
    assert got["handed"]


def test_to_empty_matches_module_to_empty():
    from megafixed.config import ModelConfig
    from megafixed.model.empty import to_empty
    from megafixed.model.gpt import meta_gpt

    cfg = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, code_bits=8, max_seq_len=32)
    ours, ref = meta_gpt(cfg), meta_gpt(cfg)
    to_empty(ours, torch.device("cpu"))
    ref.to_empty(device=torch.device("cpu"))
    a, b = dict(ours.named_parameters()), dict(ref.named_parameters())
    a.update({f"buffer:{n}": t for n, t in ours.named_buffers()})
    b.update({f"buffer:{n}": t for n, t in ref.named_buffers()})
    assert a.keys() == b.keys()
    for name in a:
        x, y = a[name], b[name]
        assert (type(x), x.shape, x.stride(), x.dtype, x.device, x.requires_grad) == \
            (type(y), y.shape, y.stride(), y.dtype, y.device, y.requires_grad), name


def test_bench_startup_writes_ratios_against_import_torch_measured_in_the_same_run(tmp_path, capsys):
    import argparse

    from megafixed.bench import startup
    from megafixed.config import ConfigError

    p = argparse.ArgumentParser()
    startup.add_arguments(p)
    out = tmp_path / "s.json"
    assert startup.run(p.parse_args(["--cases", "import_torch", "--rounds", "1", "--json", str(out)])) == 0
    r = json.loads(out.read_text())
    base = r["cases"]["import_torch"]
    assert r["baseline"] == "import_torch" and r["rounds"] == 1 and len(base["wall_s"]) == len(base["cpu_s"]) == 1
    assert base["ratio_wall"] == base["ratio_cpu"] == 1.0 and base["median_cpu_s"] > 0
    assert len(r["loadavg_before"]) == len(r["loadavg_after"]) == 3
    assert "import_torch" in capsys.readouterr().out
    # every case runs the real CLI: one process, or torchrun with the ranks it names
    for case, (ranks, extra) in startup.CASES.items():
        cmd = startup.command(case, tmp_path / case)
        assert cmd[0] == sys.executable and all(e in cmd for e in extra)
        assert (f"--nproc-per-node={ranks}" in cmd) == (ranks > 1) and ("megafixed.cli" in cmd) == (ranks > 0)
    with pytest.raises(ConfigError, match="unknown case 'nope'"):
        startup.run(p.parse_args(["--cases", "nope"]))
    with pytest.raises(ConfigError, match="--rounds 0"):
        startup.run(p.parse_args(["--rounds", "0"]))


FAKE_RUN = r"""
import sys
world = int(sys.argv[1])
print(f"megafixed: rank 0 of {world} on host: rendezvous at 127.0.0.1:1 (waits up to 120s, MEGAFIXED_RDZV_TIMEOUT)")
for line in ("cpu threads: 1 intra-op", "training gf2 interface: 4 steps", "step 1/4 | loss 5.5",
             "warning (%d of %d ranks): lib.py:3: UserWarning: once" % (world // 2, world), "step 2/4 | loss 5.4",
             "done: 4 steps"):
    print(line, flush=True)
"""


class _LineClock:
    """``perf_counter`` for the benchmark: one second per reading (a reading per line, and the start and end),
    so the phases are the stand-in's line counts, whatever the machine's speed."""

    def __init__(self):
        self.t = -1.0

    def perf_counter(self):
        self.t += 1.0
        return self.t


def test_bench_startup_by_world_size_times_each_phase_from_its_log_line(tmp_path, monkeypatch, capsys):
    """``--world``'s arithmetic and report on a stand-in run (the real one is a benchmark, docs/benchmarks.md):
    the phases split the wall time at rank 0's lines, the log's length and warning lines are counted, and
    the ratios are against the smallest world of the same run."""
    import argparse

    from megafixed.bench import startup, startup_world
    from megafixed.config import ConfigError

    assert startup_world.layout(32, "3d") == (2, 2, 8) and startup_world.layout(2, "3d") == (1, 1, 2)
    cmd = startup_world.command(8, "3d", tmp_path / "run", 12345)
    assert cmd[cmd.index("-m") + 1] == "torch.distributed.run" and "--nproc-per-node=8" in cmd
    assert {"parallel.tp=2", "parallel.pp=2", "train.global_batch=4", "train.engine=torch"} <= set(cmd)
    monkeypatch.setattr(startup_world, "command",
                        lambda world, kind, run_dir, port: [sys.executable, "-c", FAKE_RUN, str(world)])
    monkeypatch.setattr(startup_world, "time", _LineClock())
    p = argparse.ArgumentParser()
    startup.add_arguments(p)
    out = tmp_path / "w.json"
    assert startup.run(p.parse_args(["--world", "8,2", "--rounds", "1", "--json", str(out)])) == 0
    r = json.loads(out.read_text())
    assert r["baseline_world"] == 2 and list(r["worlds"]) == ["2", "8"]
    eight = r["worlds"]["8"]
    assert set(eight["phases_s"]) == {"imports", "rendezvous", "build", "first_step", "rest", "exit"}
    assert sum(eight["phases_s"].values()) == pytest.approx(eight["wall_s"], abs=0.01)
    assert eight["phases_s"] == {"imports": 1, "rendezvous": 1, "build": 1, "first_step": 1, "rest": 3, "exit": 1}
    assert (eight["log_lines"], eight["warning_lines"], eight["per_rank_lines"]) == (7, 1, 0)
    assert eight["ratio_to_smallest"]["world"] == 4.0 and r["worlds"]["2"]["ratio_to_smallest"]["wall"] == 1.0
    assert "world" in capsys.readouterr().out
    for bad in ("1,2", "two"):
        with pytest.raises(ConfigError, match="--world"):
            startup.run(p.parse_args(["--world", bad]))


KEPT_PATCHES = ("megafixed.run.dynamo_free", "megafixed.engine.deepspeed.muon",
                "megafixed.engine.deepspeed.megatron_tp", "megafixed.engine.deepspeed.ops",
                "megafixed.data.gigatoken_arrays")


@pytest.mark.parametrize("module", KEPT_PATCHES)
def test_kept_patches_name_the_installed_versions(module):
    """Each patch of a library's internals that start-up keeps (it saves over a CPU-second per rank with no
    public route) was written against one minor version of that library: another one fails here, so the
    patch is re-checked (or dropped) before it can change behaviour or quietly stop saving anything."""
    import importlib
    from importlib.metadata import version

    dist, written = importlib.import_module(module).WRITTEN_AGAINST
    installed = version(dist)
    minor = lambda v: v.split("+")[0].split(".")[:2]  # noqa: E731
    assert minor(installed) == minor(written), (
        f"{module} patches {dist} {written}'s internals, and {dist} {installed} is installed: re-check it "
        f"against the new version (its docstring names what it relies on), then update WRITTEN_AGAINST")

