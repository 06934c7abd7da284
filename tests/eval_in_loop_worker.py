"""In-loop zero-shot scores on 2 data-parallel gloo ranks (launched by torchrun from
tests/test_eval_in_loop.py): for each case (an engine and its sharding) the engine the trainer
builds, the saved tiny model's weights loaded into it, then ``score_zero_shot`` on its module.

    python tests/eval_in_loop_worker.py OUT_PREFIX STATE.pt TASKS LIMIT case=override,override ... -- key=value ...

Every rank writes ``OUT_PREFIX.<rank>.json``: ``{case: {"values": {...}, "training_after": bool}}``.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402


def reset_model_parallel() -> None:
    """Forget the previous case's megatron-core groups, so the next setup_distributed makes its own."""
    from megafixed.engine.deepspeed.megatron_tp import load

    ps = load().parallel_state
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()


def load_weights(engine, cfg, state_path: str, scratch: Path) -> None:
    """The saved weights into the engine's module: the engine's own loader (``scratch``: a folder every
    rank sees), except under ZeRO-3, whose module-only load of a converted checkpoint finds no files
    (DeepSpeed looks for ZeRO-3 shards): there, each partitioned parameter gathered and set from rank 0."""
    if cfg.train.engine == "deepspeed" and cfg.zero.stage == 3:
        import deepspeed

        state = torch.load(state_path)
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=0):
            if torch.distributed.get_rank() == 0:
                missing = engine.module.load_state_dict(state, strict=False).missing_keys
                assert not [k for k in missing if not k.endswith("_extra_state")], missing
        return
    engine.load_weights(lambda: torch.load(state_path), scratch)


def main(argv: list[str]) -> int:
    from megafixed.config import load_config
    from megafixed.data.tokenizers import load_tokenizer
    from megafixed.engine import build_engine
    from megafixed.eval.in_loop import score_zero_shot
    from megafixed.parallel import setup_distributed
    from megafixed.paths import bundled
    from megafixed.run_plan import RunPlan

    out_prefix, state_path, tasks, limit = argv[0], argv[1], argv[2].split(","), int(argv[3])
    split = argv.index("--")
    cases = dict(c.split("=", 1) for c in argv[4:split])
    common = argv[split + 1:]
    results = {}
    for case, extra in cases.items():
        reset_model_parallel()
        cfg = load_config(str(bundled("quickstart.yaml")), [*common, *extra.split(",")])
        topo = setup_distributed(RunPlan.for_launch(cfg))
        engine = build_engine(cfg, topo)
        load_weights(engine, cfg, state_path, Path(f"{out_prefix}.scratch.{case}"))
        engine.module.train()
        values = score_zero_shot(engine.module, tasks=tasks, limit=limit, tokenizer=load_tokenizer(cfg.data.tokenizer),
                                 batch_size=4, group=topo.dp_group, device=engine.device)
        results[case] = {"values": values, "training_after": engine.module.training, "dp": topo.dp}
        torch.distributed.barrier()
    with open(f"{out_prefix}.{torch.distributed.get_rank()}.json", "w") as fh:
        json.dump(results, fh)
    torch.distributed.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
