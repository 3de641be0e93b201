"""Caches keyed on content: editing the data (even keeping every length) or the tokenizer is
never answered with old tokens; a damaged cache file is rebuilt."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from mtdao.data import BPETokenizer, Corpus, encode_corpus, load_corpus, load_tokenizer
from mtdao.data.sources import content_hash

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "the",
    "lazy",
    "dog",
    "while",
    "seven",
    "wizards",
    "quietly",
    "hex",
    "jam",
]


def write_corpus(root, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    for index in range(12):
        words = rng.choice(WORDS, size=400)
        (root / f"doc{index:02d}.txt").write_text(" ".join(words) + "\n")


def same_length_edit(path) -> None:
    """Replace every 'quick' by 'slowq' (same length): same document and character counts."""
    text = path.read_text()
    edited = text.replace("quick", "slowq")
    assert edited != text and len(edited) == len(text)
    path.write_text(edited)


def tokens_of(corpus_dir, cache_dir):
    corpus = load_corpus(str(corpus_dir))
    tokenizer = load_tokenizer("bpe:300", corpus, cache_dir)
    return corpus, tokenizer, encode_corpus(corpus, tokenizer, cache_dir)


def same_tokens(a, b) -> bool:
    return np.array_equal(a.val, b.val) and all(
        np.array_equal(x, y) for x, y in zip(a.train, b.train, strict=True)
    )


def test_same_length_edit_of_the_data_is_never_served_old_tokens(tmp_path):
    corpus_dir, cache = tmp_path / "corpus", tmp_path / "cache"
    write_corpus(corpus_dir)
    before_corpus, before_tokenizer, before = tokens_of(corpus_dir, cache)

    for path in sorted(corpus_dir.iterdir()):
        same_length_edit(path)
    corpus, tokenizer, after = tokens_of(corpus_dir, cache)

    assert [len(d) for d in corpus.train_docs] == [len(d) for d in before_corpus.train_docs]
    assert corpus.fingerprint != before_corpus.fingerprint
    assert tokenizer.name != before_tokenizer.name  # a BPE trained on the edited text
    assert len(list(cache.glob("bpe-300-*.json"))) == 2
    fresh = encode_corpus(corpus, BPETokenizer.train(corpus.train_docs, 300), None)
    assert same_tokens(after, fresh) and not same_tokens(after, before)


def test_same_data_is_served_from_the_cache(tmp_path, monkeypatch):
    corpus_dir, cache = tmp_path / "corpus", tmp_path / "cache"
    write_corpus(corpus_dir)
    _, _, first = tokens_of(corpus_dir, cache)
    monkeypatch.setattr(BPETokenizer, "train", None)  # neither retrained ...
    monkeypatch.setattr(BPETokenizer, "encode_batch", None)  # ... nor re-encoded
    _, _, again = tokens_of(corpus_dir, cache)
    assert same_tokens(first, again)


def test_an_edited_pretrained_tokenizer_is_not_served_old_tokens(tmp_path):
    corpus = Corpus("c", ["alpha beta gamma " * 50, "delta epsilon " * 40], ["beta delta " * 30])
    tokenizer_dir = tmp_path / "tokenizer"
    BPETokenizer.train(["alpha beta gamma"] * 20, 270).save(tokenizer_dir / "tokenizer.json")
    old = encode_corpus(corpus, load_tokenizer(f"hf:{tokenizer_dir}", corpus, tmp_path), tmp_path)
    retrained = BPETokenizer.train(["delta epsilon beta"] * 20, 270)
    retrained.save(tokenizer_dir / "tokenizer.json")
    new = encode_corpus(corpus, load_tokenizer(f"hf:{tokenizer_dir}", corpus, tmp_path), tmp_path)
    assert same_tokens(new, encode_corpus(corpus, retrained)) and not same_tokens(new, old)


def test_fingerprint_sees_content_and_split_not_the_name():
    docs = ["abc", "def"]
    fingerprint = Corpus("x", docs, ["g"]).fingerprint
    assert Corpus("renamed", list(docs), ["g"]).fingerprint == fingerprint
    assert Corpus("x", ["abcd", "ef"], ["g"]).fingerprint != fingerprint  # moved boundary
    assert Corpus("x", ["abc"], ["def", "g"]).fingerprint != fingerprint  # other split
    assert Corpus("x", ["abc", "dеf"], ["g"]).fingerprint != fingerprint  # Cyrillic "е"
    assert content_hash([]) != content_hash([""])


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_damaged_token_cache_is_rebuilt(tmp_path, caplog, damage):
    corpus_dir, cache = tmp_path / "corpus", tmp_path / "cache"
    write_corpus(corpus_dir)
    _, _, first = tokens_of(corpus_dir, cache)
    (cached,) = cache.glob("tokens-*.npz")
    data = cached.read_bytes()
    cached.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"x" * 100)
    with caplog.at_level(logging.WARNING, logger="mtdao.data.batches"):
        _, _, again = tokens_of(corpus_dir, cache)
    assert same_tokens(first, again)
    assert any(str(cached) in r.getMessage() for r in caplog.records)
    assert cached.read_bytes()[:2] == b"PK"  # written anew


def test_damaged_tokenizer_cache_is_retrained(tmp_path, caplog):
    corpus_dir, cache = tmp_path / "corpus", tmp_path / "cache"
    write_corpus(corpus_dir)
    _, tokenizer, _ = tokens_of(corpus_dir, cache)
    (cached,) = cache.glob("bpe-300-*.json")
    cached.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="mtdao.data.tokenizers"):
        corpus = load_corpus(str(corpus_dir))
        again = load_tokenizer("bpe:300", corpus, cache)
    assert again.fingerprint == tokenizer.fingerprint
    assert any("unreadable" in r.getMessage() for r in caplog.records)
