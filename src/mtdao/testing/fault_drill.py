"""Fault drills: replicas of a fault-tolerant run under remote control, to rehearse failures.

``python -m mtdao.testing.fault_drill CONTROL_DIR NAME -- <mtdao train flags>`` runs one replica
(``mtdao train``) with hooks that a controller steers through files in CONTROL_DIR:

* ``NAME.hold``: while it exists, the replica waits before announcing itself to the lighthouse;
* ``gate``: a step count; no replica takes a step beyond it until it moves;
* ``NAME.hold-S``: while it exists, the replica waits inside its round at step S, just before it
  all-reduces (``NAME.entered-S`` says it got there);
* ``NAME.asked`` holds the step of the last quorum the replica asked the lighthouse for (a joiner
  asks before its first step; the others' next round takes it in only if it asked first);
* ``NAME.rewind`` holding ``S T``: the replica keeps a copy of its state after its round at
  step S and goes back to it once it has taken step T, its commit count unchanged (as a replica
  that lost steps in a stuck collective comes back);
* the replica writes its step to ``NAME.status`` and, after every committed round, a digest of
  its whole state (parameters, optimizer state, engine state) to ``NAME.rounds`` and one of the
  state every replica shares even with delayed rounds to ``NAME.globals``.

A replica of several processes (``--shards``, under torchrun) is steered by the same files; each
process writes its own status, digests (of its shards) and pid, process r > 0 as ``NAME.rR``.

:class:`Drill` is the one controller of every drill: the fault-tolerance tests and
``benchmarks/fault_tolerance.py`` run it on loopback, the WAN drill inside emulated sites.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

from mtdao.sync.trained_state import TrainedState
from mtdao.testing.digests import global_digest, state_digest
from mtdao.testing.ports import unused_port

POLL_S = 0.02
# A process sent SIGKILL is gone once the kernel reaps it; one sent SIGTERM ends its step and
# exits as on Ctrl-C (under a second, measured beside two busy processes on two cores). Waiting
# longer than this means it hangs.
EXIT_AFTER_SIGNAL_S = 30.0

Launch = Callable[[str, list[str], dict[str, str], IO], subprocess.Popen]
"""How a drill starts process ``name``: (name, argv, environment, log file) -> the process."""


def launch_here(name: str, argv: list[str], env: dict[str, str], log: IO) -> subprocess.Popen:
    """On this machine, in a session of its own (so that :meth:`Drill.close` ends its children)."""
    return subprocess.Popen(
        argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


# -- inside a replica ---------------------------------------------------------------------------


class DrillObserver:
    """Steers one process of a replica through the files in ``control`` (see the module
    docstring): a :class:`~mtdao.train.fault_tolerance.replica.ReplicaObserver`."""

    def __init__(self, control: Path, name: str) -> None:
        self.control, self.name = control, name
        self.label = process_label(name, int(os.environ.get("RANK", "0")))
        self.rewind = _read_ints(control / f"{name}.rewind")
        self.saved = None  # the state after the round at the rewind's first step
        _write(control / f"{self.label}.pid", str(os.getpid()))

    def before_connect(self, run, replicas) -> None:
        replicas.quorum.before_collective = lambda: self._hold_in_round(run.step)
        replicas.before_quorum = lambda: _write(self.control / f"{self.label}.asked", str(run.step))
        _write(self.control / f"{self.label}.status", "held 0")
        _wait_while(lambda: (self.control / f"{self.name}.hold").exists())

    def before_step(self, run) -> None:
        from mtdao.ft.healing import HealedState

        if self.rewind and run.step == self.rewind[1] and self.saved is not None:
            HealedState(TrainedState(run.sync)).load_state_dict(self.saved)
            self.saved = None
            run.sync.communicator.quorum.prepared = None  # the coming round needs a new quorum
            print(f"fault drill: rewound to step {run.step}", flush=True)
        gate = self.control / "gate"
        if _read_int(gate, run.step + 1) <= run.step:
            _write(self.control / f"{self.label}.status", f"waiting {run.step}")
            _wait_while(lambda: _read_int(gate, run.step + 1) <= run.step)
        _write(self.control / f"{self.label}.status", f"running {run.step}")

    def after_round(self, run) -> None:
        from mtdao.ft.healing import HealedState

        with open(self.control / f"{self.label}.rounds", "a") as handle:
            handle.write(f"{run.step} {state_digest(run)}\n")
        with open(self.control / f"{self.label}.globals", "a") as handle:
            handle.write(f"{run.step} {global_digest(run)}\n")
        if self.rewind and run.step == self.rewind[0] and self.saved is None:
            self.saved = HealedState(TrainedState(run.sync)).state_dict()

    def _hold_in_round(self, step: int) -> None:
        _write(self.control / f"{self.label}.entered-{step}", "")
        _wait_while(lambda: (self.control / f"{self.name}.hold-{step}").exists())


def process_label(name: str, rank: int) -> str:
    """The files of process ``rank`` of replica ``name``: ``name`` itself for the first."""
    return name if rank == 0 else f"{name}.r{rank}"


def _read_int(path: Path, default: int) -> int:
    try:
        return int(path.read_text())
    except (FileNotFoundError, ValueError):
        return default


def _read_ints(path: Path) -> list[int]:
    return [int(word) for word in path.read_text().split()] if path.exists() else []


def _write(path: Path, text: str) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def _wait_while(condition: Callable[[], bool]) -> None:
    while condition():
        time.sleep(POLL_S)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 3 or argv[2] != "--":
        print("usage: python -m mtdao.testing.fault_drill CONTROL_DIR NAME -- <train flags>")
        return 2
    from mtdao.cli import main as cli_main
    from mtdao.train.fault_tolerance.replica import observe_replicas

    observe_replicas(DrillObserver(Path(argv[0]), argv[1]))

    return cli_main(["train", *argv[3:]])


# -- the controller -----------------------------------------------------------------------------


class Drill:
    """A lighthouse and named replicas, each a subprocess steered through the files in ``root``,
    its log in ``logs`` (default: ``root``), started by ``launch`` (default: on this machine).

    ``train_flags`` are the ``mtdao train`` flags every replica shares; :meth:`start` adds the
    replica's own. Use it as a context manager: every process is killed on the way out.

    The lighthouse's join timeout is long on purpose: a replica that waited longer than it to
    join makes the next quorum form with whoever asked first, and a member arriving a moment
    later would miss that sync (a dead replica is not waited for: it stops heartbeating).
    """

    def __init__(
        self,
        root: Path,
        train_flags: Sequence[str],
        heartbeat_timeout: float = 1.0,
        join_timeout: float = 30.0,
        *,
        logs: Path | None = None,
        port: int | None = None,
        env: Mapping[str, str] | None = None,
        launch: Launch = launch_here,
    ) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.logs = Path(logs) if logs is not None else self.root
        self.train_flags = list(train_flags)
        self.heartbeat_timeout, self.join_timeout = heartbeat_timeout, join_timeout
        self.launch = launch
        self.processes: dict[str, subprocess.Popen] = {}
        self.killed_at: dict[str, float] = {}
        self.started_at: dict[str, float] = {}
        self.port = port if port is not None else unused_port()
        self.lighthouse = f"127.0.0.1:{self.port}"
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}

    def __enter__(self) -> Drill:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start_lighthouse(
        self,
        min_replicas: int = 1,
        bind_host: str = "127.0.0.1",
        *,
        name: str = "lighthouse",
        reached_at: str | None = None,
        flags: Sequence[str] = (),
    ) -> None:
        """Start the lighthouse as ``name``, listening on ``bind_host``; replicas reach it at
        ``reached_at`` (a host name; default: ``bind_host``). ``flags`` come last."""
        self.lighthouse = f"{reached_at or bind_host}:{self.port}"
        argv = [sys.executable, "-m", "mtdao", "lighthouse", "--port", str(self.port)]
        argv += ["--bind-host", bind_host]
        argv += ["--min-replicas", str(min_replicas), "--heartbeat-timeout"]
        argv += [str(self.heartbeat_timeout), "--join-timeout", str(self.join_timeout), *flags]
        self._spawn(name, argv)

    def start(
        self,
        name: str,
        replica_id: int,
        flags: Sequence[str] = (),
        hold=False,
        shards: int = 1,
        max_restarts: int | None = None,
        *,
        out: Path | None = None,
    ) -> None:
        """Start replica ``name`` (held before it connects when ``hold``), its run directory
        ``out`` (default: ``root/name``): one process, or, with ``max_restarts``, ``shards``
        processes under torchrun, which restarts them all that many times when one of them
        dies (with --resume, the replica's same command line). ``flags`` follow the shared
        ``train_flags``, so they override them."""
        if hold:
            (self.root / f"{name}.hold").touch()
        drill = ["-m", "mtdao.testing.fault_drill", str(self.root), name, "--"]
        argv = [sys.executable, *drill]
        if max_restarts is not None:
            argv = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
            argv += ["--nproc-per-node", str(shards), "--max-restarts", str(max_restarts), *drill]
        argv += ["--fault-tolerant", "--replica-id", str(replica_id), "--lighthouse"]
        out = out if out is not None else self.root / name
        argv += [self.lighthouse, "--out", str(out), *self.train_flags, *flags]
        if shards > 1:
            argv += ["--shards", str(shards)]
        self._spawn(name, argv)

    def _spawn(self, name: str, argv: list[str], *, lowest_priority: bool = False) -> None:
        """Start ``argv`` as ``name``; ``lowest_priority``: under ``nice -n 19``, as a stranger on
        a machine of its own, which takes no CPU from this one's processes (nice execs: the pid
        is the program's)."""
        if lowest_priority:
            argv = ["nice", "-n", "19", *argv]
        log = open(self.logs / f"{name}.log", "w")  # noqa: SIM115 (the process has its own copy)
        self.started_at[name] = time.time()
        self.processes[name] = self.launch(name, argv, self.env, log)
        log.close()

    def release(self, name: str) -> None:
        (self.root / f"{name}.hold").unlink(missing_ok=True)

    def gate(self, step: int | None) -> None:
        """No replica takes a step beyond ``step`` (None: no limit)."""
        if step is None:
            (self.root / "gate").unlink(missing_ok=True)
        else:
            _write(self.root / "gate", str(step))

    def hold_round(self, name: str, step: int) -> None:
        (self.root / f"{name}.hold-{step}").touch()

    def release_round(self, name: str, step: int) -> None:
        (self.root / f"{name}.hold-{step}").unlink(missing_ok=True)

    def entered_round(self, name: str, step: int) -> bool:
        return (self.root / f"{name}.entered-{step}").exists()

    def asked_quorum(self, name: str) -> bool:
        """Whether the replica (process) ``name`` has asked the lighthouse for a quorum."""
        return (self.root / f"{name}.asked").exists()

    def kill(self, name: str) -> None:
        """SIGKILL, as a machine that dies would."""
        self.killed_at[name] = time.time()
        self.processes[name].send_signal(signal.SIGKILL)
        self.processes[name].wait(timeout=EXIT_AFTER_SIGNAL_S)

    def kill_process(self, name: str, rank: int) -> None:
        """SIGKILL process ``rank`` of replica ``name`` (one started under torchrun)."""
        label = process_label(name, rank)
        self.killed_at[label] = time.time()
        os.kill(self.pid(label), signal.SIGKILL)

    def pid(self, label: str) -> int:
        return int((self.root / f"{label}.pid").read_text())

    def stop(self, name: str, timeout: float = EXIT_AFTER_SIGNAL_S) -> int:
        """SIGTERM, as an operator stopping a process would; returns its exit code."""
        self.processes[name].send_signal(signal.SIGTERM)
        return self.wait_exit(name, timeout)

    def status(self, name: str) -> tuple[str, int]:
        try:
            state, step = (self.root / f"{name}.status").read_text().split()
        except (FileNotFoundError, ValueError):
            return "starting", -1
        return state, int(step)

    def global_rounds(self, name: str) -> dict[int, str]:
        """{step: global digest} of every round the replica committed (:func:`global_digest`)."""
        return self.rounds(name, "globals")

    def rounds(self, name: str, digests: str = "rounds") -> dict[int, str]:
        """{step: state digest} of every round the replica committed."""
        path = self.root / f"{name}.{digests}"
        lines = path.read_text().split("\n") if path.exists() else []
        return {int(step): digest for step, digest in (line.split() for line in lines if line)}

    def events(self, name: str, event: str | None = None) -> list[dict]:
        import json

        path = self.root / name / "replicas.jsonl"
        if not path.exists():
            return []
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [r for r in records if event is None or r["event"] == event]

    def log(self, name: str) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text() if path.exists() else ""

    def returncode(self, name: str) -> int | None:
        return self.processes[name].poll()

    def wait_for(self, condition: Callable[[], bool], timeout: float, what: str) -> float:
        """Poll until ``condition()``; returns the seconds it took. Fails with every replica's
        log tail, or at once when a replica it may be waiting on has died unexpectedly."""
        started = time.time()
        while not condition():
            if time.time() - started > timeout:
                raise TimeoutError(f"after {timeout:g} s still waiting for {what}\n{self.tails()}")
            time.sleep(POLL_S)
        return time.time() - started

    def wait_exit(self, name: str, timeout: float) -> int:
        try:
            return self.processes[name].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(
                f"{name} still running after {timeout:g} s\n{self.tails()}"
            ) from None

    def tails(self, lines: int = 8) -> str:
        parts = []
        for name in self.processes:
            tail = "\n".join(self.log(name).splitlines()[-lines:])
            parts.append(f"--- {name} (exit {self.returncode(name)}):\n{tail}")
        return "\n".join(parts)

    def close(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):  # a session of its own: all of it
                    os.killpg(process.pid, signal.SIGKILL)
                with contextlib.suppress(ProcessLookupError):  # or one another launch started
                    process.kill()
        # torchrun starts each process in a session of its own: those are found by their pids
        for path in self.root.glob("*.pid"):
            with contextlib.suppress(ValueError, OSError):
                pid = int(path.read_text())
                if str(self.root) in Path(f"/proc/{pid}/cmdline").read_text():
                    os.kill(pid, signal.SIGKILL)
        for process in self.processes.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=EXIT_AFTER_SIGNAL_S)


if __name__ == "__main__":
    from mtdao.train.distributed import end_worker_process

    end_worker_process(main())  # a replica: see end_worker_process
