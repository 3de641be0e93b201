"""A small Llama-style decoder-only transformer, written to run under ``torch.func.vmap``.

The simulator trains M workers at once by stacking every parameter along a leading worker
dimension and calling ``vmap(functional_call(model, ...))``. That rules out anything vmap or
autograd-through-vmap cannot follow: in-place writes to parameters or buffers in ``forward``,
``.item()``, and Python branches that depend on tensor values. Shapes (``T`` below) are fine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


def default_ffn_hidden(d_model: int) -> int:
    """SwiGLU hidden width: 8/3 * d_model (same parameter count as a 4x GELU MLP), rounded to 32."""
    return max(32, 32 * round(8 * d_model / 3 / 32))


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    """Number of token ids the embedding and the LM head cover."""
    d_model: int
    """Width of the residual stream."""
    n_layers: int
    """Number of transformer blocks."""
    n_heads: int
    """Attention heads per block; ``d_model / n_heads`` must be an even integer (RoPE pairs)."""
    max_seq_len: int
    """Longest sequence the RoPE tables are precomputed for."""
    d_ff: int | None = None
    """SwiGLU hidden width; None picks 8/3 * d_model rounded to a multiple of 32."""
    rope_theta: float = 10000.0
    """RoPE base: larger values rotate slower, i.e. reach further."""
    norm_eps: float = 1e-6
    """Epsilon inside RMSNorm."""
    tie_embeddings: bool = True
    """Use the token embedding matrix as the LM head (no separate output matrix)."""
    init_std: float = 0.02
    """Std of the normal init of every matrix; residual projections get it / sqrt(2 * n_layers)."""

    def __post_init__(self) -> None:
        for field in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{field} must be a positive int, got {value!r}")
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"ModelConfig.d_model={self.d_model} is not divisible by n_heads={self.n_heads}"
            )
        if (self.d_model // self.n_heads) % 2 != 0:
            raise ValueError(
                f"ModelConfig.n_heads={self.n_heads} gives an odd head dim "
                f"{self.d_model // self.n_heads}; RoPE needs it even"
            )
        if self.d_ff is not None and (not isinstance(self.d_ff, int) or self.d_ff <= 0):
            raise ValueError(f"ModelConfig.d_ff must be a positive int or None, got {self.d_ff!r}")
        for field in ("rope_theta", "norm_eps", "init_std"):
            value = getattr(self, field)
            if not value > 0:
                raise ValueError(f"ModelConfig.{field} must be positive, got {value!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def ffn_hidden(self) -> int:
        """The SwiGLU hidden width actually used (``d_ff`` or its default)."""
        return self.d_ff if self.d_ff is not None else default_ffn_hidden(self.d_model)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position * frequency, each [max_seq_len, head_dim // 2]."""
    freqs = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), freqs)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs (x[2i], x[2i+1]) of x [B, H, T, D] by the angle of their position.

    The rotation is computed in the tables' float32 and returned in x's dtype: under bf16 autocast
    q and k would otherwise come out float32 beside a bf16 v, which attention refuses."""
    x_even, x_odd = x[..., 0::2], x[..., 1::2]
    rotated_even = x_even * cos - x_odd * sin
    rotated_odd = x_even * sin + x_odd * cos
    return torch.stack((rotated_even, rotated_odd), dim=-1).flatten(-2).to(x.dtype)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=False)
        self.out_proj = nn.Linear(config.d_model, config.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Simulated workers (vmapped) run this as one call over all of them:
        # mtdao.model.vmapped_attention.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(B, T, C))


class SwiGLU(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.d_model, config.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(config.d_model, config.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(config.ffn_hidden, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = CausalSelfAttention(config)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.final_norm = RMSNorm(config.d_model, config.norm_eps)
        # Tied: the head reads self.embed.weight in forward, so there is one tensor to count,
        # stack and synchronise instead of two aliases of it.
        self.lm_head = (
            None
            if config.tie_embeddings
            else nn.Linear(config.d_model, config.vocab_size, bias=False)
        )
        # Non-persistent: derived from the config, so they stay out of checkpoints and out of
        # the parameter dict that functional_call swaps in.
        cos, sin = rope_tables(config.head_dim, config.max_seq_len, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        std = self.config.init_std
        # GPT-2: each block adds two residual branches, so scale their output projections down
        # to keep the residual stream's variance roughly independent of depth.
        residual_std = std / math.sqrt(2 * self.config.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                is_residual_out = name.endswith(("out_proj", "down_proj"))
                nn.init.normal_(module.weight, 0.0, residual_std if is_residual_out else std)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, vocab_size] for tokens [B, T]; position t only sees tokens <= t."""
        T = tokens.shape[-1]
        if self.config.max_seq_len < T:
            raise ValueError(f"sequence length {T} exceeds max_seq_len={self.config.max_seq_len}")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        x = self.final_norm(x)
        head = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(x, head)

    def num_parameters(self) -> int:
        """Trainable parameter count; a tied embedding counts once."""
        return sum(p.numel() for p in self.parameters())
