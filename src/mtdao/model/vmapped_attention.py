"""Attention while the workers are vmapped: every worker's attention in one kernel call.

torch has no vmap batching rule for its fused CPU attention kernel, so under vmap it loops over
the workers, slicing each one's query, key and value out with ``select``. The loop's backward is
what grows faster than the work: the gradient of each worker's slice is a zero tensor the size of
all workers' with that slice written in (``select``'s backward), summed into the whole, so every
attention call moves O(M^2) memory: at M = 256 on the micro model most of a training step.

Attention treats its leading dimensions as independent batch entries, so the worker dimension can
join the batch dimension instead: one ordinary call over [M * batch, heads, length, dim], whose
backward autograd records as for any unbatched call. Each worker's output and gradients are the
kernel's on that worker's slice, bit for bit what a separate model computes (the kernel splits its
work by batch entry and head, never across them).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._C._functorch import is_batchedtensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode


def _sdpa_arguments(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """``F.scaled_dot_product_attention``'s arguments, by name (its signature)."""
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


class _WorkersInBatchAttention(torch.autograd.Function):
    """Attention whose vmap rule folds the vmapped dimension into the batch dimension.

    Only its vmap rule runs: :class:`FoldWorkersIntoAttention` applies it to vmapped inputs alone,
    and the rule calls attention itself, which autograd records as usual."""

    @staticmethod
    def forward(query, key, value, attn_mask, is_causal, scale, enable_gqa):
        raise RuntimeError("_WorkersInBatchAttention is for vmapped inputs only")

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad_output):
        raise RuntimeError("_WorkersInBatchAttention is for vmapped inputs only")

    @staticmethod
    def vmap(info, in_dims, query, key, value, attn_mask, is_causal, scale, enable_gqa):
        workers = info.batch_size

        def workers_first(tensor: Tensor, dim: int | None) -> Tensor:
            return (
                tensor.movedim(dim, 0) if dim is not None else tensor.expand(workers, *tensor.shape)
            )

        query, key, value = (workers_first(t, d) for t, d in zip((query, key, value), in_dims))
        # [M, *batch] broadcast over query, key and value (their last three: heads, length, dim)
        batch = torch.broadcast_shapes(query.shape[:-3], key.shape[:-3], value.shape[:-3])

        def folded(tensor: Tensor) -> Tensor:
            return tensor.expand(*batch, *tensor.shape[-3:]).reshape(-1, *tensor.shape[-3:])

        if attn_mask is not None:
            scores = (*batch, query.shape[-3], query.shape[-2], key.shape[-2])
            if in_dims[3] is not None:  # one mask per worker: align its other dims to the right
                attn_mask = attn_mask.movedim(in_dims[3], 0)
                attn_mask = attn_mask.reshape(
                    workers, *[1] * (len(scores) - attn_mask.dim()), *attn_mask.shape[1:]
                )
            attn_mask = attn_mask.expand(scores).reshape(-1, *scores[-3:])
        output = F.scaled_dot_product_attention(
            folded(query),
            folded(key),
            folded(value),
            attn_mask=attn_mask,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )
        return output.reshape(*batch, *output.shape[1:]), 0


class FoldWorkersIntoAttention(TorchFunctionMode):
    """While active, ``F.scaled_dot_product_attention`` of vmapped inputs runs as one call with
    the workers folded into the batch dimension. Anything else runs as it would without it: calls
    on unbatched tensors, dropout (each worker's draws are vmap's to make), and inputs other than
    [batch, heads, length, dim] per worker, for which the kernel torch picks depends on the number
    of dimensions (the fused CPU kernel takes four, no more, no fewer)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa = _sdpa_arguments(
            *args, **kwargs
        )
        tensors = [t for t in (query, key, value, attn_mask) if t is not None]
        if (
            dropout_p == 0.0
            and all(t.dim() == 4 for t in (query, key, value))
            and any(is_batchedtensor(t) for t in tensors)
        ):
            return _WorkersInBatchAttention.apply(
                query, key, value, attn_mask, is_causal, scale, enable_gqa
            )
        return func(*args, **kwargs)


@contextlib.contextmanager
def attention_that_vmaps(device: torch.device):
    """Attention under vmap as one call over all workers; on a GPU, by its plain matrix-product
    kernel.

    torch's fused CUDA attention kernels, batched over the workers by vmap, gave NaN gradients in
    bf16 and failed in float32 ("LSE is not correctly aligned") on torch 2.11 and an H200, where
    the same model unbatched trains (`git show 1bbf067:BENCHMARKS.md`, section 9). At the sequence lengths simulated
    workers run, the math kernel costs little."""
    on_gpu = sdpa_kernel(SDPBackend.MATH) if device.type == "cuda" else contextlib.nullcontext()
    with FoldWorkersIntoAttention(), on_gpu:
        yield
