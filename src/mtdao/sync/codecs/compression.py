"""What each kind of tensor crosses the link as: a dtype per kind, parameters as pseudo-gradients.

Three groups of kinds, each with its own dtype (:mod:`mtdao.sync.codecs.quantize`): ``params``,
sent as the pseudo-gradient ``anchor - x`` (small and centred on zero where ``x`` is neither, so
a blockwise scale fits it), with optional error feedback; ``momenta``; ``second-moment``. Why
each travels as it does: docs/design.md ("Quantized payloads").

``fp32`` sends the tensor itself, averaged exactly: the default, the same as a plain round.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mtdao.sync.codecs.quantize import DEFAULT_BLOCK, SYNC_DTYPES, Codec, is_sync_dtype

KIND_GROUPS = ("params", "momenta", "second-moment")
SECOND_MOMENT_KEY = "exp_avg_sq"


def kind_group(kind: str) -> str:
    """``params``, ``second-moment`` (exp_avg_sq) or ``momenta`` (every other state)."""
    if kind == "params":
        return "params"
    return "second-moment" if kind == SECOND_MOMENT_KEY else "momenta"


@dataclass(frozen=True)
class SyncCodecs:
    """The dtype on the link for each group of kinds, and error feedback for the parameters."""

    params: str = "fp32"
    momenta: str = "fp32"
    second_moment: str = "fp32"
    error_feedback: bool = False
    block: int = DEFAULT_BLOCK

    def __post_init__(self) -> None:
        for group, dtype in zip(KIND_GROUPS, (self.params, self.momenta, self.second_moment)):
            if not is_sync_dtype(dtype):
                raise ValueError(
                    f"`sync_dtype`: unknown dtype {dtype!r} for {group}; "
                    f"choose from {', '.join(SYNC_DTYPES)}"
                )
        for kind in ("params", "exp_avg", SECOND_MOMENT_KEY):
            try:
                self.codec(kind)
            except ValueError as error:
                raise ValueError(f"`sync_dtype` {kind_group(kind)}: {error}") from None
        if self.error_feedback and self.params == "fp32":
            raise ValueError(
                "`error_feedback` corrects quantized parameters: give `sync_dtype` params=bf16, "
                "fp8, int8, int4, int2 or top<k>"
            )

    @classmethod
    def parse(cls, spec: Sequence[str], error_feedback: bool = False) -> SyncCodecs:
        """From ``["int8"]`` (every group) and/or ``["params=int8", "second-moment=bf16"]``."""
        dtypes = dict.fromkeys(KIND_GROUPS, "fp32")
        for item in spec:
            group, _, dtype = item.rpartition("=")
            if not group:
                dtypes = dict.fromkeys(KIND_GROUPS, dtype)
            elif group in dtypes:
                dtypes[group] = dtype
            else:
                raise ValueError(
                    f"`sync_dtype`: unknown kind {group!r} in {item!r}; "
                    f"choose from {', '.join(KIND_GROUPS)}"
                )
        return cls(*dtypes.values(), error_feedback=error_feedback)

    def spec(self) -> tuple[str, ...]:
        """The shortest ``parse`` input that gives these dtypes."""
        dtypes = (self.params, self.momenta, self.second_moment)
        if len(set(dtypes)) == 1:
            return (dtypes[0],)
        return tuple(f"{group}={dtype}" for group, dtype in zip(KIND_GROUPS, dtypes))

    def dtype(self, kind: str) -> str:
        group = kind_group(kind)
        if group == "params":
            return self.params
        return self.second_moment if group == "second-moment" else self.momenta

    def codec(self, kind: str) -> Codec | None:
        """How ``kind`` is encoded (None: float32, sent as it is)."""
        dtype = self.dtype(kind)
        if dtype == "fp32":
            return None
        domain = "positive" if kind_group(kind) == "second-moment" else "signed"
        return Codec(dtype, domain, self.block)

    @property
    def quantizes_anything(self) -> bool:
        return (self.params, self.momenta, self.second_moment) != ("fp32",) * 3


class PseudoGradients:
    """Parameters sent as ``anchor - x``, with this worker's error feedback residuals."""

    def __init__(self, codec: Codec, error_feedback: bool, local_workers: int) -> None:
        self.codec = codec
        self.error_feedback = error_feedback
        self.local_workers = local_workers
        self.residuals: dict[int, Tensor] = {}
        """What quantization lost of each parameter's last pseudo-gradient, per local worker."""

    @torch.no_grad()
    def payload(self, index: int, anchor: Tensor, value: Tensor) -> Tensor:
        """What parameter ``index`` sends: its pseudo-gradient (plus the last residual)."""
        pseudo_gradient = anchor - value
        if self.error_feedback:
            if index in self.residuals:
                pseudo_gradient = pseudo_gradient + self.residuals[index]
            rows = pseudo_gradient.reshape(self.local_workers, -1)
            lost = rows - self.codec.roundtrip(rows).to(rows.dtype)
            self.residuals[index] = lost.view_as(pseudo_gradient)
        return pseudo_gradient

    @torch.no_grad()
    def forget(self, layout, workers) -> None:
        """Zero ``workers``' residuals: a healed worker took the others' values, so what its
        own quantization had not yet sent (NaN/inf, when its values were) belongs to no one."""
        residuals = list(self.residuals.values())
        zeros = [torch.zeros((), device=r.device) for r in residuals]
        layout.assign_to_workers(residuals, zeros, workers)

    @staticmethod
    def global_value(anchor: Tensor, mean_pseudo_gradient: Tensor) -> Tensor:
        return anchor - mean_pseudo_gradient

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": {str(i): r.clone() for i, r in self.residuals.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.residuals = {int(i): r.clone() for i, r in state["residuals"].items()}
