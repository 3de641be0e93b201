"""--outer-step nesterov: a local method's parameter average becomes DiLoCo's outer step, while its
optimizer states are still averaged as its policy says."""

from __future__ import annotations

import pytest
import torch

from mtdao.train.config import TrainConfig, resolve
from mtdao.train.trainer import build_run, train_step

pytestmark = pytest.mark.usefixtures("one_thread")

K = 3


def run_for(tmp_path, corpus_dir, name: str, **overrides):
    config = TrainConfig.of(
        model="tiny",
        method="mtdao",
        workers=2,
        sync_period=K,
        batch_size=2,
        seq_len=32,
        steps=2 * K,
        eval_tokens=64,
        data=str(corpus_dir),
        out=str(tmp_path / name),
        device="cpu",
        progress=False,
        **overrides,
    )
    return build_run(resolve(config))


def global_params(run) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in run.workers.global_model().named_parameters()}


def test_policy_keeps_the_state_periods_and_adds_the_outer_step(tmp_path, corpus_dir):
    plain = run_for(tmp_path, corpus_dir, "plain")
    outer = run_for(tmp_path, corpus_dir, "outer", outer_step="nesterov", outer_lr=0.5)
    assert plain.sync.policy.outer is None
    assert outer.sync.policy.outer.lr == 0.5 and outer.sync.policy.outer.nesterov
    assert (
        outer.sync.policy.periods()
        == plain.sync.policy.periods()
        == {"params": K, "other states": K}
    )


def test_first_sync_is_a_nesterov_step_on_the_average(tmp_path, corpus_dir):
    """Same seeds, so both runs are identical up to the first sync. There, with a zero outer
    momentum, x = x0 - lr (1 + mu) (x0 - mean(x)); the states are the plain average in both."""
    plain = run_for(tmp_path, corpus_dir, "plain")
    outer = run_for(tmp_path, corpus_dir, "outer", outer_step="nesterov")
    start = global_params(plain)
    for _ in range(K):
        train_step(plain)
        train_step(outer)
    average, stepped = global_params(plain), global_params(outer)
    factor = 0.7 * (1 + 0.9)  # default outer lr and momentum
    for name, x0 in start.items():
        expected = x0 - factor * (x0 - average[name])
        torch.testing.assert_close(stepped[name], expected, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(stepped[name], average[name])
    for p_plain, p_outer in zip(plain.sync.params, outer.sync.params):
        for key, value in plain.optimizer.state[p_plain].items():
            torch.testing.assert_close(outer.optimizer.state[p_outer][key], value)
        assert torch.equal(p_outer[0], p_outer[1])  # every worker restarts from the outer step


def test_the_outer_momentum_schedule_and_radial_averaging_reach_the_engine(tmp_path, corpus_dir):
    run = run_for(
        tmp_path,
        corpus_dir,
        "scheduled",
        outer_step="nesterov",
        outer_momentum_warmup=1,
        outer_momentum_start=0.3,
        outer_momentum_decay=0.5,
        outer_momentum_final=0.6,
        radial_directional=("momenta", "params"),
    )
    outer = run.sync.policy.outer
    # a run of 2 K = 6 steps decays over its last half: from step 3 to step 6
    assert (outer.momentum_decay_from, outer.momentum_decay_to) == (3, 2 * K)
    assert [outer.momentum_at(step, K) for step in (K, 2 * K)] == [0.3, 0.6]
    assert run.sync.rounds.plan.radial.groups == ("params", "momenta")
    plain = run_for(tmp_path, corpus_dir, "plain", outer_step="nesterov")
    assert plain.sync.policy.outer.momentum_at(K, K) == 0.9
    assert plain.sync.rounds.plan.radial.groups == ()
