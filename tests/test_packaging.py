"""A regular (non-editable) install runs the main job from any directory, and writes only into the
cwd (the run) and the user cache -- never into the install tree. Plus the pieces that make it so:
``bundled:`` paths, ``cache_dir()``, cache keying, no stray folders after a failure."""
from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from megafixed import paths
from megafixed.config import load_config
from megafixed.data.prepare import prepare_data

ROOT = Path(__file__).resolve().parent.parent
BUNDLED_FILES = ("megafixed/bundled/wiki_vital_en.jsonl.gz", "megafixed/bundled/quickstart.yaml",
                 "megafixed/bundled/README.md")
SMALL = ["data.tokenizer_train_vocab=512", "model.vocab_size=512", "model.code_bits=9", "model.d_model=64",
         "model.n_heads=4", "model.n_layers=1", "model.max_seq_len=64", "data.seq_len=32"]


def _tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


def _build_wheel(tmp: Path) -> Path:
    # Build from a copy: an in-tree build writes build/ and *.egg-info into the working tree.
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "runs", "*.egg-info", "__pycache__", ".pytest_cache", "cache", ".venv"))
    out = tmp / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(src)], check=True, capture_output=True, text=True, timeout=300)
    (wheel,) = out.glob("megafixed-*.whl")
    return wheel


def test_wheel_runs_quickstart_from_any_directory(tmp_path):
    wheel = _build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        site = tmp_path / "site"
        zf.extractall(site)  # what `pip install` of the wheel puts in site-packages (minus scripts)
    assert set(BUNDLED_FILES) <= names, "package data missing from the wheel"
    assert "megafixed/kernels/token_codes.py" in names  # kernels/ installs as megafixed.kernels
    assert not any(n.startswith(("tests/", "examples/", "docs/")) for n in names)  # the library only
    before = _tree_digest(site)

    cwd, cache = tmp_path / "elsewhere", tmp_path / "user-cache"
    cwd.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site), "MEGAFIXED_CACHE_DIR": str(cache),
           # a real install byte-compiles at install time; here, don't let imports add .pyc files
           "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, "-m", "megafixed.cli", "quickstart", "train.max_steps=2", "validation.interval=0",
         "train.global_batch=16", "model.n_layers=1", "model.d_model=64", "model.n_heads=2",
         "metrics.tensorboard=false", "--sample-tokens=2"],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"STDOUT:\n{proc.stdout[-3000:]}\nSTDERR:\n{proc.stderr[-5000:]}"

    summary = json.loads((cwd / "runs" / "quickstart" / "quickstart.json").read_text())
    assert summary["steps"] == 2 and Path(summary["run_dir"]) == (cwd / "runs" / "quickstart").resolve()
    tokenizers = list((cache / "data").glob("wiki_vital_en-*/wiki_vital_en.tok4096.json"))
    assert len(tokenizers) == 1 and tokenizers[0].with_suffix(".idx").exists()
    assert f"tokenizer {tokenizers[0]}" in proc.stdout
    assert _tree_digest(site) == before, "the run wrote into the install tree"
    assert sorted(p.name for p in cwd.iterdir()) == ["runs"]


def test_bundled_paths_resolve_from_any_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = paths.resolve("bundled:wiki_vital_en.jsonl.gz")
    assert os.path.isabs(path) and os.path.isfile(path)
    assert paths.resolve("data/x.jsonl") == "data/x.jsonl" and paths.resolve(None) is None
    cfg = load_config(str(paths.bundled("quickstart.yaml")))
    assert cfg.data.source == "bundled:wiki_vital_en.jsonl.gz"
    # the repository's examples/configs/quickstart.yaml is the packaged config, by include
    assert load_config(str(ROOT / "examples" / "configs" / "quickstart.yaml")) == cfg


def test_cache_dir_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGAFIXED_CACHE_DIR", str(tmp_path / "mf"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert paths.cache_dir("a", "b") == tmp_path / "mf" / "a" / "b"
    monkeypatch.delenv("MEGAFIXED_CACHE_DIR")
    assert paths.cache_dir() == tmp_path / "xdg" / "megafixed"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/xdg")  # invalid per the XDG spec: ignored
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert paths.cache_dir() == tmp_path / "home" / ".cache" / "megafixed"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert paths.cache_dir("x") == tmp_path / "home" / ".cache" / "megafixed" / "x"
    assert not (tmp_path / "home").exists()  # computing the path creates nothing


def _small_corpus(path: Path, docs: int = 200) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(paths.bundled("wiki_vital_en.jsonl.gz"), "rb") as src, gzip.open(path, "wb") as dst:
        for _, line in zip(range(docs), src):
            dst.write(line)
    return path


def test_prepare_caches_in_the_user_cache_keyed_by_source(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGAFIXED_CACHE_DIR", str(tmp_path / "cache"))
    a = _small_corpus(tmp_path / "a" / "corpus.jsonl.gz", 200)
    b = _small_corpus(tmp_path / "b" / "corpus.jsonl.gz", 150)  # same file name, other corpus
    src_before = {p: _tree_digest(p.parent) for p in (a, b)}
    cfg_a = prepare_data(load_config(None, [f"data.source={a}", *SMALL]), progress=False)
    cfg_b = prepare_data(load_config(None, [f"data.source={b}", *SMALL]), progress=False)
    for cfg in (cfg_a, cfg_b):
        assert Path(cfg.data.tokenizer).parent.parent == tmp_path / "cache" / "data"
        assert Path(cfg.data.prefixes[0]).parent == Path(cfg.data.tokenizer).parent
    assert cfg_a.data.prefixes != cfg_b.data.prefixes
    from megafixed.data.indexed import IndexedShard
    assert IndexedShard(cfg_a.data.prefixes[0]).num_documents == 200
    assert IndexedShard(cfg_b.data.prefixes[0]).num_documents == 150
    assert {p: _tree_digest(p.parent) for p in (a, b)} == src_before  # nothing next to the sources


def test_failed_preparation_leaves_no_cache_folders(tmp_path, monkeypatch):
    from megafixed.data import tokenizers
    from megafixed.data.errors import DataError

    def fails_after_making_its_folder(sources, output, *args, **kwargs):
        os.makedirs(os.path.dirname(output), exist_ok=True)  # as the real writer does first
        raise DataError("tokenizer training failed")

    cache = tmp_path / "cache"
    monkeypatch.setenv("MEGAFIXED_CACHE_DIR", str(cache))
    monkeypatch.setattr(tokenizers, "train_tokenizer", fails_after_making_its_folder)
    corpus = _small_corpus(tmp_path / "corpus.jsonl.gz", 10)
    with pytest.raises(DataError, match="tokenizer training failed"):
        prepare_data(load_config(None, [f"data.source={corpus}", *SMALL]), progress=False)
    assert not cache.exists()
    # a folder that existed before is kept, even when empty
    cache.mkdir()
    with pytest.raises(DataError):
        prepare_data(load_config(None, [f"data.source={corpus}", *SMALL]), progress=False)
    assert cache.is_dir() and not any(cache.iterdir())


def test_runtime_env_defaults_extensions_dir_to_the_user_cache(tmp_path, monkeypatch):
    from megafixed.engine.deepspeed.env import prepare_runtime_env

    monkeypatch.setenv("MEGAFIXED_CACHE_DIR", str(tmp_path / "mf"))
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    prepare_runtime_env()
    # One folder per environment (python, torch, DeepSpeed, compiler flags, CPU): engine/deepspeed/ops.py.
    from megafixed.engine.deepspeed.ops import build_key
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(tmp_path / "mf" / "torch_extensions" / build_key())
    assert not (tmp_path / "mf").exists()


def test_known_library_noise_is_filtered_and_the_rest_is_not():
    from megafixed.engine.deepspeed.env import quiet_library_noise

    quiet_library_noise()
    quiet_library_noise()  # idempotent
    logger = logging.getLogger("DeepSpeed")

    def record(msg):
        return logging.LogRecord("DeepSpeed", logging.WARNING, __file__, 1, msg, None, None)

    assert not logger.filter(record("**** You are using ZeRO with an untested optimizer, proceed with caution *****"))
    assert not logger.filter(record("Setting accelerator to CPU. If you have GPU or other accelerator, ..."))
    assert logger.filter(record("NaN or Inf found in input tensor."))
    assert sum(type(f).__name__ == "_DropHarmless" for f in logger.filters) == 1
