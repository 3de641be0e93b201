"""Where training text comes from: the Python standard library, local files, or Hugging Face.

Every source becomes a ``Corpus`` of whole documents, already split into train and validation.
Splits are deterministic (a hash of each document's key), so every rank of a multi-process run
and every rerun sees the same split without communicating.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import socket
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import xxhash

from mtdao.data.errors import INSTALL_DATA, DataError


@dataclass
class Corpus:
    name: str
    """Names the source (for people); caches are keyed on the content itself (``fingerprint``)."""
    train_docs: list[str]
    val_docs: list[str]
    skipped: list[tuple[str, str]] = field(default_factory=list)
    """(file, why) for each file of a local directory that was not read: binary, not UTF-8,
    empty or unreadable."""

    @functools.cached_property
    def train_fingerprint(self) -> str:
        """A hash of the training documents (what a tokenizer is trained on)."""
        return content_hash(self.train_docs)

    @functools.cached_property
    def fingerprint(self) -> str:
        """A hash of every document and of the train/validation split: any edit, even one that
        keeps every length, changes it. About 6 ms for the 31M-character builtin corpus."""
        return content_hash([self.train_fingerprint, content_hash(self.val_docs)])


def content_hash(docs: list[str]) -> str:
    """XXH3-128 of the documents, each prefixed by its byte length (so no two lists collide by
    moving text across a document boundary)."""
    hasher = xxhash.xxh3_128()
    hasher.update(len(docs).to_bytes(8, "little"))
    for doc in docs:
        data = doc.encode("utf-8", "surrogatepass")
        hasher.update(len(data).to_bytes(8, "little"))
        hasher.update(data)
    return hasher.hexdigest()


def load_corpus(
    spec: str | None, val_fraction: float = 0.02, max_chars: int = 50_000_000
) -> Corpus:
    """Load the corpus that ``spec`` names.

    spec: None or "builtin" (this interpreter's standard library sources, no download), a path
    to a text file or a directory of text files, or "hf:NAME[:CONFIG]" (a Hugging Face dataset
    name, a ``save_to_disk`` directory, or a data-files directory). ``max_chars`` caps how much
    of a Hugging Face dataset is read.
    """
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if spec is None or spec == "builtin":
        return _stdlib_corpus(val_fraction)
    if spec.startswith("hf:"):
        return _hf_corpus(spec[len("hf:") :], val_fraction, max_chars)
    if not spec:
        raise DataError("empty corpus spec; use 'builtin', a path, or 'hf:NAME[:CONFIG]'")
    return _local_corpus(Path(spec).expanduser(), val_fraction)


def _hash_fraction(key: str) -> float:
    """A stable pseudo-random number in [0, 1) for a key (unlike hash(), fixed across runs)."""
    return int(hashlib.md5(key.encode("utf-8")).hexdigest()[:15], 16) / 16**15


def _split_by_key(
    keyed_docs: list[tuple[str, str]], val_fraction: float
) -> tuple[list[str], list[str]]:
    """Split (key, text) documents by a hash of the key; both sides get at least one document.

    Exact duplicates keep only their first copy, so no validation text is also in training
    (the stdlib has eight, e.g. identical one-line __init__.py files).
    """
    seen: set[str] = set()
    unique = []
    for key, text in keyed_docs:
        if text not in seen:
            seen.add(text)
            unique.append((key, text))
    if len(unique) == 1:
        raise DataError(
            f"{len(keyed_docs)} documents but all identical; cannot split off validation"
        )
    val_keys = {key for key, _ in unique if _hash_fraction(key) < val_fraction}
    by_score = sorted((key for key, _ in unique), key=_hash_fraction)
    if not val_keys:  # a small corpus where no hash fell below val_fraction
        val_keys = {by_score[0]}
    if len(val_keys) == len(unique):
        val_keys.discard(by_score[-1])
    train = [text for key, text in unique if key not in val_keys]
    val = [text for key, text in unique if key in val_keys]
    return train, val


def _split_one_text(text: str, val_fraction: float, source: str) -> tuple[list[str], list[str]]:
    """A single document: the last val_fraction of its characters is the validation set."""
    cut = int(len(text) * (1.0 - val_fraction))
    if cut == 0 or cut == len(text):
        raise DataError(f"{source} has {len(text)} characters, too few to split off validation")
    return [text[:cut]], [text[cut:]]


def _read_text(path: Path) -> str | None:
    """The file's text, or None if it looks binary (a NUL byte or invalid UTF-8)."""
    return _text_or_why_not(path)[0]


def _text_or_why_not(path: Path) -> tuple[str | None, str]:
    """(the file's text, "") or (None, why it is not text: unreadable, binary, not UTF-8)."""
    try:
        data = path.read_bytes()
    except OSError as error:
        return None, f"cannot be read ({error.strerror or error})"
    nul = data.find(b"\x00")
    if nul >= 0:
        return None, f"binary (a NUL byte at offset {nul})"
    try:
        return data.decode("utf-8"), ""
    except UnicodeDecodeError as error:
        where = f"byte 0x{data[error.start]:02x} at offset {error.start}"
        return None, f"not UTF-8 ({where}: Latin-1 or another encoding?)"


def _stdlib_corpus(val_fraction: float) -> Corpus:
    root = Path(sysconfig.get_paths()["stdlib"])
    keyed_docs = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if "site-packages" in relative or "dist-packages" in relative:
            continue
        text = _read_text(path)
        if text:  # skips unreadable, non-UTF-8 and empty files
            keyed_docs.append((relative, text))
    if len(keyed_docs) < 2:
        raise DataError(f"found {len(keyed_docs)} readable .py files under {root}")
    train, val = _split_by_key(keyed_docs, val_fraction)
    return Corpus(f"builtin:python-stdlib-{platform.python_version()}", train, val)


def _local_corpus(path: Path, val_fraction: float) -> Corpus:
    try:
        resolved = path.resolve(strict=True)
    except FileNotFoundError:
        raise DataError(f"corpus path does not exist: {path}") from None
    except (RuntimeError, OSError) as error:  # a symlink loop: RuntimeError up to Python 3.12
        why = "a symlink loop" if "loop" in str(error).lower() else (error.strerror or error)
        raise DataError(f"corpus path cannot be followed: {path} ({why})") from None
    name = f"local:{resolved}"
    if path.is_file():
        text, why_not = _text_or_why_not(path)
        if text is None:
            raise DataError(f"corpus file is not UTF-8 text: {path} is {why_not}")
        if not text:
            raise DataError(f"corpus file is empty: {path}")
        return Corpus(name, *_split_one_text(text, val_fraction, f"corpus file {path}"))

    keyed_docs, skipped = [], []
    for file in sorted(path.rglob("*")):
        relative = file.relative_to(path)
        if any(part.startswith(".") for part in relative.parts) or file.is_dir():
            continue
        if not file.is_file():  # a broken symlink, a symlink loop, a socket or a device
            why = "a symlink that leads to no file (broken, or a loop)" if file.is_symlink() else ""
            skipped.append((relative.as_posix(), why or "not a regular file"))
            continue
        text, why_not = _text_or_why_not(file)
        if text:  # binary, non-UTF-8 and empty files in a directory are skipped, not fatal
            keyed_docs.append((relative.as_posix(), text))
        else:
            skipped.append((relative.as_posix(), why_not or "empty"))
    if not keyed_docs:
        raise DataError(f"corpus directory has no non-empty UTF-8 text files: {path}")
    if len(keyed_docs) == 1:
        split = _split_one_text(keyed_docs[0][1], val_fraction, f"corpus {path}")
    else:
        split = _split_by_key(keyed_docs, val_fraction)
    return Corpus(name, *split, skipped=skipped)


def _hf_corpus(target: str, val_fraction: float, max_chars: int) -> Corpus:
    dataset_name, _, config = target.partition(":")
    if not dataset_name:
        raise DataError("hf: corpus spec needs a dataset name, as in hf:NAME[:CONFIG]")
    if not _is_saved_dataset(Path(dataset_name).expanduser()):
        go_offline_if_the_hub_is_unreachable(f"hf:{target}")
    try:
        import datasets
    except ImportError:
        raise DataError(f"hf:{target} needs the 'datasets' package: {INSTALL_DATA}") from None

    try:
        dataset = _open_hf_dataset(datasets, dataset_name, config or None)
        texts = _read_hf_texts(dataset, max_chars, f"hf:{target}")
    except DataError:
        raise
    except Exception as error:  # load_dataset raises many types; the user needs one line
        reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise DataError(
            f"cannot load Hugging Face dataset {target!r}: {type(error).__name__}: {reason}"
        ) from error
    if not texts:
        raise DataError(f"Hugging Face dataset {target!r} has no non-empty text documents")

    total_chars = sum(len(text) for text in texts)
    name = f"hf:{target}" + (f"[first {total_chars} chars]" if total_chars >= max_chars else "")
    if len(texts) == 1:
        return Corpus(name, *_split_one_text(texts[0], val_fraction, f"hf:{target}"))
    keyed_docs = [(f"doc-{index}", text) for index, text in enumerate(texts)]
    return Corpus(name, *_split_by_key(keyed_docs, val_fraction))


def _open_hf_dataset(datasets, name: str, config: str | None):
    """A saved dataset directory is read with load_from_disk, anything else with load_dataset."""
    path = Path(name).expanduser()
    if not _is_saved_dataset(path):
        # Streaming reads only the documents needed to reach max_chars.
        return datasets.load_dataset(name, config, split="train", streaming=True)
    dataset = datasets.load_from_disk(str(path))
    if isinstance(dataset, datasets.DatasetDict):
        if "train" not in dataset:
            raise DataError(f"saved dataset {path} has no 'train' split: {list(dataset)}")
        dataset = dataset["train"]
    return dataset


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


HUB_PROBE_TIMEOUT_S = 3.0
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def hub_reachable(timeout: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """Whether a TCP connection to the Hugging Face hub (``HF_ENDPOINT``) opens within
    ``timeout`` seconds."""
    endpoint = urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((endpoint.hostname or "", port), timeout=timeout).close()
    except OSError:
        return False
    return True


def go_offline_if_the_hub_is_unreachable(source: str) -> None:
    """Without a hub to reach, ``datasets`` retries for half a minute before it reads its cache
    (or fails): set HF_HUB_OFFLINE / HF_DATASETS_OFFLINE instead, and say so. A setting the user
    made is left alone."""
    if any(os.environ.get(name) for name in OFFLINE_VARIABLES) or hub_reachable():
        return
    for name in OFFLINE_VARIABLES:
        os.environ[name] = "1"
    # the libraries read these variables when imported: tell one imported already
    for module, names in (
        ("datasets.config", OFFLINE_VARIABLES),
        ("huggingface_hub.constants", OFFLINE_VARIABLES[:1]),
    ):
        if module in sys.modules:
            for name in names:
                setattr(sys.modules[module], name, True)
    print(
        f"{source}: the Hugging Face hub is unreachable; reading the local cache only "
        "(HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1)",
        file=sys.stderr,
        flush=True,
    )


def _read_hf_texts(dataset, max_chars: int, source: str) -> list[str]:
    """Documents of the text column ("text", else the first string column) up to max_chars."""
    texts, total_chars, column = [], 0, None
    for row in dataset:
        if column is None:
            string_columns = [key for key, value in row.items() if isinstance(value, str)]
            if not string_columns:
                raise DataError(f"{source} has no text column (columns: {', '.join(row)})")
            column = "text" if "text" in string_columns else string_columns[0]
        text = row[column]
        if text:
            texts.append(text)
            total_chars += len(text)
            if total_chars >= max_chars:
                break
    return texts
