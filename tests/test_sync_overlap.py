"""Delayed (overlapped) rounds: sent at t, applied at t + D, the local progress kept by the merge.

The merge's specification (docs/design.md, mtdao/sync/overlap.py) is pinned here as exact
equivalences (a delayed round equals an immediate one where the gradients do not depend on it),
invariants (mean kept, second moment positive, healed workers) and a checkpoint taken mid-flight.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor
from torch.testing import assert_close

from mtdao import MTAdam
from mtdao.cli import main
from mtdao.sync import LocalUpdateSync, SimulatedWorkers, SyncCodecs, gradient_averaging, unified
from mtdao.sync.overlap import merge
from mtdao.sync.policy import with_state_period
from mtdao.sync.round_options import check_round_options
from mtdao.sync.testing import RecordingCommunicator

M, SHAPE = 4, (5, 3)
EXACT = dict(rtol=1e-12, atol=1e-12)


def gradient(step: int) -> Tensor:
    """Worker w's gradient at ``step``: fixed data, not a function of the parameters."""
    gen = torch.Generator().manual_seed(step)
    return torch.randn(M, *SHAPE, generator=gen, dtype=torch.float64)


def run(optimizer_fn, steps: int, delay: int, policy=None, **options):
    """Workers that start apart (no initial broadcast) and follow :func:`gradient`."""
    gen = torch.Generator().manual_seed(99)
    param = torch.nn.Parameter(torch.randn(M, *SHAPE, generator=gen, dtype=torch.float64))
    optimizer = optimizer_fn([param])
    sync = LocalUpdateSync(
        optimizer,
        policy or unified(4),
        SimulatedWorkers(M),
        delay=delay,
        broadcast_initial=False,
        **options,
    )
    for step in range(1, steps + 1):
        param.grad = gradient(step)
        sync.step()
    return param, optimizer, sync


def mt_adam(params, lr=0.0):
    return MTAdam(params, lr=lr, betas=(0.9,), omegas=(0.5,), beta2=0.99, weight_decay=0.0)


def test_delay_zero_is_the_blocking_round():
    plain = run(lambda p: mt_adam(p, lr=1e-2), 9, delay=0)
    again = run(lambda p: mt_adam(p, lr=1e-2), 9, delay=0, fragments=1)
    assert torch.equal(plain[0], again[0])
    for key, value in plain[1].state[plain[0]].items():
        assert torch.equal(value, again[1].state[again[0]][key])


def synced_on_time(optimizer_fn, steps: int, sync_at: int):
    """The same workers without an engine: everything averaged at once after step ``sync_at``."""
    gen = torch.Generator().manual_seed(99)
    param = torch.nn.Parameter(torch.randn(M, *SHAPE, generator=gen, dtype=torch.float64))
    optimizer = optimizer_fn([param])
    for step in range(1, steps + 1):
        param.grad = gradient(step)
        optimizer.step()
        if step == sync_at:
            with torch.no_grad():
                for tensor in [param, *optimizer.state[param].values()]:
                    if tensor.dim() > 0:
                        tensor.copy_(tensor.mean(dim=0).expand_as(tensor))
    return param, optimizer


def test_delayed_states_equal_states_synced_on_time():
    """lr = 0: gradients do not depend on the sync, so an EMA state merged at t (correction
    weighted by beta^D) is the state averaged when its snapshot was taken, at t - D, and updated
    since. K = 4, D = 3: the round of step 4 is sent at step 1."""
    on_time, delayed = synced_on_time(mt_adam, 7, sync_at=1), run(mt_adam, 7, delay=3)
    for key in ("exp_avg_0", "exp_avg_sq"):
        expected = on_time[1].state[on_time[0]][key]
        assert_close(delayed[1].state[delayed[0]][key], expected, **EXACT)
    # a plain delta merge (beta^D left out) would not be: the old snapshot would still decay
    undecayed = run(mt_adam, 7, delay=3, state_decays={})
    got = undecayed[1].state[undecayed[0]]["exp_avg_0"]
    assert not torch.allclose(got, on_time[1].state[on_time[0]]["exp_avg_0"])


def test_delayed_parameters_equal_parameters_synced_on_time():
    """SGD on gradients that ignore the parameters: the global value plus each worker's local
    change since the snapshot is where an average at the snapshot would have led."""
    on_time = synced_on_time(lambda p: torch.optim.SGD(p, lr=0.1), 7, sync_at=1)[0]
    delayed, _, sync = run(lambda p: torch.optim.SGD(p, lr=0.1), 7, delay=3)
    assert_close(delayed, on_time, **EXACT)
    # sent 3 steps before steps 4 and 8, each recorded when it commits (where it lands)
    assert [e.step for e in sync.events] == [1]
    sync.rounds.flush()
    assert [e.step for e in sync.events] == [1, 5]


def test_a_delayed_round_is_sent_d_steps_before_its_step_and_applied_at_it():
    param = torch.nn.Parameter(torch.arange(8.0).view(M, 2))
    communicator = RecordingCommunicator(SimulatedWorkers(M))
    sync = LocalUpdateSync(
        torch.optim.SGD([param], lr=1.0),
        unified(3),
        communicator,
        delay=1,
        broadcast_initial=False,
    )
    before = param.detach().clone()
    param.grad = torch.zeros_like(param)
    sync.step()
    assert not communicator.average_kinds()
    sync.step()  # step 2: the round of step 3 is sent, nothing is written
    assert torch.equal(param, before) and len(communicator.average_kinds()) == 1
    assert not sync.events and sync.traffic.bytes == 8  # sent; recorded when it commits
    param.grad = torch.ones_like(param)  # local progress during the delay: -1 everywhere
    sync.step()  # step 3: the average of the snapshot lands, with the progress kept
    assert torch.equal(param, (before.mean(dim=0) - 1).expand_as(param))
    assert [e.step for e in sync.events] == [2]


def test_merge_keeps_the_mean_and_the_second_moment_positive():
    gen = torch.Generator().manual_seed(7)
    for trial in range(20):
        snapshot = torch.rand(M, 64, generator=gen, dtype=torch.float64) ** 8 * 1e3
        decay = 0.9**trial  # c: from no decay to almost all of the snapshot forgotten
        fresh = torch.rand(M, 64, generator=gen, dtype=torch.float64) ** 8
        current = decay * snapshot + fresh  # an EMA of squares D steps on
        average = snapshot.mean(dim=0)
        merged = current.clone()
        merge(merged, average, snapshot, decay, positive=True)
        assert (merged >= 0).all() and (merged >= decay * average).all()
        assert_close(merged.mean(dim=0), current.mean(dim=0), rtol=1e-12, atol=1e-9)
        assert_close(merged, fresh + decay * average, rtol=1e-12, atol=1e-9)
    # signed tensors: the spread left is the local progress, the mean unchanged
    snapshot, progress = torch.randn(M, 10, generator=gen), torch.randn(M, 10, generator=gen)
    tensor = snapshot + progress
    merge(tensor, snapshot.mean(dim=0), snapshot, 1.0)
    assert_close(tensor, snapshot.mean(dim=0) + progress)
    # a healed worker (left out of the round) takes the average itself
    tensor = snapshot + progress
    healed = torch.tensor([False, True, False, False]).view(M, 1)
    merge(tensor, snapshot.mean(dim=0), snapshot, 1.0, healed=healed)
    assert torch.equal(tensor[1], snapshot.mean(dim=0))


def test_a_worker_left_out_of_a_delayed_round_takes_the_average():
    param = torch.nn.Parameter(torch.arange(8.0).view(M, 2))
    sync = LocalUpdateSync(
        torch.optim.SGD([param], lr=1.0),
        unified(3),
        SimulatedWorkers(M),
        delay=1,
        on_non_finite="skip",
        broadcast_initial=False,
    )
    param.grad = torch.zeros_like(param)
    sync.step()
    param.grad[2] = float("nan")  # worker 2 diverges on the step whose round is sent
    sync.step()
    param.grad = torch.ones_like(param)
    sync.step()
    others = param.detach()[[0, 1, 3]]  # the average of their snapshots, plus their -1
    assert torch.isfinite(param).all() and torch.equal(others[0], others[2])
    assert_close(param[2], others[0] + 1)  # worker 2: that average, without its own progress
    assert sync.skipped_rounds[0]["workers"] == [2]


def test_a_checkpoint_with_a_round_in_flight_resumes_exactly():
    def fresh():
        gen = torch.Generator().manual_seed(99)
        param = torch.nn.Parameter(torch.randn(M, *SHAPE, generator=gen, dtype=torch.float64))
        optimizer = mt_adam([param], lr=1e-2)
        sync = LocalUpdateSync(optimizer, unified(4), SimulatedWorkers(M), delay=3)
        return param, optimizer, sync

    def steps(param, sync, first, last):
        for step in range(first, last + 1):
            param.grad = gradient(step) * (1 + param.detach())  # depends on the parameters
            sync.step()

    param, optimizer, sync = fresh()
    steps(param, sync, 1, 6)  # the round of step 8 is in flight since step 5
    assert len(sync.rounds.pending) == 1
    saved = copy.deepcopy((param.detach(), optimizer.state_dict(), sync.state_dict()))
    steps(param, sync, 7, 12)
    resumed, resumed_optimizer, resumed_sync = fresh()
    with torch.no_grad():
        resumed.copy_(saved[0])
    resumed_optimizer.load_state_dict(saved[1])
    resumed_sync.load_state_dict(saved[2])
    steps(resumed, resumed_sync, 7, 12)
    assert torch.equal(resumed, param)
    assert resumed_sync.state_dict()["events"] == sync.state_dict()["events"]


def test_flush_applies_what_is_in_flight():
    param, _, sync = run(lambda p: torch.optim.SGD(p, lr=0.1), 6, delay=3)
    assert len(sync.rounds.pending) == 1 and not torch.equal(param[0], param[1])
    sync.rounds.flush()  # the round sent at step 5 lands now, on top of step 6's progress
    assert len(sync.rounds.pending) == 0
    progress = -0.1 * gradient(6)
    assert_close(param - progress, (param - progress).mean(dim=0).expand_as(param), **EXACT)


def test_a_delay_must_land_before_the_next_round():
    assert check_round_options(unified(32), delay=31) == 31
    with pytest.raises(ValueError, match="^`sync_delay` 32 must be below every sync period"):
        check_round_options(unified(32), delay=32)
    with pytest.raises(ValueError, match=r"the shortest is 16"):
        check_round_options(with_state_period(unified(32), 16), delay=16)
    with pytest.raises(ValueError, match="gradient averaging"):
        check_round_options(gradient_averaging(), delay=1)
    with pytest.raises(ValueError, match="Invalid sync delay"):
        check_round_options(unified(4), delay=-1)


@pytest.mark.parametrize(
    "options, flag",
    [
        (dict(fragments=2), "`sync_fragments`"),
        (dict(codecs=SyncCodecs.parse(("int8",))), "`sync_dtype`"),
        (dict(delay=1, fragments=2), "`sync_delay`"),
    ],
)
def test_gradient_averaging_refuses_every_round_option_by_its_setting(options, flag):
    """The engine refuses with the config's rule and message (mtdao.sync.round_options)."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2, 3))], lr=0.1)
    with pytest.raises(
        ValueError, match=f"^{flag}: policy 'gradient-averaging' averages gradients"
    ):
        LocalUpdateSync(optimizer, gradient_averaging(), SimulatedWorkers(2), **options)
    with pytest.raises(ValueError, match="^`sync_fragments` must be a positive integer, got 0$"):
        check_round_options(unified(4), fragments=0)


@pytest.mark.parametrize(
    "extra, match",
    [
        (("--sync-delay", "4"), "--sync-delay 4 must be below --sync-period 4"),
        (("--sync-delay", "2", "--method", "ddp"), "--sync-delay: ddp averages gradients"),
        (("--sync-fragments", "99"), "--sync-fragments 99: the model has only 30 layers"),
        (("--sync-dtype", "int3"), "--sync-dtype: unknown dtype 'int3' for params"),
        (("--sync-dtype", "moments=int8"), "--sync-dtype: unknown kind 'moments'"),
        (("--error-feedback",), "--error-feedback corrects quantized parameters"),
    ],
)
def test_bad_sync_options_are_one_line(tmp_path, corpus_dir, capsys, extra, match):
    args = ["train", "--model", "tiny", "--workers", "2", "--sync-period", "4", "--steps", "4"]
    args += ["--data", str(corpus_dir), "--out", str(tmp_path / "run"), "--no-progress", *extra]
    assert main(args) == 2
    err = capsys.readouterr().err
    said = ("data: ", "warning: ")  # what was loaded, and a short run's note
    lines = [line for line in err.strip().splitlines() if not line.startswith(said)]
    assert len(lines) == 1 and lines[0].startswith("mtdao train: error: " + match), err
