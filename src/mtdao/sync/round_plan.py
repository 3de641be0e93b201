"""How the engine's rounds are formed, sent and applied: fragments, delay and codecs composed.

:class:`RoundPlan` holds the three options of :class:`~mtdao.sync.engine.LocalUpdateSync` that
change a round without changing the policy, and does the parts of a round that depend on them:
collecting what is due (:meth:`RoundPlan.collect`: the fragments due, :mod:`.fragments`, D
steps ahead when delayed), opening and sending it (a copy when delayed, parameters as
pseudo-gradients when quantized, :mod:`.compression`; radial-directional kinds as unit updates
and norms, :mod:`.radial`), decoding and applying the averages (:meth:`RoundPlan.apply`: an
assignment, or a merge, :mod:`.overlap`). The driver (:mod:`.round_driver`) moves the round
through its stages.

With the defaults (one fragment, no delay, float32) a round is collected, sent and applied exactly
as a plain blocking round. A sharded tensor (DTensor) is collected whole (fragments and sizes are
the whole tensor's) and handled as its local shard from the send on: snapshots, pseudo-gradients,
residuals and averages are this process's shard of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from mtdao.sync.codecs.compression import PseudoGradients, SyncCodecs
from mtdao.sync.codecs.quantize import check_supported
from mtdao.sync.communicator import Averages, Communicator
from mtdao.sync.dtensors import local_shard, shard_like
from mtdao.sync.fragments import FragmentSchedule
from mtdao.sync.overlap import POSITIVE_STATE_KEYS, merge, merge_factor
from mtdao.sync.policy import NON_AVERAGED_STATE_KEYS, SyncPolicy, SyncRule, state_decays
from mtdao.sync.radial import NORMS_KIND, RadialDirectional
from mtdao.sync.round_options import check_round_options
from mtdao.sync.rounds import Round, SyncRound


class RoundPlan:
    """Fragments, delay and codecs of one engine (validated together)."""

    def __init__(
        self,
        policy: SyncPolicy,
        optimizer: Optimizer,
        communicator: Communicator,
        names: Sequence[str],
        *,
        fragments: int = 1,
        delay: int = 0,
        codecs: SyncCodecs | None = None,
        decays: dict[str, float] | None = None,
        radial: Sequence[str] = (),
    ) -> None:
        codecs = codecs or SyncCodecs()
        delay = check_round_options(policy, delay=delay, fragments=fragments, codecs=codecs)
        self.policy, self.optimizer = policy, optimizer
        self.communicator, self.layout = communicator, communicator.layout
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.names = list(names)
        self.delay = delay
        sizes = [self.layout.worker_numel(p) for p in self.params]
        self.fragments = FragmentSchedule(self.names, sizes, fragments)
        self.codecs = codecs
        device = self.params[0].device if self.params else torch.device("cpu")
        for kind in ("params", "exp_avg", "exp_avg_sq"):
            check_supported(codecs.codec(kind), device)
        params_codec = codecs.codec("params")
        self.pseudo_gradients = (
            PseudoGradients(params_codec, codecs.error_feedback, self.layout.local_workers)
            if params_codec is not None and policy.params.period is not None
            else None
        )
        if decays is None and delay:
            try:
                decays = state_decays(optimizer)
            except ValueError:  # an optimizer of unknown decays: the plain delta merge
                decays = {}
        self.decays = dict(decays or {})
        self.radial = RadialDirectional(radial, self.layout, communicator.transport.stacked)
        if "params" in self.radial.groups and policy.params.period is None:
            raise ValueError(
                "`radial_directional` params: the policy never averages the parameters"
            )
        if "params" in self.radial.groups and codecs.error_feedback:
            raise ValueError(
                "`radial_directional` params: error feedback corrects the pseudo-gradient, not "
                "the unit vector sent in its place; drop `error_feedback`"
            )

    @property
    def radial_params(self) -> bool:
        """Whether the parameters go as norm and direction (they then need anchors)."""
        return "params" in self.radial.groups

    def collect(self, step: int) -> SyncRound:
        """The round sent at ``step``: what is due D steps later (a delayed round lands where a
        blocking one would), the parameters of the fragments due, then their states in key order
        per parameter."""
        lands = step + self.delay
        return self._collect(
            step, lambda kind, rule, index: self.fragments.is_due(rule, index, lands)
        )

    def collect_final(self, step: int, in_sync: Callable[[str, int], bool]) -> SyncRound:
        """The final round after step ``step``: every tensor the policy averages (parameters
        with a period, each state with one), whatever its fragment, but those ``in_sync(kind,
        parameter index)`` says every worker holds alike already."""

        def due(kind: str, rule: SyncRule, index: int) -> bool:
            return rule.period is not None and not in_sync(kind, index)

        return self._collect(step, due)

    def _collect(self, step: int, is_due: Callable[[str, SyncRule, int], bool]) -> SyncRound:
        """The parameters ``is_due(kind, rule, index)`` names, then their states in key order
        per parameter."""
        due = SyncRound(step, [], [], [])
        for index, p in enumerate(self.params):
            if is_due("params", self.policy.params, index):
                due.tensors.append(p)
                due.kinds.append("params")
                due.names.append(self.names[index])
                due.param_indices.append(index)
                due.owners.append(index)
        for index, p in enumerate(self.params):
            for key, value in sorted(self.optimizer.state.get(p, {}).items()):
                if key in NON_AVERAGED_STATE_KEYS or not isinstance(value, Tensor):
                    continue
                # 0-dim states are counters (NAdam's mu_product), except those of a 0-dim parameter
                param_shaped = value.dim() > 0 or p.dim() == 0
                if param_shaped and is_due(key, self.policy.state_rule(key), index):
                    due.tensors.append(value)
                    due.kinds.append(key)
                    due.names.append(f"{key} of {self.names[index]}")
                    due.owners.append(index)
        return due

    def open(self, due: SyncRound, anchors: Sequence[Tensor], blocking: bool = False) -> Round:
        """Open the round: encode what each tensor sends (of a sharded tensor, this process's
        shard: every value a round keeps is a local shard), for one communicator call
        (:meth:`average`). The error-feedback residuals it advances are kept in it, to put back
        if discarded. ``blocking``: applied at its own step whatever the delay (the final
        round)."""
        delay = 0 if blocking else self.delay
        tensors = [local_shard(t) for t in due.tensors]
        snapshots = [t.clone() for t in tensors] if delay else None
        sent = list(snapshots or tensors)
        residuals_before: dict[int, Tensor | None] = {}
        if self.pseudo_gradients is not None:
            for j, index in enumerate(due.param_indices):
                residuals_before[index] = self.pseudo_gradients.residuals.get(index)
                sent[j] = self.pseudo_gradients.payload(index, anchors[index], sent[j])
        if self.radial.groups:
            pseudo_gradients_sent = self.pseudo_gradients is not None
            sent = self.radial.encode(due.kinds, due.owners, sent, anchors, pseudo_gradients_sent)
        land, advance = due.step + delay, due.step + max(1, delay // 2)
        return Round(due, sent, snapshots, land, advance, self.pseudo_gradients, residuals_before)

    def average(self, due: SyncRound, sent: Sequence[Tensor], excluded=()) -> Averages:
        norms = list(sent[len(due.tensors) :])  # radial-directional norms, in float
        kinds = list(due.kinds) + [NORMS_KIND] * len(norms)
        # a local shard sent goes as a DTensor again: its worker's traffic counts the whole tensor
        sent = [shard_like(t, value) for t, value in zip(due.tensors, sent)] + norms
        if not self.codecs.quantizes_anything:
            return self.communicator.average(sent, kinds, excluded)
        codecs = [self.codecs.codec(kind) for kind in due.kinds] + [None] * len(norms)
        return self.communicator.average(sent, kinds, excluded, codecs)

    def decoded(self, pending: Round, averages: list[Tensor], anchors) -> list[Tensor]:
        """The averages of what the round's tensors sent, one per tensor: radial-directional
        kinds decoded (:mod:`.radial`), the rest as they are."""
        if not self.radial.groups:
            return averages
        due, pseudo_gradients_sent = pending.due, self.pseudo_gradients is not None
        numels = [self.layout.worker_numel(t) for t in due.tensors]
        return self.radial.decode(
            due.kinds, due.owners, averages, numels, anchors, pseudo_gradients_sent
        )

    def global_params(self, pending: Round, means: list[Tensor], anchors) -> list[Tensor]:
        """The new global parameters from the averages of what the parameters sent."""
        if self.pseudo_gradients is None:
            return means
        anchors = [anchors[i] for i in pending.due.param_indices]
        return [PseudoGradients.global_value(a, m) for a, m in zip(anchors, means)]

    def apply(self, pending: Round, first: int, values: Sequence[Tensor]) -> None:
        """Give the round's tensors from position ``first`` on their new global ``values``: one
        assignment, or (a delayed round) a merge into each."""
        tensors = pending.due.tensors[first : first + len(values)]
        kinds, owners = pending.due.kinds[first:], pending.due.owners[first:]
        self.radial.remember(kinds, owners, values)
        if pending.snapshots is None:
            self.communicator.assign(tensors, values)
            return
        for j, (tensor, value) in enumerate(zip(tensors, values), start=first):
            tensor = local_shard(tensor)
            healed = None
            if pending.excluded:
                mask = self.layout.worker_mask(pending.excluded)
                healed = self.layout.per_worker_view(mask, tensor)
            kind = pending.due.kinds[j]
            factor = merge_factor(kind, self.delay, self.decays)
            positive = kind in POSITIVE_STATE_KEYS
            merge(tensor, value, pending.snapshots[j], factor, positive, healed)

    def restore(self, saved: dict[str, Any]) -> Round:
        """A delayed round from a checkpoint or a heal: its tensors found again by the step it
        opened at (its residuals are in the saved ones already)."""
        due = self.collect(saved["step"])
        device = local_shard(due.tensors[0]).device
        sent, snapshots, averages = (
            [t.to(device) for t in saved[key]] for key in ("sent", "snapshots", "averages")
        )
        restored = Round(
            due,
            sent,
            snapshots,
            saved["finish_step"],
            saved["advance_step"],
            excluded=list(saved.get("excluded", [])),
        )
        restored.launch(Averages(averages, saved["bytes"], saved["collectives"]))
        return restored
