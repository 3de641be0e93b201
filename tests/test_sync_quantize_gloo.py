"""Quantized, delayed and fragmented rounds on real processes (gloo, 3 workers) == the simulator.

A quantized average is bit-identical everywhere: every rank decodes the same gathered bytes, and
the simulator runs the same functions on the same blocks. Three workers make the payload's padding
to equal chunks matter. The float32 delayed rounds match to float tolerance (gloo sums in another
order than a mean over stacked workers, as for blocking rounds).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import Tensor
from torch.testing import assert_close

from mtdao import MTAdam
from mtdao.sync import Communicator, LocalUpdateSync, SimulatedWorkers, unified
from mtdao.sync.codecs.compression import SyncCodecs
from mtdao.sync.process_group import ProcessGroupWorkers
from mtdao.sync.testing import run_on_gloo

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"
    ),
]

WORLD_SIZE = 3
SHAPES = [(7, 300), (5,), (64,), ()]  # odd sizes: partial blocks, padding to 3 equal chunks
CODEC_SETS = {
    "int8": SyncCodecs.parse(["int8"]),
    "fp8": SyncCodecs.parse(["fp8"]),
    "bf16": SyncCodecs.parse(["bf16"]),
    "mixed": SyncCodecs.parse(["params=int8", "momenta=fp8", "second-moment=bf16"]),
    "int4": SyncCodecs.parse(["int4"]),
    "int2": SyncCodecs.parse(["int2"]),
    "sparse": SyncCodecs.parse(["params=top8", "momenta=int2", "second-moment=int4"]),
}
LOW_BIT = SyncCodecs.parse(["params=top8", "momenta=int2", "second-moment=int4"], True)
KINDS = ["params", "exp_avg_0", "exp_avg_sq", "params"]
TRAININGS = {
    "delayed": dict(delay=2),
    "delayed-int8-fragments": dict(delay=2, fragments=2, codecs=SyncCodecs.parse(["int8"], True)),
    "int8": dict(codecs=SyncCodecs.parse(["int8"], True)),
    "low-bit": dict(codecs=LOW_BIT),
    "delayed-low-bit-fragments": dict(delay=2, fragments=2, codecs=LOW_BIT),
}
SYNC_PERIOD, STEPS = 4, 12
JOIN_TIMEOUT_S = 120


def worker_tensors(worker: int) -> list[Tensor]:
    gen = torch.Generator().manual_seed(500 + worker)
    tensors = [torch.randn(shape, generator=gen) for shape in SHAPES]
    tensors[2] = tensors[2].square() * 1e-6  # a second moment: positive, small
    return tensors


def averages(communicator: Communicator, stacked: bool, codecs: SyncCodecs, excluded=()):
    if stacked:
        per_worker = [worker_tensors(w) for w in range(WORLD_SIZE)]
        tensors = [torch.stack(column) for column in zip(*per_worker)]
    else:
        tensors = worker_tensors(communicator.rank)
    result = communicator.average(tensors, KINDS, excluded, [codecs.codec(kind) for kind in KINDS])
    return {"values": result.wait(), "bytes": result.bytes, "collectives": result.collectives}


def train(communicator: Communicator, stacked: bool, options: dict) -> dict:
    """Three workers, two layers, pulled to their own targets; averaged every 4 steps."""
    gen = torch.Generator().manual_seed(7)
    targets = [torch.randn(20, 30, generator=gen), torch.randn(30, generator=gen)]
    rows = range(WORLD_SIZE) if stacked else [communicator.rank]
    weight = torch.nn.Parameter(torch.zeros(len(rows), 20, 30) if stacked else torch.zeros(20, 30))
    bias = torch.nn.Parameter(torch.zeros(len(rows), 30) if stacked else torch.zeros(30))
    scale = torch.tensor([1.0 + w for w in rows]).view(-1, 1, 1)
    optimizer = MTAdam(
        [{"params": [weight, bias], "names": ["layer.weight", "head.bias"]}],
        lr=0.05,
        betas=(0.9,),
        omegas=(0.7,),
    )
    sync = LocalUpdateSync(optimizer, unified(SYNC_PERIOD), communicator, **options)
    for step in range(STEPS):
        optimizer.zero_grad()
        pull = scale if stacked else scale[0]
        loss = ((weight - pull * targets[0]) ** 2).sum() + (
            (bias - pull[..., 0] * targets[1]) ** 2
        ).sum()
        (loss * (1 + step % 3)).backward()
        sync.step()
    return {
        "params": [weight.detach().clone(), bias.detach().clone()],
        "states": [{k: v.clone() for k, v in optimizer.state[p].items()} for p in (weight, bias)],
        "engine": sync.state_dict(),
    }


def rank_work() -> dict:
    communicator = ProcessGroupWorkers()
    results = {name: averages(communicator, False, codecs) for name, codecs in CODEC_SETS.items()}
    results["int8-excluded"] = averages(communicator, False, CODEC_SETS["int8"], [1])
    for name, options in TRAININGS.items():
        results[f"train-{name}"] = train(ProcessGroupWorkers(), False, options)
    return results


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("gloo-quantized")
    return run_on_gloo(rank_work, WORLD_SIZE, root, preload=[__name__], timeout_s=JOIN_TIMEOUT_S)


@pytest.mark.parametrize("name", [*CODEC_SETS, "int8-excluded"])
def test_quantized_average_is_bit_identical_on_every_rank_and_in_the_simulator(name, gloo_results):
    codecs = CODEC_SETS[name.split("-")[0]]
    excluded = [1] if name.endswith("excluded") else []
    simulated = averages(SimulatedWorkers(WORLD_SIZE), True, codecs, excluded)
    for results in gloo_results:
        real = results[name]
        for value, expected in zip(real["values"], simulated["values"], strict=True):
            assert value.dtype == expected.dtype and torch.equal(value, expected)
        assert (real["bytes"], real["collectives"]) == (
            simulated["bytes"],
            simulated["collectives"],
        )
    # and it is an average, within the codec's rounding of the workers' values (fp8: 2^-4; two
    # roundings of half a unit, absmax / 7 or absmax; top-k keeps what is largest, nothing else)
    error = {"int8": 0.02, "fp8": 0.07, "bf16": 0.01, "mixed": 0.07, "int4": 0.15, "int2": 1.0}
    error = error.get(name.split("-")[0], 1.0)
    columns = [torch.stack(c) for c in zip(*(worker_tensors(w) for w in range(WORLD_SIZE)))]
    kept = [w for w in range(WORLD_SIZE) if w not in excluded]
    for value, column in zip(simulated["values"], columns):
        largest = column.abs().max().item()
        assert_close(value, column[kept].mean(dim=0), rtol=0, atol=error * largest)


@pytest.mark.parametrize("name", list(TRAININGS))
def test_real_training_with_the_options_matches_the_simulator(name, gloo_results):
    simulated = train(SimulatedWorkers(WORLD_SIZE), True, TRAININGS[name])
    quantized = "codecs" in TRAININGS[name]
    for rank, results in enumerate(gloo_results):
        real = results[f"train-{name}"]
        pairs = list(zip(real["params"], simulated["params"]))
        for states, stacked in zip(real["states"], simulated["states"]):
            pairs += [(states[k], stacked[k]) for k in states if k != "step"]
        for value, stacked in pairs:
            if quantized:  # every operation is the same on a rank and on its row
                assert torch.equal(value, stacked[rank]), name
            else:
                assert_close(value, stacked[rank])
        assert real["engine"]["traffic"] == simulated["engine"]["traffic"]
        assert real["engine"]["events"] == simulated["engine"]["events"]
        if quantized:
            for residual, stacked in zip(
                real["engine"]["pseudo_gradients"]["residuals"].values(),
                simulated["engine"]["pseudo_gradients"]["residuals"].values(),
            ):
                assert torch.equal(residual, stacked[rank])
    if "delay" not in TRAININGS[name] and quantized:  # a quantized round: identical workers
        final = [results[f"train-{name}"]["params"] for results in gloo_results]
        for rank in range(1, WORLD_SIZE):
            assert all(torch.equal(a, b) for a, b in zip(final[0], final[rank]))
