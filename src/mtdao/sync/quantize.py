"""Codecs for what crosses the link: bf16, fp8 and int8 payloads with blockwise scales.

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

SYNC_DTYPES = ("fp32", "bf16", "fp8", "int8")
DOMAINS = ("signed", "positive")
DEFAULT_BLOCK = 256
FP8_MAX = 448.0  # largest float8_e4m3fn
FP8_TINY = 2.0**-9  # its smallest subnormal
INT8_MAX = 127
LOG_LEVELS = 254  # int8 codes 1..255 for positive values; 0 is exact zero
INF_BITS = float(0x7F800000)  # the bit pattern of +inf, as a float


@dataclass(frozen=True)
class Codec:
    """How one kind of tensor is encoded: ``dtype`` on the wire, ``domain`` of its values."""

    dtype: str
    domain: str = "signed"
    block: int = DEFAULT_BLOCK

    def __post_init__(self) -> None:
        if self.dtype not in SYNC_DTYPES or self.dtype == "fp32":
            raise ValueError(f"Invalid codec dtype {self.dtype!r}; choose from bf16, fp8, int8")
        if self.domain not in DOMAINS:
            raise ValueError(f"Invalid codec domain {self.domain!r}; choose from {DOMAINS}")
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"Invalid block size {self.block!r} (must be an integer >= 1)")

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
        return self.block * self.code_bytes + self.scale_bytes

    def encode(self, blocks: Tensor) -> Tensor:
        """float32 ``[..., block]`` -> uint8 ``[..., block_bytes]``."""
        blocks = blocks.float()
        if self.dtype == "bf16":
            return _bytes(blocks.to(torch.bfloat16))
        if self.dtype == "fp8":
            return _encode_fp8(blocks, sqrt=self.domain == "positive")
        if self.domain == "positive":
            return _encode_log_int8(blocks)
        return _encode_int8(blocks)

    def decode(self, payload: Tensor) -> Tensor:
        """uint8 ``[..., block_bytes]`` -> float32 ``[..., block]``."""
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


def check_supported(codec: Codec | None, device: torch.device) -> None:
    """Refuse a codec this torch build or device cannot compute (fp8 needs float8_e4m3fn)."""
    if codec is None or codec.dtype != "fp8":
        return
    try:
        torch.ones(1, device=device).to(torch.float8_e4m3fn).float()
    except (AttributeError, RuntimeError, TypeError) as error:
        raise ValueError(
            f"--sync-dtype fp8: this torch build has no float8_e4m3fn on {device.type} ({error})"
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
    """Codes 1..255 spread between the block's smallest and largest positive bit pattern, taken
    as float32 (it rounds the pattern to 24 significant bits: 2^-16 relative, far below a code's
    step); 0 for zero. The bounds travel as two float32 patterns, NaN for a corrupt block."""
    bits = blocks.view(torch.int32).float()  # monotone in the value for values >= 0
    positive = blocks > 0
    lo = torch.where(positive, bits, torch.inf).amin(dim=-1, keepdim=True)
    hi = torch.where(positive, bits, 0.0).amax(dim=-1, keepdim=True)
    corrupt = ~(blocks >= 0).all(dim=-1, keepdim=True) | (hi >= INF_BITS)  # NaN, < 0, inf
    lo = torch.minimum(lo, hi)  # a block without positive values: lo = hi = 0
    step = _log_step(lo, hi)
    levels = ((bits - lo) / step).round_().clamp_(0, LOG_LEVELS)
    codes = torch.where(positive, levels + 1, 0.0).to(torch.uint8)
    bounds = torch.where(corrupt, torch.nan, torch.cat([lo, hi], dim=-1))
    return torch.cat([codes, _bytes(bounds)], dim=-1)


def _log_step(lo: Tensor, hi: Tensor) -> Tensor:
    step = (hi - lo) / LOG_LEVELS
    return torch.where(step > 0, step, torch.ones_like(step))


def _decode_log_int8(codes: Tensor, bound_bytes: Tensor) -> Tensor:
    bounds = _floats(bound_bytes)
    lo, hi = bounds[..., :1], bounds[..., 1:]
    bits = (codes.float() - 1).mul_(_log_step(lo, hi)).add_(lo).round_()
    values = torch.minimum(bits, hi).to(torch.int32).view(torch.float32)
    values = torch.where(codes > 0, values, 0.0)
    return torch.where(torch.isnan(lo), torch.nan, values)
