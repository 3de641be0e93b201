"""What the reliability machinery costs: checkpoint save/load, checksums, corpus fingerprints.

1. Save and load of one checkpoint of a real run (tiny model, 2 simulated workers, after two
   steps so the optimizer states exist), with this checkout's checkpoint module; with
   ``--baseline FILE`` (another version's ``checkpoint.py``, e.g. from ``git show``), that one
   is timed side by side, alternating, and reported as a ratio. Then the trainer's own save
   against a training step of the same run.
2. Checksum throughput of the candidate algorithms on a 100 MB file (read from the page cache).
3. Fingerprinting the builtin corpus (the key of the token caches) against loading it.

    git show 629e1df:src/mtdao/train/checkpoint/store.py > /tmp/checkpoint_before.py
    OMP_NUM_THREADS=1 python benchmarks/checkpoint_costs.py --baseline /tmp/checkpoint_before.py
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import inspect
import os
import statistics
import tempfile
import time
import zlib
from pathlib import Path

import torch
import xxhash

from mtdao.data import load_corpus
from mtdao.train.checkpoint import store as checkpoint
from mtdao.train.checkpoint.checkpointer import Checkpointer
from mtdao.train.checkpoint.run_state import RunState
from mtdao.train.config import TrainConfig, resolve
from mtdao.train.setup import build_run
from mtdao.train.trainer import train_step


def build_tiny_run(model: str, work: Path):
    corpus = work / "corpus"
    corpus.mkdir()
    for module in ("argparse", "textwrap", "csv", "string"):
        source = inspect.getsource(__import__(module))
        (corpus / f"{module}.py").write_text(source)
    config = TrainConfig.of(
        model=model, workers=2, batch_size=2, seq_len=32, steps=10_000, data=str(corpus),
        out=str(work / "run"), device="cpu", progress=False,
    )  # fmt: skip
    run = build_run(resolve(config))
    for _ in range(2):  # the optimizer states exist after a step
        train_step(run)
    return run


def run_state(run) -> tuple[dict, dict]:
    return RunState(run).state_dict(), {"step": run.step, "config": run.config.to_dict()}


def time_harness_save(run, rounds: int) -> None:
    """The trainer's save (finite screen, files, fsyncs, commit, pruning to the newest 2) against
    one training step of the same run, alternating."""
    checkpointer = Checkpointer(run.config, run.process, run.device)
    steps, saves = [], []
    for _ in range(rounds):
        started = time.perf_counter()
        train_step(run)
        steps.append(time.perf_counter() - started)
        started = time.perf_counter()
        checkpointer.save(run)
        saves.append(time.perf_counter() - started)
    step, save = statistics.median(steps), statistics.median(saves)
    print(f"harness: one training step {step * 1e3:.1f} ms, one save {save * 1e3:.1f} ms "
          f"(medians of {rounds}); a save every N steps adds {save / step:.2f}/N of a step")  # fmt: skip


def time_save_load(modules: dict, state: dict, meta: dict, work: Path, rounds: int) -> None:
    times = {(name, op): [] for name in modules for op in ("save", "load")}
    for index in range(rounds):
        order = list(modules.items())[:: 1 if index % 2 == 0 else -1]  # alternate who goes first
        for name, module in order:
            run_dir = work / name
            started = time.perf_counter()
            module.save_checkpoint(run_dir, 0, 1, state, meta)
            times[(name, "save")].append(time.perf_counter() - started)
            started = time.perf_counter()
            module.load_checkpoint(run_dir, 0, 1)
            times[(name, "load")].append(time.perf_counter() - started)
    size = (checkpoint.checkpoint_path(work / "current") / "rank0.pt").stat().st_size
    print(f"checkpoint file: {size / 1e6:.1f} MB, {rounds} rounds")
    for (name, op), values in times.items():
        print(f"  {name:8s} {op}: median {statistics.median(values) * 1e3:6.1f} ms, "
              f"fastest {min(values) * 1e3:6.1f} ms")  # fmt: skip
    if "baseline" in modules:
        for op in ("save", "load"):
            ratio = statistics.median(times[("current", op)]) / statistics.median(
                times[("baseline", op)]
            )
            print(f"  {op} current/baseline (medians): {ratio:.2f}x")


class Crc32:
    def __init__(self) -> None:
        self.value = 0

    def update(self, data: bytes) -> None:
        self.value = zlib.crc32(data, self.value)


def time_checksums(work: Path) -> None:
    path = work / "100mb.bin"
    path.write_bytes(os.urandom(100 * 2**20))
    algorithms = {
        "xxh3_128": xxhash.xxh3_128,
        "crc32": Crc32,
        "sha256": hashlib.sha256,
        "blake2b": hashlib.blake2b,
    }
    print("checksum of a 100 MB file (fastest of 3):")
    for name, make in algorithms.items():
        best = float("inf")
        for _ in range(3):
            started, hasher = time.perf_counter(), make()
            with open(path, "rb") as handle:
                while chunk := handle.read(1 << 20):
                    hasher.update(chunk)
            best = min(best, time.perf_counter() - started)
        print(f"  {name:9s} {best * 1e3:6.1f} ms  ({100 / best:6.0f} MB/s)")


def time_corpus_fingerprint() -> None:
    started = time.perf_counter()
    corpus = load_corpus("builtin")
    loaded = time.perf_counter() - started
    chars = sum(map(len, corpus.train_docs)) + sum(map(len, corpus.val_docs))
    started = time.perf_counter()
    corpus.fingerprint  # noqa: B018 - computed (and cached) on first access
    hashed = time.perf_counter() - started
    print(f"builtin corpus: {chars / 1e6:.1f}M characters; loading {loaded * 1e3:.0f} ms, "
          f"fingerprint {hashed * 1e3:.1f} ms ({hashed / loaded:.1%} of loading)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", type=Path, help="another version's checkpoint.py")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)
    modules = {"current": checkpoint}
    if args.baseline:
        spec = importlib.util.spec_from_file_location("checkpoint_baseline", args.baseline)
        modules["baseline"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(modules["baseline"])
    with tempfile.TemporaryDirectory() as work:
        run = build_tiny_run(args.model, Path(work))
        state, meta = run_state(run)
        time_save_load(modules, state, meta, Path(work), args.rounds)
        time_harness_save(run, args.rounds)
        time_checksums(Path(work))
    time_corpus_fingerprint()


if __name__ == "__main__":
    main()
