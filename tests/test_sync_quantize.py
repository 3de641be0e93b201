"""Quantized sync: codec error bounds per domain, NaN/inf kept visible, the quantized mean and its
byte count, pseudo-gradients with error feedback, and the engine's quantized rounds."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from mtdao import MTAdam
from mtdao.sync import LocalUpdateSync, SimulatedWorkers, unified
from mtdao.sync.codecs.compression import PseudoGradients, SyncCodecs
from mtdao.sync.codecs.quantize import Codec
from mtdao.sync.exchange import BlockLayout, pack, quantized_mean, simulated_mean, unpack
from mtdao.sync.transport import StackedTransport

BLOCK = 64


def random_blocks(seed: int, shape=(6, BLOCK), scale_spread: float = 3.0) -> torch.Tensor:
    """Signed values whose magnitude varies by blocks (as pseudo-gradients of layers do)."""
    gen = torch.Generator().manual_seed(seed)
    scales = torch.exp(torch.randn(shape[0], 1, generator=gen) * scale_spread)
    return torch.randn(shape, generator=gen) * scales


def second_moments(seed: int, decades: float = 12.0) -> torch.Tensor:
    """Positive values over ``decades`` decades within each block, some exact zeros."""
    gen = torch.Generator().manual_seed(seed)
    exponents = torch.rand(6, BLOCK, generator=gen) * decades - decades
    values = torch.pow(10.0, exponents)
    values[0, :5] = 0.0
    return values


# -- codecs ---------------------------------------------------------------------------------------


def test_signed_codecs_stay_within_their_rounding_bounds():
    x = random_blocks(0)
    absmax = x.abs().amax(dim=-1, keepdim=True)
    for dtype, bound in (("int8", absmax / 127 / 2), ("bf16", x.abs() * 2.0**-8)):
        error = (Codec(dtype, block=BLOCK).roundtrip(x.reshape(1, -1)).view_as(x) - x).abs()
        assert (error <= bound * (1 + 1e-6)).all(), dtype
    # fp8 (e4m3): 3 mantissa bits relative to the value, or the subnormal step of the block scale
    decoded = Codec("fp8", block=BLOCK).roundtrip(x.reshape(1, -1)).view_as(x)
    bound = torch.maximum(x.abs() * 2.0**-4, absmax / 448 * 2.0**-10)
    assert ((decoded - x).abs() <= bound * (1 + 1e-6)).all()


def test_second_moment_keeps_its_relative_precision_and_its_sign():
    decades = 12.0
    v = second_moments(1, decades)
    # int8 codes split the block's span of float32 bit patterns (about log2 of its range, in
    # units of 2^23) into 254 steps: half a step is at most log2(range) / 508 relative
    log_bound = decades * torch.log2(torch.tensor(10.0)).item() / 508
    # fp8 sends sqrt(v) with 3 mantissa bits: (1 + 2^-4)^2 - 1 relative, within its normal range
    # (sqrt(v) within 2^-6 .. 448 of the block scale: about 8.9 decades of v)
    cases = (("int8", v, log_bound), ("bf16", v, 2.0**-8), ("fp8", second_moments(1, 8.0), 0.13))
    for dtype, values, tolerance in cases:
        decoded = Codec(dtype, "positive", BLOCK).roundtrip(values.reshape(1, -1))
        decoded = decoded.view_as(values)
        positive = values > 0
        assert (decoded[~positive] == 0).all(), dtype  # exact zeros stay zero
        assert (decoded[positive] > 0).all(), dtype  # nothing positive becomes zero
        relative = (decoded[positive] - values[positive]).abs() / values[positive]
        assert relative.max() <= tolerance, (dtype, relative.max())
    # a linear int8 scale would zero every value below absmax / 254 (here most of them)
    linear = Codec("int8", "signed", BLOCK).roundtrip(v.reshape(1, -1)).view_as(v)
    assert (linear[v > 0] == 0).float().mean() > 0.5


def test_fp8_rounds_tiny_second_moments_up_never_to_zero():
    v = torch.full((1, BLOCK), 1e-30)
    v[0, 0] = 1.0  # the block's scale: 1e-30 is far below fp8's range under it
    decoded = Codec("fp8", "positive", BLOCK).roundtrip(v)
    assert (decoded > 0).all() and (decoded[0, 1:] >= v[0, 1:]).all()


@pytest.mark.parametrize("dtype", ["bf16", "fp8", "int8"])
@pytest.mark.parametrize("domain", ["signed", "positive"])
def test_non_finite_values_stay_visible(dtype, domain):
    codec = Codec(dtype, domain, BLOCK)
    for bad in (float("nan"), float("inf")):
        x = second_moments(2)
        x[3, 7] = bad
        decoded = codec.decode(codec.encode(x))
        assert not torch.isfinite(decoded[3, 7]), (bad, dtype, domain)
        assert torch.isfinite(decoded[2]).all()
    if domain == "positive" and dtype != "bf16":  # a negative second moment is corrupt too
        x = second_moments(2)
        x[1, 0] = -1.0
        assert torch.isnan(codec.decode(codec.encode(x))[1]).all()


def test_payload_sizes_count_codes_and_scales():
    assert Codec("int8", block=256).block_bytes == 256 + 4
    assert Codec("fp8", block=256).block_bytes == 256 + 4
    assert Codec("int8", "positive", 256).block_bytes == 256 + 8  # two int32 bounds
    assert Codec("bf16", block=256).block_bytes == 512
    for codec in (Codec("int8", block=BLOCK), Codec("int8", "positive", BLOCK)):
        assert codec.encode(torch.ones(3, BLOCK)).shape == (3, codec.block_bytes)
    with pytest.raises(ValueError, match="Invalid codec dtype"):
        Codec("fp32")


def test_sync_codecs_per_kind():
    codecs = SyncCodecs.parse(["int8", "second-moment=bf16"], error_feedback=True)
    assert codecs.codec("params") == Codec("int8", "signed")
    assert codecs.codec("exp_avg_0") == codecs.codec("momentum_buffer") == Codec("int8", "signed")
    assert codecs.codec("exp_avg_sq") == Codec("bf16", "positive")
    assert codecs.spec() == ("params=int8", "momenta=int8", "second-moment=bf16")
    assert SyncCodecs.parse(codecs.spec(), True) == codecs
    assert SyncCodecs.parse(["fp8"]).spec() == ("fp8",)
    assert SyncCodecs().codec("params") is None and not SyncCodecs().quantizes_anything
    with pytest.raises(ValueError, match="unknown kind 'grads'"):
        SyncCodecs.parse(["grads=int8"])
    with pytest.raises(ValueError, match="^`error_feedback` corrects quantized parameters"):
        SyncCodecs(error_feedback=True)


def test_fp8_is_refused_where_torch_cannot_compute_it(monkeypatch):
    to = torch.Tensor.to

    def no_float8(tensor, *args, **kwargs):
        if torch.float8_e4m3fn in args:
            raise RuntimeError("float8 is not supported on this device")
        return to(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", no_float8)
    params = [torch.nn.Parameter(torch.zeros(2, 3))]
    optimizer = MTAdam(params, lr=1e-2, betas=(0.9,), omegas=(1.0,))
    with pytest.raises(ValueError, match="^`sync_dtype` fp8: this torch build has no float8"):
        LocalUpdateSync(optimizer, unified(2), SimulatedWorkers(2), codecs=SyncCodecs(params="fp8"))


# -- the quantized mean ---------------------------------------------------------------------------


def test_block_layout_pads_to_whole_blocks_and_equal_chunks_and_counts_it():
    layout = BlockLayout((100, 64, 1), BLOCK, num_chunks=3)
    assert layout.tensor_blocks == [2, 1, 1] and layout.total_blocks == 6
    codec = Codec("int8", block=BLOCK)
    sizes = layout.kind_bytes(["params", "exp_avg_0", "params"], codec)
    assert sum(size for _, size in sizes) == 6 * codec.block_bytes
    rows = [torch.randn(2, n) for n in layout.numels]
    blocks = pack(rows, layout)
    assert blocks.shape == (2, 6, BLOCK)
    for row, back in zip(rows, unpack(blocks[1], layout)):
        assert torch.equal(row[1], back)


def test_quantized_mean_is_the_mean_of_what_each_worker_sent_requantized():
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randn(4, 300, generator=gen), torch.randn(4, 50, generator=gen) * 1e-3]
    codec = Codec("int8", block=BLOCK)
    means, layout = simulated_mean(rows, codec)
    for row, mean in zip(rows, means):
        sent = codec.roundtrip(row)  # each worker's payload as decoded
        expected = codec.roundtrip(sent.mean(dim=0, keepdim=True))[0]
        assert_close(mean, expected, rtol=0, atol=1e-7)
        # two int8 roundings: within a block step of the exact mean
        step = row.abs().max() / 127
        assert (mean - row.mean(dim=0)).abs().max() <= step
    excluded, _ = simulated_mean(rows, codec, excluded=[1])
    kept = codec.roundtrip(rows[0])[[0, 2, 3]].mean(dim=0, keepdim=True)
    assert_close(excluded[0], codec.roundtrip(kept)[0], rtol=0, atol=1e-7)


def test_several_codecs_share_one_exchange_and_average_as_alone():
    """A round's dense codecs travel side by side in one all-to-all and one all-gather: each
    codec's means are the bits it would average to in an exchange of its own."""
    gen = torch.Generator().manual_seed(5)
    params = [torch.randn(4, 700, generator=gen), torch.randn(4, 3, generator=gen)]
    moments = [torch.rand(4, 300, generator=gen) + 1e-6]
    codecs = [Codec("int4", block=BLOCK), Codec("int8", "positive", block=BLOCK)]
    transport = StackedTransport(4)
    together = quantized_mean(list(zip([params, moments], codecs)), transport, excluded=[2])
    assert together.collectives == 2
    means = together.wait()
    alone = [
        quantized_mean([(rows, codec)], transport, excluded=[2]).wait()
        for rows, codec in zip([params, moments], codecs)
    ]
    assert len(means) == 3
    for mean, expected in zip(means, alone[0] + alone[1]):
        assert torch.equal(mean, expected)


def test_error_feedback_carries_what_quantization_lost():
    """Over rounds, the decoded payloads plus the last residual sum to the true pseudo-gradients:
    no error is lost, only delayed."""
    codec = Codec("int8", block=BLOCK)
    feedback = PseudoGradients(codec, error_feedback=True, local_workers=2)
    anchor = torch.zeros(130)
    true_sum, sent_sum = torch.zeros(2, 130), torch.zeros(2, 130)
    gen = torch.Generator().manual_seed(4)
    for _ in range(5):
        value = torch.randn(2, 130, generator=gen) * torch.logspace(-4, 0, 130)
        payload = feedback.payload(0, anchor, value)
        true_sum += anchor - value
        sent_sum += codec.roundtrip(payload)
    assert_close(sent_sum + feedback.residuals[0], true_sum, rtol=0, atol=1e-5)
    plain = PseudoGradients(codec, error_feedback=False, local_workers=2)
    assert torch.equal(plain.payload(0, anchor, value), anchor - value) and not plain.residuals


# -- the engine's quantized rounds ----------------------------------------------------------------


def quadratic_run(codecs: SyncCodecs | None, steps: int = 8, num_workers: int = 4):
    """Four simulated workers pulled towards different targets; averaged every 4 steps."""
    gen = torch.Generator().manual_seed(5)
    targets = torch.randn(num_workers, 40, 30, generator=gen)
    weight = torch.nn.Parameter(torch.zeros(num_workers, 40, 30))
    bias = torch.nn.Parameter(torch.zeros(num_workers, 30))
    params = [weight, bias]
    optimizer = MTAdam(
        [{"params": params, "names": ["w", "b"]}], lr=0.05, betas=(0.9,), omegas=(0.9,)
    )
    communicator = SimulatedWorkers(num_workers)
    sync = LocalUpdateSync(optimizer, unified(4), communicator, codecs=codecs)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = (weight - targets).square().sum() + (bias - targets[:, 0]).square().sum()
        loss.backward()
        sync.step()
    return params, optimizer, sync


@pytest.mark.exact
@pytest.mark.parametrize("dtype", ["bf16", "fp8", "int8"])
def test_a_quantized_round_leaves_every_worker_identical_and_close_to_fp32(dtype):
    exact_params, exact_optimizer, exact = quadratic_run(None)
    params, optimizer, sync = quadratic_run(SyncCodecs.parse([dtype]))
    for tensor in [*params, *(v for p in params for v in optimizer.state[p].values())]:
        if tensor.dim() > 0:  # after a sync every worker holds the same bits
            assert all(torch.equal(tensor[0], tensor[w]) for w in range(1, 4))
    tolerance = {"bf16": 1e-2, "fp8": 6e-2, "int8": 2e-2}[dtype]
    for p, q in zip(params, exact_params):
        assert_close(p, q, rtol=0, atol=tolerance * q.abs().max().item())
    # the account counts the encoded payload (codes, scales, padding) of both rounds, per kind:
    # parameters and momenta share the signed codec (and its padding to 4 equal chunks, counted
    # with the parameters, which lead), the second moment has its own
    signed, positive = Codec(dtype), Codec(dtype, "positive")
    blocks = [5, 1]  # 1200 and 30 elements in blocks of 256
    by_kind = sync.traffic.bytes_by_kind
    assert by_kind["exp_avg_0"] == 2 * sum(blocks) * signed.block_bytes
    shared = BlockLayout((1200, 30, 1200, 30), signed.block, 4).total_blocks
    assert by_kind["params"] + by_kind["exp_avg_0"] == 2 * shared * signed.block_bytes
    assert by_kind["exp_avg_sq"] == 2 * 8 * positive.block_bytes  # 6 blocks padded to 8
    assert sum(by_kind.values()) == sync.traffic.bytes == sum(e.bytes for e in sync.events)
    assert exact.traffic.bytes / sync.traffic.bytes == pytest.approx(4 / signed.code_bytes, rel=0.3)


class CapturingWorkers(SimulatedWorkers):
    """Simulated workers that keep what each average call was given."""

    def __init__(self, num_workers: int) -> None:
        super().__init__(num_workers)
        self.sent: list[list[torch.Tensor]] = []

    def average(self, tensors, kinds, excluded=(), codecs=None):
        self.sent.append([t.clone() for t in tensors])
        return super().average(tensors, kinds, excluded, codecs)


def test_parameters_travel_as_pseudo_gradients_from_the_anchor():
    weight = torch.nn.Parameter(torch.randn(3, 20, generator=torch.Generator().manual_seed(6)))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    communicator = CapturingWorkers(3)
    sync = LocalUpdateSync(optimizer, unified(2), communicator, codecs=SyncCodecs(params="int8"))
    start = weight[0].detach().clone()  # every worker's after the initial broadcast
    offsets = torch.tensor([1.0, -2.0, 4.0]).view(3, 1) * torch.linspace(0.1, 1, 20)
    for _ in range(2):  # gradients that move worker w by offsets[w] / 2 per step
        weight.grad = -offsets * 5
        sync.step()
    (sent,) = communicator.sent
    assert_close(sent[0], -offsets, rtol=0, atol=1e-6)  # anchor - x, per worker
    codec = Codec("int8")
    mean = codec.roundtrip(codec.roundtrip(sent[0]).mean(dim=0, keepdim=True))[0]
    assert torch.equal(weight[1], start - mean) and torch.equal(
        sync.rounds.anchors[0], start - mean
    )
    assert_close(weight[0], start + offsets.mean(dim=0), rtol=0, atol=4 / 127 / 2 * 2)
