"""Held-out natural-language corpora found on the machine, for checks never tuned on.

- ``vim``: the vim documentation, plain text files as vim ships them.
- ``gnu-info``: the GNU info manuals of ``/usr/share/info`` (coreutils, sed, grep, gettext, ...),
  gzipped and split into nodes by control characters. They are written once as UTF-8 text files
  of about 20,000 characters (whole nodes), so that the split into training and validation
  documents has enough documents to work with.
- ``builtin``: the project's own corpus (no path needed).
"""

from __future__ import annotations

import gzip
import re
from pathlib import Path

VIM_DOCS = Path("/usr/share/vim/vim90/doc")
INFO_DIR = Path("/usr/share/info")
CHUNK_CHARS = 20_000
# info's node separator (0x1f) and other control characters; tabs and newlines stay
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def corpus_paths(names, cache: Path) -> tuple[dict[str, str], dict[str, str]]:
    """(corpus -> ``--data`` value, corpus -> why it is missing) for ``names``."""
    found: dict[str, str] = {}
    missing: dict[str, str] = {}
    for name in names:
        if name == "builtin":
            found[name] = "builtin"
        elif name == "vim":
            if any(VIM_DOCS.glob("*.txt")):
                found[name] = str(VIM_DOCS)
            else:
                missing[name] = f"no vim documentation in {VIM_DOCS}"
        elif name == "gnu-info":
            written = write_gnu_info_corpus(cache / "gnu-info")
            if written:
                found[name] = str(cache / "gnu-info")
            else:
                missing[name] = f"no gzipped info manuals in {INFO_DIR}"
        else:
            raise ValueError(f"unknown corpus {name!r}")
    return found, missing


def write_gnu_info_corpus(target: Path, source: Path = INFO_DIR) -> int:
    """Write the info manuals of ``source`` as text files into ``target`` (once: an existing
    non-empty ``target`` is kept as it is); returns the number of files there."""
    if target.is_dir() and any(target.iterdir()):
        return sum(1 for _ in target.iterdir())
    manuals = sorted(source.glob("*.info*.gz")) if source.is_dir() else []
    if not manuals:
        return 0
    target.mkdir(parents=True, exist_ok=True)
    count = 0
    for manual in manuals:
        text = gzip.decompress(manual.read_bytes()).decode("utf-8", errors="replace")
        nodes = [node for node in text.split("\x1f") if node.strip()]
        nodes = [
            _CONTROL.sub("", node) for node in nodes if not node.lstrip().startswith("Tag Table")
        ]
        stem = manual.name.removesuffix(".gz").replace(".info", "")
        for index, chunk in enumerate(_chunks(nodes)):
            (target / f"{stem}-{index:03d}.txt").write_text(chunk, encoding="utf-8")
            count += 1
    return count


def _chunks(nodes: list[str]):
    """Consecutive nodes joined into pieces of a little over CHUNK_CHARS characters."""
    piece: list[str] = []
    size = 0
    for node in nodes:
        piece.append(node)
        size += len(node)
        if size > CHUNK_CHARS:
            yield "\n".join(piece)
            piece, size = [], 0
    if piece:
        yield "\n".join(piece)
