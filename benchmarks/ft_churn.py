"""Churn: replicas of examples/fault_tolerant_loop.py killed at random for minutes, on loopback.

    python benchmarks/ft_churn.py --minutes 30 --replicas 3 --mtbf 15 --json churn.json

R replicas of the example loop and a lighthouse (``mtdao lighthouse``), all holding a run secret;
a quorum needs one replica, so the survivors go on however many are down. (A replica restarted
while the lighthouse is fresh may form a quorum alone and start over from step 0 until it meets
the others; then whichever side committed more rounds heals the other. A majority instead,
``--min-replicas 2`` of 3, stalled the survivors for minutes on a crowded machine, where a
restart takes longer than the time between kills.)
First the baseline: the same replicas for ``--baseline-s`` seconds with no failure, which gives
the pace (steps per second) and committed steps per replica-second. Then the churn run: for
``--minutes`` (the kill window) a replica drawn at random is killed with SIGKILL, the intervals
exponential with mean ``--mtbf`` seconds, and started again at once with the same command; the
lighthouse is killed and started again on its port every ``--lighthouse-every`` seconds. The
replicas are given no step count they would reach; when the window ends the benchmark writes the
step to stop at into the example's ``--stop-file`` (a minute ahead at the faster of the baseline
pace and the last 20 s's, so that a replica restarted just before still finds the others to heal
from), and the replicas run to it and the final round.

What happened is read from the replicas' own lines (one per round: rounds committed and
discarded so far, and the step; one per heal) as they are written:

* ``failures``: replicas killed in the window;
* ``heals``: heal lines in the window (a restarted replica's, and a survivor's that missed a
  commit);
* ``rounds_committed``: rounds committed in the window, counted per replica (a round the three
  commit counts three times);
* ``rounds_discarded``: rounds discarded in the window, counted per replica (a round that two
  survivors discard counts twice; a round due while the lighthouse is away counts too);
* ``longest_without_commit_s``: the longest stretch in which no replica committed a round, from
  the window's start to the last commit of the run (its final round);
* ``goodput``: committed steps per replica-second in the window (K steps for each round a
  replica committed) over the same in the baseline;
* ``progress_lost``: times in the window the live replicas' highest step fell by more than
  LOST_ROUNDS rounds, and ``steps_lost`` by how much in all: training went on from a replica
  behind the one that died (replicas that commit together stand within a round of each other),
  or started over from step 0 (every replica that held the model was down at once: a restart
  takes longer than the time between kills on a crowded machine, and the example keeps no
  checkpoint);
* ``splits``: times two live replicas each stood in a quorum that left the other out (read
  from their membership lines: the join line and each ``quorum now replicas ...``), from the
  window's start to the end of the run, and ``longest_split_s`` the longest of them: the
  lighthouse formed a quorum without a replica that was alive (one it had dropped, or one that
  asked late), and the two sides trained apart until they met again;
* ``identical``: every replica exited 0 at the last step with the same digest of its final
  parameters (the example's ``result.json``).

Every process it starts runs in a session of its own and is killed on the way out, on Ctrl-C,
SIGTERM or an error too. Times are read when a line is seen (every 0.25 s); each kill, start and
lighthouse restart is written with its time to ``events.log`` beside the logs, and every line of
every replica but its round lines (joins, heals, membership, discards, refusals) with the time it
was seen and the process's name to ``timeline.log``. FILE is written when the window ends
(``identical`` null) and again when the replicas have ended.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mtdao.testing.fault_drill import Drill

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fault_tolerant_loop.py"
PERIOD = 8  # the example's default sync period: K steps per round
POLL_S = 0.25
HEARTBEAT_S = 1.0  # the lighthouse drops a killed replica after it
JOIN_S = 30.0  # a quorum waits this long at most for a live replica that has not asked yet
START_LIMIT_S = 300.0  # every replica's first round, on a crowded machine
PACE_WINDOW_S = 20.0
END_MARGIN_S = 60.0  # the replicas stop this far (in steps at their pace) after the window: a
# replica restarted just before it must find the others to heal from
LOST_ROUNDS = 4  # a fall of the group's step by more rounds than this lost progress
NEVER = 10**9  # the replicas' --steps: they stop at the step the benchmark writes
MEMBERS = re.compile(r"(?:joined at step \d+ with|quorum now) replicas ((?:\d+, )*\d+)")


@dataclass
class Process:
    """One process of a replica: its log and what its lines said so far."""

    name: str
    replica: int
    offset: int = 0
    discarded: int = 0  # the count of its last line
    last_step: int = 0
    members: list[int] | None = None  # of its last quorum, once said


@dataclass
class Record:
    """What the replicas' lines said, with the time each was seen."""

    commits: list[tuple[float, int]] = field(default_factory=list)
    """(time, the group's committed rounds) each time the highest count said rose."""
    replica_rounds: list[tuple[float, bool]] = field(default_factory=list)
    """(time, committed) of every round line of every process."""
    heals: list[float] = field(default_factory=list)
    steps: list[tuple[float, int]] = field(default_factory=list)
    """(time, the group's step: the highest said by the replicas' current processes) at each
    change; it falls when the run starts over."""
    lost: list[tuple[float, int]] = field(default_factory=list)
    """(time, steps) of each fall of the group's step by more than LOST_ROUNDS rounds."""
    splits: list[list[float]] = field(default_factory=list)
    """[first seen, last seen] of each time two live replicas' quorums left each other out."""

    @property
    def committed(self) -> int:
        return self.commits[-1][1] if self.commits else 0

    @property
    def step(self) -> int:
        return self.steps[-1][1] if self.steps else 0


class Churn:
    """A lighthouse and R replicas of the example in ``drill``, their lines read as they come."""

    def __init__(self, drill: Drill, replicas: int, token: Path, out: Path) -> None:
        self.drill, self.replicas = drill, replicas
        self.steps = NEVER  # until the replicas are told where to stop
        self.secret = ["--auth-token-file", str(token)]
        self.out = out
        self.stop_file = out / "stop-at-step"
        out.mkdir(parents=True, exist_ok=True)
        self.processes: dict[int, Process] = {}
        self.record = Record()
        self.starts = 0
        self.lighthouses = 0
        self.unasked_exits: list[str] = []
        self.events = out.parent / "events.log"
        self.timeline = out.parent / "timeline.log"
        self.splitting = False

    def event(self, what: str) -> None:
        with open(self.events, "a") as events:
            events.write(f"{time.time():.2f} {what}\n")

    def start_lighthouse(self) -> None:
        self.lighthouses += 1
        name = f"lighthouse.{self.lighthouses}"
        self.drill.start_lighthouse(min_replicas=1, name=name, flags=self.secret)
        self.event(f"start {name}")

    def restart_lighthouse(self) -> None:
        self.drill.kill(f"lighthouse.{self.lighthouses}")
        self.event(f"kill lighthouse.{self.lighthouses}")
        self.start_lighthouse()

    def start(self, replica: int) -> None:
        self.starts += 1
        name = f"r{replica}.{self.starts}"
        argv = [sys.executable, str(EXAMPLE), "--lighthouse", self.drill.lighthouse]
        argv += ["--replica-id", str(replica), "--steps", str(NEVER)]
        argv += ["--out", str(self.out / f"r{replica}"), "--sync-period", str(PERIOD), *self.secret]
        argv += ["--stop-file", str(self.stop_file)]
        self.drill._spawn(name, argv)
        self.event(f"start {name}")
        self.processes[replica] = Process(name, replica)

    def stop(self, pace: float) -> int:
        """Tell every replica to stop END_MARGIN_S ahead, at the faster of ``pace`` and the
        last PACE_WINDOW_S's; returns that step."""
        now, step = time.time(), self.record.step
        before = [s for t, s in self.record.steps if t <= now - PACE_WINDOW_S]
        recent = (step - before[-1]) / PACE_WINDOW_S if before else 0.0
        ahead = step + max(pace, recent) * END_MARGIN_S
        last = math.ceil(ahead / PERIOD) * PERIOD
        temporary = self.stop_file.with_suffix(".tmp")
        temporary.write_text(f"{last}\n")
        temporary.replace(self.stop_file)  # whole, or not yet: a replica reads it at every step
        self.steps = last
        return last

    def kill(self, replica: int) -> None:
        self.read()  # its last lines count
        self.drill.kill(self.processes[replica].name)
        self.event(f"kill {self.processes[replica].name}")
        self.start(replica)

    def running(self, replica: int) -> bool:
        return self.drill.returncode(self.processes[replica].name) is None

    def restart_the_fallen(self) -> None:
        """A replica or lighthouse that exited unasked is started again (and counted)."""
        self.read()  # its last lines count
        for replica, process in list(self.processes.items()):
            code = self.drill.returncode(process.name)
            if code not in (None, 0):
                self.unasked_exits.append(f"{process.name} exit {code}")
                self.start(replica)
        lighthouse = f"lighthouse.{self.lighthouses}"
        if self.drill.returncode(lighthouse) is not None:
            self.unasked_exits.append(f"{lighthouse} exit {self.drill.returncode(lighthouse)}")
            self.start_lighthouse()

    def read(self) -> None:
        now = time.time()
        for process in self.processes.values():
            path = self.drill.logs / f"{process.name}.log"
            try:
                with open(path, "rb") as log:
                    log.seek(process.offset)
                    chunk = log.read()
            except FileNotFoundError:
                continue
            whole = chunk[: chunk.rfind(b"\n") + 1]
            process.offset += len(whole)
            for line in whole.decode(errors="replace").splitlines():
                self._said(process, line, now)
        split = self.split()
        if split and not self.splitting:
            self.record.splits.append([now, now])
        elif self.splitting:  # on, or just over
            self.record.splits[-1][1] = now
        self.splitting = split

    def split(self) -> bool:
        """Whether two live replicas each stand in a quorum that leaves the other out."""
        said = [
            (p.replica, p.members)
            for p in self.processes.values()
            if p.members is not None and self.running(p.replica)
        ]
        return any(a not in theirs and b not in mine for a, mine in said for b, theirs in said)

    def _said(self, process: Process, line: str, now: float) -> None:
        prefix = f"replica {process.replica}: "
        said = line[len(prefix) :] if line.startswith(prefix) else ""
        a_round = " rounds committed, " in said and "; step " in said
        if not a_round:
            with open(self.timeline, "a") as timeline:
                timeline.write(f"{now:.2f} {process.name} {line}\n")
            members = MEMBERS.search(said)
            if members:
                process.members = [int(r) for r in members.group(1).split(", ")]
        if "healed from replica" in said:  # the library's join or heal line
            self.record.heals.append(now)
        elif a_round:
            counts, step = said.split("; step ")
            committed = int(counts.split()[0])
            discarded = int(counts.split(", ")[1].split()[0])
            self.record.replica_rounds.append((now, discarded == process.discarded))
            process.discarded, process.last_step = discarded, int(step)
            if committed > self.record.committed:
                self.record.commits.append((now, committed))
            group_step = max(p.last_step for p in self.processes.values())
            if group_step < self.record.step - LOST_ROUNDS * PERIOD:
                self.record.lost.append((now, self.record.step - group_step))
            if group_step != self.record.step:
                self.record.steps.append((now, group_step))
        elif said.startswith("{"):  # its result: the final round committed unless discarded
            result = json.loads(said)
            final_committed = result.get("discarded_rounds") == process.discarded
            if result.get("step") == self.steps and final_committed:
                self.record.commits.append((now, self.record.committed + 1))


def wait_until(churn: Churn, condition, limit_s: float, what: str) -> None:
    ended = time.time() + limit_s
    while not condition():
        if time.time() > ended:
            raise TimeoutError(
                f"after {limit_s:g} s still waiting for {what}\n{churn.drill.tails()}"
            )
        time.sleep(POLL_S)
        churn.read()


def every_replica_said_a_round(churn: Churn) -> bool:
    return all(p.last_step > 0 for p in churn.processes.values())


def committed_steps_per_replica_second(record: Record, start: float, end: float, replicas: int):
    committed = sum(1 for t, ok in record.replica_rounds if start <= t < end and ok)
    return committed * PERIOD / (replicas * (end - start))


def baseline(root: Path, replicas: int, seconds: float, token: Path) -> dict:
    """The replicas with no failure: their pace and committed steps per replica-second."""
    with Drill(root, [], heartbeat_timeout=HEARTBEAT_S, join_timeout=JOIN_S) as drill:
        churn = Churn(drill, replicas, token, root / "out")
        churn.start_lighthouse()
        for replica in range(replicas):
            churn.start(replica)
        wait_until(churn, lambda: every_replica_said_a_round(churn), START_LIMIT_S, "a round")
        began, first_step = time.time(), churn.record.step
        wait_until(churn, lambda: time.time() >= began + seconds, seconds + 60, "the baseline")
        ended = time.time()
        rate = committed_steps_per_replica_second(churn.record, began, ended, replicas)
        pace = (churn.record.step - first_step) / (ended - began)
    if pace <= 0:
        raise RuntimeError("the baseline took no step: see the logs in " + str(root))
    return {"seconds": ended - began, "steps_per_s": pace, "committed_steps_per_replica_s": rate}


def churn_run(
    root: Path, args: argparse.Namespace, token: Path, base: dict, write: Callable[[dict], None]
) -> dict:
    """The churn run's figures; ``write`` is given those of the window as soon as it ends."""
    window_s, pace = args.minutes * 60, base["steps_per_s"]
    rng = random.Random(args.seed)
    with Drill(root, [], heartbeat_timeout=HEARTBEAT_S, join_timeout=JOIN_S) as drill:
        churn = Churn(drill, args.replicas, token, root / "out")
        churn.start_lighthouse()
        for replica in range(args.replicas):
            churn.start(replica)
        wait_until(churn, lambda: every_replica_said_a_round(churn), START_LIMIT_S, "a round")
        began = time.time()
        failures, next_kill = 0, began + rng.expovariate(1 / args.mtbf)
        next_lighthouse = began + args.lighthouse_every
        while time.time() < began + window_s:
            time.sleep(POLL_S)
            churn.read()
            churn.restart_the_fallen()
            now = time.time()
            if now >= next_kill:
                churn.kill(rng.randrange(args.replicas))
                failures += 1
                next_kill = now + rng.expovariate(1 / args.mtbf)
            if now >= next_lighthouse:
                churn.restart_lighthouse()
                next_lighthouse = now + args.lighthouse_every
        window_end = time.time()
        steps = churn.stop(pace)
        write(figures_so_far(churn, args, steps, began, window_end, failures))
        limit_s = 3 * END_MARGIN_S + START_LIMIT_S  # the margin, slower, and a start
        try:  # the replicas run to their end
            wait_until(churn, lambda: all_done(churn), limit_s, "every replica's end")
        except TimeoutError as error:
            print(str(error).splitlines()[0], file=sys.stderr)
        churn.read()
        run = figures_so_far(churn, args, steps, began, window_end, failures)
        run["results"] = final_results(churn, root / "out")
        return run


def figures_so_far(
    churn: Churn, args: argparse.Namespace, steps: int, began: float, window_end: float,
    failures: int,
) -> dict:  # fmt: skip
    """The window's figures from what the replicas have said so far."""
    record = churn.record
    rate = committed_steps_per_replica_second(record, began, window_end, args.replicas)
    return {
        "steps": steps,
        "window_s": window_end - began,
        "failures": failures,
        "heals": sum(1 for t in record.heals if began <= t < window_end),
        "rounds_committed": sum(
            1 for t, ok in record.replica_rounds if began <= t < window_end and ok
        ),
        "rounds_discarded": sum(
            1 for t, ok in record.replica_rounds if began <= t < window_end and not ok
        ),
        "longest_without_commit_s": longest_gap(record, began),
        "committed_steps_per_replica_s": rate,
        "lighthouse_restarts": churn.lighthouses - 1,
        "progress_lost": [
            {"after_s": round(t - began, 1), "steps": steps}
            for t, steps in record.lost
            if began <= t < window_end
        ],
        "splits": [
            {"after_s": round(first - began, 1), "seconds": round(last - first, 1)}
            for first, last in record.splits
            if first >= began
        ],
        "unasked_exits": list(churn.unasked_exits),
        "results": [],
    }


def all_done(churn: Churn) -> bool:
    """Whether every replica has exited (after the window an exit is a result: none restarts)."""
    return all(not churn.running(r) for r in churn.processes)


def final_results(churn: Churn, out: Path) -> list[dict]:
    results = []
    for replica, process in sorted(churn.processes.items()):
        path = out / f"r{replica}" / "result.json"
        result = json.loads(path.read_text()) if path.exists() else {}
        results.append({"replica": replica, "exit": churn.drill.returncode(process.name), **result})
    return results


def longest_gap(record: Record, start: float) -> float:
    """The longest stretch from ``start`` to the last commit in which no replica committed a
    round (the group's highest count is no measure: a replica that trained alone for a while
    may have set it, and the others commit below it until they meet)."""
    times = [start] + sorted(t for t, ok in record.replica_rounds if ok and t > start)
    times += [t for t, _ in record.commits if t > times[-1]]  # the final round
    return max((b - a for a, b in zip(times, times[1:])), default=0.0)


def identical(results: list[dict], steps: int) -> bool:
    return (
        all(r["exit"] == 0 and r.get("step") == steps for r in results)
        and len({r.get("params_sha256") for r in results}) == 1
    )


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, required=True, help="the kill window")
    parser.add_argument("--replicas", type=int, required=True)
    parser.add_argument("--mtbf", type=float, required=True, help="mean seconds between kills")
    parser.add_argument("--json", required=True, help="where the figures go")
    parser.add_argument("--out", help="the processes' logs (default: beside --json)")
    parser.add_argument(
        "--lighthouse-every", type=float, default=180.0, help="seconds between its restarts"
    )
    parser.add_argument(
        "--baseline-s", type=float, help="the run without failures (default: 10 s a minute)"
    )
    parser.add_argument("--seed", type=int, default=0, help="of the kills")
    args = parser.parse_args(argv)
    for name in ("minutes", "mtbf", "lighthouse_every"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.replicas < 2:
        parser.error(
            f"--replicas must be >= 2 (one to kill, one to heal from), got {args.replicas}"
        )
    if args.baseline_s is None:
        args.baseline_s = min(120.0, max(30.0, 10 * args.minutes))
    elif not args.baseline_s > 0:
        parser.error(f"--baseline-s must be > 0, got {args.baseline_s}")
    return args


def interrupted(*_) -> None:
    """SIGTERM unwinds as Ctrl-C does: every Drill on the way kills its processes."""
    raise KeyboardInterrupt


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, interrupted)
    json_path = Path(args.json)
    root = Path(args.out) if args.out else json_path.with_suffix("")
    root.mkdir(parents=True, exist_ok=True)
    token = root / "run-secret"
    token.write_text(f"churn-{random.SystemRandom().getrandbits(128):032x}\n")
    token.chmod(0o600)
    base = baseline(root / "baseline", args.replicas, args.baseline_s, token)

    def write(run: dict) -> dict:
        """The figures to FILE; until the replicas end, without ``identical``."""
        figures = {
            "failures": run["failures"],
            "heals": run["heals"],
            "rounds_committed": run["rounds_committed"],
            "rounds_discarded": run["rounds_discarded"],
            "longest_without_commit_s": round(run["longest_without_commit_s"], 1),
            "goodput": round(
                run["committed_steps_per_replica_s"] / base["committed_steps_per_replica_s"], 3
            ),
            "progress_lost": len(run["progress_lost"]),
            "steps_lost": sum(s["steps"] for s in run["progress_lost"]),
            "splits": len(run["splits"]),
            "longest_split_s": max((s["seconds"] for s in run["splits"]), default=0.0),
            "identical": identical(run["results"], run["steps"]) if run["results"] else None,
        }
        report = {
            **figures,
            "command": " ".join(["python benchmarks/ft_churn.py", *(argv or sys.argv[1:])]),
            "baseline": base,
            "churn": run,
        }
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=1) + "\n")
        return figures

    run = churn_run(root / "churn", args, token, base, write)
    figures = write(run)
    for key, value in figures.items():
        print(f"{key}: {value}")
    print(f"(window {run['window_s']:.0f} s, {run['steps']} steps, logs in {root}; {json_path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
