"""``prepare_data(cfg)``: make a run's data ready -- train a tokenizer and tokenize a raw corpus on
first use (cached), then check that the tokenizer fits the model and its fixed codes.

With ``data.source`` set (the quickstart's bundled corpus) and nothing else, the defaults are::

    data.tokenizer   = <cache>/<stem>.tok<V>.json     (HF byte-level BPE, V = tokenizer_train_vocab)
    data.prefixes[0] = <cache>/<stem>.tok<V>          (Megatron .bin/.idx)

where ``<cache>`` is ``data.cache_dir`` if set, else ``cache_dir("data", "<stem>-<hash of the source
paths>")`` in the user cache (``megafixed.paths``; ``$MEGAFIXED_CACHE_DIR`` overrides it). The hash
keeps two corpora with the same file name apart; the install tree (where ``bundled:`` sources live)
is never written to. A tokenizer path ending in ``.model`` trains a sentencepiece BPE instead.
Shards are rebuilt when the source or the tokenizer file changes (their size + mtime are recorded
in the shard's ``.meta.json``).

Multi-process: only ``is_main`` writes. Other ranks poll until the files are complete (a shard
is complete once its ``.idx`` exists: it is renamed into place last), so no barrier is needed --
though calling it on rank 0 first and barriering is equally fine.
"""
from __future__ import annotations

import copy
import hashlib
import logging
import os
import time
from typing import Callable, Optional

from ..paths import cache_dir as user_cache_dir
from ..paths import resolve as resolve_bundled
from .errors import DataError, check_vocab_fits
from .indexed import IndexedShard, meta_path, shard_exists
from .prefixes import resolve_prefix
from .readers import expand_inputs

log = logging.getLogger(__name__)
CORPUS_SUFFIXES = (".gz", ".zst", ".zstd", ".jsonl", ".json", ".ndjson", ".parquet", ".txt")


def _stem(path: str) -> str:
    name = os.path.basename(path)
    while True:
        for suf in CORPUS_SUFFIXES:
            if name.endswith(suf) and len(name) > len(suf):
                name = name[: -len(suf)]
                break
        else:
            return name


def _stat(path: str) -> list:
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns]


def _fingerprint(sources: list[str], tokenizer: str, json_key: str) -> dict:
    return {"sources": {os.path.abspath(s): _stat(s) for s in sources},
            "tokenizer": _stat(tokenizer), "json_key": json_key}


def _shards_match(prefix: str, fingerprint: dict) -> bool:
    if not shard_exists(prefix):
        return False
    try:
        import json

        with open(meta_path(prefix)) as fh:
            return json.load(fh).get("prepare_fingerprint") == fingerprint
    except (OSError, ValueError):
        return False


def _made_by_prepare(prefix: str) -> bool:
    """True if the shard's meta records a prepare fingerprint (so it is a cache we may rebuild)."""
    try:
        import json

        with open(meta_path(prefix)) as fh:
            return "prepare_fingerprint" in json.load(fh)
    except (OSError, ValueError):
        return False


def _wait_for(what: str, ready: Callable[[], bool], timeout_s: float, poll_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise DataError(f"waited {timeout_s:.0f}s for the main process to write {what}; check the main "
                            f"process's log (it may have failed), or run prepare_data there first")
        time.sleep(poll_s)


def _abs(path: Optional[str]) -> Optional[str]:
    path = resolve_bundled(path)
    return os.path.abspath(os.path.expanduser(path)) if path else path


def _default_cache(sources: list[str]) -> str:
    """The user-cache folder for the tokenizer and shards made from ``sources``: the stem names it
    for people, a hash of the absolute source paths keeps two ``corpus.jsonl`` in different folders
    from overwriting each other's shards."""
    key = hashlib.sha256("\n".join(os.path.abspath(s) for s in sources).encode()).hexdigest()[:12]
    return str(user_cache_dir("data", f"{_stem(sources[0])}-{key}"))


def _missing_dirs(path: str) -> list[str]:
    """``path`` and those of its ancestors that do not exist yet, deepest first."""
    out = []
    path = os.path.abspath(path)
    while not os.path.exists(path):
        out.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return out


def _remove_empty(dirs: list[str]) -> None:
    for d in dirs:  # deepest first; stops at the first one that holds something (or is gone)
        try:
            os.rmdir(d)
        except OSError:
            break


def _make_tokenizer_and_shards(cfg, sources: list[str], is_main: bool, wait_timeout_s: float, poll_s: float,
                               workers: Optional[int], progress: bool) -> None:
    """Train ``data.tokenizer`` and tokenize ``sources`` into ``data.prefixes[0]`` unless both are current."""
    from ..model.interfaces import interface_of

    d = cfg.data
    if not os.path.exists(d.tokenizer):
        # Refuse a vocabulary the model cannot hold before spending the training (and tokenizing) time.
        check_vocab_fits(d.tokenizer_train_vocab, model_vocab=cfg.model.vocab_size,
                         code_bits=interface_of(cfg.model).id_bits(cfg.model),
                         where="data.tokenizer_train_vocab (the tokenizer to train)")
        if is_main:
            from .tokenizers import train_tokenizer

            t0 = time.perf_counter()
            train_tokenizer(sources, d.tokenizer, d.tokenizer_train_vocab, kind="bpe", json_key=d.source_json_key)
            log.info("trained tokenizer %s (vocab %d) in %.1fs", d.tokenizer, d.tokenizer_train_vocab,
                     time.perf_counter() - t0)
        else:
            _wait_for(d.tokenizer, lambda: os.path.exists(d.tokenizer), wait_timeout_s, poll_s)
    fp = _fingerprint(sources, d.tokenizer, d.source_json_key)
    prefix = d.prefixes[0]
    if not _shards_match(prefix, fp):
        if shard_exists(prefix) and not _made_by_prepare(prefix):
            # Shards at an explicit data.prefixes[0] that this function did not write are the user's
            # (e.g. `data.prefixes=...` over the quickstart config): re-tokenizing would overwrite them.
            raise DataError(f"data.prefixes[0]={prefix} holds shards that were not tokenized from "
                            f"data.source={d.source}; refusing to overwrite them. To train on those shards "
                            f"set data.source=null; to tokenize data.source, point data.prefixes elsewhere")
        if is_main:
            from .preprocess import PreprocessOptions, preprocess

            report = preprocess(PreprocessOptions(
                inputs=sources, output_prefix=prefix, tokenizer=d.tokenizer, json_keys=[d.source_json_key],
                workers=workers or min(32, os.cpu_count() or 1), append_eod=True, progress=progress,
                extra_meta={"prepare_fingerprint": fp}))
            log.info("%s", report.summary())
        else:
            _wait_for(f"{prefix}.bin/.idx", lambda: _shards_match(prefix, fp), wait_timeout_s, poll_s)


def prepare_data(cfg, is_main: bool = True, wait_timeout_s: float = 6 * 3600, poll_s: float = 1.0,
                 workers: Optional[int] = None, progress: bool = True):
    """Train the tokenizer / tokenize ``data.source`` if needed, validate, return cfg with absolute paths."""
    cfg = copy.deepcopy(cfg)
    d = cfg.data
    if d.mock:  # synthetic tokens (megafixed.data.mock): nothing to tokenize or check on disk
        return cfg
    d.cache_dir = _abs(d.cache_dir)
    if d.source:
        d.source = resolve_bundled(d.source)
        sources = expand_inputs([d.source])
        cache = d.cache_dir or _default_cache(sources)
        name = f"{_stem(sources[0])}.tok{d.tokenizer_train_vocab}"
        d.tokenizer = _abs(d.tokenizer) or os.path.join(cache, name + ".json")
        d.prefixes = [_abs(p) for p in d.prefixes] or [os.path.join(cache, name)]
        # The writers below create the folders they write into; if preparation fails, remove the
        # ones that are still empty, so a failed first run leaves no stray cache folders.
        created = [_missing_dirs(os.path.dirname(p)) for p in (d.tokenizer, d.prefixes[0])] if is_main else []
        try:
            _make_tokenizer_and_shards(cfg, sources, is_main, wait_timeout_s, poll_s, workers, progress)
        except BaseException:
            for chain in created:
                _remove_empty(chain)
            raise
    else:
        d.tokenizer = _abs(d.tokenizer)
        d.prefixes = [_abs(p) for p in d.prefixes]
    if not d.prefixes:
        raise DataError("no data: set data.prefixes (preprocessed shards) or data.source (a raw corpus)")
    for p in d.prefixes:
        resolve_prefix(p)  # a clear error now beats one deep inside the trainer
    _check_vocab(cfg)
    return cfg


def _check_vocab(cfg) -> None:
    from ..model.interfaces import interface_of

    d, m = cfg.data, cfg.model
    if d.tokenizer:
        from .tokenizers import load_tokenizer

        tok = load_tokenizer(d.tokenizer)
        vocab, where = tok.vocab_size, f"tokenizer {d.tokenizer}"
    else:  # no tokenizer given: trust what preprocessing recorded next to the first shard
        first = resolve_prefix(d.prefixes[0])[0]
        vocab = IndexedShard(first).meta().get("vocab_size")
        where = f"the tokenizer of shard {first}"
        if vocab is None:
            # Shards without a recorded vocabulary (written elsewhere): an id past the model's vocab
            # would only surface mid-run (an IndexError in the embedding or the loss, a device assert
            # on GPU), so scan them once here. One sequential read of the .bin files.
            vocab, where = _largest_id_plus_one(d.prefixes)
            if vocab is None:
                return
    check_vocab_fits(int(vocab), model_vocab=m.vocab_size,
                     code_bits=interface_of(m).id_bits(m), where=where)


def _largest_id_plus_one(prefixes: list) -> tuple:
    """(largest token id + 1, which shard holds it) over all shards of ``prefixes``; (None, "") if empty."""
    best, where = None, ""
    for p in prefixes:
        for shard_prefix in resolve_prefix(p):
            tokens = IndexedShard(shard_prefix).tokens
            top = int(tokens.max()) + 1 if tokens.size else None
            if top is not None and (best is None or top > best):
                best = top
                where = f"shard {shard_prefix} (no vocab_size in its .meta.json; largest token id {best - 1})"
    return best, where
