"""Corpora, tokenizers and per-worker batch streams; every DataError names what was wrong."""

import os

os.environ["HF_DATASETS_OFFLINE"] = "1"  # before datasets/huggingface_hub read it at import
os.environ["HF_HUB_OFFLINE"] = "1"

import json  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from mtdao.data import (  # noqa: E402
    BPETokenizer,
    ByteTokenizer,
    Corpus,
    DataError,
    HFTokenizer,
    TokenizedCorpus,
    WorkerShard,
    encode_corpus,
    load_corpus,
    load_tokenizer,
    stacked_batches,
    validation_batches,
)

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "wizards",
    "quietly",
    "hex",
]


def make_docs(count: int, words_per_doc: int = 60) -> list[str]:
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(WORDS, words_per_doc)) + f" #{i}\n" for i in range(count)]


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """Belt and braces: if another test imported datasets first, the env vars came too late.
    The cache is redirected too, so loading local files leaves no lock files in ~/.cache."""
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True, raising=False)


def byte_tokens(count: int = 40, words_per_doc: int = 60) -> TokenizedCorpus:
    docs = make_docs(count, words_per_doc)
    return encode_corpus(Corpus("test", docs[:-2], docs[-2:]), ByteTokenizer())


# --- sources -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def builtin_corpus() -> Corpus:
    return load_corpus(None)


def test_builtin_corpus_is_the_stdlib_split_by_file(builtin_corpus):
    assert builtin_corpus.name == f"builtin:python-stdlib-{platform.python_version()}"
    assert len(builtin_corpus.train_docs) > 500
    assert sum(map(len, builtin_corpus.train_docs)) > 5_000_000
    val_share = len(builtin_corpus.val_docs) / len(builtin_corpus.train_docs)
    assert 0.005 < val_share < 0.05
    assert not set(builtin_corpus.val_docs) & set(builtin_corpus.train_docs[:200])


def test_local_directory_is_sorted_split_by_file_and_skips_hidden_and_binary(tmp_path):
    for index in range(30):
        (tmp_path / "sub" if index % 2 else tmp_path).mkdir(exist_ok=True)
        folder = tmp_path / "sub" if index % 2 else tmp_path
        (folder / f"doc{index:02d}.txt").write_text(f"document {index}\n", encoding="utf-8")
    (tmp_path / ".hidden.txt").write_text("hidden\n")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "config").write_text("hidden too\n")
    (tmp_path / "image.bin").write_bytes(b"\x89PNG\x00\x01")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "empty.txt").write_text("")

    corpus = load_corpus(str(tmp_path), val_fraction=0.2)
    docs = corpus.train_docs + corpus.val_docs
    assert sorted(docs) == sorted(f"document {i}\n" for i in range(30))
    assert 1 <= len(corpus.val_docs) < 15
    assert load_corpus(str(tmp_path), val_fraction=0.2) == corpus  # deterministic
    assert corpus.name == f"local:{tmp_path.resolve()}"
    # every skipped file is named with why (it used to be skipped without a word)
    assert corpus.skipped == [
        ("empty.txt", "empty"),
        ("image.bin", "binary (a NUL byte at offset 4)"),
        ("latin1.txt", "not UTF-8 (byte 0xe9 at offset 3: Latin-1 or another encoding?)"),
    ]


def test_the_data_line_counts_the_skipped_files_and_names_each_once(tmp_path):
    from mtdao.train.setup import SKIPPED_NAMED, skipped_files

    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text(f"text of {name}\n")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "blob.bin").write_bytes(b"ab\x00cd")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    note = skipped_files(load_corpus(str(tmp_path)))
    first, *named = note.split("\n")
    assert first == "; 3 files skipped"
    assert named == [
        "data: skipped blob.bin: binary (a NUL byte at offset 2)",
        "data: skipped latin1.txt: not UTF-8 (byte 0xe9 at offset 3: Latin-1 or another encoding?)",
        "data: skipped loop: a symlink that leads to no file (broken, or a loop)",
    ]
    for index in range(SKIPPED_NAMED + 5):
        (tmp_path / f"z{index:03d}.bin").write_bytes(b"\x00")
    note = skipped_files(load_corpus(str(tmp_path)))
    assert note.count("data: skipped ") == SKIPPED_NAMED
    assert note.endswith("data: ... and 8 more skipped files")


def test_a_corpus_path_that_is_a_symlink_loop_is_one_clear_error(tmp_path):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(DataError, match=r"cannot be followed: .*a \(a symlink loop\)"):
        load_corpus(str(tmp_path / "a"))


def test_small_directory_still_gets_a_validation_file(tmp_path):
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text(f"text of {name}\n")
    corpus = load_corpus(str(tmp_path), val_fraction=0.01)
    assert len(corpus.train_docs) == 1 and len(corpus.val_docs) == 1


def test_single_file_validation_is_its_tail(tmp_path):
    path = tmp_path / "book.txt"
    path.write_text("x" * 90 + "y" * 10, encoding="utf-8")
    corpus = load_corpus(str(path), val_fraction=0.1)
    assert corpus.train_docs == ["x" * 90] and corpus.val_docs == ["y" * 10]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: p / "missing.txt", "does not exist: .*missing.txt"),
        (lambda p: _write(p / "empty.txt", b""), "empty: .*empty.txt"),
        (lambda p: _write(p / "blob.bin", b"ab\x00cd"), "not UTF-8 text.*blob.bin"),
        (lambda p: _write(p / "one.txt", b"x"), "one.txt has 1 characters, too few"),
        (lambda p: _only_binary_dir(p), "no non-empty UTF-8 text files: .*bins"),
    ],
)
def test_bad_local_corpus_paths(tmp_path, make, message):
    with pytest.raises(DataError, match=message):
        load_corpus(str(make(tmp_path)))


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


def _only_binary_dir(root):
    (root / "bins").mkdir()
    (root / "bins" / "a.bin").write_bytes(b"\x00\x01")
    return root / "bins"


def test_bad_val_fraction_and_empty_spec():
    with pytest.raises(DataError, match="val_fraction must be in"):
        load_corpus(None, val_fraction=1.0)
    with pytest.raises(DataError, match="empty corpus spec"):
        load_corpus("")


# --- Hugging Face corpora (local only) -----------------------------------------------------


def test_hf_saved_dataset_and_text_column(tmp_path):
    import datasets

    docs = make_docs(20)
    datasets.Dataset.from_dict({"id": list(range(20)), "text": docs}).save_to_disk(tmp_path / "ds")
    corpus = load_corpus(f"hf:{tmp_path / 'ds'}")
    assert sorted(corpus.train_docs + corpus.val_docs) == sorted(docs)
    assert corpus.val_docs

    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": docs})}).save_to_disk(
        tmp_path / "dd"
    )
    capped = load_corpus(f"hf:{tmp_path / 'dd'}", max_chars=3 * len(docs[0]))
    assert len(capped.train_docs + capped.val_docs) == 3  # first string column, capped
    assert "first" in capped.name


def test_hf_data_files_directory(tmp_path):
    with open(tmp_path / "part.jsonl", "w") as file:
        for index in range(6):
            file.write(json.dumps({"n": index, "content": f"row {index} " * 5}) + "\n")
    corpus = load_corpus(f"hf:{tmp_path}")
    assert len(corpus.train_docs) + len(corpus.val_docs) == 6
    assert corpus.train_docs[0].startswith("row")


def test_hf_errors_name_the_dataset(tmp_path):
    import datasets

    with pytest.raises(DataError, match="cannot load Hugging Face dataset 'no-such/dataset-xyz'"):
        load_corpus("hf:no-such/dataset-xyz")
    datasets.Dataset.from_dict({"n": [1, 2]}).save_to_disk(tmp_path / "numbers")
    with pytest.raises(DataError, match="numbers has no text column \\(columns: n\\)"):
        load_corpus(f"hf:{tmp_path / 'numbers'}")
    datasets.Dataset.from_dict({"text": ["", ""]}).save_to_disk(tmp_path / "blank")
    with pytest.raises(DataError, match="blank' has no non-empty text"):
        load_corpus(f"hf:{tmp_path / 'blank'}")


def test_hf_without_datasets_package_or_train_split(tmp_path, monkeypatch):
    import datasets

    datasets.DatasetDict({"test": datasets.Dataset.from_dict({"text": ["a"]})}).save_to_disk(
        tmp_path / "no_train"
    )
    with pytest.raises(DataError, match="no_train has no 'train' split: \\['test'\\]"):
        load_corpus(f"hf:{tmp_path / 'no_train'}")
    monkeypatch.setitem(sys.modules, "datasets", None)  # import now raises ImportError
    with pytest.raises(DataError, match="hf:anything needs the 'datasets' package"):
        load_corpus("hf:anything")


# --- tokenizers ----------------------------------------------------------------------------


def test_byte_tokenizer_round_trips_unicode():
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode("héllo → 世界")
    assert ids.dtype == np.int32 and ids.max() < 256
    assert tokenizer.decode(ids) == "héllo → 世界"


def test_bpe_is_trained_once_then_loaded_from_cache(tmp_path, monkeypatch):
    corpus = Corpus("bpe-test", make_docs(50), make_docs(2))
    tokenizer = load_tokenizer("bpe:300", corpus, tmp_path)
    assert 257 <= tokenizer.vocab_size <= 300
    assert tokenizer.decode(tokenizer.encode("the lazy fox é")) == "the lazy fox é"
    assert len(tokenizer.encode(corpus.train_docs[0])) < len(corpus.train_docs[0]) / 2
    assert len(list(tmp_path.glob("bpe-300-*.json"))) == 1

    monkeypatch.setattr(BPETokenizer, "train", None)  # a retrain would now fail
    again = load_tokenizer("bpe:300", corpus, tmp_path)
    assert again.name == tokenizer.name
    assert list(again.encode(corpus.val_docs[0])) == list(tokenizer.encode(corpus.val_docs[0]))


def test_hf_tokenizer_from_local_file(tmp_path):
    trained = BPETokenizer.train(make_docs(30), 280)
    trained.save(tmp_path / "tokenizer.json")
    for spec in (f"hf:{tmp_path}", f"hf:{tmp_path / 'tokenizer.json'}"):
        loaded = load_tokenizer(spec, Corpus("unused", [], []), tmp_path)
        assert isinstance(loaded, HFTokenizer)
        assert loaded.eot_id == trained.eot_id
        assert list(loaded.encode("quick dogs")) == list(trained.encode("quick dogs"))


@pytest.mark.parametrize(
    "spec, message",
    [
        ("sentencepiece", "unknown tokenizer spec 'sentencepiece'"),
        ("bpe:100", "'bpe:100' needs an integer vocab size >= 257"),
        ("bpe:lots", "'bpe:lots' needs an integer"),
        ("hf:no-such/tokenizer-xyz", "'no-such/tokenizer-xyz' is neither a local tokenizer.json"),
    ],
)
def test_bad_tokenizer_specs(tmp_path, spec, message):
    with pytest.raises(DataError, match=message):
        load_tokenizer(spec, Corpus("c", ["a"], ["b"]), tmp_path)


@pytest.mark.parametrize("spec", ["bpe:4096", "hf:gpt2"])
def test_a_tokenizer_without_its_package_says_how_to_install_it(tmp_path, monkeypatch, spec):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import now raises ImportError
    expected = f"{spec} needs the 'tokenizers' package: pip install -c constraints.txt -e "
    with pytest.raises(DataError, match=re.escape(expected + '".[data]"')):
        load_tokenizer(spec, Corpus("c", ["a"], ["b"]), tmp_path)


# --- encoding and batches ------------------------------------------------------------------


def test_encode_corpus_ends_each_document_with_end_of_text():
    tokens = encode_corpus(Corpus("c", ["ab", "c"], ["d", "ef"]), ByteTokenizer())
    assert [doc.tolist() for doc in tokens.train] == [[97, 98, 0], [99, 0]]
    assert tokens.val.tolist() == [100, 0, 101, 102, 0]
    assert tokens.val.dtype == np.int32


def test_encoding_cache_round_trips(tmp_path):
    corpus = Corpus("cache-test", make_docs(20), make_docs(2))
    tokenizer = load_tokenizer("bpe:290", corpus, tmp_path)
    fresh = encode_corpus(corpus, tokenizer, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("tokens-*.npz"))) == 1
    cached = encode_corpus(corpus, tokenizer, cache_dir=tmp_path)
    assert all(np.array_equal(a, b) for a, b in zip(fresh.train, cached.train, strict=True))
    assert np.array_equal(fresh.val, cached.val) and cached.val.dtype == np.int32
    assert all(doc[-1] == tokenizer.eot_id for doc in cached.train)


def test_batches_are_shifted_windows_of_the_shard():
    shard = WorkerShard(byte_tokens(), worker=1, num_workers=2, batch_size=4, seq_len=16, seed=3)
    inputs, targets = shard.next_batch()
    assert inputs.shape == targets.shape == (4, 16) and inputs.dtype == torch.long
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    stream = shard.tokens.tolist()
    row = inputs[0].tolist()
    assert any(stream[i : i + 16] == row for i in range(len(stream) - 15))


def test_contiguous_shards_are_equal_cuts_of_the_stream_in_corpus_order():
    tokens = byte_tokens()
    stream = np.concatenate(tokens.train)
    shards = [
        WorkerShard(tokens, w, 3, 2, 8, seed=0, split="contiguous").tokens.numpy() for w in range(3)
    ]
    length = len(stream) // 3
    for worker, shard in enumerate(shards):
        assert np.array_equal(shard, stream[worker * length : (worker + 1) * length])


def sorted_two_kinds() -> TokenizedCorpus:
    """40 documents listed by kind, as a directory lists its files: 20 of 'a' then 20 of 'b'."""
    docs = [np.full(50, ord("a") if i < 20 else ord("b"), dtype=np.int32) for i in range(40)]
    return TokenizedCorpus(train=docs, val=np.full(50, ord("a"), dtype=np.int32))


def test_shuffled_shards_mix_a_corpus_listed_by_kind_where_corpus_order_splits_it():
    tokens = sorted_two_kinds()

    def share_of_a(split: str, seed: int = 0) -> list[float]:
        shards = [WorkerShard(tokens, w, 4, 2, 8, seed=seed, split=split) for w in range(4)]
        return [float((shard.tokens == ord("a")).float().mean()) for shard in shards]

    assert share_of_a("contiguous") == [1.0, 1.0, 0.0, 0.0]  # each worker one kind
    assert share_of_a("by-file") == [1.0, 1.0, 0.0, 0.0]
    for seed in range(3):
        assert all(0.2 <= share <= 0.8 for share in share_of_a("shuffled", seed))


def test_shuffled_shards_are_equal_cuts_of_one_seeded_order_of_whole_documents():
    tokens = byte_tokens()
    total = sum(map(len, tokens.train))

    def shards(seed: int) -> list[np.ndarray]:
        return [WorkerShard(tokens, w, 3, 2, 8, seed=seed).tokens.numpy() for w in range(3)]

    first = shards(0)
    assert [len(shard) for shard in first] == [total // 3] * 3
    joined = np.concatenate(first)  # whole documents one after another, in another order
    used, position = [], 0
    while position < len(joined):
        rest = joined[position:]  # the last document is cut short by total % 3
        match = next(
            i
            for i, doc in enumerate(tokens.train)
            if i not in used and np.array_equal(rest[: len(doc)], doc[: len(rest)])
        )
        used.append(match)
        position += len(tokens.train[match])
    assert sorted(used) == list(range(len(tokens.train))) and used != sorted(used)
    assert all(np.array_equal(a, b) for a, b in zip(first, shards(0), strict=True))
    assert not np.array_equal(first[0], shards(1)[0])  # the order is the run seed's
    assert not np.array_equal(first[0], np.concatenate(tokens.train)[: total // 3])


def test_by_file_shards_are_contiguous_runs_of_whole_documents():
    tokens = byte_tokens()
    shards = [
        WorkerShard(tokens, w, 3, 2, 8, seed=0, split="by-file").tokens.numpy() for w in range(3)
    ]
    assert np.array_equal(np.concatenate(shards), np.concatenate(tokens.train))
    assert all(shard[-1] == 0 for shard in shards)  # each ends at a document boundary
    assert all(len(shard) > 0.2 * sum(map(len, shards)) for shard in shards)


def test_seeds_and_workers_give_different_streams():
    tokens = byte_tokens()
    first = WorkerShard(tokens, 0, 2, 4, 16, seed=0).next_batch()[0]
    assert torch.equal(first, WorkerShard(tokens, 0, 2, 4, 16, seed=0).next_batch()[0])
    assert not torch.equal(first, WorkerShard(tokens, 0, 2, 4, 16, seed=1).next_batch()[0])
    assert not torch.equal(first, WorkerShard(tokens, 1, 2, 4, 16, seed=0).next_batch()[0])


@pytest.mark.parametrize("split", ["shuffled", "by-file", "contiguous"])
def test_a_lone_worker_matches_its_slice_of_the_simulator(split):
    tokens = byte_tokens()
    shards = [WorkerShard(tokens, w, 3, 4, 16, seed=7, split=split) for w in range(3)]
    simulated = [stacked_batches(shards) for _ in range(3)]
    assert simulated[0][0].shape == (3, 4, 16)
    for worker in range(3):
        alone = WorkerShard(tokens, worker, 3, 4, 16, seed=7, split=split)
        for inputs, targets in simulated:
            own_inputs, own_targets = alone.next_batch()
            assert torch.equal(own_inputs, inputs[worker])
            assert torch.equal(own_targets, targets[worker])


def test_resumed_shard_continues_bit_identically(tmp_path):
    tokens = byte_tokens()
    shard = WorkerShard(tokens, 1, 2, 4, 16, seed=5)
    for _ in range(3):
        shard.next_batch()
    torch.save(shard.state_dict(), tmp_path / "shard.pt")
    expected = [shard.next_batch() for _ in range(3)]

    resumed = WorkerShard(tokens, 1, 2, 4, 16, seed=5)
    resumed.load_state_dict(torch.load(tmp_path / "shard.pt"))
    assert resumed.batches_drawn == 3
    for inputs, targets in expected:
        got_inputs, got_targets = resumed.next_batch()
        assert torch.equal(got_inputs, inputs) and torch.equal(got_targets, targets)

    other_worker = WorkerShard(tokens, 0, 2, 4, 16, seed=5)
    with pytest.raises(DataError, match="shard state has worker=1, this shard has 0"):
        other_worker.load_state_dict(shard.state_dict())


def test_a_shard_state_of_another_split_is_refused():
    tokens = byte_tokens()
    saved = WorkerShard(tokens, 1, 2, 4, 16, seed=5, split="contiguous")
    saved.next_batch()
    shuffled = WorkerShard(tokens, 1, 2, 4, 16, seed=5)
    with pytest.raises(DataError, match="split='contiguous', this shard has 'shuffled'"):
        shuffled.load_state_dict(saved.state_dict())
    old = {**saved.state_dict(), "split": "iid"}  # an earlier version's name for contiguous
    with pytest.raises(DataError, match="split='iid', this shard has 'contiguous'"):
        WorkerShard(tokens, 1, 2, 4, 16, seed=5, split="contiguous").load_state_dict(old)


def test_shard_errors():
    tokens = byte_tokens(count=4, words_per_doc=5)
    available = sum(map(len, tokens.train)) // 2
    with pytest.raises(
        DataError, match=f"has {available} training tokens but one window needs 1001"
    ):
        WorkerShard(tokens, 0, 2, 4, 1000, seed=0)
    with pytest.raises(DataError, match="unknown data split 'random'"):
        WorkerShard(tokens, 0, 2, 4, 8, seed=0, split="random")
    with pytest.raises(DataError, match="worker 2 is outside 0..1"):
        WorkerShard(tokens, 2, 2, 4, 8, seed=0)
    with pytest.raises(DataError, match="by-file split\\) has 0 training tokens"):
        WorkerShard(tokens, 5, 6, 1, 4, seed=0, split="by-file")  # 4 documents, 6 workers


def test_validation_batches_are_fixed_non_overlapping_windows():
    val = np.arange(1000, dtype=np.int32)
    batches = validation_batches(val, batch_size=4, seq_len=10, max_tokens=95)
    assert [inputs.shape[0] for inputs, _ in batches] == [4, 4, 1]  # 9 windows of 10 targets
    targets = torch.cat([t for _, t in batches]).flatten()
    assert targets.tolist() == list(range(1, 91))  # each token a target once, in order
    inputs = torch.cat([i for i, _ in batches]).flatten()
    assert inputs.tolist() == list(range(90))
    everything = validation_batches(val, batch_size=32, seq_len=10, max_tokens=10**9)
    assert sum(t.numel() for _, t in everything) == 990


def test_validation_errors():
    with pytest.raises(DataError, match="validation set has 10 tokens but one window needs 11"):
        validation_batches(np.zeros(10, dtype=np.int32), 2, 10, 1000)
    with pytest.raises(DataError, match="max_tokens=5 is less than one window of seq_len=10"):
        validation_batches(np.zeros(100, dtype=np.int32), 2, 10, 5)
