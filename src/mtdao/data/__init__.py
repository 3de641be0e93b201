"""Training text, tokenizers, and the per-worker batch streams cut from them."""

from mtdao.data.batches import (
    SPLITS,
    TokenizedCorpus,
    WorkerShard,
    encode_corpus,
    stacked_batches,
    validation_batches,
)
from mtdao.data.errors import DataError
from mtdao.data.sources import Corpus, load_corpus
from mtdao.data.tokenizers import (
    BPETokenizer,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
)

__all__ = [
    "SPLITS",
    "BPETokenizer",
    "ByteTokenizer",
    "Corpus",
    "DataError",
    "HFTokenizer",
    "TokenizedCorpus",
    "Tokenizer",
    "WorkerShard",
    "encode_corpus",
    "load_corpus",
    "load_tokenizer",
    "stacked_batches",
    "validation_batches",
]
