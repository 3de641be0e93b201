"""Token arrays and the batches cut from them: one deterministic stream per worker.

A worker's batches depend only on (tokens, worker, num_workers, seed), so a rank that builds
just its own ``WorkerShard`` draws exactly the batches the simulator's ``stacked_batches``
puts in that worker's slice.
"""

from __future__ import annotations

import hashlib
import logging
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mtdao.data.errors import DataError
from mtdao.data.sources import Corpus
from mtdao.data.tokenizers import ByteTokenizer, Tokenizer, tokenizer_fingerprint

SPLITS = ("shuffled", "by-file", "contiguous")

logger = logging.getLogger(__name__)


@dataclass
class TokenizedCorpus:
    train: list[np.ndarray]
    """One int32 array per training document, each ending with the tokenizer's end-of-text id."""
    val: np.ndarray
    """All validation documents concatenated (with end-of-text ids between them), int32."""


def encode_corpus(
    corpus: Corpus, tokenizer: Tokenizer, cache_dir: Path | None = None
) -> TokenizedCorpus:
    """Tokenize every document and append ``tokenizer.eot_id`` (if any) after each one.

    With ``cache_dir``, the result of a learned tokenizer is stored there and reused (BPE takes
    seconds per 10 MB on a small CPU); bytes are always encoded directly (about 1 s for the
    builtin corpus). The cache is keyed on the text itself and the tokenizer's settings, so an
    edited corpus or tokenizer is never served old tokens.
    """
    if cache_dir is None or isinstance(tokenizer, ByteTokenizer):
        return _encode(corpus, tokenizer)
    fingerprint = (
        f"tokens-v2|{corpus.fingerprint}|{tokenizer_fingerprint(tokenizer)}|{tokenizer.eot_id}"
    )
    path = Path(cache_dir) / f"tokens-{hashlib.sha256(fingerprint.encode()).hexdigest()[:16]}.npz"
    if path.is_file():
        cached = _read_cached_tokens(path)
        if cached is not None:
            return cached
    tokens = _encode(corpus, tokenizer)
    _write_cached_tokens(path, tokens, np.uint16 if tokenizer.vocab_size <= 2**16 else np.int32)
    return tokens


def _read_cached_tokens(path: Path) -> TokenizedCorpus | None:
    """The cached encoding, or None (with a warning) when the file is damaged."""
    try:
        with np.load(path) as cached:
            train = cached["train"].astype(np.int32)
            return TokenizedCorpus(
                train=np.split(train, np.cumsum(cached["train_lengths"])[:-1]),
                val=cached["val"].astype(np.int32),
            )
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as error:
        logger.warning("token cache %s is unreadable (%s); encoding again", path, error)
        return None


def _write_cached_tokens(path: Path, tokens: TokenizedCorpus, storage) -> None:
    """Store atomically (ranks encoding at once cannot tear the file); a cache that cannot be
    written (full disk, read-only directory) is skipped with a warning, never left half-written."""
    partial = path.with_name(f"{path.stem}.{os.getpid()}.partial.npz")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(
            partial,
            train=np.concatenate(tokens.train).astype(storage),  # uint16 halves the file
            train_lengths=np.array([len(doc) for doc in tokens.train], dtype=np.int64),
            val=tokens.val.astype(storage),
        )
        os.replace(partial, path)
    except OSError as error:
        partial.unlink(missing_ok=True)
        logger.warning("token cache %s not written: %s", path, error)


def _encode(corpus: Corpus, tokenizer: Tokenizer) -> TokenizedCorpus:
    end_of_text = np.array([] if tokenizer.eot_id is None else [tokenizer.eot_id], dtype=np.int32)

    def encode_all(docs: list[str]) -> list[np.ndarray]:
        if hasattr(tokenizer, "encode_batch"):
            encoded = tokenizer.encode_batch(docs)
        else:
            encoded = [tokenizer.encode(doc) for doc in docs]
        return [np.concatenate([np.asarray(ids), end_of_text]).astype(np.int32) for ids in encoded]

    val = encode_all(corpus.val_docs)
    return TokenizedCorpus(
        train=encode_all(corpus.train_docs),
        val=np.concatenate(val) if val else np.zeros(0, dtype=np.int32),
    )


def _shard_tokens(
    train: list[np.ndarray], worker: int, num_workers: int, split: str, seed: int
) -> np.ndarray:
    """The slice of the training stream that belongs to ``worker``; built without the others'."""
    if split == "shuffled":
        # A corpus lists its documents in path order, so cuts of that order give each worker its
        # own part of the tree (the stdlib's test/ package alone fills one quarter): the IID
        # split cuts a seeded random order of the documents instead.
        order = np.random.default_rng(np.random.SeedSequence([seed, _SHUFFLE_STREAM]))
        return _equal_cut([train[i] for i in order.permutation(len(train))], worker, num_workers)
    if split == "contiguous":
        return _equal_cut(train, worker, num_workers)
    # by-file: whole documents, contiguous runs of them in corpus order (for a directory, sorted
    # paths), so workers see different distributions; a document goes to the worker whose equal
    # share of the token count contains its first token.
    lengths, doc_starts = _lengths_and_starts(train)
    owner = doc_starts * num_workers // max(int(lengths.sum()), 1)
    mine = np.nonzero(owner == worker)[0]
    if len(mine) == 0:
        return np.zeros(0, dtype=np.int32)
    return np.concatenate([train[i] for i in mine])


def _equal_cut(docs: list[np.ndarray], worker: int, num_workers: int) -> np.ndarray:
    """Worker's equal contiguous cut of the documents' concatenation, cut mid-document where it
    falls."""
    lengths, doc_starts = _lengths_and_starts(docs)
    shard_len = int(lengths.sum()) // num_workers
    begin, end = worker * shard_len, (worker + 1) * shard_len
    overlapping = np.nonzero((doc_starts < end) & (doc_starts + lengths > begin))[0]
    if len(overlapping) == 0:
        return np.zeros(0, dtype=np.int32)
    first = int(overlapping[0])
    joined = np.concatenate([docs[i] for i in overlapping])
    offset = begin - int(doc_starts[first])
    return joined[offset : offset + shard_len]


def _lengths_and_starts(docs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Each document's token count and the offset of its first token in their concatenation."""
    lengths = np.array([len(doc) for doc in docs], dtype=np.int64)
    return lengths, np.concatenate([[0], np.cumsum(lengths)[:-1]])


# the document shuffle's stream, apart from every worker's window stream ([seed, worker])
_SHUFFLE_STREAM = 0x1D5A_F1E5


def _generator_seed(seed: int, worker: int) -> int:
    """Independent streams per (seed, worker): SeedSequence mixes both into 64 bits."""
    return int(np.random.SeedSequence([seed, worker]).generate_state(1, dtype=np.uint64)[0])


class WorkerShard:
    """Random windows of ``seq_len + 1`` tokens from one worker's share of the training data."""

    def __init__(
        self,
        tokens: TokenizedCorpus,
        worker: int,
        num_workers: int,
        batch_size: int,
        seq_len: int,
        seed: int,
        split: str = "shuffled",
    ):
        if split not in SPLITS:
            raise DataError(f"unknown data split {split!r}; valid: {', '.join(SPLITS)}")
        if not 0 <= worker < num_workers:
            raise DataError(f"worker {worker} is outside 0..{num_workers - 1}")
        if batch_size <= 0 or seq_len <= 0:
            raise DataError(f"batch_size and seq_len must be positive, got {batch_size}, {seq_len}")
        self.worker, self.num_workers, self.seed, self.split = worker, num_workers, seed, split
        self.batch_size, self.seq_len = batch_size, seq_len
        self.tokens = torch.from_numpy(
            _shard_tokens(tokens.train, worker, num_workers, split, seed)
        )
        self.num_windows = len(self.tokens) - seq_len  # valid start positions
        if self.num_windows < 1:
            raise DataError(
                f"worker {worker}/{num_workers} ({split} split) has {len(self.tokens)} training "
                f"tokens but one window needs {seq_len + 1}; use a larger corpus, fewer workers "
                "or a shorter seq_len"
            )
        self.generator = torch.Generator().manual_seed(_generator_seed(seed, worker))
        self.batches_drawn = 0
        self._offsets = torch.arange(seq_len + 1)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each LongTensor [batch_size, seq_len]; targets are inputs shifted by 1."""
        starts = torch.randint(self.num_windows, (self.batch_size,), generator=self.generator)
        windows = self.tokens[starts[:, None] + self._offsets].long()
        self.batches_drawn += 1
        return windows[:, :-1], windows[:, 1:]

    def _identity(self) -> dict:
        return {
            "worker": self.worker,
            "num_workers": self.num_workers,
            "seed": self.seed,
            "split": self.split,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "num_tokens": len(self.tokens),
        }

    def state_dict(self) -> dict:
        return {
            **self._identity(),
            "generator": self.generator.get_state(),
            "batches_drawn": self.batches_drawn,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where the saved shard stopped; it must describe the same shard."""
        for key, value in self._identity().items():
            if state.get(key) != value:
                raise DataError(
                    f"shard state has {key}={state.get(key)!r}, this shard has {value!r}"
                )
        self.generator.set_state(state["generator"])
        self.batches_drawn = state["batches_drawn"]


def stacked_batches(shards: list[WorkerShard]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each shard's next batch, stacked along a leading worker dim: two [M, B, T] tensors."""
    inputs, targets = zip(*(shard.next_batch() for shard in shards))
    return torch.stack(inputs), torch.stack(targets)


def validation_batches(
    val_tokens: np.ndarray, batch_size: int, seq_len: int, max_tokens: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed validation batches from the start of ``val_tokens``.

    Window i is tokens [i*seq_len, i*seq_len + seq_len + 1), so every token is a target at most
    once, and at most ``max_tokens`` targets are covered. The last batch may hold fewer than
    batch_size windows: average losses weighted by ``targets.numel()``.
    """
    if batch_size <= 0 or seq_len <= 0:
        raise DataError(f"batch_size and seq_len must be positive, got {batch_size}, {seq_len}")
    if len(val_tokens) < seq_len + 1:
        raise DataError(
            f"validation set has {len(val_tokens)} tokens but one window needs {seq_len + 1}"
        )
    num_windows = min((len(val_tokens) - 1) // seq_len, max_tokens // seq_len)
    if num_windows < 1:
        raise DataError(f"max_tokens={max_tokens} is less than one window of seq_len={seq_len}")
    tokens = torch.from_numpy(np.asarray(val_tokens[: num_windows * seq_len + 1], dtype=np.int64))
    starts = torch.arange(num_windows) * seq_len
    windows = tokens[starts[:, None] + torch.arange(seq_len + 1)]
    return [(chunk[:, :-1], chunk[:, 1:]) for chunk in windows.split(batch_size)]
