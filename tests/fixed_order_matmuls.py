"""Matrix products summed in an order fixed by construction, for bit-for-bit claims that would
otherwise rest on a BLAS library.

A BLAS library (MKL, OpenBLAS) chooses its kernel, and with it the order in which a matrix
product sums its k terms, by CPU, by matrix sizes, by batch size and by memory alignment: a
product of the same two matrices can round differently once it is one entry of a batch of 3
instead of 7. Under :class:`FixedOrderMatmuls` each product is an element-wise product followed
by torch's own sum over k, whose order depends on k alone, so a claim such as "chunking the
workers changes no result" then rests on the code under test, not on the BLAS.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


def product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for [..., m, k] @ [..., k, n]: products [..., m, k, n], then a sum over k."""
    return (a.unsqueeze(-1) * b.unsqueeze(-3)).sum(dim=-2)


def scaled(result: torch.Tensor, base: torch.Tensor, beta, alpha) -> torch.Tensor:
    """``beta * base + alpha * result`` as addmm/baddbmm define it (beta 0 ignores ``base``)."""
    result = result if alpha == 1 else alpha * result
    if beta == 0:
        return result
    return (base if beta == 1 else beta * base) + result


class FixedOrderMatmuls(TorchDispatchMode):
    """Every mm, bmm, addmm and baddbmm as :func:`product`; ``products`` counts them.

    With ``math_attention`` (the default) attention takes its plain matrix-product form, whose
    products come here too; without, the fused CPU attention kernel runs, which calls the BLAS on
    each (batch entry, head) block, blocks of the same sizes wherever the entry sits."""

    def __init__(self, math_attention: bool = True) -> None:
        super().__init__()
        self.products = 0
        self._math_attention = sdpa_kernel(SDPBackend.MATH) if math_attention else nullcontext()

    def __enter__(self):
        self._math_attention.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._math_attention.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.mm.default, aten.bmm.default):
            self.products += 1
            return product(*args)
        if func in (aten.addmm.default, aten.baddbmm.default):
            self.products += 1
            base, a, b = args
            return scaled(product(a, b), base, kwargs.get("beta", 1), kwargs.get("alpha", 1))
        if func in (
            aten.mm.out,
            aten.bmm.out,
            aten.addmm.out,
            aten.baddbmm.out,
            aten.addbmm.default,
        ):
            raise NotImplementedError(f"{func} has no fixed-order form here; add one")
        return func(*args, **kwargs)
