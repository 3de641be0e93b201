"""The link codecs' CPU kernels (``csrc/codecs.cpp``): int8, int4 and int2 in both domains and
top-k, one pass over a block for its scale and one for its codes, where torch's operations take
ten or more passes over the whole payload.

:class:`mtdao.sync.codecs.quantize.Codec` takes them for float32 blocks on the CPU and its eager (torch)
codecs anywhere else (a GPU, bf16 and fp8, a machine that cannot build the kernels). Both paths
give the same bytes and the same decoded bits, so workers on different paths still end a round
alike; that is checked once per process, on blocks that take every branch (zeros, -0.0, ties,
subnormals, NaN and inf, huge and tiny scales), before the kernels serve anything. If the check
fails, one warning says so and the eager codecs serve instead.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
from torch import Tensor

from mtdao.native_build import Kernel, native_library

CODECS = Kernel(
    "mtdao.sync.codecs",
    "codecs.cpp",
    "mtdao_codecs",
    "the C++ codec kernels",
    "quantized rounds take torch's codecs, which are slower on the CPU",
    "about 10-20 s",
)
BITS = {"int8": 8, "int4": 4, "int2": 2}

# None until the first request builds, loads and checks the kernels.
_usable: bool | None = None


def serves(codec, tensor: Tensor) -> bool:
    """Whether the kernels encode / decode ``codec`` for ``tensor`` (blocks or a payload)."""
    if tensor.device.type != "cpu" or not (codec.dtype in BITS or codec.kept is not None):
        return False
    return usable(type(codec))


def usable(codec_type) -> bool:
    """Whether the kernels are built, loaded and give the bytes and bits of ``codec_type``'s
    eager codecs (:class:`mtdao.sync.codecs.quantize.Codec`, handed in: it is the caller)."""
    global _usable
    if _usable is None:
        _usable = native_library(CODECS) and _passes_check(codec_type)
    return _usable


def encode(codec, blocks: Tensor) -> Tensor:
    """float32 ``[..., block]`` -> uint8 ``[..., block_bytes]``, as :meth:`Codec.encode_eager`."""
    rows = blocks.reshape(-1, codec.block).contiguous()
    ops = torch.ops.mtdao_codecs
    if codec.kept is not None:
        payload = ops.encode_topk(rows, codec.kept)
    elif codec.domain == "positive":
        payload = ops.encode_log(rows, BITS[codec.dtype])
    else:
        payload = ops.encode_signed(rows, BITS[codec.dtype])
    return payload.view(*blocks.shape[:-1], codec.block_bytes)


def decode(codec, payload: Tensor) -> Tensor:
    """uint8 ``[..., block_bytes]`` -> float32 ``[..., block]``, as :meth:`Codec.decode_eager`."""
    rows = payload.reshape(-1, codec.block_bytes).contiguous()
    ops = torch.ops.mtdao_codecs
    if codec.kept is not None:
        blocks = ops.decode_topk(rows, codec.kept, codec.block)
    elif codec.domain == "positive":
        blocks = ops.decode_log(rows, BITS[codec.dtype], codec.block)
    else:
        blocks = ops.decode_signed(rows, BITS[codec.dtype], codec.block)
    return blocks.view(*payload.shape[:-1], codec.block)


def probe_blocks(block: int = 256, seed: int = 0) -> dict[str, Tensor]:
    """Blocks for each domain that take every branch of the codecs, sound ones and corrupt ones
    (``[rows, block]``); top-k's positions are tie-free (its ties may be broken either way)."""
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=generator)

    scales = torch.logspace(-30, 30, 16).unsqueeze(1)  # a float32 scale from 1e-30 to 1e30
    signed = torch.cat([draw(16, block) * scales, draw(8, block)])
    signed[0] = 0.0  # an all-zero block: its own scale
    signed[1, ::2] = -0.0
    signed[2, :8] = signed[2, 8:16]  # equal values in one block
    signed[3, 5] = 2.0**-140  # a subnormal
    signed[4, 7] = float("nan")
    signed[5, 9] = float("inf")
    signed[6, :] = 1.5  # every value the block's largest
    positive = torch.cat([draw(16, block).square() * scales, draw(8, block).exp()])
    positive[0] = 0.0
    positive[1, ::3] = 0.0
    positive[2, ::2] = -0.0
    positive[3, 1:] = 0.0  # one positive value
    positive[4, 7] = float("nan")
    positive[5, 9] = float("inf")
    positive[6, 3] = -1e-9  # a negative second moment is corrupt
    positive[7, :] = 2.0**-140  # subnormals only
    positive[8, 0] = 3e38  # a bit pattern that rounds up to inf's
    distinct = draw(16, block) * scales  # top-k: no ties to break
    distinct[4, 7] = float("nan")
    distinct[5, 9] = float("inf")
    return {"signed": signed, "positive": positive, "topk": distinct}


def _passes_check(codec_type) -> bool:
    try:
        check_against_eager(codec_type)
    except Exception as error:
        warnings.warn(
            f"mtdao: the C++ codec kernels disagree with torch's codecs ({type(error).__name__}: "
            f"{str(error).strip().splitlines()[0][:200]}); quantized rounds take torch's codecs.",
            RuntimeWarning,
            stacklevel=4,
        )
        return False
    return True


def check_against_eager(codec_type, block: int = 256) -> None:
    """Raise unless every kernel gives the eager codec's bytes and decoded bits on the probe
    blocks (a corrupt block's codes may differ: it decodes to non-finite values either way)."""
    probes = probe_blocks(block)
    for dtype in [*BITS, "top8", "top1"]:
        domains = ("signed",) if dtype.startswith("top") else ("signed", "positive")
        for domain in domains:
            codec = codec_type(dtype, domain, block)
            blocks = probes["topk" if dtype.startswith("top") else domain]
            _compare(codec, blocks, encode(codec, blocks), codec.encode_eager(blocks))


def _compare(codec, blocks: Tensor, native: Tensor, eager: Tensor) -> None:
    sound = torch.isfinite(blocks).all(dim=-1)
    if codec.domain == "positive":
        sound &= ~(blocks < 0).any(dim=-1)
    if not torch.equal(native[sound], eager[sound]):
        rows = ((native != eager).any(dim=-1) & sound).nonzero().flatten().tolist()
        raise AssertionError(f"{codec.name}: other bytes in blocks {rows[:8]}")
    for payload in (native, eager):
        got, expected = decode(codec, payload), codec.decode_eager(payload)
        if not torch.equal(got[sound].view(torch.int32), expected[sound].view(torch.int32)):
            raise AssertionError(f"{codec.name}: other decoded bits")
        if torch.isfinite(got[~sound]).all(dim=-1).any():
            raise AssertionError(f"{codec.name}: a corrupt block decoded to finite values")


@contextlib.contextmanager
def eager_only() -> Iterator[None]:
    """Torch's codecs serve inside (a benchmark compares the two paths in one process)."""
    global _usable
    usable_before = _usable
    _usable = False
    try:
        yield
    finally:
        _usable = usable_before


def forget() -> None:
    """Decide again at the next request (tests use it with a simulated failure)."""
    global _usable
    _usable = None
