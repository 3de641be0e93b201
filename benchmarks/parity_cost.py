"""What the bit-parity check costs a round, at the micro model, measured side by side in one run.

    python benchmarks/parity_cost.py --replicas 3 --steps 400

R fault-tolerant replicas of the micro model (byte vocabulary, batches of 4 sequences of 32
tokens, MTAdam, parameters and states averaged every ``--sync-period`` steps) and a lighthouse on
loopback, no failure. Each replica counts the seconds its engine spends in rounds (encoding, the
collectives, commit and applying: ``LocalUpdateSync.rounds.seconds_syncing``; the quorum, which comes
before, is left out, so the ratio errs high) and the seconds its parity check spends hashing what
each round assigned and comparing (``ReplicaGroups.parity.seconds``: within the rounds, and in
the exchange that opens each, which runs anyway). Prints both per round and their ratio, per
replica.

``--replica-id`` runs one replica (what the benchmark starts R of).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

VOCAB, SEQ_LEN, BATCH, LR = 256, 32, 4, 3e-3
LIMIT_S = 1800.0  # the whole run, on a crowded machine


def replica(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F

    import mtdao
    from mtdao.ft import ReplicaConfig, fault_tolerant_replica
    from mtdao.model import Llama, model_config
    from mtdao.sync import LocalUpdateSync, unified

    torch.manual_seed(0)  # every replica builds the same model
    model = Llama(model_config("micro", VOCAB, SEQ_LEN))
    optimizer = mtdao.MTAdam(model.parameters(), lr=LR, betas=(0.99,), omegas=(0.9,), beta2=0.95)
    config = ReplicaConfig(args.replica_id, args.lighthouse, auth_token_file=args.auth_token_file)
    replicas = fault_tolerant_replica(config)
    sync = LocalUpdateSync(optimizer, unified(args.sync_period), replicas)
    batches = torch.Generator().manual_seed(args.replica_id)
    started = time.perf_counter()
    with sync.attached():
        while sync.step_count < args.steps:
            tokens = torch.randint(VOCAB, (BATCH, SEQ_LEN + 1), generator=batches)
            logits = model(tokens[:, :-1])
            F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
            optimizer.step()
            optimizer.zero_grad()
    wall = time.perf_counter() - started
    replicas.shutdown()
    parity = replicas.parity
    averaged = sum(p.numel() for p in model.parameters())
    print(json.dumps({
        "replica": args.replica_id, "rounds": len(sync.events), "wall_s": wall,
        "round_s": sync.rounds.seconds_syncing, "parity_s": parity.seconds, "mismatches": len(parity.mismatches),
        "parameters": averaged,
    }), flush=True)  # fmt: skip


def controller(args: argparse.Namespace) -> None:
    from mtdao.testing.fault_drill import Drill

    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    token = root / "run-secret"
    token.write_text("parity-cost-benchmark\n")
    token.chmod(0o600)
    secret = ["--auth-token-file", str(token)]
    with Drill(root, []) as drill:
        drill.start_lighthouse(min_replicas=args.replicas, flags=secret)
        for r in range(args.replicas):
            argv = [sys.executable, __file__, "--replica-id", str(r), *secret]
            argv += ["--lighthouse", drill.lighthouse, "--steps", str(args.steps)]
            drill._spawn(f"r{r}", [*argv, "--sync-period", str(args.sync_period)])
        exits = [drill.wait_exit(f"r{r}", LIMIT_S) for r in range(args.replicas)]
        if exits != [0] * args.replicas:
            sys.exit(f"a replica failed: exits {exits}\n{drill.tails()}")
        for r in range(args.replicas):
            said = json.loads(drill.log(f"r{r}").strip().splitlines()[-1])
            round_ms = 1e3 * said["round_s"] / said["rounds"]
            parity_ms = 1e3 * said["parity_s"] / said["rounds"]
            share = said["parity_s"] / said["round_s"]
            print(
                f"replica {r}: {said['rounds']} rounds, {round_ms:.2f} ms a round, parity "
                f"{parity_ms:.3f} ms a round ({said['mismatches']} mismatches): {share:.2%} of "
                f"the rounds' time ({said['parameters']} parameters and their states)"
            )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--sync-period", type=int, default=8)
    parser.add_argument("--out", default="/tmp/mtdao-parity-cost", help="logs and the secret")
    parser.add_argument("--replica-id", type=int, help="run one replica (started by the rest)")
    parser.add_argument("--lighthouse", help="host:port (with --replica-id)")
    parser.add_argument("--auth-token-file", help="the run's secret (with --replica-id)")
    args = parser.parse_args(argv)
    if args.replicas < 2 or args.steps < args.sync_period or args.sync_period < 1:
        parser.error("need --replicas >= 2 and --steps >= --sync-period >= 1")
    replica(args) if args.replica_id is not None else controller(args)


if __name__ == "__main__":
    main()
