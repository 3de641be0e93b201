"""MT-DAO-SGDM: SGD with N momenta of different timescales (the variant the theory covers)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from mtdao.optim.base import MultiTimescaleOptimizer
from mtdao.optim.functional import mt_sgd_multi_tensor, mt_sgd_single_tensor
from mtdao.optim.fused import SGD, mt_sgd_fused


class MTSGD(MultiTimescaleOptimizer):
    """Multi-timescale SGD with momentum: ``x -= lr (w_0 g + sum_j w_j u_j)``.

    Momenta are EMAs (``u = b u + (1 - b) g``), so the step size does not grow by 1 / (1 - b) as
    with ``torch.optim.SGD(momentum=b)``. The default, one momentum 0.9 at weight 1, is that EMA form
    of heavy-ball SGD.
    """

    single_tensor_kernel = staticmethod(mt_sgd_single_tensor)
    fused_kernel = staticmethod(mt_sgd_fused)
    fused_rule = SGD
    multi_tensor_kernel = staticmethod(mt_sgd_multi_tensor)
    hyperparameter_names = ("lr", "betas", "omegas", "weight_decay")

    _has_second_moment = False

    def __init__(
        self,
        params: Iterable,
        lr: float,
        betas: Sequence[float] = (0.9,),
        omegas: Sequence[float] = (1.0,),
        weight_decay: float = 0.0,
        foreach: bool | None = None,
        fused: bool | None = None,
        flat: bool | None = None,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=betas,
            omegas=omegas,
            weight_decay=weight_decay,
            foreach=foreach,
            fused=fused,
            flat=flat,
        )
        super().__init__(params, defaults)
