"""The final round (``LocalUpdateSync.finish``): one model at the end of every run. A run that
ends on a step where a blocking round synced everything sends nothing and changes nothing; one
that ends mid-round, with rounds in flight, fragments, a codec or a longer state period ends with
every worker holding the same parameters and averaged states; ``attached()`` runs it on a clean
exit (or not, when asked), and processes of a gloo group end identical with delayed rounds."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from optimizer_cases import make_params, train

from mtdao import MTAdam
from mtdao.sync import (
    LocalUpdateSync,
    OuterOptimizerConfig,
    SimulatedWorkers,
    explicit,
    gradient_averaging,
    half_life_policy,
    unified,
)
from mtdao.sync.codecs.compression import SyncCodecs
from mtdao.sync.process_group import ProcessGroupWorkers
from mtdao.sync.testing import run_on_gloo

WORKERS, K = 3, 4
INT8 = SyncCodecs.parse(["int8"], error_feedback=True)


def make(policy, **engine):
    params = make_params(shapes=[(WORKERS, 5, 3), (WORKERS, 5)])  # layers "a" and "b"
    groups = [{"params": params, "names": ["a.weight", "b.weight"]}]
    optimizer = MTAdam(groups, lr=0.05, betas=(0.9,), omegas=(0.5,), beta2=0.95)
    sync = LocalUpdateSync(optimizer, policy, SimulatedWorkers(WORKERS), **engine)
    return params, optimizer, sync


def held(params, optimizer) -> list[torch.Tensor]:
    states = [v for p in params for k, v in sorted(optimizer.state[p].items()) if k != "step"]
    return [p.detach().clone() for p in params] + [s.clone() for s in states]


def workers_alike(tensors) -> bool:
    return all(torch.equal(t[w], t[0]) for t in tensors for w in range(WORKERS))


def test_a_run_that_ends_on_a_sync_step_sends_nothing_and_changes_nothing():
    params, optimizer, sync = make(unified(K))
    train(sync, params, 2 * K)
    before, sent, events = held(params, optimizer), sync.traffic.bytes, list(sync.events)
    assert sync.finish() is None
    assert all(torch.equal(a, b) for a, b in zip(before, held(params, optimizer)))
    assert sync.traffic.bytes == sent and sync.events == events


def test_gradient_averaging_has_no_final_round():
    params, optimizer, sync = make(gradient_averaging())
    train(sync, params, 3)
    sent = sync.traffic.bytes
    assert sync.finish() is None and sync.traffic.bytes == sent
    assert workers_alike(held(params, optimizer))


def test_a_run_that_ends_mid_round_ends_with_the_workers_average():
    params, optimizer, sync = make(unified(K))
    train(sync, params, K + 2)
    expected = [t.mean(dim=0) for t in held(params, optimizer)]
    assert not workers_alike(held(params, optimizer))
    event = sync.finish()
    assert event.final and event.step == K + 2 and event.bytes > 0
    assert event.kinds == ["params", "exp_avg_0", "exp_avg_sq"]
    after = held(params, optimizer)
    assert workers_alike(after)
    for value, mean in zip(after, expected):
        assert torch.equal(value[0], mean)
    assert sync.finish() is None  # once is enough


def test_a_longer_state_period_is_averaged_at_the_end_the_parameters_left_alone():
    # the parameters sync every K steps, exp_avg_0 (decay 0.95) every 3K, exp_avg_sq every 4K
    params, optimizer, sync = make(half_life_policy(K, {"exp_avg_0": 0.95, "exp_avg_sq": 0.97}))
    train(sync, params, 2 * K)
    parameters = [p.detach().clone() for p in params]
    event = sync.finish()
    assert event.kinds == ["exp_avg_0", "exp_avg_sq"]
    assert all(torch.equal(p.detach(), q) for p, q in zip(params, parameters))
    assert workers_alike(held(params, optimizer))


def test_under_an_outer_step_the_final_round_is_the_plain_average_and_keeps_the_anchor():
    params, optimizer, sync = make(explicit(K, outer=OuterOptimizerConfig()))
    train(sync, params, K + 2)
    means = [p.detach().mean(dim=0) for p in params]
    anchors = [a.clone() for a in sync.rounds.anchors]
    momentum = [m.clone() for m in sync.rounds.outer.momentum_buffers]
    assert sync.finish().kinds == ["params"]  # DiLoCo's states stay local
    for p, mean in zip(params, means):
        assert all(torch.equal(p.detach()[w], mean) for w in range(WORKERS))
    assert all(torch.equal(a, b) for a, b in zip(sync.rounds.anchors, anchors))
    assert all(torch.equal(a, b) for a, b in zip(sync.rounds.outer.momentum_buffers, momentum))


@pytest.mark.parametrize(
    "policy, options",
    [
        (lambda: unified(K), dict(delay=2, fragments=2, codecs=INT8)),
        (lambda: explicit(K, outer=OuterOptimizerConfig()), dict(delay=1, fragments=2)),
    ],
    ids=["delay-fragments-int8-ef", "diloco-delay-fragments"],
)
def test_rounds_in_flight_land_first_then_every_worker_holds_the_same_model(policy, options):
    params, optimizer, sync = make(policy(), **options)
    train(sync, params, 2 * K + 1)
    assert len(sync.rounds.pending) >= 1
    sync.finish()
    assert len(sync.rounds.pending) == 0
    averaged = held(params, optimizer)
    if sync.rounds.outer is not None:  # DiLoCo keeps its states local
        averaged = averaged[: len(params)]
    assert workers_alike(averaged)
    assert sync.events[-1].final and not any(e.final for e in sync.events[:-1])


@pytest.mark.parametrize("final_round", [True, False])
def test_attached_runs_the_final_round_when_the_block_ends(final_round):
    params, optimizer, sync = make(unified(K), delay=1)
    with sync.attached(final_round=final_round):
        for step in range(2 * K - 1):  # the round opened at the last step is in flight
            for p in params:
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step))
            optimizer.step()
    assert workers_alike(held(params, optimizer)) == final_round
    assert (len(sync.rounds.pending) == 0) == final_round


def test_an_error_in_the_block_skips_the_final_round():
    params, optimizer, sync = make(unified(K))
    with pytest.raises(KeyError), sync.attached():
        train(sync, params, K + 1)
        raise KeyError("the loop failed")
    assert not sync.events or not sync.events[-1].final


def gloo_delayed_run() -> list[torch.Tensor]:
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optimizer = MTAdam(model.parameters(), lr=0.05, betas=(0.9,), omegas=(0.5,))
    sync = LocalUpdateSync(
        optimizer, unified(K), ProcessGroupWorkers(), delay=2, fragments=2, codecs=INT8
    )
    with sync.attached():
        for _ in range(2 * K + 3):  # ends with a round in flight
            inputs = torch.randn(8, 4, generator=gen)
            model(inputs).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    states = [v for p in model.parameters() for k, v in optimizer.state[p].items() if k != "step"]
    return [p.detach() for p in model.parameters()] + states


@pytest.mark.slow
def test_processes_of_a_gloo_group_with_delayed_rounds_end_identical(tmp_path):
    ranks = run_on_gloo(gloo_delayed_run, 3, tmp_path, preload=[__name__], timeout_s=120)
    for other in ranks[1:]:
        assert all(torch.equal(a, b) for a, b in zip(ranks[0], other))
