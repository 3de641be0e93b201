"""Text <-> token ids: raw UTF-8 bytes, a byte-level BPE trained here, or a pretrained one.

Every tokenizer has ``eot_id``, the end-of-text id that ``encode_corpus`` puts after each
document (None if the tokenizer has none).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import xxhash

from mtdao.data.errors import INSTALL_DATA, DataError
from mtdao.data.sources import Corpus

END_OF_TEXT = "<|endoftext|>"
BPE_RECIPE = 1
"""Version of ``BPETokenizer.train``'s settings; bump it when they change (keys the cache)."""

logger = logging.getLogger(__name__)


@runtime_checkable
class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eot_id: int | None

    def encode(self, text: str) -> list[int] | np.ndarray: ...

    def decode(self, ids) -> str: ...


class ByteTokenizer:
    """One token per UTF-8 byte. The end-of-text id is byte 0 (NUL): corpora with a NUL byte
    are rejected as binary by the loader, so it never occurs inside a document."""

    name = "byte"
    vocab_size = 256
    eot_id = 0
    fingerprint = "byte"

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return bytes(np.asarray(ids, dtype=np.uint8)).decode("utf-8", errors="replace")


class _WrappedTokenizer:
    """Adapts a ``tokenizers.Tokenizer`` (Rust, fast) to the Tokenizer protocol."""

    def __init__(self, name: str, backend):
        self.name = name
        self.backend = backend
        self.vocab_size = backend.get_vocab_size()
        self.eot_id = _find_end_of_text(backend.get_vocab())

    @functools.cached_property
    def fingerprint(self) -> str:
        """A hash of everything that decides the ids: vocabulary, merges, normalization,
        pre-tokenization and special tokens (the tokenizer's full JSON form)."""
        return xxhash.xxh3_128(self.backend.to_str().encode("utf-8")).hexdigest()

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.backend.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Many documents at once; the Rust side spreads them over threads."""
        # encode_batch_fast skips character offsets we never use: ~2.5x faster, same ids.
        encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
        encodings = encode(texts, add_special_tokens=False)
        return [np.asarray(encoding.ids, dtype=np.int32) for encoding in encodings]

    def decode(self, ids) -> str:
        return self.backend.decode(np.asarray(ids).tolist(), skip_special_tokens=False)


class BPETokenizer(_WrappedTokenizer):
    """Byte-level BPE trained on a corpus's training documents (never on validation)."""

    @classmethod
    def train(cls, docs: list[str], vocab_size: int, name: str = "bpe") -> BPETokenizer:
        from tokenizers import Tokenizer as Backend
        from tokenizers import decoders, models, pre_tokenizers, trainers

        backend = Backend(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[END_OF_TEXT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte stays encodable
            show_progress=False,
        )
        backend.train_from_iterator(docs, trainer=trainer)
        return cls(name, backend)

    @classmethod
    def from_file(cls, path: Path, name: str = "bpe") -> BPETokenizer:
        from tokenizers import Tokenizer as Backend

        return cls(name, Backend.from_file(str(path)))

    def save(self, path: Path) -> None:
        """Write atomically, so ranks training the same tokenizer at once cannot tear the file."""
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.partial")
        try:
            self.backend.save(str(partial))
            os.replace(partial, path)
        except Exception as error:  # the Rust side reports a full disk as its own exception
            partial.unlink(missing_ok=True)
            if isinstance(error, OSError):
                raise
            raise OSError(f"cannot write {path}: {error}") from None


class HFTokenizer(_WrappedTokenizer):
    """A pretrained tokenizer from a local tokenizer.json (file or directory) or the Hugging Face
    cache. Never downloads: fetch it once beforehand with network access."""

    def __init__(self, name: str):
        super().__init__(f"hf:{name}", _load_pretrained(name))


def _tokenizers_package(spec: str):
    """The ``tokenizers`` package, or a DataError saying how to install it."""
    try:
        import tokenizers
    except ImportError:
        raise DataError(f"{spec} needs the 'tokenizers' package: {INSTALL_DATA}") from None
    return tokenizers


def _load_pretrained(name: str):
    Backend = _tokenizers_package(f"hf:{name}").Tokenizer
    path = Path(name).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if path.is_file():
        try:
            return Backend.from_file(str(path))
        except Exception as error:
            raise DataError(f"cannot read tokenizer file {path}: {error}") from error
    try:
        from huggingface_hub import hf_hub_download

        cached = hf_hub_download(name, "tokenizer.json", local_files_only=True)
        return Backend.from_file(cached)
    except Exception:
        raise DataError(
            f"tokenizer {name!r} is neither a local tokenizer.json nor in the Hugging Face cache "
            "(downloads are disabled; fetch it first)"
        ) from None


def _find_end_of_text(vocab: dict[str, int]) -> int | None:
    for token in (END_OF_TEXT, "<|end_of_text|>", "</s>", "<eos>", "[SEP]"):
        if token in vocab:
            return vocab[token]
    return None


def load_tokenizer(spec: str, corpus: Corpus, cache_dir: Path) -> Tokenizer:
    """spec: "byte", "bpe:VOCAB" (trained on corpus.train_docs, cached in cache_dir) or "hf:NAME"."""
    if spec == "byte":
        return ByteTokenizer()
    if spec.startswith("hf:"):
        return HFTokenizer(spec[len("hf:") :])
    if spec.startswith("bpe:"):
        vocab_text = spec[len("bpe:") :]
        if not vocab_text.isdigit() or int(vocab_text) < 257:
            raise DataError(f"tokenizer spec {spec!r} needs an integer vocab size >= 257")
        return _cached_bpe(corpus, int(vocab_text), Path(cache_dir))
    raise DataError(f"unknown tokenizer spec {spec!r}; use 'byte', 'bpe:VOCAB' or 'hf:NAME'")


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """What keys a cache of this tokenizer's output: its settings' hash where it has one."""
    fingerprint = getattr(tokenizer, "fingerprint", None)
    return fingerprint or f"{tokenizer.name}|{tokenizer.vocab_size}|{tokenizer.eot_id}"


def _cached_bpe(corpus: Corpus, vocab_size: int, cache_dir: Path) -> BPETokenizer:
    # Keyed on the training text itself (an edit that keeps every length still retrains), the
    # training settings, and the library version that trains it.
    tokenizers = _tokenizers_package(f"bpe:{vocab_size}")
    settings = f"bpe-recipe-{BPE_RECIPE}|tokenizers-{tokenizers.__version__}|{vocab_size}"
    key = hashlib.sha256(f"{settings}|{corpus.train_fingerprint}".encode()).hexdigest()[:16]
    name = f"bpe:{vocab_size}-{key}"
    path = cache_dir / f"bpe-{vocab_size}-{key}.json"
    if path.is_file():
        try:
            return BPETokenizer.from_file(path, name)
        except Exception as error:  # the Rust side raises its own exception type
            logger.warning("tokenizer cache %s is unreadable (%s); training again", path, error)
    tokenizer = BPETokenizer.train(corpus.train_docs, vocab_size, name)
    try:
        tokenizer.save(path)
    except OSError as error:
        logger.warning("tokenizer cache %s not written: %s", path, error)
    return tokenizer
