"""Fragments: layers dealt into P balanced fragments due at staggered steps; one step's bytes fall
about P-fold while the bytes per period stay the same."""

from __future__ import annotations

import pytest
import torch

from mtdao import MTAdam
from mtdao.model import Llama, model_config
from mtdao.sync import (
    LocalUpdateSync,
    OuterOptimizerConfig,
    SimulatedWorkers,
    SyncPolicy,
    SyncRule,
    stack_workers,
    unified,
)
from mtdao.sync.fragments import FragmentSchedule, layer_of
from mtdao.sync.policy import with_state_period
from mtdao.sync.testing import RecordingCommunicator

K = 8


def micro_names_and_sizes() -> tuple[list[str], list[int]]:
    model = Llama(model_config("micro", 256, 16))
    named = list(model.named_parameters())
    return [n for n, _ in named], [p.numel() for _, p in named]


def test_layers_are_modules_and_fragments_balance_them():
    names, sizes = micro_names_and_sizes()
    assert layer_of("blocks.0.attn.qkv.weight") == "blocks.0.attn.qkv"
    assert layer_of("bias") == "bias"
    for fragments in (1, 2, 4, 8):
        schedule = FragmentSchedule(names, sizes, fragments)
        assert sum(schedule.sizes) == sum(sizes)
        # a layer is never split: its parameters share a fragment
        for name, fragment in zip(names, schedule.fragment_of):
            same_layer = [
                f for n, f in zip(names, schedule.fragment_of) if layer_of(n) == layer_of(name)
            ]
            assert set(same_layer) == {fragment}
        # largest first, to the lightest: within one largest layer of the ideal share
        assert max(schedule.sizes) <= sum(sizes) / fragments + max(sizes)
    assert max(FragmentSchedule(names, sizes, 4).sizes) / sum(sizes) < 0.3
    with pytest.raises(ValueError, match="^`sync_fragments` 17: the model has only 16 layers"):
        FragmentSchedule(names, sizes, 17)


def test_each_fragment_is_due_once_per_period_at_its_own_offset():
    schedule = FragmentSchedule(["a.w", "b.w", "c.w", "d.w"], [1, 1, 1, 1], 4)
    rule = SyncRule(K)
    due_steps = {
        index: [t for t in range(1, 3 * K + 1) if schedule.is_due(rule, index, t)]
        for index in range(4)
    }
    offsets = sorted(steps[0] % K for steps in due_steps.values())
    assert offsets == [0, 2, 4, 6]  # f * K / P
    assert all(len(steps) == 3 for steps in due_steps.values())
    one = FragmentSchedule(["a.w", "b.w"], [1, 1], 1)
    assert [t for t in range(1, 20) if one.is_due(rule, 0, t)] == [8, 16]  # P = 1: the rule
    assert not schedule.is_due(SyncRule(None), 0, K)


def train_micro(fragments: int, steps: int, policy=None, communicator=None):
    torch.manual_seed(0)
    workers = stack_workers(Llama(model_config("micro", 256, 16)), 2)
    named = list(workers.named_parameters())
    optimizer = MTAdam(
        [{"params": [p for _, p in named], "names": [n for n, _ in named]}],
        lr=1e-2,
        betas=(0.9,),
        omegas=(0.7,),
    )
    communicator = communicator or SimulatedWorkers(2)
    sync = LocalUpdateSync(optimizer, policy or unified(K), communicator, fragments=fragments)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        tokens = torch.randint(0, 256, (2, 2, 17), generator=gen)
        losses = workers.losses(
            lambda logits, targets: torch.nn.functional.cross_entropy(
                logits.reshape(-1, 256), targets.reshape(-1)
            ),
            tokens[..., :-1],
            tokens[..., 1:],
        )
        losses.sum().backward()
        sync.step()
        optimizer.zero_grad()
    return workers, sync


def bytes_per_step(sync) -> dict[int, int]:
    sent: dict[int, int] = {}
    for event in sync.events:
        sent[event.step] = sent.get(event.step, 0) + event.bytes
    return sent


@pytest.mark.parametrize("policy", [unified(K), with_state_period(unified(2 * K), K)])
def test_bytes_per_step_fall_p_fold_and_bytes_per_period_stay(policy, one_thread):
    steps = 2 * max(policy.params.period, K)
    _, whole = train_micro(1, steps, policy)
    _, split = train_micro(4, steps, policy)
    assert split.traffic.bytes == whole.traffic.bytes  # every fragment once per period
    assert split.traffic.bytes_by_kind == whole.traffic.bytes_by_kind
    peak_whole, peak_split = (
        max(bytes_per_step(whole).values()),
        max(bytes_per_step(split).values()),
    )
    # 4 fragments of the micro model's 16 layers: the largest holds 26% of the elements
    assert peak_whole / peak_split > 3.0
    assert len(bytes_per_step(split)) > len(bytes_per_step(whole))


def test_a_round_carries_a_fragment_and_its_states(one_thread):
    communicator = RecordingCommunicator(SimulatedWorkers(2))
    workers, sync = train_micro(2, K, communicator=communicator)
    names = [n for n, _ in workers.named_parameters()]
    fragment_of = dict(zip(names, sync.rounds.plan.fragments.fragment_of))
    calls = [c for c in communicator.calls if c.method == "average"]
    assert [e.step for e in sync.events] == [K // 2, K]
    for call, fragment in zip(calls, (1, 0)):
        params = [k for k in call.kinds if k == "params"]
        members = [n for n in names if fragment_of[n] == fragment]
        assert len(params) == len(members)
        assert call.kinds.count("exp_avg_0") == call.kinds.count("exp_avg_sq") == len(members)


def test_fragmented_diloco_moves_each_fragment_with_its_own_momentum(one_thread):
    """Streaming DiLoCo: a fragment's outer step moves its own anchors and momentum buffers only,
    and every worker takes the fragment's new anchor."""
    policy = SyncPolicy(params=SyncRule(K), outer=OuterOptimizerConfig(), name="diloco")
    _, half = train_micro(2, K // 2, policy)  # fragment 1 has synced, fragment 0 not yet
    fragment_of = half.rounds.plan.fragments.fragment_of
    for param, anchor, buffer, fragment in zip(
        half.params, half.rounds.anchors, half.rounds.outer.momentum_buffers, fragment_of
    ):
        assert bool(buffer.abs().sum() > 0) == (fragment == 1)
        if fragment == 1:
            assert torch.equal(param[0], anchor) and torch.equal(param[1], anchor)
        else:
            assert not torch.equal(param[0], anchor)
    _, whole = train_micro(2, K, policy)
    assert all(bool(b.abs().sum() > 0) for b in whole.rounds.outer.momentum_buffers)
