"""4-bit and 2-bit blockwise codecs, codes packed several to a byte.

Two domains, as for int8 (:mod:`mtdao.sync.codecs.quantize`):

* ``signed``: int8's scheme with fewer levels: the integers ``-Q .. Q`` (``Q = 2^(bits-1) - 1``:
  7 for 4 bits, 1 for 2 bits, a ternary code) times ``unit = absmax / Q``, so a value is at most
  ``unit / 2`` from its level and zero stays zero (why a zero level matters: docs/design.md,
  "Below 8 bits"). The unit travels as one float32 per block (0 for an all-zero block, which so
  decodes to zeros).
* ``positive`` (the second moment): the float32 bit pattern (a piecewise-linear log2) quantized
  between the block's smallest and largest positive value, as int8 does, with ``2^bits - 2``
  steps: code 0 is exact zero, codes 1 .. 2^bits - 1 are log-spaced. Nothing positive becomes
  zero; with 2 bits a block keeps three values, its bounds and their geometric middle.

Every operation is row-wise and exactly rounded (divisions, products, rounding, integer shifts),
so a block decodes to the same bits wherever it is decoded. A NaN/inf in a block decodes the
block to NaN/inf (its unit or bounds are NaN/inf), so the engine's non-finite check still sees it.
"""

from __future__ import annotations

import torch
from torch import Tensor

LOW_BITS = {"int4": 4, "int2": 2}
INF_BITS = float(0x7F800000)  # the bit pattern of +inf, as a float


def block_bytes(bits: int, domain: str, block: int) -> int:
    """Packed codes, then one float32 unit (signed) or two float32 bounds (positive)."""
    return block * bits // 8 + (8 if domain == "positive" else 4)


def check_block(bits: int, block: int) -> None:
    if block % (8 // bits):
        raise ValueError(
            f"Invalid block size {block} for {bits}-bit codes: it must be a multiple of {8 // bits}"
        )


def encode(blocks: Tensor, bits: int, domain: str) -> Tensor:
    """float32 ``[..., block]`` -> uint8 ``[..., block_bytes]``."""
    if domain == "positive":
        codes, scale = log_codes(blocks, 2**bits - 2)
    else:
        codes, scale = _signed_codes(blocks, 2 ** (bits - 1) - 1)
    return torch.cat([_pack(codes, bits), scale.contiguous().view(torch.uint8)], dim=-1)


def decode(payload: Tensor, bits: int, domain: str, block: int) -> Tensor:
    """uint8 ``[..., block_bytes]`` -> float32 ``[..., block]``."""
    packed_bytes = block * bits // 8
    codes = _unpack(payload[..., :packed_bytes], bits)
    scale = payload[..., packed_bytes:].contiguous().view(torch.float32)
    if domain == "positive":
        return log_values(codes, scale, 2**bits - 2)
    top = 2 ** (bits - 1) - 1
    return (codes.float() - top) * scale


# -- signed: integer multiples of a unit ----------------------------------------------------------


def _signed_codes(blocks: Tensor, top: int) -> tuple[Tensor, Tensor]:
    """Code ``c`` in ``0 .. 2 top`` stands for ``(c - top) * unit``."""
    absmax = blocks.abs().amax(dim=-1, keepdim=True)
    unit = absmax / top
    divisor = torch.where(absmax == 0, torch.ones_like(unit), unit)
    codes = (blocks / divisor).round_().clamp_(-top, top).add_(top)
    return codes.to(torch.uint8), unit  # unit 0 (all-zero block) decodes every code to 0


# -- positive: log-spaced codes from the bit pattern ----------------------------------------------


def log_codes(blocks: Tensor, steps: int) -> tuple[Tensor, Tensor]:
    """Codes 1 .. steps + 1 spread between the block's smallest and largest positive bit pattern
    (taken as float32, which rounds it to 24 significant bits: far below a code's step), 0 for
    zero; the bounds ``[..., 2]`` as float32 patterns, NaN for a corrupt block (NaN, < 0, inf)."""
    blocks = blocks.float()
    bits = blocks.view(torch.int32).float()  # monotone in the value for values >= 0
    positive = blocks > 0
    lo = torch.where(positive, bits, torch.inf).amin(dim=-1, keepdim=True)
    # in a sound block every pattern but -0.0's (negative) is >= 0: the plain max is the largest
    # positive one; a corrupt block's bounds are NaN whatever they are
    hi = bits.amax(dim=-1, keepdim=True).clamp_min_(0.0)
    corrupt = ~(blocks.amin(dim=-1, keepdim=True) >= 0) | (hi >= INF_BITS)  # amin keeps NaN
    lo = torch.minimum(lo, hi)  # a block without positive values: lo = hi = 0
    step = _log_step(lo, hi, steps)
    codes = bits.sub_(lo).div_(step).round_().clamp_(0, steps).add_(1).masked_fill_(~positive, 0)
    bounds = torch.where(corrupt, torch.nan, torch.cat([lo, hi], dim=-1))
    return codes.to(torch.uint8), bounds


def log_values(codes: Tensor, bounds: Tensor, steps: int) -> Tensor:
    lo, hi = bounds[..., :1], bounds[..., 1:]
    bits = (codes.float() - 1).mul_(_log_step(lo, hi, steps)).add_(lo).round_()
    values = torch.minimum(bits, hi, out=bits).to(torch.int32).view(torch.float32)
    return values.masked_fill_(codes == 0, 0.0).masked_fill_(torch.isnan(lo), torch.nan)


def _log_step(lo: Tensor, hi: Tensor, steps: int) -> Tensor:
    step = (hi - lo) / steps
    return torch.where(step > 0, step, torch.ones_like(step))


# -- packing --------------------------------------------------------------------------------------


def _pack(codes: Tensor, bits: int) -> Tensor:
    """uint8 codes below 2^bits ``[..., n]`` -> ``[..., n * bits / 8]``, code i of a byte in its
    bits ``bits * i`` and up (byte-wide shifts and ors: no wider integers needed)."""
    grouped = codes.view(*codes.shape[:-1], -1, 8 // bits)
    packed = grouped[..., 0].clone()
    for i in range(1, 8 // bits):
        packed |= grouped[..., i] << (bits * i)
    return packed


def _unpack(packed: Tensor, bits: int) -> Tensor:
    parts = [(packed >> (bits * i)) & (2**bits - 1) for i in range(8 // bits)]
    return torch.stack(parts, dim=-1).reshape(*packed.shape[:-1], -1)
