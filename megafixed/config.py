"""Typed run configuration: dataclasses, YAML files, dotted command-line overrides, strict checks.

A run config is a tree of small dataclasses (one per concern). ``load_config(path, overrides)``
reads YAML, applies ``section.key=value`` overrides (values parsed as YAML, so ``true``, ``3e-4``
and ``[a, b]`` work), and validates types. An unknown key anywhere is an error that names it and
lists the valid keys. A config file may ``include:`` other files (GPT-NeoX style composition:
model file + cluster file + overrides); later files win.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

import yaml

from .config_checks import check_ranges, require_at_least
from .errors import ConfigError  # noqa: F401 -- re-exported: callers import it from megafixed.config
from .model.config import ModelConfig  # noqa: F401 -- the model section; it lives with the model


# ----------------------------------------------------------------------------------- sections
@dataclass
class DataConfig:
    tokenizer: Optional[str] = None  # .model / tokenizer.json / GPT-2 dir; None -> from the shards
    prefixes: list = field(default_factory=list)  # Megatron .bin/.idx prefixes, or PREFIX.manifest.json files
    weights: Optional[list] = None  # blend weights, one per prefix; None -> proportional to size
    seq_len: int = 1024
    split: str = "98,1,1"  # train, valid, test shares of documents
    cache_dir: Optional[str] = None  # sample-index cache; None -> next to the data
    # Raw corpus to tokenize on first use (the main job's bundled corpus); writes `prefixes[0]`.
    source: Optional[str] = None
    source_json_key: str = "text"
    tokenizer_train_vocab: int = 4096  # used when `tokenizer` is to be trained from `source`
    num_workers: int = 0
    # Synthetic tokens (megafixed.data.mock; Megatron's --mock-data): no tokenizer, shards or
    # source needed, for throughput runs (`megafixed bench train`). Uniform over model.vocab_size.
    mock: bool = False
    # Steps whose batches are consumed without training, as numbered in the logs: "5-6,900-1200"
    # (Megatron's --iterations-to-skip). A rollback adds its window in <run_dir>/faults/skipped_steps.json.
    skip_steps: list = field(default_factory=list)

    def validate(self) -> None:
        from .step_ranges import parse

        parse(self.skip_steps, error=ConfigError)
        split_shares(self.split)
        check_blend_weights(self.weights, len(self.prefixes))
        if self.seq_len < 1:
            raise ConfigError(f"data.seq_len must be >= 1, got {self.seq_len}")


def split_shares(split, error: type = ConfigError) -> list[float]:
    """The train/valid/test shares ``data.split`` names (``'98,1,1'``), unnormalised. The one check
    of the key: the config's validation and the dataset builder (which may get a plain namespace)
    both call it; ``error``: the ConfigError subclass to raise (the data pipeline's DataError)."""
    try:
        shares = [float(p) for p in str(split).split(",")]
    except ValueError:
        raise error(f"data.split={split!r} must be comma-separated numbers like '98,1,1'") from None
    if len(shares) != 3 or any(s < 0 for s in shares) or sum(shares) <= 0:
        raise error(f"data.split={split!r} must be three non-negative shares, e.g. '98,1,1'")
    return shares


def check_blend_weights(weights, n_prefixes: int, error: type = ConfigError) -> None:
    """``data.weights``: None (blend by size) or one non-negative weight per prefix, with a positive
    sum. The one check of the key (see :func:`split_shares`)."""
    if weights is None:
        return
    if len(weights) != n_prefixes:
        raise error(f"data.weights has {len(weights)} entries but data.prefixes has {n_prefixes}; give one "
                    f"weight per prefix")
    for i, w in enumerate(weights):
        if float(w) < 0:
            raise error(f"data.weights[{i}]={w} must be >= 0 (blend weights are non-negative shares)")
    if sum(float(w) for w in weights) <= 0:
        raise error(f"data.weights={list(weights)} sum to 0; give at least one prefix a positive weight")


@dataclass
class OptimizerConfig:
    lr: float = 3e-4
    min_lr: float = 3e-5
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    embedding_weight_decay: bool = False  # decay a learned input table too (default: no)


@dataclass
class ScheduleConfig:
    kind: Literal["cosine", "wsd", "constant", "linear"] = "cosine"
    warmup_steps: int = 0
    decay_steps: Optional[int] = None  # None -> train.max_steps
    wsd_decay_fraction: float = 0.2  # WSD: share of steps spent in the final decay


@dataclass
class TrainConfig:
    """The loop itself; every other concern of a run has its own section (guard, checkpoint, ...)."""
    max_steps: int = 1000
    global_batch: int = 8  # sequences per optimizer step, across all data-parallel ranks
    micro_batch: int = 8  # sequences per forward/backward on one rank
    run_dir: str = "runs/default"
    # An existing run_dir (or a checkpoint in it) owned by another user or writable by group/others is
    # refused before anything is read (ssh's rule); true: read it knowingly, e.g. a group-shared
    # directory whose members you trust (docs/security.md). Also for train.init_from's source.
    trust_run_dir: bool = False
    seed: int = 1234
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    activation_checkpointing: bool = False
    compile: bool = False  # torch.compile each block in place (both engines)
    # The training engine: a name in the engine registry (megafixed.engines: DeepSpeed, the default,
    # whose keys are zero.*; or the torch-native one, torch_engine.*). The default is spelt here
    # because a dataclass default cannot ask the registry; Config.validate checks it against it.
    engine: str = "deepspeed"
    # CPU intra-op threads per process; 0: OMP_NUM_THREADS if set, else this process's share of the
    # usable cores (megafixed/threads.py). Printed once at the start of the run.
    threads: int = 0
    # Start a new run from these weights (module only, at step 0; Adam moments start fresh): a run
    # directory, its checkpoints folder or a tag directory, of any TP/PP layout -- e.g. the output of
    # `megafixed import hf`. Ignored once the run has its own checkpoint (it then resumes from that).
    init_from: Optional[str] = None
    # The backbone's Linears in float8 (torchao; train.engine=torch only): off, tensorwise (one scale per
    # tensor; FSDP2 all-gathers float8 weights on CUDA) or rowwise (a scale per row, more accurate).
    # Emulated off CUDA. megafixed/engine/native/float8.py says which Linears; docs/float8.md.
    float8: Literal["off", "tensorwise", "rowwise"] = "off"

    def validate(self) -> None:
        require_at_least("train", self, 1, ("global_batch", "micro_batch"))
        require_at_least("train", self, 0, ("max_steps",))


@dataclass
class GuardConfig:
    """The bad-step guard (``train/callbacks/guard/``): a non-finite loss or gradient norm, or a
    spike -- a value beyond spike_sigma standard deviations above the mean of the last spike_window good
    steps (no verdict before the window is full). stop; skip (drop the update, count the batch as
    consumed); rollback (reload the newest verified checkpoint before the bad step, skip the data from it
    to the bad step + rollback_skip, go on; after max_rollbacks rollbacks, stop)."""
    on_nonfinite: Literal["stop", "skip", "rollback"] = "stop"
    on_spike: Literal["stop", "skip", "rollback"] = "skip"
    spike_sigma: float = 6.0
    spike_window: int = 128
    rollback_skip: int = 10
    max_rollbacks: int = 3
    # A verdict is checked once before it is acted on (megafixed/train/callbacks/guard/recheck.py): every rank
    # computes the step again from the state before its update, with the same batch and RNG. Good again: a transient
    # fault (a flaky device, a flipped bit): the run trains on the recomputation, names the rank(s) whose
    # values differed and counts it per node in <run_dir>/faults/bad_steps.jsonl. Bad again: on_nonfinite /
    # on_spike act as without the check. On by default: it costs one more computation of a step only when a
    # verdict comes (without one, ~11 us of host bookkeeping per step of 8 micro batches: torch's RNG state
    # and the batch references; no device read, no collective), and turns a transient fault into a step
    # trained as if nothing happened instead of a dropped batch, a rollback or a stopped run.
    recheck: bool = True
    # After this many transient faults on one node, the run saves a checkpoint and exits 77
    # (exit_codes.EXCLUDE_NODE); the Slurm job script resubmits the job without that node. 0: never.
    max_transient_faults: int = 2


@dataclass
class CheckpointConfig:
    interval: int = 500  # save every N steps (and at the last step, and on a stop request)
    keep: int = 2  # <= 0 keeps every checkpoint
    async_save: bool = False  # write checkpoints in the background; `latest` moves once they are complete
    # The checkpoint a resume, a requeue or a rollback would load fails verification (a file missing,
    # truncated or corrupt): it is moved aside as <tag>.damaged-<why> (never deleted) and the newest older
    # checkpoint that verifies is loaded, said in one line and in the run record. false: stop in one line.
    fallback: bool = True

    def validate(self) -> None:
        require_at_least("checkpoint", self, 1, ("interval",))


@dataclass
class WatchdogConfig:
    # No step completed for this long: every rank writes its Python stacks to <run_dir>/faults/, rank 0
    # names the ranks that did not reach the step, exit 76 (exit_codes.HUNG). 0: max(300 s, 20 x the
    # median step time); the first step, saves and validation get at least parallel.collective_timeout_s.
    timeout_s: float = 0


@dataclass
class StragglersConfig:
    # Every log interval: a rank whose forward compute per step is over this times the median is named.
    factor: float = 1.5


@dataclass
class ValidationConfig:
    interval: int = 100  # validate every N steps, at step 0 and at the last step; 0: never
    iters: int = 10  # global batches of the validation split per pass

    def validate(self) -> None:
        require_at_least("validation", self, 0, ("interval", "iters"))


@dataclass
class MetricsConfig:
    interval: int = 10  # a metrics record and a progress line every N steps
    tensorboard: bool = True

    def validate(self) -> None:
        require_at_least("metrics", self, 1, ("interval",))


@dataclass
class WandbConfig:
    # Weights & Biases beside TensorBoard (pip install 'megafixed[wandb]'): the same records; a restart
    # continues the same W&B run (its id is kept in <run_dir>/wandb_run.json). mode auto: WANDB_MODE,
    # else online; offline writes under <run_dir>/wandb/ for a later `wandb sync`.
    enabled: bool = False
    project: str = "megafixed"
    entity: Optional[str] = None
    run_name: Optional[str] = None  # None: the run directory's name
    tags: list = field(default_factory=list)
    mode: Literal["auto", "online", "offline", "disabled"] = "auto"


@dataclass
class FaultsConfig:
    # Drills (megafixed/run/faults.py): faults separated by ';', e.g. 'nan@3:rank=1;spike@5:once;slow:rank=0'.
    # Recorded in config.yaml like every key; a resume may change it. None: no drill.
    inject: Optional[str] = None  # parsed (and a malformed one refused) when the run's callbacks are built


@dataclass
class EvalConfig:
    """In-loop zero-shot evaluation (megafixed/train/callbacks/zero_shot.py), e.g.
    ``eval.tasks=[hellaswag,piqa,lambada] eval.interval=50 eval.limit=200``. The task names are checked
    when the callback is built (before the run starts): the task registry lives above the config."""
    tasks: list = field(default_factory=list)  # megafixed eval's task names (and mmlu, mmlu_<subject>)
    interval: int = 0  # steps between evaluations (and the last step); 0: off
    limit: int = 100  # the first N documents of each task (per MMLU subject), as megafixed eval --limit
    batch_size: int = 32  # packed rows per forward pass, as megafixed eval --batch-size

    def validate(self) -> None:
        if any(not isinstance(t, str) for t in self.tasks):
            raise ConfigError(f"eval.tasks={self.tasks!r} must be a list of task names, e.g. [hellaswag, piqa]")
        if self.interval > 0 and not self.tasks:
            raise ConfigError(f"eval.interval={self.interval} needs eval.tasks, e.g. "
                              f"eval.tasks=[hellaswag,piqa,lambada] (or eval.interval=0: no in-loop evaluation)")


@dataclass
class ProfileConfig:
    """Section ``profile`` (megafixed/train/callbacks/profile.py, docs/profiling.md): ``profile.steps=10-12
    profile.memory_snapshot=true``."""
    steps: Union[int, str] = ""  # a window of steps as numbered in the logs, "10-12" (or one step); "": off
    memory_snapshot: bool = False  # also CUDA's allocation history over the window (needs CUDA)
    memory_entries: int = 100000  # allocation events the CUDA history keeps (the oldest are dropped)
    record_shapes: bool = False  # operators' input shapes in the trace (bigger traces)
    with_stack: bool = False  # Python stacks of operators in the trace (much bigger traces, slower)
    top: int = 5  # operators named in the summary line

    def validate(self) -> None:
        if self.window() is None and self.memory_snapshot:
            raise ConfigError("profile.memory_snapshot=true needs profile.steps, the window it records "
                              "(e.g. profile.steps=10-12)")

    def window(self) -> Optional[tuple[int, int]]:
        """``(first, last)`` step of the window, or None when profiling is off."""
        from .step_ranges import parse

        ranges = parse(self.steps, key="profile.steps", error=ConfigError)
        if not ranges:
            return None
        if len(ranges) != 1:
            raise ConfigError(f"profile.steps={self.steps!r} must be one window of steps, e.g. 10-12 (a trace "
                              f"holds one window; profile another in another run)")
        return ranges[0]


# A key that left the train section -> its place now: named in the one-line refusal of the old key.
MOVED_KEYS = {
    "train.on_nonfinite": "guard.on_nonfinite", "train.on_spike": "guard.on_spike",
    "train.spike_sigma": "guard.spike_sigma", "train.spike_window": "guard.spike_window",
    "train.rollback_skip": "guard.rollback_skip", "train.max_rollbacks": "guard.max_rollbacks",
    "train.recheck_bad_steps": "guard.recheck", "train.max_transient_faults": "guard.max_transient_faults",
    "train.save_interval": "checkpoint.interval", "train.keep_checkpoints": "checkpoint.keep",
    "train.async_save": "checkpoint.async_save", "train.checkpoint_fallback": "checkpoint.fallback",
    "train.hang_timeout_s": "watchdog.timeout_s", "train.straggler_factor": "stragglers.factor",
    "train.eval_interval": "validation.interval", "train.eval_iters": "validation.iters",
    "train.log_interval": "metrics.interval", "train.tensorboard": "metrics.tensorboard",
    "train.wandb": "wandb.enabled", "train.wandb_project": "wandb.project", "train.wandb_entity": "wandb.entity",
    "train.wandb_run_name": "wandb.run_name", "train.wandb_tags": "wandb.tags", "train.wandb_mode": "wandb.mode",
}


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    # Context parallelism: each sequence split over ``cp`` ranks (docs/parallelism.md#context-parallelism).
    # ulysses: all-to-all from sequence- to head-sharded around the attention core (any device; heads/tp must
    # divide by cp); ring: torch's context_parallel (CUDA SDPA kernels only).
    cp: int = 1
    cp_method: Literal["ulysses", "ring"] = "ulysses"
    sequence_parallel: bool = False
    pp_partition: Literal["parameters", "uniform", "type:Block"] = "parameters"
    # train.engine=torch: any schedule torch.distributed.pipelining's get_schedule_class names (1F1B, GPipe,
    # Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV); DeepSpeed runs 1F1B only.
    pp_schedule: str = "1F1B"
    vpp: int = 1  # pipeline stages per rank (looped schedules: >= 2; V-shaped ones: exactly 2)
    # How many layers the input interface and the head each count as when the torch engine spreads the
    # blocks over its stages (0: only blocks are counted; the input joins the first stage, the head the last).
    pp_input_head_layers: int = 1
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    # A collective (any group) that waits this long for a peer fails, naming the lost rank/node, instead of
    # hanging for torch's 30 minutes; long enough for the slowest checkpoint save or evaluation (Megatron: 10 min).
    collective_timeout_s: float = 600
    # tp/pp >= 1 is checked once, by the range table (config_checks.py); the layout rules by the run plan.


@dataclass
class ZeroConfig:
    # DeepSpeed's ZeRO; not used under train.engine=torch (FSDP2 shards instead: torch_engine.*).
    stage: int = 1
    offload_optimizer: bool = False
    reduce_bucket_size: int = 500_000_000

    def validate(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise ConfigError(f"zero.stage must be 0, 1, 2 or 3, got {self.stage}")


@dataclass
class TorchEngineConfig:
    """The torch-native engine's keys (``megafixed.engine.native``); read only under train.engine=torch."""
    # HSDP's replicate degree (torchtitan's data_parallel_replicate_degree): the data-parallel ranks form a
    # (dp_replicate, dp / dp_replicate) mesh, parameters sharded over the second axis and replicated over the
    # first. 1: FSDP2 over every data-parallel rank; = the data-parallel size: plain replication (no sharding,
    # DDP-like, for small models).
    dp_replicate: int = 1
    # FSDP2's knob: free each block's gathered parameters after its forward (less memory) or keep them
    # until its backward (one all-gather fewer per block and step). The head, first in backward, is kept.
    reshard_after_forward: bool = True


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    torch_engine: TorchEngineConfig = field(default_factory=TorchEngineConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    stragglers: StragglersConfig = field(default_factory=StragglersConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    # User callbacks (megafixed/train/callbacks/): each {name: "package.module:Class", args: {...}}.
    callbacks: list = field(default_factory=list)

    def validate(self) -> "Config":
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            if hasattr(section, "validate"):
                section.validate()
        check_ranges(self)  # every numeric key in its range, before any work starts
        from .engines import engine_kind

        engine_kind(self.train.engine, error=ConfigError)  # a registered engine (the error lists them)
        if self.data.seq_len > self.model.max_seq_len:
            raise ConfigError(f"data.seq_len={self.data.seq_len} exceeds model.max_seq_len="
                              f"{self.model.max_seq_len}; raise model.max_seq_len or lower data.seq_len")
        # Cross-field *layout* rules (ZeRO with PP, divisibility, batch arithmetic) need the world
        # size and live in one place: megafixed.parallel.layout.validate_layout.
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------------- typing
def _check_value(path: str, value: Any, tp: Any) -> Any:
    """Check (and mildly coerce: int -> float) one value against a dataclass field type."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin is typing.Union or origin is types.UnionType:
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _check_value(path, value, a)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{path}: bad value {value!r}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value is False and "off" in choices:  # YAML 1.1 reads a bare `off` as false
            value = "off"
        if value not in choices:
            raise ConfigError(f"{path}={value!r} is not one of {list(choices)}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}={value!r} must be true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}={value!r} must be an integer")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads `3e-4` (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}={value!r} must be a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}={value!r} must be a string")
        return value
    if tp is list or origin is list:
        if isinstance(value, (str, int, float)):
            value = [value]  # `data.prefixes=foo` on the command line means a one-element list
        if not isinstance(value, list):
            raise ConfigError(f"{path}={value!r} must be a list")
        return value
    return value


def _merge_into(obj: Any, data: dict, prefix: str = "") -> None:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(type(obj))
    names = [f.name for f in dataclasses.fields(obj)]
    for key, value in data.items():
        path = f"{prefix}{key}"
        if path in MOVED_KEYS:
            raise ConfigError(f"{path} moved to {MOVED_KEYS[path]}")
        if key not in names:
            raise ConfigError(f"unknown config key '{path}'; valid keys under "
                              f"'{prefix.rstrip('.') or 'config'}' are: {', '.join(names)}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            _merge_into(current, value, path + ".")
        else:
            setattr(obj, key, _check_value(path, value, hints[key]))


def _read_yaml(path: str, seen: tuple = ()) -> dict:
    path = os.path.abspath(path)
    if path in seen:
        raise ConfigError(f"config include cycle at {path}")
    if not os.path.exists(path):
        raise ConfigError(f"config file not found: {path}")
    if os.path.isdir(path):
        raise ConfigError(f"config {path} is a directory; pass a YAML file such as examples/configs/quickstart.yaml")
    with open(path, "rb") as fh:
        raw = fh.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:  # yaml would report a byte offset in a stream, not the file
        raise ConfigError(f"config file {path} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
                          f"re-save it as UTF-8") from exc
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"config file {path}{where} is not valid YAML "
                          f"({getattr(exc, 'problem', None) or exc}); fix its syntax") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at top level")
    includes = data.pop("include", []) or []
    if isinstance(includes, str):
        includes = [includes]
    merged: dict = {}
    for inc in includes:
        _deep_update(merged, _read_yaml(os.path.join(os.path.dirname(path), inc), seen + (path,)))
    _deep_update(merged, data)
    return merged


def _deep_update(dst: dict, src: dict) -> dict:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _deep_update(dst[k], v)
        else:
            dst[k] = v
    return dst


def parse_overrides(overrides: list[str]) -> dict:
    """``["model.input=gf2", "train.max_steps=50"]`` -> nested dict with YAML-parsed values."""
    out: dict = {}
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        key, raw = item.split("=", 1)
        if not key.strip() or any(not p for p in key.strip().split(".")):
            raise ConfigError(f"override {item!r} has an empty key; write section.key=value, e.g. train.max_steps=10")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {item!r}: the value {raw!r} is not valid YAML "
                              f"({getattr(exc, 'problem', None) or 'syntax error'}); quote it or close its brackets, "
                              f"e.g. data.prefixes=[a,b]") from exc
        node = out
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):  # `model=3 model.d_model=4`: a value, then a key under it
                raise ConfigError(f"override {item!r} conflicts with an earlier override that set "
                                  f"'{p}' to a value; give each key once")
        node[parts[-1]] = value
    return out


def apply_overrides(cfg: Config, overrides: list[str]) -> None:
    """Set ``section.key=value`` ``overrides`` on a built ``cfg`` (a planner row's keys, which the config's
    own rules have already checked: ``megafixed plan`` makes each row from valid options)."""
    for section, values in parse_overrides(overrides).items():
        for key, value in values.items():
            setattr(getattr(cfg, section), key, value)


def config_from_dict(data: dict, cls: type = Config) -> Any:
    cfg = cls()
    _merge_into(cfg, data)
    return cfg


def load_config(path: Optional[str] = None, overrides: Optional[list[str]] = None,
                validate: bool = True) -> Config:
    data = _read_yaml(path) if path else {}
    _deep_update(data, parse_overrides(overrides or []))
    cfg = config_from_dict(data)
    return cfg.validate() if validate else cfg


def resolve_code(cfg: Config) -> Config:
    """A deep copy of ``cfg`` whose gf2 code is written out as ``model.code_rows``/``code_shift``.

    The copy builds the identical code without consulting ``code_seed``, so a config saved from it
    reproduces the run's A and b even if seeded sampling ever changed. Other inputs are copied as is.
    """
    out = copy.deepcopy(cfg)
    m = out.model
    from .model.interfaces import interface_of
    iface = interface_of(m, error=ConfigError)
    if iface.affine_recoding:
        from .codes import CodeError
        try:
            code = iface.make_code(m)
        except CodeError as exc:
            raise ConfigError(f"model: {exc}") from exc
        m.code_rows, m.code_shift = list(code.rows), code.shift
    return out


def save_config(cfg: Config, path: str) -> None:
    """Write the resolved config atomically so a crash never leaves half a YAML file.

    A gf2 code is written out as its rows and shift (see :func:`resolve_code`).
    """
    from .atomic import atomic_write_text

    atomic_write_text(path, yaml.safe_dump(resolve_code(cfg).to_dict(), sort_keys=False))
