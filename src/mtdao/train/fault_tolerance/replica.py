"""One replica of a fault-tolerant run: ``mtdao train --fault-tolerant --replica-id I --lighthouse ADDR``.

A fault-tolerant run is ``--workers`` replicas, started anywhere and at any time, and a lighthouse
(``mtdao lighthouse``) that knows which of them are alive. A replica is one process, or
``--shards S`` processes under ``torchrun --nproc-per-node S`` sharding its model with FSDP2
(:mod:`mtdao.train.sharding`); killing any of them takes the replica out, and torchrun
``--max-restarts`` brings it back to heal. Replica I trains
on data shard I, averages with whichever replicas are alive at each sync
(:mod:`mtdao.ft`) and writes its own run directory. A replica that starts late or
restarts heals from a live peer: parameters, every optimizer state and the engine's state. Every
averaged state is the same on all replicas after a sync, so the healed replica carries on with the
group's global states, not only its parameters. Its data position stays its own.

The replica trains in the one training loop (:func:`mtdao.train.trainer.loop`); this module
builds its run and gives the loop its hooks (:class:`ReplicaDriver`).

Progress lines (stderr, from the replica's first process) say when replicas join or leave, when
this replica healed and when a round was discarded (a line that repeats, a discard at every step
while the lighthouse is away or a refused heal state, once a minute per kind with a count);
``replicas.jsonl`` in the run directory has every one, one JSON line each (events ``connect``,
``quorum``, ``discarded``, ``committed``, each with its time and step).
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch

from mtdao.sync.communicator import RoundNotCommitted
from mtdao.sync.engine import NonFiniteError
from mtdao.sync.repeated_lines import RepeatedLines
from mtdao.train import trainer
from mtdao.train.config import TrainConfig, marked
from mtdao.train.distributed import ProcessInfo
from mtdao.train.fault_tolerance.lighthouse import INSTALL_HINT
from mtdao.train.loop_hooks import LoopHooks
from mtdao.train.metrics import write_json
from mtdao.train.setup import Run, build_run

# Settings that may differ between the replicas of one run (marked replica_local on the field);
# every other must match the quorum's, or the replica is refused when it first heals.
REPLICA_FIELDS = marked("replica_local")


class ReplicaObserver:
    """What a fault drill (:mod:`mtdao.testing.fault_drill`) watches and steers in a replica;
    every method a no-op here. Added to a process with :func:`observe_replicas`."""

    def before_connect(self, run: Run, replicas) -> None:
        """Once the run is built, before the replica announces itself to the lighthouse."""

    def before_step(self, run: Run) -> None:
        """Before every step (a drill may pause the replica here)."""

    def after_round(self, run: Run) -> None:
        """After every committed round (a drill may record the state here)."""


OBSERVERS: list[ReplicaObserver] = []


def observe_replicas(observer: ReplicaObserver) -> None:
    """Let ``observer`` watch every replica trained in this process from now on."""
    OBSERVERS.append(observer)


def train_replica(config: TrainConfig) -> dict[str, Any]:
    """Train one replica of a fault-tolerant run (config resolved); returns its results."""
    try:
        import mtdao.ft.joining  # noqa: F401  (torchft with it)
    except ModuleNotFoundError as error:
        if error.name != "torchft":
            raise
        raise ValueError(f"--fault-tolerant needs torchft: {INSTALL_HINT}") from None
    driver = ReplicaDriver(config)
    with stop_on_signals():
        try:
            results = trainer.train(config, build=driver.build, hooks=driver)
        finally:
            driver.close()
    results["simulated"] = False
    results["fault_tolerance"] = driver.summary()
    if driver.is_main:
        write_json(Path(config.job.out) / "results.json", results)
    return results


class ReplicaDriver(LoopHooks):
    """Builds the replica's run around a torchft communicator; the training loop's hooks."""

    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self.replicas = None
        self.events: ReplicaEvents | None = None
        self.heals: list[dict[str, Any]] = []
        self.discarded: list[dict[str, Any]] = []
        self.quorums = 0
        self.lighthouse_away = False  # rounds are skipped until a quorum forms again
        self.refusals = None  # what is said of the unproven peers (a RefusalLog, once built)
        self.repeated_lines = RepeatedLines()  # discards, refused heals: each kind once a minute
        self.is_main = True
        """The replica's first process: it speaks, and writes the replica's records."""

    def build(self, config: TrainConfig, process: ProcessInfo) -> Run:
        from mtdao.ft import RefusalLog, fault_tolerant_replica

        ft = config.fault_tolerance
        self.replicas = fault_tolerant_replica(
            ft,
            shared_config=shared_config(config),
            collective_timeout=config.parallel.collective_timeout,
            allow_non_finite=config.sync.on_non_finite == "skip",
        )
        self.replicas.quorum.collectives.say = self._say
        self.replicas.on_quorum = None  # _report_quorum says joins and heals, with the rest
        self.refusals = RefusalLog()
        self.is_main = process.rank == 0
        run = build_run(config, process, communicator=self.replicas, worker_index=ft.replica_id)
        self.events = ReplicaEvents(run.run_dir / "replicas.jsonl", ft.replica_id, self.is_main)
        for observer in OBSERVERS:
            observer.before_connect(run, self.replicas)
        self.events.write({"event": "connect", "step": run.step})
        self.replicas.connect()  # ready to join: the lighthouse hears from this replica from now
        self._say(f"serving on {ft.bind_host}: {self.replicas.listeners()}")
        return run

    def close(self) -> None:
        if self.replicas is not None:
            self.replicas.shutdown()

    def summary(self) -> dict[str, Any]:
        return {
            "replica_id": self.config.fault_tolerance.replica_id,
            "replicas_at_end": list(self.replicas.replicas) if self.replicas else [],
            "quorums": self.quorums,
            "heals": self.heals,
            "discarded_rounds": self.discarded,
        }

    # -- the training loop's hooks -------------------------------------------------------------

    def describe(self, run: Run) -> str:
        return f"{run.config.sync.method} replica {run.config.fault_tolerance.replica_id}"

    def tokens_per_step(self, run: Run) -> int:
        return run.config.text.batch_size * run.config.text.seq_len  # this replica's worker

    def before_step(self, run: Run) -> None:
        raise_if_asked_to_stop()
        for observer in OBSERVERS:
            observer.before_step(run)
        self._prepare(run)

    def after_round(self, run: Run) -> None:
        self._committed(run)

    def on_discarded(self, run: Run, failure: RoundNotCommitted) -> None:
        self._discarded(run, failure)

    def check_losses(self, run: Run, worker_losses: torch.Tensor, resumed) -> None:
        """This replica's own loss: with --on-non-finite skip a diverged replica goes on and
        takes the others' average at the next sync."""
        if bool(torch.isfinite(worker_losses).all()) or run.config.sync.on_non_finite != "raise":
            return
        raise NonFiniteError(
            f"training loss is NaN/inf at step {run.step} on replica "
            f"{run.config.fault_tolerance.replica_id}; "
            "lower --lr, or pass --on-non-finite skip to leave it out of the next sync (it "
            "then takes the others' average)"
        )

    def may_checkpoint(self, run: Run) -> bool:
        """This replica's own checkpoint; one holding NaN/inf (left out of a round with
        --on-non-finite skip) waits for the next sync to heal it: nothing coordinates between
        syncs, so no peer can heal it now."""
        held = [p for p in run.sync.params]
        held += [v for p in run.sync.params for v in run.optimizer.state.get(p, {}).values()]
        if run.workers.layout.all_finite([t for t in held if torch.is_tensor(t)]):
            return True
        self._say(f"step {run.step}: checkpoint skipped (NaN/inf until the next sync)")
        return False

    def _prepare(self, run: Run) -> None:
        """A quorum when joining or when the coming step has a round (counted as sync time)."""
        started = time.perf_counter()
        start = run.sync.prepare()
        if start is None:
            return
        elapsed = time.perf_counter() - started
        run.clock.train_s += elapsed
        run.clock.sync_s += elapsed
        self.quorums += 1
        self._report_quorum(run, start)

    def _report_quorum(self, run: Run, start) -> None:
        members = _ids(start.replicas)
        self._report_refused(run)
        if start.stale is not None:
            self._say_repeated(
                f"step {run.step}: sitting this round out ({start.stale}); healing next"
            )
        record = {
            "event": "quorum",
            "step": run.step,
            "replicas": start.replicas,
            "joined": start.joined,
            "left": start.left,
            "quorum_id": start.quorum_id,
            "seconds": start.seconds,
        }
        if self.lighthouse_away:
            self.lighthouse_away = False
            self._say(f"step {run.step}: the lighthouse is back; averaging over replicas {members}")
        if self.quorums == 1:
            self._say(f"joined at step {run.step}; averaging over replicas {members}")
        else:
            if start.left:
                self._say(
                    f"step {run.step}: replica {_ids(start.left)} left; averaging over {members}"
                )
            if start.joined:
                self._say(
                    f"step {run.step}: replica {_ids(start.joined)} joined; averaging over {members}"
                )
        if start.heal is not None:
            heal = {"step": run.step, "source": start.heal.source, "bytes": start.heal.bytes}
            heal["seconds"] = start.heal.seconds
            self.heals.append(heal)
            record["heal"] = heal
            self._say(
                f"healed from replica {start.heal.source}: continuing at step {run.step} "
                f"({start.heal.bytes / 1e6:.1f} MB in {start.heal.seconds:.1f} s)"
            )
        self.events.write(record)

    def _report_refused(self, run: Run) -> None:
        """The unproven peers of the last quorum (each once a minute at most, see
        :mod:`mtdao.ft.refusals`) and the heal states refused since the last report."""
        for line in self.refusals.lines(self.replicas.refused()):
            self._say(f"step {run.step}: {line}")
        for line in self.replicas.notes():
            self._say_repeated(f"step {run.step}: {line}")

    def _discarded(self, run: Run, failure: RoundNotCommitted) -> None:
        self._report_refused(run)  # also for a quorum whose group did not form
        record = {"event": "discarded", "step": run.step, "reason": str(failure)}
        self.discarded.append({"step": run.step, "reason": str(failure)})
        self.lighthouse_away = "lighthouse" in str(failure) and "unreachable" in str(failure)
        self.events.write(record)
        self._say_repeated(f"step {run.step}: {failure}; every replica keeps its own state")

    def _committed(self, run: Run) -> None:
        event = run.sync.events[-1]
        record = {"event": "committed", "step": event.step, "kinds": event.kinds}
        self.events.write({**record, "replicas": self.replicas.contributors})
        for observer in OBSERVERS:
            observer.after_round(run)

    def _say(self, line: str) -> None:
        if self.is_main:
            say(self.config.fault_tolerance.replica_id, line)

    def _say_repeated(self, line: str) -> None:
        """A line that may come at every step or quorum: each kind once a minute, with the
        count held back (:mod:`mtdao.sync.repeated_lines`)."""
        said = self.repeated_lines.line(line)
        if said is not None:
            self._say(said)


class ReplicaEvents:
    """``replicas.jsonl``: what the quorums did, as this replica saw it, one JSON line each
    (written by the replica's first process only, when ``enabled``)."""

    def __init__(self, path: Path, replica_id: int, enabled: bool = True) -> None:
        self.path, self.replica_id, self.enabled = path, replica_id, enabled

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps({"time": time.time(), "replica": self.replica_id, **record})
        with open(self.path, "a") as handle:
            handle.write(line + "\n")


def say(replica_id: int, line: str) -> None:
    trainer.say(f"[replica {replica_id}] {line}")


def _ids(replicas) -> str:
    return ", ".join(str(r) for r in replicas)


def shared_config(config: TrainConfig) -> dict[str, Any]:
    """The settings every replica must share: all but REPLICA_FIELDS."""
    return {k: v for k, v in config.to_dict().items() if k not in REPLICA_FIELDS}


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_stop_asked_by: list[str] = []  # the signal that asked this replica to stop, once one has


@contextlib.contextmanager
def stop_on_signals():
    """While active, SIGTERM stops this replica as Ctrl-C does (it leaves the quorum, closes its
    servers and exits with one line), and neither is lost: a signal that lands while torch runs a
    future's Python callback (torchft's collectives complete through them) raises inside that
    callback, where torch logs the KeyboardInterrupt and drops it, so the signal is also
    remembered and :func:`raise_if_asked_to_stop` raises it again before the next step. Off the
    main thread, where signals cannot be handled, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _stop_asked_by.clear()

    def interrupt(signum, frame):
        name = signal.Signals(signum).name
        _stop_asked_by.append(name)
        raise KeyboardInterrupt(name)

    previous = {number: signal.signal(number, interrupt) for number in STOP_SIGNALS}
    try:
        yield
    finally:
        for number, handler in previous.items():
            if handler is not None:  # None: a handler not set from Python, nothing to restore
                signal.signal(number, handler)


def raise_if_asked_to_stop() -> None:
    """Raise the KeyboardInterrupt of a stop signal received earlier, if torch dropped it."""
    if _stop_asked_by:
        raise KeyboardInterrupt(_stop_asked_by[0])
