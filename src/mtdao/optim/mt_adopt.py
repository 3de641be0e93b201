"""MT-DAO-ADOPT: ADOPT (normalize by the previous second moment) with N first momenta."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from mtdao.optim.base import MultiTimescaleOptimizer
from mtdao.optim.functional import mt_adopt_multi_tensor, mt_adopt_single_tensor
from mtdao.optim.fused import ADOPT, mt_adopt_fused


class MTAdopt(MultiTimescaleOptimizer):
    """Multi-timescale ADOPT, the paper's main base optimizer.

    The gradient is normalized by the second moment of the *previous* steps, clipped to
    ``±step**0.25`` when ``clip``, then fed to N momenta; the normalized gradient gets
    ``1 - sum(omegas)``. The first call only initializes the second moment (official ADOPT
    convention). ``betas=(b1,), omegas=(1.0,)`` is plain ADOPT with clipping.
    """

    single_tensor_kernel = staticmethod(mt_adopt_single_tensor)
    fused_kernel = staticmethod(mt_adopt_fused)
    fused_rule = ADOPT
    multi_tensor_kernel = staticmethod(mt_adopt_multi_tensor)
    hyperparameter_names = ("lr", "betas", "omegas", "beta2", "eps", "weight_decay", "clip")

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: Sequence[float] = (0.999,),
        omegas: Sequence[float] = (0.9,),
        beta2: float = 0.9999,
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        clip: bool = True,
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
            clip=bool(clip),
            foreach=foreach,
            fused=fused,
            flat=flat,
        )
        super().__init__(params, defaults)
