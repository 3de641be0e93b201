"""MT-DAO-Adam: Adam with N first momenta of different timescales plus the raw gradient."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from mtdao.optim.base import MultiTimescaleOptimizer
from mtdao.optim.functional import mt_adam_multi_tensor, mt_adam_single_tensor
from mtdao.optim.fused import ADAM, mt_adam_fused


class MTAdam(MultiTimescaleOptimizer):
    """Multi-timescale Adam with decoupled weight decay.

    ``betas`` are the decays of the N first momenta, ``omegas`` their mixing weights; the raw
    gradient gets ``1 - sum(omegas)``. With ``betas=(b1,), omegas=(1.0,)`` this is
    ``torch.optim.AdamW(betas=(b1, beta2))``; with ``omegas=(nu,)`` it is QHAdam with nu2 = 1.
    The default, one slow momentum (0.999) mixed at 0.9, has exactly Adam's memory.
    """

    single_tensor_kernel = staticmethod(mt_adam_single_tensor)
    fused_kernel = staticmethod(mt_adam_fused)
    fused_rule = ADAM
    multi_tensor_kernel = staticmethod(mt_adam_multi_tensor)
    hyperparameter_names = ("lr", "betas", "omegas", "beta2", "eps", "weight_decay")

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: Sequence[float] = (0.999,),
        omegas: Sequence[float] = (0.9,),
        beta2: float = 0.999,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        foreach: bool | None = None,
        fused: bool | None = None,
        flat: bool | None = None,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=betas,
            omegas=omegas,
            beta2=beta2,
            eps=eps,
            weight_decay=weight_decay,
            foreach=foreach,
            fused=fused,
            flat=flat,
        )
        super().__init__(params, defaults)
