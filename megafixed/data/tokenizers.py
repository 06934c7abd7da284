"""One small tokenizer interface over sentencepiece, HF ``tokenizers`` and GPT-2 style BPE files.

Every backend is a real engine (sentencepiece, HF tokenizers); this module only adapts them to
``encode / decode / vocab_size / eod_id / describe`` so that preprocessing, the trainer and the
evaluation code never care which one a run uses. ``describe()`` is what we store next to shards and
in checkpoints; ``load_tokenizer(describe())`` gives the same tokenizer back.
"""
from __future__ import annotations

import hashlib
import os
from typing import Iterable, Optional, Sequence, Union

from ..atomic import atomic_path
from .errors import DataError

EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[EOS]", "<|eot_id|>", "<|im_end|>")
EOD_TOKEN = "<|endoftext|>"  # the end-of-document token of tokenizers we train


class Tokenizer:
    """Interface: ``vocab_size`` (ids are 0..vocab_size-1), ``eod_id`` (end-of-document token)."""

    kind = "abstract"
    vocab_size: int
    eod_id: int

    def __init__(self, path: str):
        self.path = os.path.abspath(path)

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def describe(self) -> dict:
        return {"type": self.kind, "path": self.path}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path!r}, vocab_size={self.vocab_size}, eod_id={self.eod_id})"


def _ids(ids) -> list[int]:
    return [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]


class SentencePieceTokenizer(Tokenizer):
    kind = "sentencepiece"

    def __init__(self, path: str):
        super().__init__(path)
        import sentencepiece as spm

        try:
            self._sp = spm.SentencePieceProcessor(model_file=self.path)
        except (RuntimeError, OSError) as exc:  # sentencepiece's message names neither file nor fix
            raise DataError(f"{path} is not a readable sentencepiece model ({str(exc).splitlines()[0]}); pass the "
                            f".model file written by `megafixed tokenizer train`, or train a new one") from exc
        self.vocab_size = self._sp.get_piece_size()
        eod = self._sp.eos_id()
        if eod < 0:
            for piece in EOD_CANDIDATES:
                pid = self._sp.piece_to_id(piece)
                if pid != self._sp.unk_id():
                    eod = pid
                    break
        if eod < 0:
            raise DataError(f"sentencepiece model {path} has no end-of-sequence piece; retrain it with "
                            f"eos_id>=0 (megafixed tokenizer train does this)")
        self.eod_id = eod

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # one thread: parallelism comes from preprocessing worker processes
        return self._sp.encode(list(texts), num_threads=1)

    def decode(self, ids) -> str:
        return self._sp.decode(_ids(ids))


class HFTokenizer(Tokenizer):
    """A HF ``tokenizers`` ``tokenizer.json`` (or a GPT-2 ``vocab.json`` + ``merges.txt`` pair)."""

    kind = "hf"

    def __init__(self, path: str, tokenizer=None):
        super().__init__(path)
        if tokenizer is None:
            from tokenizers import Tokenizer as _HF

            try:
                tokenizer = _HF.from_file(self.path)
            except Exception as exc:
                raise DataError(f"cannot load HF tokenizer {path}: {exc}") from exc
        self._tok = tokenizer
        vocab = self._tok.get_vocab(with_added_tokens=True)
        # ids may have gaps; what matters for dtypes and code bits is the largest id + 1
        self.vocab_size = max(self._tok.get_vocab_size(with_added_tokens=True), max(vocab.values()) + 1)
        for piece in EOD_CANDIDATES:
            if piece in vocab:
                self.eod_id = vocab[piece]
                break
        else:
            raise DataError(f"tokenizer {path} has none of the end-of-document tokens {list(EOD_CANDIDATES)}; "
                            f"add one as a special token")

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self._tok.decode(_ids(ids), skip_special_tokens=False)


# GPT-2's files under both of their common names (HF hub names; OpenAI's original names)
GPT2_FILE_PAIRS = (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe"))


def _gpt2_files(directory: str) -> Optional[tuple[str, str]]:
    for vocab, merges in GPT2_FILE_PAIRS:
        v, m = os.path.join(directory, vocab), os.path.join(directory, merges)
        if os.path.isfile(v) and os.path.isfile(m):
            return v, m
    return None


class GPT2Tokenizer(HFTokenizer):
    """GPT-2 byte-level BPE from its vocab + merges files, run by HF ``tokenizers``."""

    kind = "gpt2"

    def __init__(self, path: str):
        from tokenizers import Tokenizer as _HF
        from tokenizers import decoders, models, pre_tokenizers

        files = _gpt2_files(path)
        if files is None:
            raise DataError(f"{path} has no GPT-2 tokenizer files; expected one of {GPT2_FILE_PAIRS}")
        try:
            bpe = models.BPE.from_file(*files)
        except Exception as exc:
            raise DataError(f"cannot read GPT-2 BPE files {files}: {exc}") from exc
        tok = _HF(bpe)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([EOD_TOKEN])  # already id 50256 in GPT-2's vocab; now never split
        super().__init__(path, tokenizer=tok)


TokenizerSpec = Union[str, os.PathLike, dict, Tokenizer]


def load_tokenizer(path_or_description: TokenizerSpec) -> Tokenizer:
    """Load from a ``.model`` file, a ``tokenizer.json``, a directory (GPT-2 files or a
    tokenizer.json / tokenizer.model inside), or a ``describe()`` dict."""
    spec = path_or_description
    if isinstance(spec, Tokenizer):
        return spec
    if isinstance(spec, dict):
        kinds = {"sentencepiece": SentencePieceTokenizer, "hf": HFTokenizer, "gpt2": GPT2Tokenizer}
        if spec.get("type") not in kinds or "path" not in spec:
            raise DataError(f"tokenizer description {spec!r} needs 'type' in {sorted(kinds)} and 'path'")
        _require(spec["path"])
        return kinds[spec["type"]](spec["path"])
    kind, path = _resolve(os.fspath(spec))
    return {"sentencepiece": SentencePieceTokenizer, "hf": HFTokenizer, "gpt2": GPT2Tokenizer}[kind](path)


def tokenizer_kind(path) -> str:
    """Which engine ``load_tokenizer(path)`` would use ("sentencepiece", "hf", "gpt2"), without loading it."""
    return _resolve(os.fspath(path))[0]


def _resolve(path: str) -> tuple[str, str]:
    """(kind, the path that kind loads from), or DataError naming what is wrong."""
    _require(path)
    if os.path.isdir(path):
        if _gpt2_files(path):
            return "gpt2", path
        for name, kind in (("tokenizer.json", "hf"), ("tokenizer.model", "sentencepiece")):
            if os.path.isfile(os.path.join(path, name)):
                return kind, os.path.join(path, name)
        raise DataError(f"directory {path} holds no tokenizer: expected vocab.json + merges.txt, "
                        f"tokenizer.json or tokenizer.model")
    if path.endswith(".json"):
        return "hf", path
    if path.endswith(".model"):
        return "sentencepiece", path
    raise DataError(f"cannot tell the tokenizer type of {path}; use a sentencepiece .model, a HF "
                    f"tokenizer.json, or a directory with GPT-2's vocab.json + merges.txt")


def tokenizer_sha256(tok: Tokenizer) -> Optional[str]:
    """Hash of the tokenizer's file(s): shards record it, so a tokenizer replaced in place (same
    path, other vocabulary) is told apart from the one the shards were written with."""
    path = tok.path
    files = [os.path.join(path, f) for f in _gpt2_files(path)] if os.path.isdir(path) and _gpt2_files(path) else [path]
    h = hashlib.sha256()
    try:
        for f in files:
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
    except OSError:
        return None
    return h.hexdigest()


def _require(path: str) -> None:
    if not os.path.exists(path):
        raise DataError(f"tokenizer {path} not found; train one with `megafixed tokenizer train "
                        f"--input CORPUS --vocab-size N --output {path}` or fix the path")


# ----------------------------------------------------------------------------------- training
def _iter_training_texts(inputs: list[str], json_key: str, max_chars: int):
    from .readers import iter_texts

    seen = 0
    for text in iter_texts(inputs, json_key):
        yield text
        seen += len(text)
        if seen >= max_chars:
            return


def train_tokenizer(inputs: list[str], output: str, vocab_size: int, kind: str = "bpe",
                    json_key: str = "text", max_chars: int = 200_000_000, exact_vocab: bool = False) -> str:
    """Train a tokenizer on documents from ``inputs`` (any format :mod:`readers` reads).

    ``output`` ending in ``.model`` -> sentencepiece (``kind`` = bpe or unigram; byte fallback,
    identity normalisation, so decode(encode(text)) == text). Anything else -> HF tokenizers
    ``tokenizer.json`` (bpe: GPT-2 style byte-level BPE; unigram: metaspace unigram).
    The end-of-document token is ``<|endoftext|>`` (HF) or sentencepiece's ``</s>``.
    Training reads at most ``max_chars`` characters (a prefix of the corpus). Written atomically.
    ``exact_vocab``: refuse (and write nothing) when the corpus yields fewer tokens than asked.
    """
    if kind not in ("bpe", "unigram"):
        raise DataError(f"tokenizer kind {kind!r} unknown; use 'bpe' or 'unigram'")
    if vocab_size < 300:
        raise DataError(f"vocab_size={vocab_size} is too small; byte-level tokenizers need >= 300 "
                        f"(256 bytes plus merges and special tokens)")
    output = os.path.abspath(output)
    if output.endswith(".model"):
        _train_sentencepiece(inputs, output, vocab_size, kind, json_key, max_chars)
    else:
        if os.path.isdir(output):
            output = os.path.join(output, "tokenizer.json")
        _train_hf(inputs, output, vocab_size, kind, json_key, max_chars, exact_vocab)
    return output


def _no_text(inputs, json_key) -> DataError:
    return DataError(f"no text to train a tokenizer on in {inputs} (key {json_key!r}); check --input and "
                     f"--json-key against the records' fields")


def _train_hf(inputs, output, vocab_size, kind, json_key, max_chars, exact_vocab=False) -> None:
    from tokenizers import Tokenizer as _HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if kind == "bpe":
        tok = _HF(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD_TOKEN], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:
        tok = _HF(models.Unigram())
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=[EOD_TOKEN, "<unk>"],
                                          unk_token="<unk>", show_progress=False)
    seen = [0]

    def texts():
        for t in _iter_training_texts(inputs, json_key, max_chars):
            seen[0] += 1
            yield t

    tok.train_from_iterator(texts(), trainer=trainer)
    if not seen[0]:
        raise _no_text(inputs, json_key)
    got = tok.get_vocab_size(with_added_tokens=True)
    if exact_vocab and got < vocab_size:
        raise DataError(f"the corpus {inputs} yields only {got} tokens, fewer than --vocab-size {vocab_size}; "
                        f"lower --vocab-size to {got} or train on more text")
    os.makedirs(os.path.dirname(output), exist_ok=True)
    with atomic_path(output) as tmp:
        tok.save(tmp)


def _train_sentencepiece(inputs, output, vocab_size, kind, json_key, max_chars) -> None:
    import sentencepiece as spm

    def lines():  # sentencepiece trains on "sentences": feed the lines of each document
        for text in _iter_training_texts(inputs, json_key, max_chars):
            for line in text.split("\n"):
                if line.strip():
                    yield line

    seen, failed = [0], []

    def counted():
        try:
            for line in lines():
                seen[0] += 1
                yield line
        except Exception as exc:  # keep our own error (a corrupt input) from being re-wrapped by C++
            failed.append(exc)
            raise

    os.makedirs(os.path.dirname(output), exist_ok=True)
    tmp_prefix = f"{output[:-len('.model')]}.tmp.{os.getpid()}"
    try:
        _spm_train(spm, counted(), tmp_prefix, vocab_size, kind)
    except RuntimeError as exc:  # sentencepiece's C++ checks: vocab too high for the text, empty input
        for ext in (".model", ".vocab"):
            if os.path.exists(tmp_prefix + ext):
                os.remove(tmp_prefix + ext)
        if failed:
            raise failed[0] from None  # our own error (a corrupt input), not the C++ wrapper
        if not seen[0]:
            raise _no_text(inputs, json_key) from exc
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DataError(f"sentencepiece could not train on {inputs} ({msg}); if the vocabulary is too high for "
                        f"this corpus, lower --vocab-size or train on more text") from exc
    os.replace(tmp_prefix + ".model", output)
    if os.path.exists(tmp_prefix + ".vocab"):
        os.replace(tmp_prefix + ".vocab", output[:-len(".model")] + ".vocab")


def _spm_train(spm, sentences, tmp_prefix, vocab_size, kind) -> None:
    spm.SentencePieceTrainer.train(
        sentence_iterator=sentences, model_prefix=tmp_prefix, vocab_size=vocab_size, model_type=kind,
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=False, allow_whitespace_only_pieces=True, split_digits=True,
        input_sentence_size=1_000_000, shuffle_input_sentence=True, max_sentence_length=1 << 16,
        unk_id=0, bos_id=-1, eos_id=1, pad_id=-1, num_threads=os.cpu_count() or 1,
        minloglevel=2)
