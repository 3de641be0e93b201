"""Simulated workers == real worker processes over gloo: parameters, states, traffic, NaN guards.

One spawn of four processes runs every method; the simulator runs the same training in this
process and each rank is compared with its row of the stacked tensors.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist
from torch import Tensor
from torch.testing import assert_close

from mtdao import MTAdam
from mtdao.methods import SyncConfig, method_parts
from mtdao.methods.optimizers import build_optimizer
from mtdao.methods.table import METHODS
from mtdao.sync import (
    Communicator,
    LocalUpdateSync,
    NonFiniteError,
    SimulatedWorkers,
    unified,
)
from mtdao.sync.policy import desloc
from mtdao.sync.process_group import ProcessGroupWorkers
from mtdao.sync.testing import run_on_gloo
from mtdao.train.config import TrainConfig, resolve

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"
    ),
]

WORLD_SIZE = 4
SYNC_PERIOD, STEPS = 3, 9
D_IN, D_OUT, BATCH = 4, 3, 8
NAMES = ["weight", "scale", "bias"]
SMALL_BUCKET_BYTES = 64  # splits the float64 tensors of one round into several collectives
JOIN_TIMEOUT_S = 120


# -- the training both sides run ----------------------------------------------------------------


def make_params(worker: int) -> list[Tensor]:
    """Two dtypes and a 0-dim tensor; each worker starts elsewhere until the initial broadcast."""
    gen = torch.Generator().manual_seed(100 + worker)
    weight = torch.randn(D_OUT, D_IN, generator=gen, dtype=torch.float64)
    scale = torch.rand((), generator=gen, dtype=torch.float64) + 0.5
    bias = torch.randn(D_OUT, generator=gen, dtype=torch.float64).float()
    return [weight, scale, bias]


def batch(worker: int, step: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(10_000 * worker + step)
    inputs = torch.randn(BATCH, D_IN, generator=gen, dtype=torch.float64)
    targets = torch.randn(BATCH, D_OUT, generator=gen, dtype=torch.float64)
    return inputs, targets


def loss_fn(params: list[Tensor], inputs: Tensor, targets: Tensor) -> Tensor:
    """Sum over workers of each worker's mean squared error (with or without a worker dim)."""
    weight, scale, bias = params
    linear = torch.einsum("...nd,...od->...no", inputs, weight)
    prediction = scale[..., None, None] * linear + bias.double().unsqueeze(-2)
    return 0.5 * (prediction - targets).square().mean(dim=(-2, -1)).sum()


def setup(communicator: Communicator, stacked: bool) -> tuple[list[Tensor], list[int] | None]:
    """This process's parameters: stacked over all workers, or the one worker ``rank``."""
    if stacked:
        workers = list(range(communicator.num_workers))
        per_worker = [make_params(w) for w in workers]
        tensors = [torch.stack(column) for column in zip(*per_worker)]
        return [torch.nn.Parameter(t) for t in tensors], workers
    return [torch.nn.Parameter(t) for t in make_params(communicator.rank)], None


def data(communicator: Communicator, workers: list[int] | None, step: int):
    if workers is None:
        return batch(communicator.rank, step)
    pairs = [batch(w, step) for w in workers]
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


# options of the round, each on a method whose rounds it changes (the outer momentum's schedule
# sends nothing: a function of the step, tests/test_sync_engine.py)
OPTIONS = {
    "local-adam, radial-directional": ("local-adam", dict(radial=("params", "momenta"))),
}


def train(method: str, communicator: Communicator, stacked: bool, radial=()) -> dict:
    params, workers = setup(communicator, stacked)
    config = resolve(TrainConfig.of(method=method, optimizer="adam", lr=2e-2, weight_decay=0.0))
    optimizer = build_optimizer(
        [{"params": params, "names": NAMES}],
        config.sync,
        config.lr_schedule.lr,
        config.training.weight_decay,
    )
    method_config = SyncConfig(method=method, sync_period=SYNC_PERIOD)
    policy = method_parts(method_config, optimizer).sync_policy()
    sync = LocalUpdateSync(optimizer, policy, communicator, radial_directional=radial)
    for step in range(STEPS):
        optimizer.zero_grad()
        loss_fn(params, *data(communicator, workers, step)).backward()
        sync.step()
    engine = sync.state_dict()
    return {
        "params": [p.detach().clone() for p in params],
        "states": [
            {k: v.clone() for k, v in optimizer.state[p].items() if k != "step"} for p in params
        ],
        "traffic": engine["traffic"],
        "events": engine["events"],
        "outer": engine["outer"],
        "anchors": engine["anchors"],
    }


def nan_run(communicator: Communicator, stacked: bool, bad_worker: int, action: str) -> dict:
    """``bad_worker``'s bias gradient turns NaN at step 2. Parameters are averaged every 2 steps;
    with "skip" the states are not due then (DES-LOC periods), so the worker left out is healed
    through the heal collective."""
    params, workers = setup(communicator, stacked)
    optimizer = MTAdam([{"params": params, "names": NAMES}], lr=1e-2, betas=(0.9,), omegas=(1.0,))
    policy = desloc(2) if action == "skip" else unified(2)
    sync = LocalUpdateSync(optimizer, policy, communicator, on_non_finite=action)
    try:
        for step in range(6):
            optimizer.zero_grad()
            loss_fn(params, *data(communicator, workers, step)).backward()
            if step == 1:
                bias_grad = params[2].grad
                if workers is not None:
                    bias_grad[bad_worker].fill_(float("nan"))
                elif communicator.rank == bad_worker:
                    bias_grad.fill_(float("nan"))
            sync.step()
    except NonFiniteError as error:
        return {"error": str(error)}
    return {
        "params": [p.detach().clone() for p in params],
        "states": [
            {k: v.clone() for k, v in optimizer.state[p].items() if k != "step"} for p in params
        ],
        "skipped": sync.skipped_rounds,
        "traffic": sync.state_dict()["traffic"],
    }


# -- the spawned workers ------------------------------------------------------------------------


def rank_work() -> dict:
    results = {method: train(method, ProcessGroupWorkers(), False) for method in METHODS}
    for name, (method, options) in OPTIONS.items():
        results[name] = train(method, ProcessGroupWorkers(), False, **options)
    small = ProcessGroupWorkers(bucket_bytes=SMALL_BUCKET_BYTES)
    results["mtdao-small-buckets"] = train("mtdao", small, False)
    results["nan-raise"] = nan_run(ProcessGroupWorkers(), False, 2, "raise")
    results["nan-skip"] = nan_run(ProcessGroupWorkers(), False, 1, "skip")
    return results


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("gloo")
    return run_on_gloo(rank_work, WORLD_SIZE, root, preload=[__name__], timeout_s=JOIN_TIMEOUT_S)


@pytest.fixture(scope="module")
def simulated_results() -> dict:
    results = {method: train(method, SimulatedWorkers(WORLD_SIZE), True) for method in METHODS}
    for name, (method, options) in OPTIONS.items():
        results[name] = train(method, SimulatedWorkers(WORLD_SIZE), True, **options)
    results["nan-raise"] = nan_run(SimulatedWorkers(WORLD_SIZE), True, 2, "raise")
    results["nan-skip"] = nan_run(SimulatedWorkers(WORLD_SIZE), True, 1, "skip")
    return results


def tolerance(tensor: Tensor) -> dict:
    # float64 values inherit the float32 bias's rounding (gloo sums in another order than a mean)
    return dict(rtol=1e-7, atol=1e-9) if tensor.dtype == torch.float64 else {}


def assert_rank_matches(real: Tensor, stacked: Tensor, rank: int) -> None:
    assert_close(real, stacked[rank], **tolerance(real))


# -- the comparisons ----------------------------------------------------------------------------


@pytest.mark.parametrize("method", [*METHODS, *OPTIONS])
def test_gloo_matches_simulated(method, gloo_results, simulated_results):
    simulated = simulated_results[method]
    for rank, results in enumerate(gloo_results):
        real = results[method]
        for param, stacked in zip(real["params"], simulated["params"]):
            assert_rank_matches(param, stacked, rank)
        for states, stacked_states in zip(real["states"], simulated["states"]):
            assert states.keys() == stacked_states.keys()
            for key, value in states.items():
                assert_rank_matches(value, stacked_states[key], rank)
        assert real["traffic"] == simulated["traffic"]
        assert real["events"] == simulated["events"]
        if simulated["outer"] is not None:
            pairs = zip(real["outer"]["momentum_buffers"], simulated["outer"]["momentum_buffers"])
            for buffer, global_buffer in pairs:
                assert_close(buffer, global_buffer, **tolerance(buffer))
        for anchor, global_anchor in zip(real["anchors"], simulated["anchors"]):
            assert_close(anchor, global_anchor)
    if method not in ("ddp", "qh-ddp"):  # local methods end a round at step 9
        assert simulated["traffic"]["rounds"] == STEPS // SYNC_PERIOD
    # two dtypes: float64 and float32 travel in separate collectives
    assert simulated["traffic"]["collectives"] == 2 * simulated["traffic"]["rounds"]


def test_radial_directional_changes_the_training_it_is_compared_on(simulated_results):
    radial = simulated_results["local-adam, radial-directional"]
    # each round: 3 parameters and their 3 first momenta, one float64 norm each
    assert radial["traffic"]["bytes_by_kind"]["norms"] == STEPS // SYNC_PERIOD * 6 * 8
    plain = simulated_results["local-adam"]["params"]
    assert not all(torch.allclose(a, b) for a, b in zip(radial["params"], plain))


def test_gloo_small_buckets_split_collectives_not_results(gloo_results, simulated_results):
    simulated = simulated_results["mtdao"]
    for rank, results in enumerate(gloo_results):
        real = results["mtdao-small-buckets"]
        for param, stacked in zip(real["params"], simulated["params"]):
            assert_rank_matches(param, stacked, rank)
        assert real["traffic"]["bytes_by_kind"] == simulated["traffic"]["bytes_by_kind"]
        assert real["traffic"]["collectives"] > simulated["traffic"]["collectives"]


def test_gloo_nan_raises_on_every_rank_naming_the_worker(gloo_results, simulated_results):
    expected = simulated_results["nan-raise"]["error"]
    assert "step 2 in worker 2: bias" in expected
    for results in gloo_results:
        assert results["nan-raise"]["error"] == expected


def test_gloo_nan_skip_matches_simulated(gloo_results, simulated_results):
    simulated = simulated_results["nan-skip"]
    assert [(s["step"], s["workers"]) for s in simulated["skipped"]] == [(2, [1])]
    for rank, results in enumerate(gloo_results):
        real = results["nan-skip"]
        assert real["skipped"] == simulated["skipped"]
        for param, stacked in zip(real["params"], simulated["params"]):
            assert torch.isfinite(param).all()
            assert_rank_matches(param, stacked, rank)
        # the worker left out was healed (every state, from the others' average) on its rank
        for states, stacked_states in zip(real["states"], simulated["states"]):
            for key, value in states.items():
                assert torch.isfinite(value).all()
                # second moments square the float32 bias's rounding: a looser relative tolerance
                assert_close(value, stacked_states[key][rank], rtol=1e-6, atol=1e-9)
        assert real["traffic"] == simulated["traffic"]
        assert "heal" in real["traffic"]["bytes_by_kind"]


if __name__ == "__main__":  # pragma: no cover - run the spawned comparison by hand
    sys.exit(pytest.main([__file__, "-q"]))
