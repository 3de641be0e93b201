"""Checkpoints of sharded workers: torch.distributed.checkpoint (DCP) files inside the store,
whose sequence is unchanged; only the files differ::

    step-00000120/
        meta.json                 backend "dcp", workers M, shards S, every file's checksum
        model/.metadata           DCP: where each slice of each tensor lives
        model/__<rank>_0.distcp   DCP: process <rank>'s shards of everything element-wise
                                  (parameters, optimizer states, the engine's tensors), under
                                  "worker<w>." keys: every worker's copy is kept
        worker<w>.pt              worker w's own state: data position, RNG, the engine's step and
                                  record of rounds, clocks, evaluations

DCP records every tensor's global shape, so a checkpoint loads into another number of shards per
worker; the number of workers must match (a worker's data position cannot be split or merged)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mtdao.state_files import read_state_file
from mtdao.sync.dtensors import local_shard
from mtdao.train.checkpoint.dcp_metadata import read_metadata, safe_reader
from mtdao.train.checkpoint.index import CheckpointInfo, read_meta, verify_files
from mtdao.train.checkpoint.store import CheckpointError, CheckpointStore, write_checksummed
from mtdao.train.durable import CHECKSUM, file_checksum, fsync_directory

MODEL_DIR = "model"


def worker_file(worker: int) -> str:
    return f"worker{worker}.pt"


class ShardedCheckpointStore(CheckpointStore):
    """The store of a run of ``workers`` x ``shards`` processes (rank r: worker r // shards).

    ``save(step, state)`` takes ``{"sharded": <DCP state dict>, "worker": <plain state>}``.
    ``load()`` picks the newest checkpoint whose files all verify (each process checks a share of
    them) and returns ``{"worker": <this process's worker's state>}``; the sharded tensors are
    read afterwards, into the run once it is built, by :func:`load_sharded`.
    """

    backend = "dcp"

    def __init__(
        self,
        run_dir: Path,
        *,
        rank: int,
        workers: int,
        shards: int,
        keep: int = 2,
        collective=None,
    ) -> None:
        super().__init__(
            run_dir, rank=rank, world_size=workers * shards, keep=keep, collective=collective
        )
        self.workers, self.shards = workers, shards
        self.worker, self.shard = divmod(rank, shards)
        self._sharded: dict[str, Any] | None = None

    # -- saving --------------------------------------------------------------------------------

    def save(
        self, step: int, state: Any, meta: dict[str, Any] | None = None, check_finite: bool = True
    ) -> Path | None:
        # The store's checks read local shards; the DCP writer needs the DTensors themselves.
        self._sharded = state["sharded"]
        checked = {"sharded": _local_shards(state["sharded"]), "worker": state["worker"]}
        meta = {**(meta or {}), "backend": self.backend, "workers": self.workers}
        meta["shards"] = self.shards
        try:
            return super().save(step, checked, meta, check_finite)
        finally:
            self._sharded = None

    def _write_rank_file(self, staging: Path, state: Any) -> dict[str, Any]:
        """Every process: its DCP shard file (process 0 also DCP's metadata); the first process
        of each worker: the worker's file. Returns {file name: size and checksum}."""
        import torch.distributed.checkpoint as dcp

        model_dir = staging / MODEL_DIR
        try:
            writer = dcp.FileSystemWriter(model_dir, single_file_per_rank=True, sync_files=True)
            dcp.save(self._sharded, storage_writer=writer)
        except OSError:
            raise
        except Exception as error:  # DCP gathers every process's failure into one exception
            raise OSError(
                f"torch.distributed.checkpoint could not write: {_first_line(error)}"
            ) from None
        names = sorted(f"{MODEL_DIR}/{p.name}" for p in model_dir.glob(f"__{self.rank}_*.distcp"))
        if self.rank == 0:
            names.append(f"{MODEL_DIR}/.metadata")
        files = {name: _digest(staging / name) for name in names}
        if self.shard == 0:
            name = worker_file(self.worker)
            files[name] = write_checksummed(staging / name, state["worker"])
        return files

    def _collect_files(self, staging: Path, files: dict) -> dict[str, dict]:
        files = super()._collect_files(staging, files)
        fsync_directory(staging / MODEL_DIR)
        return files

    # -- loading -------------------------------------------------------------------------------

    def _incompatibility(self, info: CheckpointInfo) -> str | None:
        backend = info.meta.get("backend", "torch")
        if backend == self.backend and info.meta.get("workers") != self.workers:
            return (
                f"checkpoint {info.path} holds {info.meta.get('workers')} workers, this run has "
                f"{self.workers}: a worker's data position and local progress cannot be split "
                "or merged (any number of --shards per worker loads)"
            )
        if backend == self.backend:
            return None
        return super()._incompatibility(info)

    def _try_load(self, info: CheckpointInfo) -> tuple[Any, str | None]:
        """Verify the files (each process a share of them: together, all of them), agree, then
        read this process's worker file."""
        problem = self._incompatibility(info)
        if problem is None:
            names = sorted(info.files)[self.rank :: self.world_size]
            problem = verify_files(info, names) or _refused_metadata(info)
        if not self.collective.all_true(problem is None):
            return None, problem or "a file another process checked failed its check"
        try:
            return {"worker": read_state_file(info.path / worker_file(self.worker))}, None
        except (OSError, ValueError) as error:
            return None, f"{info.path / worker_file(self.worker)} cannot be read: {error}"


def load_sharded(checkpoint: Path, state_dict: dict[str, Any]) -> None:
    """Read the DCP files of ``checkpoint`` (a directory :meth:`ShardedCheckpointStore.load`
    chose) into ``state_dict`` in place, on every process together; each process reads the
    slices its tensors cover, whatever the number of shards that wrote them. The metadata is
    read by the safe reader (:mod:`mtdao.train.checkpoint.dcp_metadata`), never by ``pickle.load``."""
    import torch.distributed.checkpoint as dcp

    data_files = _data_files(checkpoint)
    try:  # refused in one line here, before DCP wraps the reason into its own report
        read_metadata(checkpoint / MODEL_DIR / ".metadata", data_files)
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{checkpoint} could not be read: {error}") from None
    reader = safe_reader(checkpoint / MODEL_DIR, data_files)
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state_dict, storage_reader=reader)
    except CheckpointException as error:  # a BaseException: each process's failure inside
        failure = next(iter(error.failures.values()), (error, None))[0]
        raise CheckpointError(f"{checkpoint} could not be read: {_first_line(failure)}") from None
    except Exception as error:
        raise CheckpointError(f"{checkpoint} could not be read: {_first_line(error)}") from None


def _data_files(checkpoint: Path) -> set[str] | None:
    """The DCP data files ``checkpoint``'s meta.json lists (checksummed); None if unlisted."""
    meta, problem = read_meta(checkpoint / "meta.json")
    if problem:
        return None
    return {name.split("/", 1)[1] for name in meta["files"] if name.startswith(f"{MODEL_DIR}/")}


def _refused_metadata(info: CheckpointInfo) -> str | None:
    """Why the DCP metadata of ``info`` is refused (forged, damaged or pointing elsewhere)."""
    try:
        read_metadata(info.path / MODEL_DIR / ".metadata", _data_files(info.path))
    except (OSError, ValueError) as error:
        return str(error)
    return None


def _local_shards(state: Any) -> Any:
    """``state`` with every DTensor replaced by its local shard (what this process holds)."""
    if isinstance(state, dict):
        return {key: _local_shards(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_local_shards(value) for value in state)
    return local_shard(state)


def _digest(path: Path) -> dict[str, Any]:
    return {"bytes": path.stat().st_size, CHECKSUM: file_checksum(path)}


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
