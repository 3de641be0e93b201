"""Fault-tolerant replicas of a plain training loop: an MLP on generated data, no mtdao harness.

One process per replica; a lighthouse knows which are alive. Kill a replica (even with kill -9)
and start it again with the same command: it heals from a live one (parameters, optimizer
states, the engine's rounds and its data position) and carries on where the others are; every
replica ends with the same model (the final round: one a death breaks is formed again among the
survivors; when no try commits, the replica says so in one line and exits 1).

    python -c 'import secrets; print(secrets.token_hex(32))' > run.token  # the run's secret
    mtdao lighthouse --port 29510 --min-replicas 3 --auth-token-file run.token &
    for i in 0 1 2; do
        python examples/fault_tolerant_loop.py --lighthouse localhost:29510 --replica-id $i \\
            --auth-token-file run.token --steps 200 --out /tmp/ft-loop/r$i &
    done

On one machine the secret may be left out of every command (this account's own stands in; see
docs/security.md). A replica says when it joins and when it heals, and whom from; one that
cannot reach the lighthouse or is refused stops with one line (exit code 1). After each round
it says how many rounds it has committed (a healed replica counts its source's) and discarded,
and its step.

Each writes ``OUT/result.json``: the steps trained and a SHA-256 of the final parameters' bytes
(in ``model.parameters()`` order), the same on every replica.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import mtdao
from mtdao.flags import add_dataclass_arguments, dataclass_from_args
from mtdao.ft import QuorumError, ReplicaConfig, ReplicaRefused, fault_tolerant_replica
from mtdao.sync import FinalRoundNotCommitted, LocalUpdateSync, SyncCodecs, unified

FEATURES, CLASSES, BATCH, LR = 32, 8, 64, 3e-3


@dataclass(frozen=True)
class ReplicaFlags:
    replica: ReplicaConfig  # one flag per field, as mtdao train has them


class GeneratedData:
    """Replica r's batches: batch i is drawn from a generator seeded by (r, i), so the position
    (batches drawn) is the whole state, and a healed replica carries on with its own data."""

    def __init__(self, replica_id: int) -> None:
        self.replica_id, self.drawn = replica_id, 0
        self.teacher = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(0))

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(1_000_003 * self.replica_id + self.drawn)
        self.drawn += 1
        inputs = torch.randn(BATCH, FEATURES, generator=generator)
        return inputs, (inputs @ self.teacher).argmax(dim=1)

    def state_dict(self) -> dict[str, int]:
        return {"drawn": self.drawn}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.drawn = state["drawn"]  # only a heal loads it (the library says so)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_dataclass_arguments(parser, ReplicaFlags)  # --replica-id, --lighthouse, ...
    parser.add_argument("--steps", type=int, required=True, help="optimizer steps")
    parser.add_argument(
        "--stop-file",
        help="a step a controller may write here ends the run there instead (the same file for "
        "every replica: benchmarks/ft_churn.py ends a run at a deadline so)",
    )
    parser.add_argument("--out", required=True, help="where result.json goes")
    parser.add_argument("--sync-period", type=int, default=8, help="K: local steps per round")
    parser.add_argument("--sync-delay", type=int, default=0, help="D: rounds overlap D steps")
    parser.add_argument("--sync-dtype", nargs="+", help="e.g. int8: what crosses the link")
    parser.add_argument("--error-feedback", action="store_true")
    args = parser.parse_args(argv)
    for name in ("replica_id", "lighthouse"):
        if getattr(args, name) is None:
            parser.error(f"--{name.replace('_', '-')} is required")
    return args


def last_step(args: argparse.Namespace) -> int:
    """--steps, or the step written to --stop-file (read at every step: every replica stops at
    the same one, with the final round)."""
    if args.stop_file and Path(args.stop_file).exists():
        return min(args.steps, int(Path(args.stop_file).read_text()))
    return args.steps


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        train(args)
    except (QuorumError, ReplicaRefused) as error:  # no lighthouse, or not let in: one line
        print(f"replica {args.replica_id}: {error}", file=sys.stderr, flush=True)
        return 1
    except FinalRoundNotCommitted as failure:  # no try of the final round committed
        print(f"replica {args.replica_id}: {failure}", file=sys.stderr, flush=True)
        return 1
    return 0


def train(args: argparse.Namespace) -> None:
    torch.manual_seed(0)  # every replica builds the same model (the first quorum aligns them)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 64), torch.nn.GELU(), torch.nn.Linear(64, CLASSES)
    )
    optimizer = mtdao.MTAdam(model.parameters(), lr=LR, betas=(0.99,), omegas=(0.9,), beta2=0.95)
    # what every replica must share: a joiner with other values is refused, naming them
    config = dataclass_from_args(ReplicaFlags, args).replica
    local = {"out", *vars(config)}  # a replica's own settings may differ from the others'
    shared = {k: v for k, v in vars(args).items() if k not in local}
    replica = fault_tolerant_replica(config, shared_config=shared)
    codecs = SyncCodecs.parse(args.sync_dtype or (), args.error_feedback)
    sync = LocalUpdateSync(
        optimizer, unified(args.sync_period), replica, delay=args.sync_delay, codecs=codecs
    )
    data = GeneratedData(args.replica_id)
    replica.track_state("data", data)  # healed with the model: a joiner goes on from here
    with sync.attached():  # joins (a new replica heals); the final round at the end
        while sync.step_count < last_step(args):  # a healed replica is at its source's step
            for group in optimizer.param_groups:  # the LR from the step: nothing to heal
                group["lr"] = LR * 0.5 * (1 + math.cos(math.pi * sync.step_count / args.steps))
            inputs, targets = data.next_batch()
            F.cross_entropy(model(inputs), targets).backward()
            optimizer.step()  # every K steps: a round with the live replicas
            optimizer.zero_grad()
            if sync.step_count % args.sync_period == 0:  # a round was due: how it went
                committed, discarded = len(sync.events), len(sync.discarded_rounds)
                rounds = f"{committed} rounds committed, {discarded} discarded"
                print(f"replica {args.replica_id}: {rounds}; step {sync.step_count}", flush=True)
    replica.shutdown()
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().cpu().contiguous().numpy().tobytes())
    result = {"step": sync.step_count, "params_sha256": digest.hexdigest()}
    result["discarded_rounds"] = len(sync.discarded_rounds)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "result.json").write_text(json.dumps(result) + "\n")
    print(f"replica {args.replica_id}: {json.dumps(result)}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
