"""What a failure costs a fault-tolerant run (mtdao train --fault-tolerant), measured on loopback.

Three replicas of one run, each a process, and a lighthouse, driven by mtdao.testing.fault_drill:

* detect: a replica killed (SIGKILL) between syncs, as the others are about to sync: seconds
  until they have a quorum without it; and one killed inside an all-reduce: seconds until the
  others discard the round, and until their next committed round. Per heartbeat timeout.
* rejoin: the killed replica restarted at once: seconds from the new process to the end of its
  start-up (Python, torch, data, model), to its first quorum (it waits for the group's next sync),
  the heal (bytes and seconds) and its first committed round.
* loss: final validation loss when replica 2 is killed at round 6 and comes back after R rounds
  (0: never killed; "never": it does not come back), against the same run with simulated
  workers, for two seeds, with what each replica sent.

``--round-options`` runs every part with delayed, fragmented, int8 rounds and error feedback
(``ROUND_OPTIONS``); the replica killed inside a round is then killed inside the first
collective of a round in flight, D steps before it lands.

    python benchmarks/fault_tolerance.py --part all --out /tmp/ft-bench
    python benchmarks/fault_tolerance.py --part all --round-options --out /tmp/ft-bench-options
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import time
from pathlib import Path

from mtdao.testing.fault_drill import Drill

SHARED = ["--workers", "3", "--no-progress", "--collective-timeout", "60", "--quorum-timeout"]
SHARED += ["300", "--connect-timeout", "30"]
DELAY = 4
ROUND_OPTIONS = ["--sync-delay", str(DELAY), "--sync-fragments", "2", "--sync-dtype", "int8"]
ROUND_OPTIONS += ["--error-feedback"]
EXTRA: list[str] = []  # the round options, when benchmarked with them


def flags(model: str, steps: int, period: int, seed: int = 0, extra=()) -> list[str]:
    return [*SHARED, "--model", model, "--steps", str(steps), "--sync-period", str(period),
            "--seed", str(seed), "--batch-size", "8", "--seq-len", "64", "--eval-tokens",
            "8192", *EXTRA, *extra]  # fmt: skip


def wait_at(drill: Drill, names, gate: int, timeout=300.0) -> None:
    drill.wait_for(
        lambda: all(drill.status(n) == ("waiting", gate) for n in names), timeout, f"gate {gate}"
    )


# -- detect and rejoin ----------------------------------------------------------------------------


def detect_and_rejoin(root: Path, heartbeat: float, model: str, cycles: int) -> list[dict]:
    """Kill replica 2 between syncs, restart it at once, let it join; ``cycles`` times; then
    kill it inside an all-reduce."""
    period = 16
    records = []
    with Drill(root, flags(model, 100_000, period), heartbeat_timeout=heartbeat) as drill:
        drill.start_lighthouse(min_replicas=2)
        drill.gate(0)  # all three ready before the first quorum: it then holds all three
        for name, replica in (("r0", 0), ("r1", 1), ("r2-0", 2)):
            drill.start(name, replica)
        wait_at(drill, ["r0", "r1", "r2-0"], 0)
        gate = 2 * period
        drill.gate(gate)
        wait_at(drill, ["r0", "r1", "r2-0"], gate)
        for cycle in range(cycles):
            victim, successor = f"r2-{cycle}", f"r2-{cycle + 1}"
            gate += period - 1  # just before the next sync: released, they ask for a quorum
            drill.gate(gate)
            wait_at(drill, ["r0", "r1", victim], gate)
            drill.kill(victim)
            drill.start(successor, 2)  # a supervisor restarting it at once
            killed = drill.killed_at[victim]
            gate += 1000 * period  # run freely: the successor joins at the next sync it can
            drill.gate(gate)
            drill.wait_for(lambda s=successor: bool(drill.rounds(s)), 300, f"{successor} joined")
            left = [e for e in drill.events("r0", "quorum") if e["time"] > killed and e["left"]]
            connect = drill.events(successor, "connect")[0]
            joined = drill.events(successor, "quorum")[0]
            first = drill.events(successor, "committed")[0]
            records.append(
                {
                    "heartbeat_timeout_s": heartbeat,
                    "model": model,
                    "detected_s": left[0]["time"] - killed,
                    "start_up_s": connect["time"] - drill.started_at[successor],
                    "connect_to_healed_s": joined["time"] - connect["time"],
                    "quorum_and_heal_s": joined["seconds"],
                    "heal_bytes": joined["heal"]["bytes"],
                    "kill_to_first_round_s": first["time"] - killed,
                }
            )
            gate = max(drill.status(n)[1] for n in ("r0", "r1")) // period * period + 2 * period
            drill.gate(gate)
            wait_at(drill, ["r0", "r1", successor], gate)
        records.append(kill_inside_a_round(drill, gate, period, f"r2-{cycles}", heartbeat))
    return records


def kill_inside_a_round(drill: Drill, gate: int, period: int, victim: str, heartbeat) -> dict:
    step = gate + period - (DELAY if EXTRA else 0)  # where the round landing at gate + K opens
    drill.hold_round("r0", step)
    drill.gate(gate + 2 * period)
    drill.wait_for(lambda: drill.entered_round(victim, step), 300, "victim inside the round")
    time.sleep(0.3)  # inside gloo's all-reduce, waiting for replica 0
    drill.kill(victim)
    killed = drill.killed_at[victim]
    drill.release_round("r0", step)
    wait_at(drill, ["r0", "r1"], gate + 2 * period)
    discarded = [e for e in drill.events("r1", "discarded") if e["step"] >= step][0]
    after = [e for e in drill.events("r1", "committed") if e["step"] > step][0]
    return {
        "heartbeat_timeout_s": heartbeat,
        "killed_inside_round": True,
        "discarded_after_s": discarded["time"] - killed,
        "next_round_after_s": after["time"] - killed,
        "next_round_replicas": after["replicas"],
    }


# -- loss -----------------------------------------------------------------------------------------


def loss_run(root: Path, seed: int, absent_rounds: int | str, steps: int, period: int) -> dict:
    kill_round = 6
    with Drill(root, flags("micro", steps, period, seed), heartbeat_timeout=1.0) as drill:
        drill.start_lighthouse(min_replicas=2)
        names = ["r0", "r1", "r2"]
        drill.gate(0)  # all three ready before the first quorum: it then holds all three
        for name, replica in zip(names, range(3)):
            drill.start(name, replica)
        wait_at(drill, names, 0)
        drill.gate(kill_round * period if absent_rounds != 0 else None)
        if absent_rounds not in (0, "never"):
            drill.start("r2b", 2, hold=True)
        if absent_rounds != 0:
            wait_at(drill, names, kill_round * period)
            drill.kill("r2")
        if absent_rounds not in (0, "never"):
            back = (kill_round + absent_rounds) * period
            drill.gate(back)
            wait_at(drill, ["r0", "r1"], back)
            drill.release("r2b")
            drill.wait_for(lambda: drill.status("r2b")[0] == "running", 300, "r2b ready")
            time.sleep(0.5)  # its quorum request reaches the lighthouse before the others'
        drill.gate(None)
        survivors = ["r0", "r1"] + (["r2"] if absent_rounds == 0 else [])
        survivors += ["r2b"] if absent_rounds not in (0, "never") else []
        for name in survivors:
            assert drill.wait_exit(name, 1800) == 0, drill.tails()
        results = json.loads((drill.root / "r0" / "results.json").read_text())
        joined = drill.events("r2b", "quorum")[:1] if "r2b" in survivors else []
    missed = None
    if joined:
        missed = (joined[0]["step"] + 1) // period - kill_round - 1
    return {
        "seed": seed,
        "absent_rounds": absent_rounds,
        "rounds_missed": missed if joined else (0 if absent_rounds == 0 else "all"),
        "final_val_loss": results["final_val_loss"],
        "heal_bytes": joined[0]["heal"]["bytes"] if joined else None,
        "bytes_per_worker": results["bytes_per_worker"],
        "comm_reduction_vs_ddp": results["comm_reduction_vs_ddp"],
    }


def simulated_loss(root: Path, seed: int, steps: int, period: int) -> float:
    from mtdao.train.config import TrainConfig
    from mtdao.train.trainer import train

    options = {}
    if EXTRA:
        options = dict(
            sync_delay=DELAY, sync_fragments=2, sync_dtype=("int8",), error_feedback=True
        )
    config = TrainConfig.of(
        workers=3, model="micro", steps=steps, sync_period=period, seed=seed, batch_size=8,
        seq_len=64, eval_tokens=8192, progress=False, out=str(root / f"simulated-{seed}"),
        **options,
    )  # fmt: skip
    return train(config)["final_val_loss"]


# -- report ---------------------------------------------------------------------------------------


def report(records: list[dict]) -> None:
    for heartbeat in sorted(
        {r["heartbeat_timeout_s"] for r in records if "heartbeat_timeout_s" in r}
    ):
        cycles = [
            r for r in records if r.get("heartbeat_timeout_s") == heartbeat and "detected_s" in r
        ]
        inside = [
            r
            for r in records
            if r.get("heartbeat_timeout_s") == heartbeat and r.get("killed_inside_round")
        ]
        if cycles:
            print(f"heartbeat timeout {heartbeat:g} s, {len(cycles)} kills between syncs:")
            for key in ("detected_s", "start_up_s", "connect_to_healed_s", "quorum_and_heal_s",
                        "kill_to_first_round_s", "heal_bytes"):  # fmt: skip
                values = [r[key] for r in cycles]
                print(
                    f"  {key}: median {statistics.median(values):.3g} (min {min(values):.3g}, max {max(values):.3g})"
                )
        for r in inside:
            print(
                f"  killed inside an all-reduce: discarded after {r['discarded_after_s']:.2f} s, next round after {r['next_round_after_s']:.2f} s over {r['next_round_replicas']}"
            )
    for r in records:
        if "absent_rounds" in r or "simulated" in r:
            print("  ", json.dumps(r))


def main(argv=None) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that every drill cleans up
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("detect", "loss", "all"), default="all")
    parser.add_argument("--out", type=Path, default=Path("/tmp/ft-bench"))
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--steps", type=int, default=480)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--heartbeats", type=float, nargs="+", default=[1.0, 5.0])
    parser.add_argument("--models", nargs="+", default=["micro", "tiny"])
    parser.add_argument("--absent", nargs="+", default=["0", "2", "8", "never"])
    parser.add_argument("--round-options", action="store_true", help=" ".join(ROUND_OPTIONS))
    args = parser.parse_args(argv)
    if args.round_options:
        EXTRA.extend(ROUND_OPTIONS)
    records: list[dict] = []
    if args.part in ("detect", "all"):
        for heartbeat in args.heartbeats:
            for model in args.models:
                root = args.out / f"detect-{heartbeat:g}-{model}"
                records += detect_and_rejoin(root, heartbeat, model, args.cycles)
                print(json.dumps(records[-args.cycles - 1 :]), flush=True)
    if args.part in ("loss", "all"):
        for seed in args.seeds:
            records.append({"simulated": True, "seed": seed,
                            "final_val_loss": simulated_loss(args.out, seed, args.steps, 16)})  # fmt: skip
            for absent in [a if a == "never" else int(a) for a in args.absent]:
                root = args.out / f"loss-{seed}-{absent}"
                records.append(loss_run(root, seed, absent, args.steps, 16))
                print(json.dumps(records[-1]), flush=True)
    (args.out / "results.json").write_text(json.dumps(records, indent=1))
    report(records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
