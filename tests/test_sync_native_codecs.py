"""The codecs' CPU kernels against torch's codecs: the same bytes, the same decoded bits."""

from importlib import resources

import pytest
import torch

from mtdao.sync.codecs import native_codecs
from mtdao.sync.codecs.quantize import Codec

pytestmark = pytest.mark.usefixtures("one_thread")

DENSE = [(d, domain) for d in ("int8", "int4", "int2") for domain in ("signed", "positive")]
TOPK = [("top1", "signed"), ("top8", "signed"), ("top32", "signed")]


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if not native_codecs.usable(Codec):
        pytest.fail("the C++ codec kernels did not build or disagree with torch's codecs")


def random_blocks(domain: str, rows: int, block: int, seed: int) -> torch.Tensor:
    """Blocks whose scales span float32's range, a tenth of their values exact zeros."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, block, generator=generator)
    values *= torch.logspace(-35, 35, rows).unsqueeze(1)
    values[torch.rand(rows, block, generator=generator) < 0.1] = 0.0
    return values.square() if domain == "positive" else values


def assert_same_bits(native: torch.Tensor, eager: torch.Tensor) -> None:
    assert torch.equal(native.view(torch.int32), eager.view(torch.int32))


@pytest.mark.exact
@pytest.mark.parametrize(("dtype", "domain"), DENSE + TOPK)
@pytest.mark.parametrize("block", [32, 256])
def test_the_kernels_give_torchs_bytes_and_bits(dtype, domain, block):
    codec = Codec(dtype, domain, block)
    blocks = random_blocks(domain, 500, block, seed=block)
    native, eager = codec.encode(blocks), codec.encode_eager(blocks)
    assert native.shape == eager.shape == (500, codec.block_bytes)
    assert torch.equal(native, eager)
    assert_same_bits(codec.decode(native), codec.decode_eager(native))


@pytest.mark.exact
def test_every_branch_matches_and_corrupt_blocks_stay_non_finite():
    native_codecs.check_against_eager(Codec)  # raises on any difference
    # and it does look: a kernel that flips one code is caught
    probes = native_codecs.probe_blocks()["signed"]
    codec = Codec("int4", "signed")
    wrong = codec.encode(probes).clone()
    wrong[10, 0] ^= 1
    with pytest.raises(AssertionError, match="other bytes in blocks"):
        native_codecs._compare(codec, probes, wrong, codec.encode_eager(probes))


def test_leading_dimensions_and_views_are_kept():
    codec = Codec("int2", "positive")
    blocks = random_blocks("positive", 24, 256, seed=3).view(2, 3, 4, 256)
    payload = codec.encode(blocks)
    assert payload.shape == (2, 3, 4, codec.block_bytes)
    strided = payload.transpose(0, 1)  # not contiguous: decoded as its values, not its storage
    assert_same_bits(codec.decode(strided), codec.decode_eager(strided))


def test_threads_do_not_change_the_bytes():
    codec = Codec("int8", "positive")
    blocks = random_blocks("positive", 4096, 256, seed=4)
    one = codec.encode(blocks)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.equal(codec.encode(blocks), one)
    finally:
        torch.set_num_threads(threads)


def test_topk_keeps_the_lowest_positions_among_ties():
    codec = Codec("top2", "signed", 8)
    blocks = torch.tensor([[0.5, -3.0, 3.0, 3.0, 0.0, 0.0, 0.0, 0.0], [0.0] * 8])
    payload = codec.encode(blocks)
    assert payload[0, 2:4].tolist() == [1, 2]  # -3 and the first 3
    assert payload[1, 2:4].tolist() == [0, 1]  # an all-zero block
    decoded = codec.decode(payload)
    assert decoded[0].tolist() == [0.0, -3.0, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert decoded[1].tolist() == [0.0] * 8


def test_a_topk_position_beyond_its_block_is_refused():
    codec = Codec("top2", "signed", 8)
    payload = codec.encode(torch.arange(8.0).unsqueeze(0))
    payload[0, 3] = 9
    with pytest.raises(RuntimeError, match="beyond its block of 8: a corrupt payload"):
        codec.decode(payload)


def test_without_the_kernels_torchs_codecs_serve(monkeypatch):
    monkeypatch.setattr(native_codecs, "native_library", lambda kernel: False)
    native_codecs.forget()
    try:
        codec = Codec("int4", "signed")
        assert not native_codecs.serves(codec, torch.zeros(1, 256))
        blocks = random_blocks("signed", 8, 256, seed=5)
        assert torch.equal(codec.encode(blocks), codec.encode_eager(blocks))
    finally:
        native_codecs.forget()


def test_kernels_that_disagree_warn_once_and_torchs_codecs_serve(monkeypatch):
    def flipped(codec, blocks):
        return codec.encode_eager(blocks).bitwise_xor(1)

    monkeypatch.setattr(native_codecs, "encode", flipped)
    native_codecs.forget()
    try:
        with pytest.warns(RuntimeWarning, match=r"the C\+\+ codec kernels disagree with torch"):
            assert not native_codecs.usable(Codec)
        assert not native_codecs.serves(Codec("int8"), torch.zeros(1, 256))
    finally:
        native_codecs.forget()


def test_bf16_fp8_and_other_devices_take_torchs_codecs():
    assert not native_codecs.serves(Codec("bf16"), torch.zeros(1, 256))
    assert not native_codecs.serves(Codec("fp8"), torch.zeros(1, 256))
    assert not native_codecs.serves(Codec("int8"), torch.zeros(1, 256, device="meta"))


def test_the_source_ships_with_the_package():
    source = resources.files(native_codecs.CODECS.package).joinpath(
        "csrc", native_codecs.CODECS.source
    )
    assert "TORCH_LIBRARY(mtdao_codecs" in source.read_text()
