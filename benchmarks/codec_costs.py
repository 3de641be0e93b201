"""What a quantized round costs one worker's CPU, per codec, next to one training step.

A worker's part of a quantized round (:mod:`mtdao.sync.exchange`), network aside: encode its
payload (parameters as pseudo-gradients, momentum, second moment: three model-sized tensors, as
MT-DAO's unified round sends), decode the M chunks it owns, sum and encode their mean, and decode
the gathered means; a top-k payload is gathered whole instead, so a worker decodes the M payloads
and sums them. With error feedback the pseudo-gradient is also encoded and decoded once more
(the residual). The step is one worker's forward, backward and MT-DAO-Adam step on the same model
and batch, in the same process. Times are this process's CPU time (one thread), so that other
jobs on a shared machine slow neither side; every setup is timed in every round, in a rotating
order, and the median over rounds is printed. On the CPU the codecs run as C++ kernels
(:mod:`mtdao.sync.codecs.native_codecs`); ``--eager`` adds a row per codec timed with torch's codecs
instead, side by side in the same rounds.

    OMP_NUM_THREADS=1 python benchmarks/codec_costs.py --model tiny --workers 4 --rounds 7 --eager
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch

import mtdao
from mtdao.model import Llama, model_config
from mtdao.sync.codecs import native_codecs
from mtdao.sync.codecs.compression import PseudoGradients
from mtdao.sync.codecs.quantize import Codec
from mtdao.sync.exchange import (
    block_layout,
    counted_bytes,
    decoded_mean,
    pack,
    reduce_chunks,
    unpack,
)
from mtdao.train.workers import language_model_loss

CODECS = ["bf16", "fp8", "int8", "int4", "int2", "top16", "top8", "top4"]
KINDS = ("params", "exp_avg_0", "exp_avg_sq")


def worker_setup(model_name: str, batch_size: int, seq_len: int):
    torch.manual_seed(0)
    model = Llama(model_config(model_name, vocab_size=256, max_seq_len=seq_len))
    optimizer = mtdao.MTAdam(model.parameters(), lr=1e-3)
    inputs = torch.randint(0, 256, (batch_size, seq_len))
    targets = torch.randint(0, 256, (batch_size, seq_len))
    return model, optimizer, inputs, targets


def time_step(setup) -> float:
    model, optimizer, inputs, targets = setup
    started = time.process_time()
    optimizer.zero_grad()
    language_model_loss(model(inputs), targets).backward()
    optimizer.step()
    return time.process_time() - started


def round_tensors(setup) -> dict[str, list[torch.Tensor]]:
    """The three kinds a unified MT-DAO round sends, one worker's, after a few steps."""
    model, optimizer, _, _ = setup
    params = [p for p in model.parameters()]
    return {
        "params": [p.detach() * 1e-3 for p in params],  # a pseudo-gradient's scale
        "exp_avg_0": [optimizer.state[p]["exp_avg_0"] for p in params],
        "exp_avg_sq": [optimizer.state[p]["exp_avg_sq"] for p in params],
    }


def time_round(tensors: dict[str, list[torch.Tensor]], dtype: str, workers: int, ef: bool):
    """Seconds of one worker's encode / reduce / decode of a round, and its bytes as the traffic
    account counts them."""
    started, payload_bytes = time.process_time(), 0
    for kind, values in tensors.items():
        domain = "positive" if kind == "exp_avg_sq" else "signed"
        codec = Codec("int4" if dtype.startswith("top") and domain == "positive" else dtype, domain)
        rows = [v.reshape(1, -1) for v in values]
        if ef and kind == "params":
            feedback = PseudoGradients(codec, error_feedback=True, local_workers=1)
            rows = [
                feedback.payload(i, torch.zeros_like(r), -r).reshape(1, -1)
                for i, r in enumerate(rows)
            ]
        layout = block_layout([r.shape[1] for r in rows], codec, workers)
        payload = codec.encode(pack(rows, layout))[0]
        payload_bytes += counted_bytes(payload.numel(), codec, workers)
        if codec.gathered:  # every worker's payload, as if each had sent these bytes
            gathered = payload.unsqueeze(0).expand(workers, -1, -1)
            unpack(decoded_mean(gathered, codec, range(workers)), layout)
            continue
        # the chunk this worker owns, as if every worker had sent these bytes
        chunk = payload.view(workers, layout.chunk_blocks, -1)[0]
        mean = reduce_chunks(chunk.unsqueeze(0).expand(workers, -1, -1), codec, range(workers))
        gathered = mean.repeat(workers, 1)
        unpack(codec.decode(gathered).view(layout.total_blocks, -1), layout)
    return time.process_time() - started, payload_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--codecs", nargs="+", default=CODECS)
    parser.add_argument("--json", help="write the medians here")
    parser.add_argument(
        "--eager", action="store_true", help="also time each codec with torch's codecs"
    )
    args = parser.parse_args()
    setup = worker_setup(args.model, args.batch_size, args.seq_len)
    for _ in range(3):  # warm up (and create the optimizer's states)
        time_step(setup)
    tensors = round_tensors(setup)
    numel = sum(v.numel() for v in tensors["params"])
    paths = ("", " (torch)") if args.eager else ("",)
    names = ["step"] + [
        f"{c}{'+ef' if ef else ''}{path}"
        for c in args.codecs
        for ef in (False, True)
        for path in paths
    ]
    times: dict[str, list[float]] = {name: [] for name in names}
    sizes: dict[str, int] = {}
    for round_index in range(args.rounds):
        order = names[round_index % len(names) :] + names[: round_index % len(names)]
        for name in order:
            if name == "step":
                times[name].append(time_step(setup))
                continue
            eager = name.endswith(" (torch)")
            codec = name.removesuffix(" (torch)")
            dtype, ef = codec.removesuffix("+ef"), codec.endswith("+ef")
            with native_codecs.eager_only() if eager else contextlib.nullcontext():
                seconds, sizes[name] = time_round(tensors, dtype, args.workers, ef)
            times[name].append(seconds)
    step_ms = statistics.median(times["step"]) * 1e3
    print(f"{args.model}: {numel:,} parameters, {args.workers} workers, torch {torch.__version__}")
    kernels = (
        "C++ kernels" if native_codecs.usable(Codec) else "torch's (the C++ kernels did not build)"
    )
    print(f"codecs: {kernels}; rows marked (torch): torch's codecs")
    print(f"one worker's step (batch {args.batch_size} x {args.seq_len}): {step_ms:.1f} ms")
    print("| codec | round ms (3 kinds) | x step | bytes counted | bytes/value | vs fp32 |")
    print("|---|---|---|---|---|---|")
    results = {"step_ms": step_ms, "parameters": numel, "codecs": {}}
    for name in names[1:]:
        ms = statistics.median(times[name]) * 1e3
        per_value = sizes[name] / (3 * numel)
        print(
            f"| {name} | {ms:.1f} | {ms / step_ms:.2f} | {sizes[name]:,} | {per_value:.3f} | "
            f"{4 / per_value:.1f}x |"
        )
        results["codecs"][name] = {"round_ms": ms, "payload_bytes": sizes[name]}
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
