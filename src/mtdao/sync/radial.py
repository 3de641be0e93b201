"""Radial-directional averaging: the workers' updates averaged as a norm and a direction apart.

The plain mean of M updates that point in near-orthogonal directions is about 1/sqrt(M) as long
as each of them, so the more workers average, the shorter the step their round takes. Averaging
the norm and the direction apart keeps the workers' mean norm:

    update = mean_w(||d_w||) * u / ||u||,   u = mean_w(d_w / ||d_w||)

for each tensor (one parameter, or one state of one parameter; a sharded tensor's norm is its
whole tensor's), where d_w is worker w's update of it since its last sync:

* ``params``: the pseudo-gradient ``anchor - x``, the anchor being the global value at the last
  parameter sync (the new global value is ``anchor - update``; an outer step then takes it);
* ``momenta`` (every optimizer state but the second moment, which must stay positive): the change
  ``m - m_anchor`` since its last sync, ``m_anchor`` being the global value that sync gave it
  (zero before the first: the momenta of torch's and MT-DAO's optimizers start at zero), kept
  here; the new global value is ``m_anchor + update``.

A worker whose update is zero has no direction: it adds a zero norm and a zero vector (its norm
lowers the mean norm, as it lowers a plain mean). Where the unit vectors cancel, to within
rounding (``||u||`` at most ``sqrt(numel)`` times the dtype's epsilon: what is left is rounding
noise, whose direction means nothing), the update is zero.

Each worker sends its unit vector in place of the tensor (the codec of its kind, if any, encodes
it) and, in the same call, its norms: one scalar per tensor in the widest of the tensors' dtypes (4 bytes
for float32 and narrower), counted in the traffic account as the kind ``norms``. A sharded worker sums each norm
over its processes first (a control collective per tensor, uncounted), and each of its processes
sends the norms.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from mtdao.sync.codecs.compression import kind_group
from mtdao.sync.dtensors import local_shard
from mtdao.sync.layout import WorkerLayout

RADIAL_GROUPS = ("params", "momenta")
NORMS_KIND = "norms"


def check_radial_groups(groups: Sequence[str]) -> tuple[str, ...]:
    """The kind groups named, checked (each once, params or momenta), in canonical order."""
    for group in groups:
        if group not in RADIAL_GROUPS:
            raise ValueError(
                f"`radial_directional`: unknown kind {group!r}; choose from "
                f"{', '.join(RADIAL_GROUPS)} (the second moment must stay positive)"
            )
    return tuple(group for group in RADIAL_GROUPS if group in groups)


def radial_update(norm_mean: Tensor, unit_mean: Tensor, numel: int, layout: WorkerLayout) -> Tensor:
    """``mean norm * u / ||u||`` of a global ``unit_mean`` (of ``numel`` elements in all), zero
    where the unit vectors cancelled to within rounding."""
    direction_norm = layout.global_sum(unit_mean.square()).sqrt()
    noise = math.sqrt(numel) * torch.finfo(unit_mean.dtype).eps
    scale = torch.where(direction_norm > noise, norm_mean / direction_norm, 0.0)
    return unit_mean * scale.to(unit_mean.dtype)


class RadialDirectional:
    """Which kinds a round sends as norm and direction, and the momenta's anchors."""

    def __init__(self, groups: Sequence[str], layout: WorkerLayout, stacked: bool) -> None:
        self.groups = check_radial_groups(groups)
        self.layout = layout
        self.stacked = stacked
        self.state_anchors: dict[tuple[str, int], Tensor] = {}
        """(state key, parameter index) -> that state's global value after its last sync."""

    def applies(self, kind: str) -> bool:
        return kind != "grads" and kind_group(kind) in self.groups

    def _state_anchor(self, kind: str, owner: int, global_like: Tensor) -> Tensor:
        """The state's anchor, shaped as one worker's copy (``global_like``)."""
        anchor = self.state_anchors.get((kind, owner))
        return global_like.new_zeros(global_like.shape) if anchor is None else anchor

    @torch.no_grad()
    def encode(
        self,
        kinds: Sequence[str],
        owners: Sequence[int],
        sent: Sequence[Tensor],
        param_anchors: Sequence[Tensor],
        pseudo_gradients_sent: bool,
    ) -> list[Tensor]:
        """What the round sends: each radial tensor's unit update in its place, then one tensor
        of norms (``[workers, tensors]`` stacked, ``[tensors]`` otherwise, in the widest dtype of
        the tensors and at least float32), if any."""
        sent, norms = list(sent), []
        for j, (kind, owner) in enumerate(zip(kinds, owners)):
            if not self.applies(kind):
                continue
            value = sent[j]
            if kind != "params":
                one_worker = value[0] if self.stacked else value
                update = value - self._state_anchor(kind, owner, one_worker)
            elif pseudo_gradients_sent:
                update = value  # already anchor - x
            else:
                update = param_anchors[owner] - value
            precise = update.to(torch.promote_types(update.dtype, torch.float32))
            norm = self.layout.per_worker_sum(precise.square()).sqrt()  # [local workers]
            # (a NaN/inf norm stays non-finite in the unit vector: the round's check finds it)
            inverse = torch.where(norm == 0, 0.0, 1.0 / norm)
            unit = precise * self.layout.per_worker_view(inverse, precise)
            sent[j] = unit.to(update.dtype)
            norms.append(norm)
        if norms:
            dtype = functools.reduce(torch.promote_types, [norm.dtype for norm in norms])
            stacked_norms = torch.stack([norm.to(dtype) for norm in norms], dim=-1)
            sent.append(stacked_norms if self.stacked else stacked_norms.reshape(-1))
        return sent

    @torch.no_grad()
    def decode(
        self,
        kinds: Sequence[str],
        owners: Sequence[int],
        averages: Sequence[Tensor],
        numels: Sequence[int],
        param_anchors: Sequence[Tensor],
        pseudo_gradients_sent: bool,
    ) -> list[Tensor]:
        """The round's averages as the plain round gives them (parameters as means, or mean
        pseudo-gradients where those are sent), the norms dropped. ``numels``: each tensor's
        elements in one worker's whole copy."""
        count = len(kinds)
        if not any(self.applies(kind) for kind in kinds):
            return list(averages)
        values, norm_means, position = list(averages[:count]), averages[count], 0
        for j, (kind, owner) in enumerate(zip(kinds, owners)):
            if not self.applies(kind):
                continue
            update = radial_update(norm_means[position], values[j], numels[j], self.layout)
            position += 1
            if kind != "params":
                values[j] = self._state_anchor(kind, owner, values[j]) + update
            elif pseudo_gradients_sent:
                values[j] = update
            else:
                values[j] = param_anchors[owner] - update
        return values

    @torch.no_grad()
    def remember(self, kinds: Sequence[str], owners: Sequence[int], values: Sequence[Tensor]):
        """Keep the global values a round gave the radial momenta, as their next anchors."""
        for kind, owner, value in zip(kinds, owners, values):
            if kind != "params" and self.applies(kind):
                self.state_anchors[(kind, owner)] = local_shard(value).detach().clone()

    def state_dict(self) -> dict[str, Any]:
        return {
            "state_anchors": [
                [kind, owner, anchor.clone()]
                for (kind, owner), anchor in sorted(self.state_anchors.items())
            ]
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state_anchors = {
            (str(kind), int(owner)): anchor.clone()
            for kind, owner, anchor in state["state_anchors"]
        }
