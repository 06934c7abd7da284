"""GPT training samples from Megatron shards: windows across documents, blends, splits, exact resume.

How a sample is defined (everything below is arithmetic on small arrays, no per-sample tables):

* **Split by documents.** Each prefix's documents (over all of its shards, in order) are cut into
  contiguous train / valid / test ranges by ``data.split`` shares (like Megatron). A split of a
  prefix is one *component*: the concatenation of its documents' tokens, EOD tokens included
  (preprocessing appends them), so samples run across document boundaries.
* **Windows.** Sample ``s`` of a component is tokens ``[s*L, s*L + L + 1)`` with ``L = seq_len``
  (inputs and shifted targets share L tokens; consecutive samples overlap by one token). A
  component of ``T`` tokens has ``(T - 1) // L`` samples per epoch.
* **Epoch order.** Component epoch ``e`` visits its samples in the order of a permutation drawn
  from ``PCG64([seed, component, split, e])``: every epoch has its own, reproducible order.
* **Blend.** One dataset epoch holds ``n_c`` samples of component ``c`` (``n_c`` proportional to the
  weights, or to the component sizes when ``data.weights`` is null); the interleave puts the
  ``k``-th sample of ``c`` at time ``(k + 0.5) / n_c`` and sorts, so every stretch of the stream
  matches the weights. That sort is the one costly piece; it is cached next to the data.
* **Caching.** With one prefix nothing is worth caching: a sample is arithmetic on the .idx arrays
  (read and validated at open in milliseconds even at 1e9 tokens). A blend's interleave index is
  cached (``data.cache_dir`` or next to the first shard) with the size + mtime of every shard file,
  and rebuilt when any of them changes.
* ``dataset[idx]`` accepts any ``idx >= 0``: ``idx >= len(dataset)`` continues into later epochs.
  So a resumed run that restarts at ``consumed_samples`` sees exactly the samples it would have seen.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np

from ..config import check_blend_weights
from ..config import split_shares as checked_shares
from .errors import DataError
from .indexed import IndexedShard, bin_path, idx_path
from .prefixes import resolve_prefix

log = logging.getLogger(__name__)
SPLITS = ("train", "valid", "test")
CACHE_VERSION = 1


def split_shares(split: str) -> np.ndarray:
    """``data.split``'s shares, normalised (checked by the config's one rule)."""
    shares = np.array(checked_shares(split, error=DataError), dtype=np.float64)
    return shares / shares.sum()


def split_boundaries(num_docs: int, split: str) -> list[int]:
    """Document indices [0, b1, b2, num_docs] cutting train / valid / test."""
    cum = np.concatenate([[0.0], np.cumsum(split_shares(split))])
    bounds = [int(round(c * num_docs)) for c in cum]
    bounds[-1] = num_docs
    return bounds


# ----------------------------------------------------------------------------------- components
@dataclass
class Component:
    """One prefix's documents in one split, as token ranges of its shards."""
    name: str
    ranges: list  # [(shard prefix, first token, end token)]
    seq_len: int

    def __post_init__(self):
        self._shards: dict = {}
        sizes = np.array([b - a for _, a, b in self.ranges], dtype=np.int64)
        self.cum = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.num_tokens = int(self.cum[-1])
        self.num_samples = max(0, (self.num_tokens - 1) // self.seq_len)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_shards"] = {}  # reopen memmaps in the receiving process
        return state

    def _shard(self, prefix: str) -> IndexedShard:
        if prefix not in self._shards:
            self._shards[prefix] = IndexedShard(prefix)
        return self._shards[prefix]

    def window(self, sample: int) -> np.ndarray:
        """Tokens [sample*L, sample*L + L + 1) of the component stream, as int64."""
        need = self.seq_len + 1
        start = sample * self.seq_len
        out = np.empty(need, dtype=np.int64)
        piece = int(np.searchsorted(self.cum, start, side="right")) - 1
        filled = 0
        while filled < need:
            prefix, a, b = self.ranges[piece]
            off = a + (start + filled - int(self.cum[piece]))
            take = min(need - filled, b - off)
            out[filled:filled + take] = self._shard(prefix).tokens[off:off + take]
            filled += take
            piece += 1
        return out


def _doc_token_offsets(shard: IndexedShard) -> np.ndarray:
    """Token offset where each document starts, plus the end (len num_documents + 1)."""
    seq_starts = np.append(shard.pointers // shard.dtype.itemsize, shard.num_tokens).astype(np.int64)
    return seq_starts[np.asarray(shard.doc_indices)]


def _components_for_prefix(prefix: str, split: str, seq_len: int) -> list[Component]:
    shards = [IndexedShard(p) for p in resolve_prefix(prefix)]
    if shards[0].meta().get("append_eod") is False:
        log.warning("%s was preprocessed without EOD tokens: samples will run documents together with no "
                    "separator (re-run preprocessing with --append-eod)", prefix)
    offsets = [_doc_token_offsets(s) for s in shards]
    doc_counts = np.array([s.num_documents for s in shards], dtype=np.int64)
    first_doc = np.concatenate([[0], np.cumsum(doc_counts)])
    bounds = split_boundaries(int(first_doc[-1]), split)
    comps = []
    for si, name in enumerate(SPLITS):
        d0, d1 = bounds[si], bounds[si + 1]
        ranges = []
        for k, s in enumerate(shards):  # intersect [d0, d1) with shard k's documents
            lo, hi = max(d0, first_doc[k]) - first_doc[k], min(d1, first_doc[k + 1]) - first_doc[k]
            if hi > lo:
                a, b = int(offsets[k][lo]), int(offsets[k][hi])
                if b > a:
                    ranges.append((s.prefix, a, b))
        comp = Component(f"{prefix}[{name}]", ranges, seq_len)
        comp._shards = {s.prefix: s for s in shards}  # share the open (already validated) shards
        comps.append(comp)
    return comps


# ----------------------------------------------------------------------------------- blending
def _blend_counts(sizes: np.ndarray, weights: Optional[list]) -> np.ndarray:
    """Samples of each component per dataset epoch (largest-remainder rounding of the weights)."""
    if weights is None:
        return sizes.copy()
    w = np.asarray(weights, dtype=np.float64)
    total = int(sizes.sum())
    exact = w / w.sum() * total
    counts = np.floor(exact).astype(np.int64)
    rest = total - int(counts.sum())
    if rest > 0:
        counts[np.argsort(-(exact - counts), kind="stable")[:rest]] += 1
    return counts


def _blend_index(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Interleave: component ``c``'s ``k``-th sample sits at time ``(k + 0.5) / n_c``; stable sort."""
    comp = np.repeat(np.arange(len(counts), dtype=np.int32), counts)
    local = np.concatenate([np.arange(n, dtype=np.int64) for n in counts]) if len(counts) else np.zeros(0, np.int64)
    times = (local + 0.5) / np.repeat(np.maximum(counts, 1), counts)
    order = np.argsort(times, kind="stable")
    return comp[order], local[order]


def _fingerprint(comps: list[Component]) -> dict:
    """Size and mtime of every shard file used: a changed shard invalidates the cached index."""
    files = sorted({f for c in comps for p, _, _ in c.ranges for f in (bin_path(p), idx_path(p))})
    return {os.path.abspath(f): [os.path.getsize(f), os.stat(f).st_mtime_ns] for f in files}


class GPTDataset:
    """Samples of ``seq_len + 1`` int64 tokens; see the module docstring for the exact definition."""

    def __init__(self, components: list[Component], weights: Optional[list], seq_len: int, seed: int,
                 split: str = "train", cache_dir: Optional[str] = None):
        self.components = components
        self.seq_len, self.seed, self.split = seq_len, int(seed), split
        self.split_id = SPLITS.index(split) if split in SPLITS else 0
        self.sizes = np.array([c.num_samples for c in components], dtype=np.int64)
        self.counts = _blend_counts(self.sizes, weights)
        if np.any((self.counts > 0) & (self.sizes == 0)):
            empty = [c.name for c, n, s in zip(components, self.counts, self.sizes) if n and not s]
            raise DataError(f"{empty} hold fewer than seq_len+1={seq_len + 1} tokens but have a blend weight; "
                            f"drop them from data.prefixes or lower data.seq_len")
        self._len = int(self.counts.sum())
        self._perms: dict = {}
        self._blend = None
        if len(components) > 1:
            self._blend = self._load_or_build_blend(cache_dir)

    # -------------------------------------------------------------------------- caching
    def _cache_key(self) -> str:
        ranges = [[os.path.abspath(p), a, b] for c in self.components for p, a, b in c.ranges]
        desc = {"v": CACHE_VERSION, "comps": ranges,
                "counts": self.counts.tolist(), "seq_len": self.seq_len}
        return hashlib.sha1(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]

    def _load_or_build_blend(self, cache_dir: Optional[str]):
        first = self.components[0].ranges[0][0] if self.components[0].ranges else "blend"
        folder = cache_dir or os.path.dirname(os.path.abspath(first))
        base = os.path.join(folder, f"{os.path.basename(first)}.{self.split}.{self._cache_key()}.blend")
        fp = _fingerprint(self.components)
        try:
            with open(base + ".json") as fh:
                meta = json.load(fh)
            if meta.get("fingerprint") == fp:
                return np.load(base + ".comp.npy", mmap_mode="r"), np.load(base + ".local.npy", mmap_mode="r")
            log.info("blend index %s is stale (shards changed); rebuilding", base)
        except (OSError, ValueError):
            pass
        comp, local = _blend_index(self.counts)
        made = not os.path.isdir(folder)
        try:
            os.makedirs(folder, exist_ok=True)
            tag = f".tmp.{socket.gethostname()}.{os.getpid()}"  # every rank may write; names never clash
            for name, arr in (("comp", comp), ("local", local)):
                with open(f"{base}.{name}.npy{tag}", "wb") as fh:
                    np.save(fh, arr)
                os.replace(f"{base}.{name}.npy{tag}", f"{base}.{name}.npy")
            with open(base + ".json" + tag, "w") as fh:  # written last: marks the cache complete
                json.dump({"fingerprint": fp, "counts": self.counts.tolist()}, fh)
            os.replace(base + ".json" + tag, base + ".json")
        except OSError as exc:  # a read-only data dir must not stop training
            log.warning("cannot cache the blend index in %s (%s); set data.cache_dir", folder, exc)
            if made:  # leave no empty cache folder behind
                import shutil

                shutil.rmtree(folder, ignore_errors=True)
        return comp, local

    # -------------------------------------------------------------------------- sampling
    def __len__(self) -> int:
        return self._len

    @property
    def num_tokens(self) -> int:
        return int(sum(c.num_tokens for c in self.components))

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_perms"] = {}
        return state

    def _perm(self, c: int, epoch: int) -> np.ndarray:
        key = (c, epoch)
        if key not in self._perms:
            if len(self._perms) > 8:  # keep a few epochs per component: eval loops revisit epoch 0
                self._perms.pop(next(iter(self._perms)))
            rng = np.random.Generator(np.random.PCG64([self.seed, c, self.split_id, epoch]))
            self._perms[key] = rng.permutation(int(self.sizes[c]))
        return self._perms[key]

    def locate(self, idx: int) -> tuple[int, int]:
        """Global sample index -> (component, window index inside the component)."""
        idx = int(idx)
        if idx < 0:
            raise IndexError(f"sample index {idx} < 0")
        epoch, j = divmod(idx, self._len)
        if self._blend is None:
            c, k = 0, idx
        else:
            c = int(self._blend[0][j])
            k = int(self._blend[1][j]) + epoch * int(self.counts[c])
        comp_epoch, m = divmod(k, int(self.sizes[c]))
        return c, int(self._perm(c, comp_epoch)[m])

    def __getitem__(self, idx: int) -> np.ndarray:
        c, s = self.locate(idx)
        return self.components[c].window(s)

    def __repr__(self) -> str:
        return (f"GPTDataset({self.split}: {self._len} samples/epoch of {self.seq_len + 1} tokens, "
                f"{len(self.components)} components, {self.num_tokens} tokens)")


# ----------------------------------------------------------------------------------- building
def build_datasets(data_cfg, seed: int) -> dict:
    """``{"train", "valid", "test"}`` -> :class:`GPTDataset`, or None for an empty split."""
    prefixes = list(data_cfg.prefixes or [])
    if not prefixes:
        raise DataError("data.prefixes is empty; set it to preprocessed shard prefixes, or set data.source "
                        "and call prepare_data(cfg) first")
    weights = list(data_cfg.weights) if data_cfg.weights is not None else None
    check_blend_weights(weights, len(prefixes), error=DataError)
    per_prefix = [_components_for_prefix(p, data_cfg.split, data_cfg.seq_len) for p in prefixes]
    out = {}
    for si, name in enumerate(SPLITS):
        comps, ws = [], []
        for i, comps_of_prefix in enumerate(per_prefix):
            c = comps_of_prefix[si]
            if c.num_samples == 0:
                if name == "train" and (weights is None or float(weights[i]) > 0) and c.num_tokens:
                    log.warning("%s has %d tokens, fewer than seq_len+1; it is left out", c.name, c.num_tokens)
                continue
            if weights is not None and float(weights[i]) == 0:
                continue
            comps.append(c)
            ws.append(float(weights[i]) if weights is not None else None)
        if not comps:
            out[name] = None
            continue
        out[name] = GPTDataset(comps, None if weights is None else ws, data_cfg.seq_len, seed, name,
                               cache_dir=data_cfg.cache_dir)
    if out["train"] is None:
        raise DataError(f"the train split of {prefixes} has no sample of seq_len+1={data_cfg.seq_len + 1} "
                        f"tokens; use more data, a smaller data.seq_len, or a larger train share in data.split")
    return out


# ----------------------------------------------------------------------------------- batches
class _RankBatches:
    """Batch sampler: the k-th batch of rank r holds samples
    ``start + k*mb*dp + r*mb + j`` for ``j < mb`` -- forever."""

    def __init__(self, start: int, mb: int, rank: int, size: int):
        self.start, self.mb, self.rank, self.size = start, mb, rank, size

    def __iter__(self) -> Iterator[list[int]]:
        k = 0
        while True:
            base = self.start + k * self.mb * self.size + self.rank * self.mb
            yield list(range(base, base + self.mb))
            k += 1


def _collate(samples):
    import torch

    return torch.from_numpy(np.stack(samples).astype(np.int64, copy=False))


def micro_batches(dataset, start_sample: int, micro_batch: int, dp_rank: int, dp_size: int,
                  num_workers: int = 0) -> Iterator:
    """Infinite iterator of torch.LongTensor [micro_batch, seq_len+1] (see :class:`_RankBatches`).

    Resuming at ``start_sample=consumed_samples`` continues the exact order; any DP layout covers
    the same samples per global batch. ``num_workers > 0`` prefetches in DataLoader workers
    (order is unchanged: DataLoader returns batches in sampler order).
    """
    if micro_batch < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size or start_sample < 0:
        raise DataError(f"micro_batches: need micro_batch>=1, 0<=dp_rank<dp_size, start_sample>=0; got "
                        f"micro_batch={micro_batch}, dp_rank={dp_rank}, dp_size={dp_size}, start_sample={start_sample}")
    sampler = _RankBatches(int(start_sample), int(micro_batch), int(dp_rank), int(dp_size))
    if num_workers <= 0:
        return (_collate([dataset[i] for i in ids]) for ids in sampler)
    from torch.utils.data import DataLoader

    return iter(DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers, collate_fn=_collate,
                           persistent_workers=True, prefetch_factor=4))
