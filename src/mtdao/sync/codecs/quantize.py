"""Codecs for what crosses the link: bf16, fp8, int8, int4 and int2 payloads with blockwise
scales, and top-k sparsification (:mod:`.lowbit` and :mod:`.topk` hold the last three).

A codec turns blocks of float32 values, shape ``[..., block]``, into bytes, shape
``[..., block_bytes]`` (the codes of the block followed by its scale), and back. Every operation
is row-wise and exactly rounded (no ``exp``/``log``, whose vectorized and scalar kernels may differ
in the last bit), so a block decodes to the same bits whichever worker, process or batch of rows
computes it: this is what lets every worker end a quantized round with bit-identical values.

Two domains, chosen by what a tensor holds (docs/design.md, "Quantized rounds"):

* ``signed`` (parameters' pseudo-gradients, momenta): int8 and fp8 scale each block by its
  largest magnitude; bf16 needs no scale (it has float32's exponent range).
* ``positive`` (the second moment: positive, with a dynamic range of many decades). Relative
  precision is what matters, so int8 quantizes the float32 *bit pattern* uniformly between the
  block's smallest and largest positive value: the bit pattern of a positive float is a
  piecewise-linear approximation of its log2, so the codes are log-spaced and the relative error
  is bounded everywhere; exact zeros stay zero. fp8 sends ``sqrt(v)`` (half the dynamic range in
  a floating format). Neither rounds a positive value to zero, which would make Adam divide by
  ``eps``: fp8 rounds tiny values up to its smallest subnormal instead (smaller steps, never
  larger ones).

A NaN/inf survives encoding, so the engine's non-finite check still sees it after a quantized
round: bf16 keeps it as it is; int8 and fp8 decode its whole block (and, for the second moment, a
block holding a negative value) to NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mtdao.sync.codecs import lowbit, native_codecs, topk

SYNC_DTYPES = ("fp32", "bf16", "fp8", "int8", "int4", "int2", "top<k>")
"""``top<k>`` stands for any ``top8``, ``top4``, ...: k kept values per block."""
DOMAINS = ("signed", "positive")
DEFAULT_BLOCK = 256
FP8_MAX = 448.0  # largest float8_e4m3fn
FP8_TINY = 2.0**-9  # its smallest subnormal
INT8_MAX = 127
LOG_LEVELS = 254  # int8 codes 1..255 for positive values; 0 is exact zero


@dataclass(frozen=True)
class Codec:
    """How one kind of tensor is encoded: ``dtype`` on the wire, ``domain`` of its values."""

    dtype: str
    domain: str = "signed"
    block: int = DEFAULT_BLOCK

    def __post_init__(self) -> None:
        if not is_sync_dtype(self.dtype) or self.dtype == "fp32":
            raise ValueError(
                f"Invalid codec dtype {self.dtype!r}; choose from bf16, fp8, int8, int4, int2, "
                "top<k> (e.g. top8)"
            )
        if self.domain not in DOMAINS:
            raise ValueError(f"Invalid codec domain {self.domain!r}; choose from {DOMAINS}")
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"Invalid block size {self.block!r} (must be an integer >= 1)")
        if self.dtype in lowbit.LOW_BITS:
            lowbit.check_block(lowbit.LOW_BITS[self.dtype], self.block)
        if self.kept is not None:
            topk.check(self.kept, self.domain, self.block)

    @property
    def kept(self) -> int | None:
        """k of a top-k codec (values kept per block), None for a dense one."""
        return topk.parse_topk(self.dtype)

    @property
    def gathered(self) -> bool:
        """Whether every worker's payload is gathered whole rather than reduced by an owner
        (:mod:`mtdao.sync.exchange`): top-k, whose mean an owner could not encode to k values
        per block again without dropping most of it."""
        return self.kept is not None

    @property
    def name(self) -> str:
        return f"{self.dtype}/{self.domain}"

    @property
    def code_bytes(self) -> int:
        return 2 if self.dtype == "bf16" else 1

    @property
    def scale_bytes(self) -> int:
        """Per block: none for bf16, one float32 scale, or two int32 bounds (int8, positive)."""
        if self.dtype == "bf16":
            return 0
        return 8 if (self.dtype, self.domain) == ("int8", "positive") else 4

    @property
    def block_bytes(self) -> int:
        """Bytes of one encoded block: codes (and a top-k codec's positions) and scales."""
        if self.dtype in lowbit.LOW_BITS:
            return lowbit.block_bytes(lowbit.LOW_BITS[self.dtype], self.domain, self.block)
        if self.kept is not None:
            return topk.block_bytes(self.kept)
        return self.block * self.code_bytes + self.scale_bytes

    def encode(self, blocks: Tensor) -> Tensor:
        """float32 ``[..., block]`` -> uint8 ``[..., block_bytes]``: the CPU kernels where they
        serve (:mod:`.native_codecs`, the same bytes), else :meth:`encode_eager`."""
        blocks = blocks.float()
        if native_codecs.serves(self, blocks):
            return native_codecs.encode(self, blocks)
        return self.encode_eager(blocks)

    def decode(self, payload: Tensor) -> Tensor:
        """uint8 ``[..., block_bytes]`` -> float32 ``[..., block]``: the CPU kernels where they
        serve, else :meth:`decode_eager`."""
        if native_codecs.serves(self, payload):
            return native_codecs.decode(self, payload)
        return self.decode_eager(payload)

    def encode_eager(self, blocks: Tensor) -> Tensor:
        """:meth:`encode` in torch's operations, on any device (the kernels' reference)."""
        blocks = blocks.float()
        if self.dtype in lowbit.LOW_BITS:
            return lowbit.encode(blocks, lowbit.LOW_BITS[self.dtype], self.domain)
        if self.kept is not None:
            return topk.encode(blocks, self.kept)
        if self.dtype == "bf16":
            return _bytes(blocks.to(torch.bfloat16))
        if self.dtype == "fp8":
            return _encode_fp8(blocks, sqrt=self.domain == "positive")
        if self.domain == "positive":
            return _encode_log_int8(blocks)
        return _encode_int8(blocks)

    def decode_eager(self, payload: Tensor) -> Tensor:
        """:meth:`decode` in torch's operations, on any device."""
        if self.dtype in lowbit.LOW_BITS:
            return lowbit.decode(payload, lowbit.LOW_BITS[self.dtype], self.domain, self.block)
        if self.kept is not None:
            return topk.decode(payload, self.kept, self.block)
        if self.dtype == "bf16":
            return payload.contiguous().view(torch.bfloat16).float()
        codes, scale = payload[..., : self.block], payload[..., self.block :]
        if self.dtype == "fp8":
            values = codes.contiguous().view(torch.float8_e4m3fn).float() * _floats(scale)
            return values.square() if self.domain == "positive" else values
        if self.domain == "positive":
            return _decode_log_int8(codes, scale)
        return codes.contiguous().view(torch.int8).float() * _floats(scale)

    def roundtrip(self, rows: Tensor) -> Tensor:
        """Each row of ``rows`` ``[R, n]`` as the link delivers it: blocks of the row encoded and
        decoded, exactly as a round encodes that tensor."""
        count, n = rows.shape
        padded = (n + self.block - 1) // self.block * self.block
        blocks = torch.nn.functional.pad(rows.float(), (0, padded - n)).view(count, -1, self.block)
        return self.decode(self.encode(blocks)).view(count, padded)[:, :n]


def is_sync_dtype(dtype: str) -> bool:
    """A dtype the link can carry: one of SYNC_DTYPES, or ``top<k>`` with a whole k >= 1."""
    return dtype in SYNC_DTYPES[:-1] or topk.parse_topk(dtype) is not None


def check_supported(codec: Codec | None, device: torch.device) -> None:
    """Refuse a codec this torch build or device cannot compute (fp8 needs float8_e4m3fn)."""
    if codec is None or codec.dtype != "fp8":
        return
    try:
        torch.ones(1, device=device).to(torch.float8_e4m3fn).float()
    except (AttributeError, RuntimeError, TypeError) as error:
        raise ValueError(
            f"`sync_dtype` fp8: this torch build has no float8_e4m3fn on {device.type} ({error})"
        ) from None


# -- the encodings -------------------------------------------------------------------------------


def _bytes(tensor: Tensor) -> Tensor:
    """The raw bytes of ``tensor``'s last dimension, as uint8."""
    return tensor.contiguous().view(torch.uint8)


def _floats(scale_bytes: Tensor) -> Tensor:
    return scale_bytes.contiguous().view(torch.float32)


def _absmax_scale(blocks: Tensor, top: float) -> Tensor:
    """Per block ``absmax / top`` ``[..., 1]``; 1 for an all-zero block (any scale decodes 0),
    NaN/inf for a block holding NaN/inf (``amax`` propagates NaN), so the block decodes to
    NaN/inf whatever its codes."""
    absmax = blocks.abs().amax(dim=-1, keepdim=True)
    return torch.where(absmax == 0, torch.ones_like(absmax), absmax / top)


def _encode_int8(blocks: Tensor) -> Tensor:
    scale = _absmax_scale(blocks, INT8_MAX)
    codes = (blocks / scale).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return torch.cat([_bytes(codes), _bytes(scale)], dim=-1)


def _encode_fp8(blocks: Tensor, sqrt: bool) -> Tensor:
    if sqrt:  # a negative second moment is corrupt: NaN, like a non-finite value
        blocks = blocks.sqrt()
    scale = _absmax_scale(blocks, FP8_MAX)
    scaled = (blocks / scale).clamp_(-FP8_MAX, FP8_MAX)
    if sqrt:  # never round a positive value to zero
        scaled = torch.where(blocks > 0, scaled.clamp_min(FP8_TINY), scaled)
    codes = scaled.to(torch.float8_e4m3fn)
    return torch.cat([_bytes(codes), _bytes(scale)], dim=-1)


def _encode_log_int8(blocks: Tensor) -> Tensor:
    """Codes 1..255 log-spaced between the block's positive bounds, 0 for zero; the bounds travel
    as two float32 bit patterns, NaN for a corrupt block (:func:`mtdao.sync.codecs.lowbit.log_codes`)."""
    codes, bounds = lowbit.log_codes(blocks, LOG_LEVELS)
    return torch.cat([codes, _bytes(bounds)], dim=-1)


def _decode_log_int8(codes: Tensor, bound_bytes: Tensor) -> Tensor:
    return lowbit.log_values(codes, _floats(bound_bytes), LOG_LEVELS)
