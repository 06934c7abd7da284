"""The bad-input catalogue: a new user's mistakes on every verb, each answered by one line.

Every case runs a real command line against a small realistic workspace (a JSONL corpus and its
compressed copies, two trained tokenizers, shards written with them, a run config, a training
run's checkpoints) and asserts the contract of ``megafixed.errors`` / ``megafixed.outputs``:

* the exit code (2 = bad input, ``megafixed.exit_codes``);
* exactly one non-empty stderr line, starting with ``error:`` and matching what names the
  problem (the file, key or flag, and the way out), and no traceback;
* every file of the workspace byte-identical before and after, and nothing added (a failed
  command removes what it created).

The cases come from how people misuse such tools: wrong or stale paths, a prefix reused, the
output equal to an input, a corpus that is empty, truncated or not what its suffix says, a
tokenizer that is not the shards' one, out-of-range config values, malformed overrides, a layout
the model cannot take, a device the machine lacks. ``train``/``quickstart`` cases run as
subprocesses (those verbs leave through ``os._exit``), in parallel, each on its own copy.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from _env import launch_free_env
from megafixed import cli

ROOT = Path(__file__).resolve().parent.parent
BAD = 2  # megafixed.exit_codes.BAD_INPUT

WORDS = ("the river city north winter light stone people music early history language small king war "
         "science bridge garden ocean mountain paper theory island market empire school field number "
         "energy animal forest planet water machine").split()


# ----------------------------------------------------------------------------------- workspace
def _corpus_lines(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        text = " ".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 12))).capitalize() + "."
                        for _ in range(rng.randint(2, 5)))
        lines.append(json.dumps({"id": i, "text": text}))
    return lines


def _build(ws: Path) -> None:
    import torch

    from megafixed.config import load_config
    from megafixed.data.indexed import ShardWriter, bin_path, idx_path
    from megafixed.data.preprocess import PreprocessOptions, preprocess
    from megafixed.data.tokenizers import train_tokenizer
    from megafixed.model import GPT

    lines = _corpus_lines(240)
    (ws / "corpus.jsonl").write_text("\n".join(lines) + "\n")
    (ws / "docs.json").write_text("\n".join(lines[:60]) + "\n")  # JSONL under a .json name
    gz = gzip.compress(("\n".join(lines) + "\n").encode())
    (ws / "corpus.jsonl.gz").write_bytes(gz)
    (ws / "truncated.jsonl.gz").write_bytes(gz[: len(gz) // 2])
    (ws / "gz").mkdir()
    (ws / "gz" / "a.jsonl.gz").write_bytes(gz)
    (ws / "gz" / "b.jsonl.gz").write_bytes(("\n".join(lines[:5]) + "\n").encode())  # not gzip inside
    (ws / "empty.jsonl").write_text("\n\n")
    (ws / "bad_records.jsonl").write_text(lines[0] + "\n{not json\n" + lines[1] + "\n")
    (ws / "fake.parquet").write_text("this is not parquet\n")
    (ws / "notes.csv").write_text("a,b\n1,2\n")
    (ws / "garbage.model").write_bytes(bytes(random.Random(1).randrange(256) for _ in range(512)))
    (ws / "garbage.json").write_text('{"hello": "world"}')
    (ws / "no_tokenizer_here").mkdir()
    (ws / "no_tokenizer_here" / "README").write_text("nothing\n")

    train_tokenizer([str(ws / "corpus.jsonl")], str(ws / "tok.json"), 320)
    train_tokenizer([str(ws / "corpus.jsonl")], str(ws / "tok2.json"), 360)
    train_tokenizer([str(ws / "corpus.jsonl")], str(ws / "tok_replaced.json"), 320)
    data = ws / "data"

    def shards(prefix: str, tok: str) -> None:
        preprocess(PreprocessOptions(inputs=[str(ws / "corpus.jsonl")], output_prefix=str(data / prefix),
                                     tokenizer=str(ws / tok), progress=False))

    shards("corpus", "tok.json")
    shards("other", "tok2.json")
    shards("replaced", "tok_replaced.json")
    shutil.copyfile(ws / "tok2.json", ws / "tok_replaced.json")  # retrained in place after preprocessing
    with ShardWriter(str(data / "empty"), "uint16") as w:  # an empty pair without a .meta.json
        w.finalize()
    shutil.copyfile(bin_path(str(data / "corpus")), bin_path(str(data / "trunc")))
    shutil.copyfile(idx_path(str(data / "corpus")), idx_path(str(data / "trunc")))
    with open(bin_path(str(data / "trunc")), "r+b") as fh:
        fh.truncate(100)
    (data / "badmagic.bin").write_bytes(b"")
    (data / "badmagic.idx").write_bytes(b"NOTANIDX" + bytes(40))

    overrides = ["model.d_model=24", "model.n_heads=6", "model.n_layers=2", "model.vocab_size=512",
                 "model.code_bits=9", "model.max_seq_len=32", "data.seq_len=16", "train.max_steps=2",
                 "train.global_batch=2", "train.micro_batch=2", "train.run_dir=runs/t", "metrics.tensorboard=false"]
    cfg = load_config(None, overrides)
    model_keys = [o.split("=")[0].split(".")[1] for o in overrides if o.startswith("model.")]
    config = {"model": {k: getattr(cfg.model, k) for k in model_keys},
              "data": {"prefixes": ["data/corpus"], "tokenizer": "tok.json", "seq_len": 16},
              "train": {"max_steps": 2, "global_batch": 2, "micro_batch": 2, "run_dir": "runs/t"},
              "metrics": {"tensorboard": False}}
    import yaml

    (ws / "config.yaml").write_text(yaml.safe_dump(config))
    (ws / "bad_utf8.yaml").write_bytes(b"model:\n  d_model: 24 # caf\xe9\n")
    (ws / "bad_syntax.yaml").write_text("model:\n  d_model: [24\n")
    (ws / "list.yaml").write_text("- model\n- data\n")
    (ws / "cycle.yaml").write_text("include: cycle.yaml\n")

    # a training run: run/config.yaml + checkpoints/{latest, step_00000001/mp_rank_00_model_states.pt}
    torch.manual_seed(0)
    sd = GPT(cfg.model).state_dict()
    ck = ws / "run" / "checkpoints"
    (ck / "step_00000001").mkdir(parents=True)
    torch.save({"module": sd, "config": cfg.to_dict()}, ck / "step_00000001" / "mp_rank_00_model_states.pt")
    (ck / "latest").write_text("step_00000001\n")
    (ws / "run" / "config.yaml").write_text("{}\n")
    from megafixed.run import manifest  # written as a current megafixed writes it: readers verify it

    tag1 = ck / "step_00000001"
    manifest.write(tag1, {"format": manifest.FORMAT, "step": 1},
                   {p.name: manifest.record_existing(p) for p in tag1.iterdir() if p.is_file()})
    # a run whose checkpoint has a run record but lost its manifest: refused by every reader
    shutil.copytree(ws / "run", ws / "run_lost_manifest")
    (ws / "run_lost_manifest" / "checkpoints" / "step_00000001" / "manifest.json").unlink()
    (ws / "run_lost_manifest" / "checkpoints" / "step_00000001" / "run.json").write_text(
        json.dumps({"config": cfg.to_dict()}))
    # a Hugging Face folder whose model.safetensors was cut short by a failed download
    (ws / "hf_trunc").mkdir()
    (ws / "hf_trunc" / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2,
        "intermediate_size": 64, "vocab_size": 300, "max_position_embeddings": 64}))
    (ws / "hf_trunc" / "model.safetensors").write_bytes(b"\x40\x00\x00\x00\x00\x00\x00\x00{\"a\":")
    for name, latest in (("ckpt_empty_latest", ""), ("ckpt_dangling", "step_00000009\n"), ("ckpt_trunc", None)):
        d = ws / name / "step_00000001"
        d.mkdir(parents=True)
        shutil.copyfile(ck / "step_00000001" / "mp_rank_00_model_states.pt", d / "mp_rank_00_model_states.pt")
        (ws / name / "latest").write_text(latest if latest is not None else "step_00000001\n")
    with open(ws / "ckpt_trunc" / "step_00000001" / "mp_rank_00_model_states.pt", "r+b") as fh:
        fh.truncate(300)
    # a run whose `latest` was emptied (a crash of some other tool, a user's `> latest`)
    (ws / "run_empty_latest" / "checkpoints" / "step_00000001").mkdir(parents=True)
    (ws / "run_empty_latest" / "checkpoints" / "latest").write_text("")
    (ws / "converted").mkdir()
    (ws / "converted" / "keep.txt").write_text("an earlier conversion\n")
    (ws / "plain.pt").write_bytes(b"an earlier plain export")


def _snapshot(root: Path) -> dict:
    """Every file and folder under root -> content hash (folders: None). Equal = nothing changed."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root) + "/"] = None
        for f in filenames:
            p = os.path.join(dirpath, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    ws = tmp_path_factory.mktemp("ws")
    _build(ws)
    return ws


# ----------------------------------------------------------------------------------- cases
# (id, argv, exit code, regex the single error line must match). Paths are relative to the workspace.
CFG = "config.yaml"
CASES = [
    # --- the command line itself
    ("unknown-verb", ["bogus"], BAD, r"invalid choice: 'bogus'"),
    ("int-flag-not-int", ["codes", "--bits", "x"], BAD, r"--bits: invalid int value: 'x'.*--help"),
    ("missing-action", ["data"], BAD, r"megafixed data: the following arguments are required: ACTION"),
    ("missing-required-flag", ["preprocess", "--input", "corpus.jsonl", "--output-prefix", "o"], BAD,
     r"required: --tokenizer"),
    ("bad-choice", ["tokenizer", "train", "--input", "corpus.jsonl", "--vocab-size", "400", "--type", "wordpiece",
                    "--output", "new.json"], BAD, r"--type: invalid choice: 'wordpiece'"),
    # --- codes
    ("codes-bits-0", ["codes", "--bits", "0"], BAD, r"code bits must be an integer in 1\.\.31, got 0"),
    ("codes-bits-32", ["codes", "--bits", "32"], BAD, r"code bits must be an integer in 1\.\.31, got 32"),
    ("codes-id-too-big", ["codes", "--bits", "2", "5"], BAD, r"token id 5 is outside \[0, 3\]"),
    ("codes-negative-id", ["codes", "--", "-1"], BAD, r"token id -1"),
    ("codes-width-below-bits", ["codes", "--bits", "8", "--width", "4", "1"], BAD, r"width 4 < code bits 8"),
    # --- tokenizer
    ("tok-input-missing", ["tokenizer", "train", "--input", "nope.jsonl", "--vocab-size", "400", "--output", "n.json"],
     BAD, r"input 'nope\.jsonl' matches no file"),
    ("tok-vocab-too-small", ["tokenizer", "train", "--input", "corpus.jsonl", "--vocab-size", "10", "--output",
                             "n.json"], BAD, r"vocab_size=10 is too small"),
    ("tok-output-exists", ["tokenizer", "train", "--input", "corpus.jsonl", "--vocab-size", "400", "--output",
                           "tok.json"], BAD, r"--output tok\.json already exists; pass --overwrite"),
    ("tok-output-is-input", ["tokenizer", "train", "--input", "docs.json", "--vocab-size", "300", "--output",
                             "docs.json", "--overwrite"], BAD, r"docs\.json is also an input"),
    ("tok-wrong-json-key", ["tokenizer", "train", "--input", "corpus.jsonl", "--json-key", "body", "--vocab-size",
                            "300", "--output", "n.json"], BAD, r"no text to train a tokenizer on.*--json-key"),
    ("tok-empty-corpus", ["tokenizer", "train", "--input", "empty.jsonl", "--vocab-size", "300", "--output",
                          "n.json"], BAD, r"no text to train a tokenizer on.*empty\.jsonl"),
    ("tok-truncated-gz", ["tokenizer", "train", "--input", "truncated.jsonl.gz", "--vocab-size", "300", "--output",
                          "n.json"], BAD, r"truncated\.jsonl\.gz is truncated"),
    ("tok-not-gzip-in-glob", ["tokenizer", "train", "--input", "gz/*.gz", "--vocab-size", "300", "--output",
                              "n.json"], BAD, r"gz/b\.jsonl\.gz is not a valid \.gz file"),
    ("tok-vocab-larger-than-corpus", ["tokenizer", "train", "--input", "docs.json", "--vocab-size", "20000",
                                      "--output", "n.json"], BAD,
     r"yields only \d+ tokens, fewer than --vocab-size 20000"),
    ("tok-spm-vocab-too-high", ["tokenizer", "train", "--input", "docs.json", "--vocab-size", "20000", "--output",
                                "n.model"], BAD, r"sentencepiece could not train.*lower --vocab-size"),
    ("tok-code-bits", ["tokenizer", "train", "--input", "corpus.jsonl", "--vocab-size", "512", "--code-bits", "8",
                       "--output", "n.json"], BAD, r"--vocab-size has 512 tokens but 8-bit fixed codes"),
    ("tok-input-dir", ["tokenizer", "train", "--input", "gz", "--vocab-size", "300", "--output", "n.json"], BAD,
     r"input gz is a directory"),
    ("tok-max-chars-0", ["tokenizer", "train", "--input", "corpus.jsonl", "--vocab-size", "300", "--max-chars", "0",
                         "--output", "n.json"], BAD, r"--max-chars 0 must be >= 1"),
    ("tok-output-missing-folder", ["tokenizer", "train", "--input", "corpus.jsonl", "--vocab-size", "300",
                                   "--output", "newdir/"], BAD, r"--output newdir/ names a folder that does not exist"),
    ("tok-show-missing", ["tokenizer", "show", "nope.json"], BAD, r"tokenizer nope\.json not found"),
    ("tok-show-garbage-model", ["tokenizer", "show", "garbage.model"], BAD,
     r"garbage\.model is not a readable sentencepiece model"),
    ("tok-show-corpus", ["tokenizer", "show", "corpus.jsonl"], BAD, r"cannot tell the tokenizer type of"),
    ("tok-show-garbage-json", ["tokenizer", "show", "garbage.json"], BAD, r"cannot load HF tokenizer .*garbage\.json"),
    ("tok-show-empty-dir", ["tokenizer", "show", "no_tokenizer_here"], BAD, r"holds no tokenizer"),
    # --- preprocess
    ("pre-existing-prefix", ["preprocess", "--input", "corpus.jsonl", "--tokenizer", "tok2.json", "--output-prefix",
                             "data/corpus"], BAD, r"data/corpus\.bin already exists; pass --overwrite"),
    ("pre-existing-sharded-set", ["preprocess", "--input", "corpus.jsonl", "--tokenizer", "tok.json",
                                  "--output-prefix", "data/corpus", "--json-keys", "text"], BAD, r"already exists"),
    ("pre-prefix-is-folder-slash", ["preprocess", "--input", "corpus.jsonl", "--tokenizer", "tok.json",
                                    "--output-prefix", "outdir/"], BAD, r"--output-prefix 'outdir/' names a folder"),
    ("pre-prefix-is-existing-dir", ["preprocess", "--input", "corpus.jsonl", "--tokenizer", "tok.json",
                                    "--output-prefix", "data"], BAD, r"--output-prefix 'data' names a folder"),
    ("pre-empty-corpus", ["preprocess", "--input", "empty.jsonl", "--tokenizer", "tok.json", "--output-prefix",
                          "new/sub/out"], BAD, r"no document written: the inputs .*empty\.jsonl.* hold no text"),
    ("pre-truncated-gz", ["preprocess", "--input", "truncated.jsonl.gz", "--tokenizer", "tok.json",
                          "--output-prefix", "new/out"], BAD, r"truncated\.jsonl\.gz is truncated.*re-download"),
    ("pre-not-gzip-in-glob", ["preprocess", "--input", "gz/*.jsonl.gz", "--tokenizer", "tok.json",
                              "--output-prefix", "out"], BAD, r"gz/b\.jsonl\.gz is not a valid \.gz file"),
    ("pre-garbage-tokenizer", ["preprocess", "--input", "corpus.jsonl", "--tokenizer", "garbage.model",
                               "--output-prefix", "out"], BAD, r"garbage\.model is not a readable sentencepiece"),
    ("pre-missing-tokenizer", ["preprocess", "--input", "corpus.jsonl", "--tokenizer", "nope.model",
                               "--output-prefix", "out"], BAD, r"tokenizer nope\.model not found"),
    ("pre-wrong-json-key", ["preprocess", "--input", "corpus.jsonl", "--tokenizer", "tok.json", "--json-keys",
                            "body", "--output-prefix", "out"], BAD, r"every record was skipped.*--json-keys body"),
    ("pre-workers-0", ["preprocess", "--input", "corpus.jsonl", "--tokenizer", "tok.json", "--workers", "0",
                       "--output-prefix", "out"], BAD, r"--workers 0 must be >= 1"),
    ("pre-shard-size-0", ["preprocess", "--input", "corpus.jsonl", "--tokenizer", "tok.json", "--shard-size-mb",
                          "0", "--output-prefix", "out"], BAD, r"--shard-size-mb must be > 0"),
    ("pre-code-bits-too-few", ["preprocess", "--input", "corpus.jsonl", "--tokenizer", "tok.json", "--code-bits",
                               "4", "--output-prefix", "out"], BAD, r"tok\.json has 320 tokens but 4-bit fixed codes"),
    ("pre-fake-parquet", ["preprocess", "--input", "fake.parquet", "--tokenizer", "tok.json", "--output-prefix",
                          "out"], BAD, r"fake\.parquet is not a readable parquet file"),
    ("pre-unknown-format", ["preprocess", "--input", "notes.csv", "--tokenizer", "tok.json", "--output-prefix",
                            "out"], BAD, r"cannot tell the format of notes\.csv"),
    ("pre-strict-bad-record", ["preprocess", "--input", "bad_records.jsonl", "--tokenizer", "tok.json", "--strict",
                               "--output-prefix", "out"], BAD, r"bad_records\.jsonl:2: not valid JSON.*--strict"),
    ("pre-report-exists", ["preprocess", "--input", "corpus.jsonl", "--tokenizer", "tok.json", "--output-prefix",
                           "out", "--report", "config.yaml"], BAD, r"config\.yaml already exists"),
    ("pre-output-is-tokenizer", ["preprocess", "--input", "corpus.jsonl", "--tokenizer", "data/corpus.meta.json",
                                 "--output-prefix", "data/corpus", "--overwrite"], BAD, r"is also an input"),
    # --- data
    ("inspect-missing", ["data", "inspect", "data/nope"], BAD, r"no shards for data prefix 'data/nope'"),
    ("inspect-truncated-bin", ["data", "inspect", "data/trunc"], BAD, r"trunc\.bin is truncated"),
    ("inspect-bad-magic", ["data", "inspect", "data/badmagic"], BAD, r"badmagic\.idx is not a Megatron index"),
    ("inspect-other-tokenizer", ["data", "inspect", "data/corpus", "--tokenizer", "tok2.json"], BAD,
     r"--tokenizer tok2\.json is not the tokenizer data/corpus was written with"),
    ("inspect-tokenizer-replaced", ["data", "inspect", "data/replaced"], BAD,
     r"tok_replaced\.json changed since data/replaced was written"),
    ("inspect-negative-docs", ["data", "inspect", "data/corpus", "--docs", "-1"], BAD, r"--docs -1 must be >= 0"),
    ("merge-onto-input", ["data", "merge", "--inputs", "data/corpus", "data/corpus", "--output-prefix", "data/corpus",
                          "--overwrite"], BAD, r"data/corpus\.bin is also an input"),
    ("merge-output-exists", ["data", "merge", "--inputs", "data/corpus", "--output-prefix", "data/other"], BAD,
     r"data/other\.bin already exists; pass --overwrite"),
    ("merge-mixed-tokenizers", ["data", "merge", "--inputs", "data/corpus", "data/other", "--output-prefix",
                                "merged/all"], BAD, r"different tokenizers"),
    ("merge-missing-input", ["data", "merge", "--inputs", "data/corpus", "data/nope", "--output-prefix", "m"], BAD,
     r"no shards for data prefix 'data/nope'"),
    ("merge-prefix-folder", ["data", "merge", "--inputs", "data/corpus", "--output-prefix", "merged/"], BAD,
     r"names a folder"),
    ("merge-truncated-input", ["data", "merge", "--inputs", "data/corpus", "data/trunc", "--output-prefix",
                               "new/merged"], BAD, r"trunc\.bin is truncated"),
    # --- config (through params)
    ("cfg-missing", ["params", "nope.yaml"], BAD, r"config file not found: .*nope\.yaml"),
    ("cfg-not-utf8", ["params", "bad_utf8.yaml"], BAD, r"bad_utf8\.yaml is not UTF-8 text.*re-save it as UTF-8"),
    ("cfg-bad-yaml", ["params", "bad_syntax.yaml"], BAD, r"bad_syntax\.yaml line \d+ is not valid YAML"),
    ("cfg-list-top-level", ["params", "list.yaml"], BAD, r"list\.yaml must hold a mapping"),
    ("cfg-directory", ["params", "data"], BAD, r"config .*data is a directory"),
    ("cfg-include-cycle", ["params", "cycle.yaml"], BAD, r"config include cycle"),
    ("ovr-malformed-list", ["params", CFG, "data.prefixes=[a,b"], BAD,
     r"override 'data\.prefixes=\[a,b'.*not valid YAML"),
    ("ovr-no-equals", ["params", CFG, "train.max_steps"], BAD, r"override 'train\.max_steps' must look like"),
    ("ovr-empty-key", ["params", CFG, "=3"], BAD, r"override '=3' has an empty key"),
    ("ovr-unknown-key", ["params", CFG, "model.bogus=1"], BAD, r"unknown config key 'model\.bogus'"),
    ("ovr-not-int", ["params", CFG, "model.d_model=abc"], BAD, r"model\.d_model='abc' must be an integer"),
    ("ovr-bad-literal", ["params", CFG, "model.input=bogus"], BAD, r"model\.input='bogus' is not one of"),
    ("range-negative-min-lr", ["params", CFG, "optimizer.min_lr=-1e-4"], BAD,
     r"optimizer\.min_lr=-0\.0001 is out of range: allowed \[0, 1\]"),
    ("range-lr-zero", ["params", CFG, "optimizer.lr=0"], BAD, r"optimizer\.lr=0\.0 is out of range"),
    ("range-lr-nan", ["params", CFG, "optimizer.lr=.nan"], BAD, r"optimizer\.lr=nan must be a finite number"),
    ("range-min-lr-above-lr", ["params", CFG, "optimizer.min_lr=0.5"], BAD, r"optimizer\.min_lr=0\.5 exceeds"),
    ("range-beta2-one", ["params", CFG, "optimizer.beta2=1.0"], BAD, r"optimizer\.beta2=1\.0 is out of range"),
    ("range-eps-negative", ["params", CFG, "optimizer.eps=-1e-8"], BAD, r"optimizer\.eps=-1e-08 is out of range"),
    ("range-dropout", ["params", CFG, "model.dropout=1.5"], BAD, r"model\.dropout=1\.5 is out of range"),
    ("range-norm-eps-zero", ["params", CFG, "model.norm_eps=0"], BAD, r"model\.norm_eps=0\.0 is out of range"),
    ("range-micro-batch-zero", ["params", CFG, "train.micro_batch=0"], BAD, r"train\.micro_batch=0 must be >= 1"),
    ("range-seed-negative", ["params", CFG, "train.seed=-1"], BAD,
     r"train\.seed=-1 is out of range: allowed \[0, 4294967295\]"),
    ("range-wsd-fraction", ["params", CFG, "schedule.wsd_decay_fraction=2"], BAD,
     r"schedule\.wsd_decay_fraction=2\.0 is out of range"),
    ("range-zero-stage", ["params", CFG, "zero.stage=4"], BAD, r"zero\.stage must be 0, 1, 2 or 3"),
    ("range-negative-weight", ["params", CFG, "data.weights=[-1]"], BAD, r"data\.weights\[0\]=-1 must be >= 0"),
    ("range-grad-clip", ["params", CFG, "optimizer.grad_clip=-1"], BAD, r"optimizer\.grad_clip=-1\.0 must be >= 0"),
    ("cfg-heads-not-dividing", ["params", CFG, "model.n_heads=5"], BAD, r"not divisible by model\.n_heads=5"),
    ("cfg-weights-count", ["params", CFG, "data.weights=[1,2]"], BAD, r"data\.weights has 2 entries"),
    # --- plan
    ("plan-gpu-mem-two-dots", ["plan", CFG, "--gpus", "2", "--gpu-mem", "1.2.3GB"], BAD,
     r"--gpu-mem '1\.2\.3GB' must be a positive size"),
    ("plan-gpu-mem-negative", ["plan", CFG, "--gpus", "2", "--gpu-mem=-5GB"], BAD, r"--gpu-mem '-5GB'"),
    ("plan-gpus-zero", ["plan", CFG, "--gpus", "0"], BAD, r"--gpus 0: the number of GPUs"),
    # --- convert
    ("convert-into-live-checkpoints", ["convert", "run/checkpoints", "run/checkpoints", "--overwrite"], BAD,
     r"live checkpoint directory"),
    ("convert-into-tag-dir", ["convert", "run/checkpoints", "run/checkpoints/step_00000001", "--overwrite"], BAD,
     r"step_00000001 is a training run's live checkpoint directory"),
    ("convert-into-own-input-dir", ["convert", "ckpt_trunc/step_00000001", "ckpt_trunc/step_00000001",
                                    "--overwrite"], BAD, r"(also an input|live checkpoint)"),
    ("convert-plain-onto-latest", ["convert", "run/checkpoints", "run/checkpoints/latest", "--plain",
                                   "--overwrite"], BAD, r"run/checkpoints/latest is a training run's live checkpoint"),
    ("preprocess-into-live-checkpoints", ["preprocess", "--input", "corpus.jsonl", "--tokenizer", "tok.json",
                                          "--output-prefix", "run/checkpoints/shards"], BAD, r"live checkpoint"),
    ("convert-tp-not-dividing-heads", ["convert", "run/checkpoints", "out", "--tp", "4"], BAD,
     r"--tp 4 does not divide the model's 6 attention heads"),
    ("convert-tp-0", ["convert", "run/checkpoints", "out", "--tp", "0"], BAD, r"--tp 0 .* must both be >= 1"),
    ("convert-pp-0", ["convert", "run/checkpoints", "out", "--pp", "0"], BAD, r"--pp 0 must both be >= 1"),
    ("convert-pp-too-many", ["convert", "run/checkpoints", "out", "--pp", "5"], BAD, r"--pp 5: the model has 2 blocks"),
    ("convert-empty-latest", ["convert", "ckpt_empty_latest", "out"], BAD, r"ckpt_empty_latest/latest is empty.*--tag"),
    ("convert-dangling-latest", ["convert", "ckpt_dangling", "out"], BAD, r"points to 'step_00000009'.*--tag"),
    ("convert-truncated", ["convert", "ckpt_trunc", "new/out"], BAD,
     r"ckpt_trunc/step_00000001/mp_rank_00_model_states\.pt cannot be read.*--tag"),
    ("convert-missing", ["convert", "nope", "out"], BAD, r"checkpoint nope not found"),
    ("convert-output-exists", ["convert", "run/checkpoints", "converted"], BAD,
     r"output converted already exists; pass --overwrite"),
    ("convert-plain-exists", ["convert", "run/checkpoints", "plain.pt", "--plain"], BAD, r"plain\.pt already exists"),
    ("convert-missing-tag", ["convert", "run/checkpoints", "out", "--tag", "step_9"], BAD,
     r"--tag step_9: no directory"),
    ("convert-run-record-without-manifest", ["convert", "run_lost_manifest/checkpoints", "out"], BAD,
     r"step_00000001 has a run record \(run\.json\) but no manifest\.json.*Restore"),
    ("eval-run-record-without-manifest", ["eval", "run_lost_manifest", "--text", "docs.json", "--tokenizer",
                                          "tok.json"], BAD, r"run record \(run\.json\) but no manifest\.json"),
    ("eval-unknown-task", ["eval", "run", "--tasks", "piqa,bogus"], BAD, r"--tasks: unknown task 'bogus'"),
    ("probe-layers-not-int", ["probe", "run", "--layers", "0,a"], BAD, r"--layers 0,a: 'a' is not a layer index"),
    ("study-seeds-not-int", ["study", "config.yaml", "--seeds", "0,x", "--out", "st"], BAD,
     r"--seeds 0,x: 'x' is not an integer; give a comma-separated list, e.g\. --seeds 0,1,2"),
    ("study-grid-empty", ["study", "config.yaml", "--grid", "model.n_layers=,", "--out", "st"], BAD,
     r"--grid model\.n_layers is empty"),
    ("import-hf-truncated", ["import", "hf", "hf_trunc", "imported"], BAD,
     r"hf_trunc/model\.safetensors cannot be read as safetensors .*truncated"),
    ("submit-signal-after-time-limit", ["submit", "config.yaml", "--gpus-per-node", "1", "--cpu", "--time",
                                        "00:02:00", "--signal-before", "600", "--dry-run"], BAD,
     r"--signal-before 600 is not below --time 00:02:00 \(120 s\)"),
    # --- bench
    ("bench-unknown", ["bench", "bogus"], BAD, r"invalid choice: 'bogus'"),
    ("bench-kernels-tokens-not-a-size", ["bench", "kernels", "--device", "cpu", "--tokens", "4k,lots"], BAD,
     r"(--tokens 4k,lots: 'lots' is not a size.*e\.g\. --tokens 4k,16k|invalid choice: 'kernels')"),
    ("bench-kernels-width-not-a-size", ["bench", "kernels", "--device", "cpu", "--width", "1024,wide"], BAD,
     r"(--width 1024,wide: 'wide' is not a size|invalid choice: 'kernels')"),
    ("bench-workers-0", ["bench", "preprocess", "--input", "corpus.jsonl", "--tokenizer", "tok.json", "--workers",
                         "0"], BAD, r"--workers 0 must be >= 1"),
    ("bench-repeat-0", ["bench", "preprocess", "--input", "corpus.jsonl", "--tokenizer", "tok.json", "--repeat",
                        "0"], BAD, r"--repeat 0 must be >= 1"),
    ("bench-input-missing", ["bench", "preprocess", "--input", "nope.jsonl"], BAD,
     r"input 'nope\.jsonl' matches no file"),
    ("bench-kernels-cuda-without-gpu", ["bench", "kernels", "--device", "cuda"], BAD,
     r"(no CUDA GPU|invalid choice: 'kernels')"),
]


def _run_in_process(argv, capsys):
    try:
        rc = cli.main(argv)
    except SystemExit as exc:  # argparse's --help, or a verb leaving through sys.exit
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


def _assert_one_line(rc, out, err, code, pattern):
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err + out, err
    assert rc == code, (rc, err)
    assert len(lines) == 1, f"expected one stderr line, got {len(lines)}:\n{err}"
    assert lines[0].startswith("error: "), lines[0]
    assert re.search(pattern, lines[0]), f"{pattern!r} not in {lines[0]!r}"


@pytest.mark.parametrize("argv,code,pattern", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(workspace, monkeypatch, capsys, argv, code, pattern):
    monkeypatch.chdir(workspace)
    monkeypatch.delenv("MEGAFIXED_TRACEBACK", raising=False)
    before = _snapshot(workspace)
    rc, out, err = _run_in_process(argv, capsys)
    _assert_one_line(rc, out, err, code, pattern)
    after = _snapshot(workspace)
    assert after == before, {"added": sorted(set(after) - set(before)), "removed": sorted(set(before) - set(after)),
                             "changed": sorted(k for k in before if k in after and before[k] != after[k])}


def test_catalogue_is_large_and_covers_every_verb():
    verbs = {c[1][0] for c in CASES} | {c[1][0] for c in SUBPROCESS_CASES}
    assert len(CASES) + len(SUBPROCESS_CASES) >= 60
    assert {"codes", "tokenizer", "preprocess", "data", "params", "plan", "convert", "bench", "train",
            "quickstart"} <= verbs


# ----------------------------------------------------------------------------------- train / quickstart
SUBPROCESS_CASES = [
    ("train-unknown-key", ["train", CFG, "model.bogus=1"], BAD, r"unknown config key 'model\.bogus'"),
    ("train-negative-min-lr", ["train", CFG, "optimizer.min_lr=-1"], BAD, r"optimizer\.min_lr=-1\.0 is out of range"),
    ("train-layout-vs-world", ["train", CFG, "parallel.tp=2"], BAD, r"world size 1 is not divisible by parallel\.tp"),
    ("train-missing-data", ["train", CFG, "data.prefixes=[data/nope]"], BAD, r"no shards for data prefix"),
    ("train-nccl-on-cpu", ["train", CFG, "parallel.backend=nccl"], BAD, r"(?i)nccl.*(gloo|CUDA)"),
    ("train-empty-latest", ["train", CFG, "train.run_dir=run_empty_latest"], BAD,
     r"run_empty_latest/checkpoints/latest is empty; write the tag .*step_00000001.*or delete it"),
    ("train-dry-run-bad-world", ["train", CFG, "--dry-run", "--world-size", "3", "parallel.tp=2"], BAD,
     r"world size 3 is not divisible by parallel\.tp \* parallel\.pp = 2\*1"),
    ("train-dropout-with-tp", ["train", CFG, "--dry-run", "--world-size", "2", "parallel.tp=2", "model.n_heads=2",
                               "model.dropout=0.1"], BAD,
     r"model\.dropout=0\.1 with parallel\.tp=2 .*sequence_parallel"),
    ("train-bf16-zero0", ["train", CFG, "--dry-run", "zero.stage=0", "train.precision=bf16"], BAD,
     r"train\.precision=bf16 needs zero\.stage >= 1"),
    ("quickstart-bad-override", ["quickstart", "data.prefixes=[a,b"], BAD, r"override 'data\.prefixes=\[a,b'"),
]


@pytest.fixture(scope="module")
def subprocess_results(workspace, tmp_path_factory):
    """Run every train/quickstart case at once, each on its own copy of the workspace."""
    # launcher-free: an in-process run of an earlier file (test_hf's DeepSpeed init) leaves
    # WORLD_SIZE/RANK/LOCAL_RANK set, and a child that inherited them would think it is a rank of a world
    env = launch_free_env(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("MEGAFIXED_TRACEBACK", None)
    procs = {}
    for name, argv, _, _ in SUBPROCESS_CASES:
        ws = tmp_path_factory.mktemp(name)
        shutil.copytree(workspace, ws, dirs_exist_ok=True)
        before = _snapshot(ws)
        p = subprocess.Popen([sys.executable, "-m", "megafixed.cli", *argv], cwd=ws, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs[name] = (p, ws, before)
    results = {}
    for name, (p, ws, before) in procs.items():
        out, err = p.communicate(timeout=300)
        results[name] = (p.returncode, out, err, before, _snapshot(ws))
    return results


@pytest.mark.parametrize("name,code,pattern", [(c[0], c[2], c[3]) for c in SUBPROCESS_CASES],
                         ids=[c[0] for c in SUBPROCESS_CASES])
def test_bad_input_train_and_quickstart(subprocess_results, name, code, pattern):
    rc, out, err, before, after = subprocess_results[name]
    # deepspeed may log at import; the contract is about our error line and the user's files
    err = "\n".join(ln for ln in err.splitlines() if not re.match(r"^\[\d{4}-\d\d-\d\d .*\] \[(INFO|WARNING)\]", ln))
    _assert_one_line(rc, out, err, code, pattern)
    assert after == before, {"added": sorted(set(after) - set(before)), "removed": sorted(set(before) - set(after))}


# ----------------------------------------------------------------------------------- damage regressions
# Each of these once replaced or damaged data a user already had, without a word.
def _copy(workspace, tmp_path) -> Path:
    ws = tmp_path / "ws"
    shutil.copytree(workspace, ws)
    return ws


def test_preprocess_onto_a_prefix_of_another_tokenizer_keeps_it_until_overwrite(workspace, tmp_path, monkeypatch,
                                                                                   capsys):
    ws = _copy(workspace, tmp_path)
    monkeypatch.chdir(ws)
    before = _snapshot(ws)
    argv = ["preprocess", "--input", "corpus.jsonl", "--tokenizer", "tok2.json", "--output-prefix", "data/corpus"]
    assert cli.main(argv) == BAD
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert _snapshot(ws) == before
    # asked explicitly: replaced, and the new sidecar records the new tokenizer
    assert cli.main(argv + ["--overwrite"]) == 0
    meta = json.loads((ws / "data" / "corpus.meta.json").read_text())
    assert meta["tokenizer"]["path"] == str(ws / "tok2.json") and meta["vocab_size"] == 360


def test_merge_onto_an_input_is_refused_and_a_merge_keeps_the_sidecar_facts(workspace, tmp_path, monkeypatch, capsys):
    ws = _copy(workspace, tmp_path)
    monkeypatch.chdir(ws)
    before = _snapshot(ws)
    assert cli.main(["data", "merge", "--inputs", "data/corpus", "data/corpus", "--output-prefix", "data/corpus",
                     "--overwrite"]) == BAD
    assert "is also an input" in capsys.readouterr().err
    assert _snapshot(ws) == before
    assert cli.main(["data", "merge", "--inputs", "data/corpus", "data/corpus", "--output-prefix", "merged/two"]) == 0
    merged = json.loads((ws / "merged" / "two.meta.json").read_text())
    src = json.loads((ws / "data" / "corpus.meta.json").read_text())
    for key in ("tokenizer", "tokenizer_sha256", "vocab_size", "eod_id", "append_eod"):
        assert merged[key] == src[key], key  # the trainer's vocab / EOD checks need them
    capsys.readouterr()
    assert cli.main(["data", "inspect", "merged/two", "--docs", "1"]) == 0  # decodes with the recorded tokenizer


def test_tokenizer_train_onto_the_shards_tokenizer_is_refused_and_inspect_still_decodes(workspace, tmp_path,
                                                                                          monkeypatch, capsys):
    ws = _copy(workspace, tmp_path)
    monkeypatch.chdir(ws)
    # shards of this copy record this copy's tokenizer (sidecars hold absolute paths)
    assert cli.main(["preprocess", "--input", "corpus.jsonl", "--tokenizer", "tok.json", "--output-prefix",
                     "mine/corpus"]) == 0
    before = _snapshot(ws)
    assert cli.main(["tokenizer", "train", "--input", "corpus.jsonl", "--vocab-size", "300", "--output",
                     "tok.json"]) == BAD
    assert "--output tok.json already exists" in capsys.readouterr().err
    assert _snapshot(ws) == before
    assert cli.main(["data", "inspect", "mine/corpus", "--docs", "1"]) == 0
    assert "Traceback" not in capsys.readouterr().err
    # forced anyway: `data inspect` now says the shards' tokenizer changed instead of printing garbage
    assert cli.main(["tokenizer", "train", "--input", "corpus.jsonl", "--vocab-size", "300", "--output", "tok.json",
                     "--overwrite"]) == 0
    capsys.readouterr()
    assert cli.main(["data", "inspect", "mine/corpus", "--docs", "1"]) == BAD
    assert "changed since mine/corpus was written" in capsys.readouterr().err


def test_convert_into_the_runs_own_checkpoints_leaves_latest_alone(workspace, tmp_path, monkeypatch, capsys):
    ws = _copy(workspace, tmp_path)
    monkeypatch.chdir(ws)
    before = _snapshot(ws)
    for out in ("run/checkpoints", "run/checkpoints/"):
        assert cli.main(["convert", "run/checkpoints", out, "--tp", "2", "--overwrite"]) == BAD
        assert "live checkpoint directory" in capsys.readouterr().err
    assert _snapshot(ws) == before
    assert (ws / "run" / "checkpoints" / "latest").read_text().strip() == "step_00000001"


def test_convert_overwrite_replaces_an_earlier_layout_without_stale_shards(workspace, tmp_path, monkeypatch, capsys):
    ws = _copy(workspace, tmp_path)
    monkeypatch.chdir(ws)
    assert cli.main(["convert", "run/checkpoints", "conv", "--tp", "2"]) == 0
    assert sorted(p.name for p in (ws / "conv" / "converted").iterdir()) == [
        "manifest.json", "mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]
    assert cli.main(["convert", "run/checkpoints", "conv", "--tp", "1"]) == BAD  # exists
    assert cli.main(["convert", "run/checkpoints", "conv", "--tp", "1", "--overwrite"]) == 0
    assert sorted(p.name for p in (ws / "conv" / "converted").iterdir()) == ["manifest.json",
                                                                              "mp_rank_00_model_states.pt"]
    assert (ws / "conv" / "latest").read_text().strip() == "converted"
    assert not [p for p in (ws / "conv").iterdir() if p.name.startswith(".")]  # no temp dir left


# ----------------------------------------------------------------------------------- inputs that must work
def test_inspect_an_empty_shard_without_a_sidecar(workspace, monkeypatch, capsys):
    monkeypatch.chdir(workspace)
    assert cli.main(["data", "inspect", "data/empty"]) == 0
    out = capsys.readouterr().out
    assert "documents: 0" in out and "(no documents)" in out


def test_codes_above_the_exhaustive_limit_check_a_sample_in_bounded_memory(capsys):
    from megafixed.commands import codes

    assert cli.main(["codes", "--bits", str(codes.EXHAUSTIVE_MAX_BITS + 1), "0"]) == 0
    assert "sampled ids" in capsys.readouterr().out


def test_a_cuda_device_is_refused_on_a_machine_without_one():
    import torch

    from megafixed.commands.bench import check_device
    from megafixed.config import ConfigError

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError, match=r"--device cuda: this machine has no CUDA GPU.*--device cpu"):
        check_device("cuda")
    check_device("cpu")


def test_every_numeric_config_field_has_a_range():
    import dataclasses
    import typing

    from megafixed.config import Config
    from megafixed.config_checks import CHECKED_ELSEWHERE, RANGES

    missing = []
    for sec in dataclasses.fields(Config):
        hints = typing.get_type_hints(sec.type if isinstance(sec.type, type) else type(getattr(Config(), sec.name)))
        for name, tp in hints.items():
            key = f"{sec.name}.{name}"
            numeric = any(t in (int, float) for t in (tp, *typing.get_args(tp)))
            listy = tp is list or typing.get_origin(tp) is list or list in typing.get_args(tp)
            if numeric and key not in RANGES and key not in CHECKED_ELSEWHERE:
                missing.append(key)
            if listy and key in ("data.weights",) and f"{key}[]" not in RANGES:
                missing.append(key)
    assert not missing, f"numeric config fields without a range in megafixed/config_checks.py: {missing}"
