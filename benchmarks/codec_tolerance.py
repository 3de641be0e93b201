"""What each optimizer state tolerates on the link: the error a codec puts into a round's average,
and into the update the averaged states then give.

Trains M simulated MT-DAO-Adam workers of a model for some local steps (no sync, so they differ as
they do at the end of a round), then averages each kind of state with each codec exactly as a round
does (every worker encodes, the owner averages and encodes the mean, everyone decodes; a top-k
payload is gathered whole, and every worker decodes and sums the M payloads) and compares with the float32 average: the relative L2 error of the average, and of the update
direction ``u / (sqrt(v) + eps)`` computed from the averaged states (``u`` the mean of the momenta;
only that kind quantized). The
second moment is judged in its log domain (the update divides by its square root), the slow and
fast momenta each on their own (``--betas 0.9 0.99``).

    OMP_NUM_THREADS=1 python benchmarks/codec_tolerance.py --model micro --steps 64
"""

from __future__ import annotations

import argparse
import json

import torch

import mtdao
from mtdao.model import Llama, model_config
from mtdao.sync import stack_workers
from mtdao.sync.codecs.quantize import Codec
from mtdao.sync.exchange import simulated_mean
from mtdao.train.workers import language_model_loss

CODECS = {
    "signed": ["bf16", "fp8", "int8", "int4", "int2", "top32", "top8"],
    "positive": ["bf16", "fp8", "int8", "int4", "int2"],
}


def trained_states(model_name: str, workers: int, steps: int, betas, seq_len: int = 64):
    torch.manual_seed(0)
    model = Llama(model_config(model_name, vocab_size=256, max_seq_len=seq_len))
    stacked = stack_workers(model, workers)
    omegas = tuple(0.9 / len(betas) for _ in betas)
    optimizer = mtdao.MTAdam(stacked.parameters(), lr=4e-3, betas=betas, omegas=omegas)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):  # random tokens with a learnable bias: enough to shape the states
        inputs = torch.randint(0, 64, (workers, 16, seq_len), generator=gen)
        targets = (inputs + 1) % 64
        optimizer.zero_grad()
        stacked.losses(language_model_loss, inputs, targets).sum().backward()
        optimizer.step()
    params = list(stacked.parameters())
    return optimizer, params


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="micro")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--betas", type=float, nargs="+", default=[0.9, 0.99])
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    optimizer, params = trained_states(args.model, args.workers, args.steps, tuple(args.betas))
    eps = 1e-8
    keys = [f"exp_avg_{j}" for j in range(len(args.betas))] + ["exp_avg_sq"]
    rows = {
        key: [optimizer.state[p][key].reshape(args.workers, -1) for p in params] for key in keys
    }
    exact = {key: [r.mean(dim=0) for r in rows[key]] for key in keys}

    results: dict = {}
    print(
        f"{args.model}, {args.workers} workers after {args.steps} local steps, betas {args.betas}"
    )
    print("| state | codec | average: rel. L2 error | update u/(sqrt(v)+eps): rel. L2 error |")
    print("|---|---|---|---|")
    for key in keys:
        domain = "positive" if key == "exp_avg_sq" else "signed"
        beta = args.betas[int(key.rsplit("_", 1)[1])] if domain == "signed" else None
        for dtype in CODECS[domain]:
            codec = Codec(dtype, domain)
            means, _ = simulated_mean(rows[key], codec)
            error = relative(torch.cat(means), torch.cat(exact[key]))
            # the update from the averaged states, only this kind quantized
            states = {k: list(exact[k]) for k in keys}
            states[key] = means
            directions, reference = [], []
            for i in range(len(params)):
                denominator = states["exp_avg_sq"][i].sqrt() + eps
                exact_denominator = exact["exp_avg_sq"][i].sqrt() + eps
                u = sum(states[k][i] for k in keys[:-1]) / len(keys[:-1])
                u_exact = sum(exact[k][i] for k in keys[:-1]) / len(keys[:-1])
                directions.append(u / denominator)
                reference.append(u_exact / exact_denominator)
            update_error = relative(torch.cat(directions), torch.cat(reference))
            name = f"{key} (beta {beta})" if beta is not None else f"{key} (log domain)"
            print(f"| {name} | {dtype} | {error:.4f} | {update_error:.4f} |")
            results.setdefault(key, {})[dtype] = {"average": error, "update": update_error}
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
