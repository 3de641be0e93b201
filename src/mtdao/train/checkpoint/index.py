"""Finding the complete checkpoints of a run directory and checking their files. Listing reads
only the small ``meta.json`` files; ``verify_files`` reads every byte."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtdao.train.durable import CHECKSUMS, file_checksum


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupted or belongs to a different run."""


CHECKPOINTS_DIR = "checkpoints"
FORMAT = 2
COMPLETE_NAME = re.compile(r"step-(\d+)(?:\.(\d+))?")
SET_ASIDE_NAME = re.compile(r"step-\d+(?:\.\d+)?\.damaged(?:\.\d+)?")
"""A checkpoint a load found damaged and renamed (kept for inspection, never loaded)."""


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint on disk (its files are not verified by listing)."""

    path: Path
    step: int
    sequence: int
    meta: dict[str, Any] = field(repr=False)

    @property
    def world_size(self) -> int | None:
        return self.meta.get("world_size")

    @property
    def files(self) -> dict[str, dict[str, Any]]:
        """{file name: {"bytes": size, "<algorithm>": checksum}}."""
        return self.meta["files"]


def list_checkpoints(run_dir: Path) -> list[CheckpointInfo]:
    """The complete checkpoints in ``run_dir``, newest first (nothing is verified)."""
    return scan_checkpoints(Path(run_dir))[0]


def scan_checkpoints(run_dir: Path) -> tuple[list[CheckpointInfo], list[tuple[Path, str]]]:
    """(complete checkpoints newest first, [(directory, why its metadata is unreadable)])."""
    found, unreadable = [], []
    root = run_dir / CHECKPOINTS_DIR
    candidates = sorted(root.iterdir()) if root.is_dir() else []
    for path in candidates:
        if COMPLETE_NAME.fullmatch(path.name) and path.is_dir():
            meta, problem = read_meta(path / "meta.json")
            if problem:
                unreadable.append((path, problem))
            else:
                found.append(CheckpointInfo(path, int(meta["step"]), int(meta["sequence"]), meta))
    found.sort(key=lambda info: info.sequence, reverse=True)
    return found, unreadable


def read_meta(path: Path) -> tuple[dict[str, Any], str | None]:
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        return {}, f"{path.name} is missing"
    except (OSError, ValueError, RecursionError) as error:
        return {}, f"{path} is unreadable ({type(error).__name__})"
    problem = _meta_problem(meta)
    return (meta, None) if problem is None else ({}, f"{path} is unreadable ({problem})")


def _meta_problem(meta: Any) -> str | None:
    """Why ``meta`` is not a meta.json as a save writes it (None: it is)."""
    if not isinstance(meta, dict):
        return "not an object"
    for key in ("step", "sequence", "world_size"):
        if type(meta.get(key)) is not int:
            return f"its {key} is not an integer"
    if not isinstance(meta.get("backend", "torch"), str):
        return "its backend is not text"
    files = meta.get("files")
    if not isinstance(files, dict):
        return "its files are not an object"
    for name, expected in files.items():
        if not isinstance(expected, dict) or type(expected.get("bytes", 0)) is not int:
            return f"its entry for {name[:60]!r} is not {{bytes, checksum}}"
        for algorithm, value in expected.items():
            if algorithm != "bytes" and (algorithm not in CHECKSUMS or not isinstance(value, str)):
                return f"its entry for {name[:60]!r} names the checksum {algorithm[:20]!r}"
    return None


def verify_files(info: CheckpointInfo, names: list[str] | None = None) -> str | None:
    """Why the named files (default: all) of ``info`` fail their size or checksum; None if fine."""
    for name in names if names is not None else list(info.files):
        expected = info.files.get(name)
        if expected is None:
            return f"{info.path / 'meta.json'} lists no {name}"
        path = info.path / name
        try:
            size = path.stat().st_size
            if "bytes" in expected and size != expected["bytes"]:
                return (
                    f"{path} is corrupted or incomplete ({size} bytes, {expected['bytes']} saved)"
                )
            algorithm = next((key for key in expected if key != "bytes"), None)
            if algorithm and file_checksum(path, algorithm) != expected[algorithm]:
                return f"{path} is corrupted or incomplete (its {algorithm} checksum differs)"
        except OSError as error:
            return f"{path} cannot be read ({error.strerror or type(error).__name__})"
    return None


def set_aside_checkpoints(run_dir: Path) -> list[Path]:
    """The checkpoints of ``run_dir`` that were found damaged and set aside, by name."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    found = sorted(root.iterdir()) if root.is_dir() else []
    return [path for path in found if SET_ASIDE_NAME.fullmatch(path.name)]


def latest_checkpoint(run_dir: Path) -> CheckpointInfo | None:
    """The newest complete checkpoint, without verifying its files (cheap)."""
    found = list_checkpoints(run_dir)
    return found[0] if found else None


def checkpoint_path(run_dir: Path) -> Path:
    """The directory of the newest complete checkpoint (``checkpoints/`` when there is none)."""
    latest = latest_checkpoint(run_dir)
    return latest.path if latest else Path(run_dir) / CHECKPOINTS_DIR


def has_checkpoint(run_dir: Path) -> bool:
    """True when ``run_dir`` holds a complete checkpoint whose files all match their checksums."""
    return any(verify_files(info) is None for info in list_checkpoints(run_dir))


def load_meta(run_dir: Path) -> dict[str, Any]:
    """The metadata of the newest complete checkpoint (its files are checked by load_checkpoint)."""
    latest = latest_checkpoint(run_dir)
    if latest is None:
        raise CheckpointError(f"no checkpoint to resume from: {run_dir} holds no complete one")
    return latest.meta
