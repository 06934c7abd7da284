"""The torch engine as the engine registry asks it (``megafixed.engine.protocols.EngineKind``), and its part
of the run plan. Light: each method imports what it needs when called (DCP, FSDP2 only then)."""
from __future__ import annotations

from dataclasses import dataclass

from ...engines import register


@dataclass(frozen=True)
class TorchPlan:
    """The torch engine's part of a ``RunPlan`` (``plan.engine_plan``)."""
    dp_replicate: int  # torch_engine.dp_replicate: HSDP's replicate degree (1 = FSDP over all of dp)
    reshard_after_forward: bool  # torch_engine.reshard_after_forward
    # its pipeline (parallel.pp > 1): torch.distributed.pipelining's schedule, stages per rank, the split
    pp_schedule: str = "1F1B"  # parallel.pp_schedule
    vpp: int = 1  # parallel.vpp
    pp_input_head_layers: int = 1  # parallel.pp_input_head_layers
    start_words: str = "torch engine"  # what shards the state, in the trainer's start line (``_start_words``)
    float8: str = "off"  # train.float8: the backbone's Linears in float8 (float8.py)
    float8_words: str = ""  # ", float8 tensorwise (emulated)": the start line's and --dry-run's mention of it


class TorchKind:
    """torch-native: FSDP2/HSDP, DTensor TP/SP, torch.distributed.pipelining, torch.distributed.checkpoint."""

    name = "torch"
    record_file = "torch_engine.json"
    config_title = "torch engine"  # what --dry-run calls its config
    # --dry-run's words, formatted with its config record
    dry_run_words = ("engine torch, {data_parallel[mode]} (dp_replicate {data_parallel[replicate_degree]} x dp_shard "
                     "{data_parallel[shard_degree]}){plan.float8_words}")
    default = False

    @property
    def checkpoint(self):
        from . import checkpoint_format

        return checkpoint_format

    @property
    def planner(self):
        from . import planner

        return planner

    def make_plan(self, cfg, dp: int, device: str = "cpu") -> TorchPlan:
        t, p = cfg.torch_engine, cfg.parallel
        return TorchPlan(dp_replicate=t.dp_replicate, reshard_after_forward=t.reshard_after_forward,
                         pp_schedule=p.pp_schedule, vpp=p.vpp, pp_input_head_layers=p.pp_input_head_layers,
                         float8=cfg.train.float8, float8_words=_float8_words(cfg.train.float8, device),
                         start_words=_start_words(dp, t.dp_replicate) + _float8_words(cfg.train.float8, device))

    def check_supported(self, cfg, plan) -> None:
        from .support import check_supported

        check_supported(cfg, plan)

    def relayout_refusal(self, old: dict, new: dict):
        from .checkpoint import relayout_refusal

        return relayout_refusal(old, new)

    def setup_groups(self, plan) -> dict:
        """One DeviceMesh in the plan's rank order, and its groups (no megatron-core on this path)."""
        from .mesh import build_mesh, mesh_groups

        return mesh_groups(build_mesh(plan, plan.engine_plan.dp_replicate))

    def build(self, cfg, topo, hook=None):
        from .build import build

        return build(cfg, topo, hook)

    def engine_config(self, cfg, plan) -> dict:
        from .config import engine_config

        return engine_config(cfg, plan)

    def prepare_runtime_env(self) -> None:
        """Nothing to set before torch: it has no accelerator to pick at import, and no library outside
        torch whose version to check (DeepSpeed's check is DeepSpeed's)."""

    def accelerator_name(self) -> str:
        """The device the engine runs on: torch's own (no library picks one at import)."""
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def dry_run_lines(self, cfg, plan) -> list:
        """Under float8: which Linears (float8.py); under PP: the schedule, its bubble and each stage's
        in-flight activation memory (``pipeline_plan.py``)."""
        lines = []
        if plan.engine_plan.float8 != "off":
            from .float8 import dry_run_line

            lines.append(dry_run_line(cfg, plan))
        if plan.pp == 1:
            return lines
        from ...parallel.memory import GiB, estimate
        from .planner import make_layout

        b = plan.batch
        layout = make_layout(cfg, plan.tp, plan.pp, plan.dp, plan.engine_plan.dp_replicate, b.micro_batch,
                             plan.sequence_parallel, "parameters")
        pipe = estimate(cfg.model, b.seq_len, layout, plan.precision).pipeline
        acts = ", ".join(f"stage {k}: {pipe['in_flight_per_stage'][k]} in flight, {v / GiB:.3f} GiB"
                         for k, v in pipe["activation_bytes_per_stage"].items())
        return lines + [
            f"# pipeline: {pipe['schedule']}, {plan.pp} ranks x {pipe['vpp']} stages, {b.accum} microbatches; "
            f"bubble {pipe['bubble_fraction']:.3f} from its action table ((p-1)/(v*m) = "
            f"{pipe['bubble_formula']:.3f}); activations {acts}"]

    def record_layout(self, plan) -> dict:
        """None of its own keys: it does not read ``zero.*`` (FSDP2 shards by the DP degree), so a record
        of it must not claim a stage."""
        return {}

    def layout_change_keys(self, plan, recorded: dict) -> list:
        """FSDP2 shards parameters and optimizer state over the DP ranks, so every DP/TP change is a
        re-layout, which DCP's resharding does on load."""
        return ["tp", "pp", "dp", "precision"]


def _start_words(dp: int, replicate: int) -> str:
    """``torch engine, FSDP2 over dp 2`` / ``HSDP 2 x 2``: what shards the state."""
    if dp == 1:
        return "torch engine"
    if replicate == 1:
        return f"torch engine, FSDP2 over dp {dp}"
    return f"torch engine, HSDP {replicate} x {dp // replicate}"


def _float8_words(recipe: str, device: str) -> str:
    return "" if recipe == "off" else f", float8 {recipe}" + ("" if device == "cuda" else " (emulated)")


register(TorchKind())
