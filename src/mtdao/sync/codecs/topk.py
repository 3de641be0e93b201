"""Top-k sparsification per block: the k largest magnitudes of each block, as int8 values with
one float32 scale, and their positions as one byte each.

A dtype ``top<k>`` (``top8``: 8 of every 256 values) keeps, per block, the k entries of largest
magnitude: per block k int8 codes, k uint8 indices (so blocks are at most 256 long) and the
scale, ``2k + 4`` bytes. Why a fixed k, why the exchange gathers every payload whole
(:mod:`mtdao.sync.exchange`) and why the second moment is refused: docs/design.md ("Below 8 bits").

The kept positions are sorted, so equal sets give equal bytes; decoding scatters the values into
zeros, exactly rounded, the same on every worker. A NaN/inf makes the block's scale NaN/inf, so
its kept values decode to NaN/inf and the engine's non-finite check still sees it.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

INT8_MAX = 127
MAX_BLOCK = 256  # positions travel as one byte
_TOPK = re.compile(r"top([1-9][0-9]*)")


def parse_topk(dtype: str) -> int | None:
    """k of a ``top<k>`` dtype, or None for any other dtype."""
    match = _TOPK.fullmatch(dtype)
    return int(match.group(1)) if match else None


def check(k: int, domain: str, block: int) -> None:
    if domain == "positive":
        raise ValueError(
            f"top{k} zeroes what it does not keep; the second moment must stay positive: "
            "give it int2, int4, int8, fp8 or bf16"
        )
    if block > MAX_BLOCK:
        raise ValueError(f"top{k} needs blocks of at most {MAX_BLOCK} (one byte per position)")
    if k > block:
        raise ValueError(f"top{k} keeps more values than a block of {block} holds")


def block_bytes(k: int) -> int:
    return 2 * k + 4


def encode(blocks: Tensor, k: int) -> Tensor:
    """float32 ``[..., block]`` -> uint8 ``[..., 2k + 4]``: codes, positions, scale."""
    blocks = blocks.float()
    positions = blocks.abs().nan_to_num(nan=torch.inf).topk(k, dim=-1).indices.sort(-1).values
    kept = blocks.gather(-1, positions)
    absmax = kept.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(absmax == 0, torch.ones_like(absmax), absmax / INT8_MAX)
    codes = (kept / scale).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return torch.cat(
        [
            codes.view(torch.uint8),
            positions.to(torch.uint8),
            scale.contiguous().view(torch.uint8),
        ],
        dim=-1,
    )


def decode(payload: Tensor, k: int, block: int) -> Tensor:
    """uint8 ``[..., 2k + 4]`` -> float32 ``[..., block]``, zero where nothing was kept."""
    codes = payload[..., :k].contiguous().view(torch.int8).float()
    positions = payload[..., k : 2 * k].long()
    scale = payload[..., 2 * k :].contiguous().view(torch.float32)
    values = torch.zeros(*payload.shape[:-1], block, device=payload.device)
    return values.scatter_(-1, positions, codes * scale)
