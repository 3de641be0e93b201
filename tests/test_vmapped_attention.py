"""Attention of vmapped workers folded into one call: the same numbers as vmap's loop over
workers, bit for bit, in one kernel call whatever the number of workers."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from fixed_order_matmuls import FixedOrderMatmuls
from torch.func import functional_call, vmap
from torch.utils._python_dispatch import TorchDispatchMode

from mtdao.model import Llama, ModelConfig
from mtdao.model.vmapped_attention import FoldWorkersIntoAttention
from mtdao.sync import stack_workers
from mtdao.train.workers import language_model_loss

WORKERS = 5


class KernelCalls(TorchDispatchMode):
    """Counts the aten attention kernels run (forward and backward) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in str(func):
            self.calls += 1
        return func(*args, **(kwargs or {}))


def vmap_loop(function, *args, in_dims=0):
    """vmap as torch runs it without the fold: a loop over workers for the fused CPU kernel."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "not yet implemented the batching rule"
        return vmap(function, in_dims=in_dims, randomness="different")(*args)


def folded(function, *args, in_dims=0):
    with FoldWorkersIntoAttention():
        return vmap(function, in_dims=in_dims, randomness="different")(*args)


def leaves(*shapes):
    torch.manual_seed(0)
    return [torch.randn(*shape, requires_grad=True) for shape in shapes]


def outputs_and_grads(run, function, tensors, in_dims):
    fresh = [t.detach().clone().requires_grad_() for t in tensors]
    output = run(function, *fresh, in_dims=in_dims)
    output.backward(torch.linspace(-1, 1, output.numel()).reshape(output.shape))
    return output, [t.grad for t in fresh]


M, B, H, L, E = WORKERS, 3, 2, 7, 4
CASES = {
    "causal": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
               [(M, B, H, L, E)] * 3, 0),
    "scale, shared key and value": (
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, scale=0.3),
        [(M, B, H, L, E), (B, H, L, E), (B, H, L, E)], (0, None, None)),
    "worker dim not first": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
                             [(B, M, H, L, E)] * 3, 1),
    "grouped query heads": (
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
        [(M, B, 4, L, E), (M, B, 2, L, E), (M, B, 2, L, E)], 0),
}  # fmt: skip


@pytest.mark.exact
@pytest.mark.parametrize("case", CASES)
def test_folded_attention_equals_the_loop_over_workers_bit_for_bit(case):
    function, shapes, in_dims = CASES[case]
    tensors = leaves(*shapes)
    expected, expected_grads = outputs_and_grads(vmap_loop, function, tensors, in_dims)
    output, grads = outputs_and_grads(folded, function, tensors, in_dims)
    assert torch.equal(output, expected)
    per_worker = in_dims if isinstance(in_dims, tuple) else (in_dims,) * len(tensors)
    for grad, expected_grad, dim in zip(grads, expected_grads, per_worker):
        if dim is not None:
            assert torch.equal(grad, expected_grad)
        else:  # shared by the workers: the sum of theirs, which the loop adds up one by one
            torch.testing.assert_close(grad, expected_grad)


@pytest.mark.exact
@pytest.mark.parametrize("mask_per_worker", [True, False], ids=["per-worker", "shared"])
def test_folded_attention_with_a_mask_equals_the_loop(mask_per_worker):
    q, k, v = leaves(*[(M, B, H, L, E)] * 3)
    torch.manual_seed(1)
    if mask_per_worker:  # padding masks differ by worker and batch entry: [M, B, 1, L, L]
        mask = torch.rand(M, B, 1, L, L) > 0.3
    else:  # one additive mask for everyone
        mask = torch.randn(L, L)
    mask_dim = 0 if mask_per_worker else None

    def attend(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    tensors, in_dims = [q, k, v], (0, 0, 0, mask_dim)
    fresh = [t.detach().clone().requires_grad_() for t in tensors]
    expected = vmap_loop(attend, *fresh, mask, in_dims=in_dims)
    expected.sum().backward()
    expected_grads = [t.grad for t in fresh]
    fresh = [t.detach().clone().requires_grad_() for t in tensors]
    output = folded(attend, *fresh, mask, in_dims=in_dims)
    output.sum().backward()
    assert torch.equal(output, expected)
    assert all(torch.equal(t.grad, e) for t, e in zip(fresh, expected_grads))


def test_folded_attention_is_one_kernel_call_for_all_workers():
    q, k, v = leaves(*[(M, B, H, L, E)] * 3)

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    for run, calls_per_pass in ((vmap_loop, WORKERS), (folded, 1)):
        with KernelCalls() as counted:
            run(attend, q, k, v).sum().backward()
        assert counted.calls == 2 * calls_per_pass, run.__name__  # forward and backward


def test_calls_the_fold_does_not_cover_run_as_without_it():
    q, k, v = leaves(*[(M, B, H, L, E)] * 3)

    def with_dropout(q, k, v):  # each worker's dropout draws come from vmap itself
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)

    def without_batch_dim(q, k, v):  # [heads, length, dim] per worker: another kernel's shape
        return F.scaled_dot_product_attention(q[0], k[0], v[0])

    for function in (with_dropout, without_batch_dim):
        torch.manual_seed(2)
        expected = vmap_loop(function, q, k, v)
        torch.manual_seed(2)
        output = folded(function, q, k, v)
        assert torch.equal(output, expected), function.__name__  # folded, they would differ
    with FoldWorkersIntoAttention():  # not vmapped: an ordinary call, its backward included
        output = F.scaled_dot_product_attention(q[0], k[0], v[0], is_causal=True)
    output.sum().backward()
    expected = F.scaled_dot_product_attention(q[0], k[0], v[0], is_causal=True)
    assert torch.equal(output, expected) and q.grad is not None


@pytest.mark.exact
def test_stacked_llama_gradients_equal_separate_models_bit_for_bit(one_thread):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=2, max_seq_len=16)
    model = Llama(config)
    workers = stack_workers(model, WORKERS)
    with torch.no_grad():
        for p in workers.parameters():
            p.add_(0.01 * torch.randn_like(p))  # every worker somewhere else
    inputs = torch.randint(0, 61, (WORKERS, 2, 16))
    targets = torch.randint(0, 61, (WORKERS, 2, 16))
    # the linear layers' products sum in a fixed order: batched (bmm) for the workers, one at a
    # time (mm) for the separate models, a BLAS may pick kernels that round differently
    with KernelCalls() as counted, FixedOrderMatmuls(math_attention=False):
        workers.losses(language_model_loss, inputs, targets).sum().backward()
    assert counted.calls == 2 * config.n_layers  # one forward and one backward call per layer
    buffers = dict(workers.named_buffers())
    for w in range(WORKERS):
        params = {n: p[w].detach().requires_grad_() for n, p in workers.named_parameters()}
        with FixedOrderMatmuls(math_attention=False):
            logits = functional_call(model, (params, buffers), (inputs[w],))
            language_model_loss(logits, targets[w]).backward()
        for name, p in workers.named_parameters():
            assert torch.equal(p.grad[w], params[name].grad), (w, name)
