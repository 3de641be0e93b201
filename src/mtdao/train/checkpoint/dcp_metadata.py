"""Reading a sharded checkpoint's DCP ``.metadata`` without letting it run code (DCP's own reader
uses ``pickle.load``, and a checksum is no defence against whoever can rewrite both): only DCP's
metadata classes and the plain types they hold are built, and every slice must lie inside a
checksummed file of the checkpoint's ``model`` directory, with no stream transform
(docs/design.md, "On sharded workers")."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
ALLOWED_GLOBALS = {
    (_METADATA_MODULE, name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by name, e.g. "torch.strided"
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
}
"""What DCP's metadata pickles name (checked against torch 2.13), dtypes aside."""


class MetadataUnpickler(pickle.Unpickler):
    """Builds DCP metadata; refuses every other global (a function or class a forged file
    names to have it called) before importing or calling it."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which is not DCP metadata")


def read_metadata(path: Path, data_files: set[str] | None = None):
    """The DCP metadata in ``path``, read safely. ``data_files``: the names of the files next
    to it that its slices may lie in (None: any plain name in that directory). Raises
    ValueError with one line saying why the file is refused."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        with open(path, "rb") as file:
            metadata = MetadataUnpickler(file).load()
    except OSError:
        raise
    except Exception as error:  # any damaged or forged pickle: one line
        raise ValueError(f"{path} is refused: {_reason(error)}") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise ValueError(
            f"{path} is refused: it holds a {type(metadata).__name__}, not DCP metadata"
        )
    sizes: dict[Path, int] = {}
    for index, where in metadata.storage_data.items():
        if not isinstance(where, _StorageInfo) or not isinstance(where.relative_path, str):
            raise ValueError(f"{path} is refused: slice {index} has no file")
        name = where.relative_path
        inside = name == Path(name).name and name not in ("", ".", "..")
        if not inside or (data_files is not None and name not in data_files):
            raise ValueError(
                f"{path} is refused: a slice lies in {name!r}, not a file of this checkpoint"
            )
        problem = _transforms(where) or _outside(where, path.parent / name, sizes)
        if problem:
            raise ValueError(f"{path} is refused: slice {index.fqn!r} {problem}")
    return metadata


def _transforms(where) -> str | None:
    """Why the slice ``where`` is refused for the stream transforms it names (None: it names
    none). mtdao saves without any; DCP would look each up in its extension registry and stop
    the resume in a traceback (its CheckpointException is no ``Exception``)."""
    descriptors = getattr(where, "transform_descriptors", None)
    if not descriptors:
        return None
    return (
        f"names the stream transforms {descriptors!r}, which mtdao never writes (a forged or foreign "
        "file): resume from an earlier checkpoint, or delete this one"
    )


def _outside(where, data_file: Path, sizes: dict[Path, int]) -> str | None:
    """Why the slice ``where`` does not lie inside ``data_file`` (None: it does); ``sizes``
    caches the files' sizes. DCP would read past the end and fail in an EOFError."""
    offset, length = where.offset, where.length
    if not (isinstance(offset, int) and isinstance(length, int) and offset >= 0 and length >= 0):
        return f"has offset {offset!r} and length {length!r}"
    if data_file not in sizes:
        try:
            sizes[data_file] = data_file.stat().st_size
        except OSError as error:
            return f"lies in {data_file.name}, which cannot be read ({error.strerror})"
    if offset + length > sizes[data_file]:
        return (
            f"lies at bytes {offset} .. {offset + length}, past the end of {data_file.name} "
            f"({sizes[data_file]} bytes)"
        )
    return None


def safe_reader(directory: Path, data_files: set[str] | None = None):
    """A ``dcp.FileSystemReader`` of ``directory`` that reads its metadata with
    :func:`read_metadata` (the tensors it reads are loaded by DCP with ``weights_only=True``)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            rank = kwargs.get("rank")
            metadata = read_metadata(Path(self._get_metadata_path(rank)), data_files)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader(directory)


def _reason(error: BaseException) -> str:
    text = str(error).strip()
    first = text.splitlines()[0] if text else ""
    return first or f"it is not a readable pickle ({type(error).__name__})"
