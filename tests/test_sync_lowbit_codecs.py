"""int4, int2 and top-k codecs: rounding bounds per domain, honest byte counts, decodes that do not
depend on who computes them, error feedback that loses nothing, bad names refused."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from mtdao import MTAdam
from mtdao.flags import as_flags
from mtdao.sync import LocalUpdateSync, SimulatedWorkers
from mtdao.sync.codecs.compression import PseudoGradients, SyncCodecs
from mtdao.sync.codecs.quantize import Codec
from mtdao.sync.exchange import simulated_mean
from mtdao.sync.policy import unified, with_state_period
from mtdao.train.config import TrainConfig, resolve
from tests.test_sync_quantize import quadratic_run, random_blocks, second_moments

BLOCK = 64
NEW_SIGNED = ["int4", "int2", "top8", "top1"]


def test_signed_low_bit_codes_are_within_half_a_unit_of_the_value():
    x = random_blocks(0)
    x[0, :3] = 0.0
    absmax = x.abs().amax(dim=-1, keepdim=True)
    for dtype, top in (("int4", 7), ("int2", 1)):
        codec = Codec(dtype, block=BLOCK)
        decoded = codec.roundtrip(x.reshape(1, -1)).view_as(x)
        unit = absmax / top
        assert ((decoded - x).abs() <= unit / 2 * (1 + 1e-6)).all(), dtype
        # the levels are the integer multiples -top .. top of the unit; zero stays zero
        multiples = decoded / unit
        assert_close(multiples, multiples.round(), rtol=0, atol=1e-4)
        assert (multiples.round().abs() <= top).all() and (decoded[0, :3] == 0).all()
        # a value below half a unit falls to zero rather than being raised to a level
        assert (decoded[x.abs() < unit / 2 * (1 - 1e-6)] == 0).all()


def test_low_bit_second_moment_stays_positive_within_its_log_step():
    v = second_moments(1, decades=12.0)
    positive = v > 0
    for dtype, steps in (("int8", 254), ("int4", 14), ("int2", 2)):
        decoded = Codec(dtype, "positive", BLOCK).roundtrip(v.reshape(1, -1)).view_as(v)
        assert (decoded[~positive] == 0).all() and (decoded[positive] > 0).all(), dtype
        for row, back in zip(v, decoded):
            kept = row > 0
            span = math.log2(row[kept].max() / row[kept].min())
            # half a step of the bit pattern's span, plus twice the piecewise-linear log2's error
            bound = span / (2 * steps) + 2 * 0.0861
            assert (back[kept] / row[kept]).log2().abs().max() <= bound + 1e-5, dtype


def test_top_k_keeps_the_largest_magnitudes_of_each_block():
    x = random_blocks(2)
    for k in (1, 8, BLOCK):
        decoded = Codec(f"top{k}", block=BLOCK).roundtrip(x.reshape(1, -1)).view_as(x)
        threshold = x.abs().topk(k, dim=-1).values[:, -1:]
        kept = x.abs() >= threshold
        assert (kept.sum(dim=-1) == k).all() and (decoded[~kept] == 0).all()
        # the kept values to int8 rounding of the block's largest
        half_step = (x.abs().amax(dim=-1, keepdim=True) / 127 / 2).expand_as(x)
        assert ((decoded - x)[kept].abs() <= half_step[kept] * (1 + 1e-6)).all()


def test_payload_bytes_count_codes_positions_and_scales():
    assert Codec("int4", block=256).block_bytes == 128 + 4
    assert Codec("int2", block=256).block_bytes == 64 + 4
    assert Codec("int4", "positive", 256).block_bytes == 128 + 8  # two bounds
    assert Codec("int2", "positive", 256).block_bytes == 64 + 8
    assert Codec("top8", block=256).block_bytes == 8 + 8 + 4  # values, positions, scale
    for codec in (*(Codec(d, block=BLOCK) for d in NEW_SIGNED), Codec("int2", "positive", BLOCK)):
        assert codec.encode(torch.randn(3, 5, BLOCK)).shape == (3, 5, codec.block_bytes)
    # the engine's account counts what the codec sends: two rounds of 4 workers' 1200 + 30 values
    _, _, sync = quadratic_run(
        SyncCodecs.parse(["params=top8", "momenta=int2", "second-moment=int4"])
    )
    by_kind = sync.traffic.bytes_by_kind
    # top-k is gathered whole, unpadded, and counted at M/2 = 2 x its payload (the others reduced
    # by owners, padded to M equal chunks)
    assert by_kind["params"] == 2 * 6 * Codec("top8").block_bytes * 2
    assert by_kind["exp_avg_0"] == 2 * 8 * Codec("int2").block_bytes
    assert by_kind["exp_avg_sq"] == 2 * 8 * Codec("int4", "positive").block_bytes


@pytest.mark.exact
@pytest.mark.parametrize("dtype", NEW_SIGNED + ["int4+", "int2+"])
def test_a_block_decodes_the_same_alone_or_among_other_workers_rows(dtype):
    """What makes every worker end a round bit-identical: a block's bytes and values do not depend
    on which rows are encoded with it (a process encodes its own, the simulator all at once)."""
    domain = "positive" if dtype.endswith("+") else "signed"
    codec = Codec(dtype.rstrip("+"), domain, BLOCK)
    x = second_moments(3) if domain == "positive" else random_blocks(3)
    together = codec.encode(x.view(2, 3, BLOCK))
    for row in range(2):
        alone = codec.encode(x.view(2, 3, BLOCK)[row])
        assert torch.equal(alone, together[row])
        assert torch.equal(codec.decode(alone), codec.decode(together)[row])


@pytest.mark.exact
@pytest.mark.parametrize("dtype", ["int4", "int2", "top8"])
def test_a_low_bit_round_leaves_every_worker_identical(dtype):
    momenta = "int2" if dtype == "top8" else dtype
    codecs = SyncCodecs.parse([f"params={dtype}", f"momenta={momenta}", "second-moment=int4"])
    params, optimizer, _ = quadratic_run(codecs)
    for tensor in [*params, *(v for p in params for v in optimizer.state[p].values())]:
        if tensor.dim() > 0:
            assert all(torch.equal(tensor[0], tensor[w]) for w in range(1, 4))
    rows = [torch.randn(4, 300, generator=torch.Generator().manual_seed(9))]
    codec = Codec(dtype, block=BLOCK)
    (mean,), _ = simulated_mean(rows, codec)
    sent = codec.roundtrip(rows[0])
    if codec.gathered:  # gathered whole: the mean of what each sent, summed in worker order
        expected = (sent[0] + sent[1] + sent[2] + sent[3]) / 4
    else:  # reduced by owners: the mean of what each sent, encoded again
        expected = codec.roundtrip(sent.mean(dim=0, keepdim=True))[0]
    assert torch.equal(mean, expected)


@pytest.mark.parametrize("dtype", ["int4", "int2", "top8", "int4+", "int2+"])
def test_non_finite_values_stay_visible(dtype):
    domain = "positive" if dtype.endswith("+") else "signed"
    codec = Codec(dtype.rstrip("+"), domain, BLOCK)
    for bad in (float("nan"), float("inf")):
        x = second_moments(2)
        x[3, 7] = bad
        decoded = codec.decode(codec.encode(x))
        assert not torch.isfinite(decoded[3]).all(), (bad, dtype)
        assert torch.isfinite(decoded[2]).all()


@pytest.mark.parametrize("dtype", ["int2", "top8"])
def test_error_feedback_delays_what_is_lost_and_never_lets_it_pile_up(dtype):
    """A constant pseudo-gradient sent 40 times: with error feedback what arrived is the true sum
    less the last residual, and the residual stays bounded; without it the loss grows each round."""
    codec = Codec(dtype, block=BLOCK)
    gen = torch.Generator().manual_seed(4)
    pseudo_gradient = torch.randn(2, 130, generator=gen) * torch.logspace(-3, 0, 130)
    anchor = torch.zeros(130)
    feedback = PseudoGradients(codec, error_feedback=True, local_workers=2)
    sent, residual_norms = torch.zeros(2, 130), []
    for _ in range(40):
        sent += codec.roundtrip(feedback.payload(0, anchor, anchor - pseudo_gradient))
        residual_norms.append(feedback.residuals[0].norm().item())
    assert_close(sent + feedback.residuals[0], 40 * pseudo_gradient, rtol=0, atol=1e-4)
    assert max(residual_norms[20:]) <= 2 * max(residual_norms[:20])  # bounded, not growing
    plain_loss = 40 * (pseudo_gradient - codec.roundtrip(pseudo_gradient)).norm()
    assert (sent - 40 * pseudo_gradient).norm() < plain_loss / 4


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (["int3"], "unknown dtype 'int3' for params"),
        (["params=top0"], "unknown dtype 'top0'"),
        (["params=top-1"], "unknown dtype 'top-1'"),
        (["params=top300"], "top300 keeps more values than a block of 256 holds"),
        (["top8"], "^`sync_dtype` second-moment: top8 zeroes what it does not keep"),
        (["second-moment=top4"], "the second moment must stay positive"),
    ],
)
def test_bad_codec_names_are_refused_with_the_problem_named(spec, message):
    with pytest.raises(ValueError, match=message):
        SyncCodecs.parse(spec)
    with pytest.raises(ValueError, match=as_flags(message)):  # the harness names the flag
        resolve(TrainConfig.of(method="mtdao", sync_dtype=tuple(spec)))


def test_low_bit_codecs_refuse_blocks_they_cannot_pack():
    with pytest.raises(ValueError, match="multiple of 2"):
        Codec("int4", block=63)
    with pytest.raises(ValueError, match="at most 256"):
        Codec("top8", block=512)
    with pytest.raises(ValueError, match="Invalid codec dtype 'int16'"):
        Codec("int16")


def test_per_kind_low_bit_codecs_round_trip_through_the_config():
    config = resolve(
        TrainConfig.of(
            method="mtdao",
            sync_dtype=("params=top8", "momenta=int2", "second-moment=int4"),
            error_feedback=True,
        )
    )
    codecs = SyncCodecs.parse(config.sync.sync_dtype, config.sync.error_feedback)
    assert codecs.codec("params") == Codec("top8")
    assert codecs.codec("exp_avg_0") == Codec("int2")
    assert codecs.codec("exp_avg_sq") == Codec("int4", "positive")


def test_low_bit_codecs_combine_with_longer_state_periods():
    """Parameters every 4 steps as top-k, the states every 8 (DES-LOC-style) at 2 and 4 bits:
    each kind is sent as often as its period says, in its own codec's bytes, and after a round of
    all three every worker holds the same bits."""
    gen = torch.Generator().manual_seed(5)
    targets = torch.randn(4, 40, 30, generator=gen)
    weight = torch.nn.Parameter(torch.zeros(4, 40, 30))
    optimizer = MTAdam([weight], lr=0.05, betas=(0.9,), omegas=(0.9,))
    codecs = SyncCodecs.parse(["params=top8", "momenta=int2", "second-moment=int4"], True)
    policy = with_state_period(unified(4), 8)
    sync = LocalUpdateSync(optimizer, policy, SimulatedWorkers(4), codecs=codecs)
    for _ in range(16):
        optimizer.zero_grad()
        (weight - targets).square().sum().backward()
        sync.step()
    by_kind = sync.traffic.bytes_by_kind
    blocks = 8  # 1200 values: 5 blocks of 256, padded to 4 equal chunks (top-k: gathered whole,
    # unpadded, counted at M/2 = 2 x its payload)
    assert by_kind["params"] == 4 * 5 * Codec("top8").block_bytes * 2  # steps 4, 8, 12, 16
    assert by_kind["exp_avg_0"] == 2 * blocks * Codec("int2").block_bytes  # steps 8, 16
    assert by_kind["exp_avg_sq"] == 2 * blocks * Codec("int4", "positive").block_bytes
    for tensor in (weight, *(v for v in optimizer.state[weight].values() if v.dim() > 0)):
        assert all(torch.equal(tensor[0], tensor[w]) for w in range(1, 4))
