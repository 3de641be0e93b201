"""Workers holding NaN/inf: found, left out of a round, and healed with the others' average.

A component the engine (:class:`~mtdao.sync.engine.LocalUpdateSync`) owns: given the tensors a
worker holds (parameters, optimizer states, error-feedback residuals) and the communicator, with
``on_non_finite="raise"`` the error names worker, tensor and step; with ``"skip"`` the offending
workers are left out of the round and take the others' average of every tensor they hold
(parameters and every state, due or not), counted as "heal" traffic, so they rejoin at once. It
writes nothing: what it finds goes into the round's :class:`~mtdao.sync.rounds.CheckedRound`,
which the engine records (and so applies) only when the round commits.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from mtdao.sync.codecs.compression import PseudoGradients
from mtdao.sync.communicator import Communicator
from mtdao.sync.policy import NON_AVERAGED_STATE_KEYS
from mtdao.sync.rounds import CheckedRound, SyncEvent, SyncRound

logger = logging.getLogger("mtdao.sync.engine")

NON_FINITE_ACTIONS = ("raise", "skip")
RESIDUAL = "residual"


class NonFiniteError(FloatingPointError):
    """A worker's tensor held NaN or inf when it was due to be averaged."""


class NonFiniteWorkers:
    """Finding, leaving out and healing the workers that hold NaN/inf (see the module
    docstring): ``params`` named by ``names``, their states in ``optimizer``, the residuals of
    ``feedback`` (None: no error feedback), averaged over ``communicator``."""

    def __init__(
        self,
        on_non_finite: str,
        params: Sequence[Tensor],
        names: Sequence[str],
        optimizer: Optimizer,
        communicator: Communicator,
        feedback: PseudoGradients | None,
    ) -> None:
        if on_non_finite not in NON_FINITE_ACTIONS:
            raise ValueError(
                f"Invalid on_non_finite: {on_non_finite!r} (choose from {NON_FINITE_ACTIONS})"
            )
        self.on_non_finite = on_non_finite
        self.params, self.names = list(params), list(names)
        self.optimizer, self.communicator, self.feedback = optimizer, communicator, feedback
        self.layout = communicator.layout

    def held(self, step: int) -> SyncRound:
        """Everything a worker holds its own copy of: its parameters, every parameter-shaped
        optimizer state (whether the policy averages it or keeps it local) and its error-feedback
        residuals (searched, never averaged: a healed worker's are reset)."""
        held = SyncRound(step, [], [], [])
        for p, name in zip(self.params, self.names):
            for key, value in [("params", p), *self._worker_states(p)]:
                held.tensors.append(value)
                held.kinds.append(key)
                held.names.append(name if key == "params" else f"{key} of {name}")
        residuals = sorted(self.feedback.residuals.items()) if self.feedback else []
        for index, residual in residuals:
            held.tensors.append(residual)
            held.kinds.append(RESIDUAL)
            held.names.append(f"error-feedback residual of {self.names[index]}")
        return held

    def _worker_states(self, p: Tensor) -> list[tuple[str, Tensor]]:
        """(key, tensor) of the states of ``p`` that each worker holds a copy of, in key order."""
        found = []
        for key, value in sorted(self.optimizer.state.get(p, {}).items()):
            if key in NON_AVERAGED_STATE_KEYS or not isinstance(value, Tensor):
                continue
            # 0-dim states are counters (NAdam's mu_product), except those of a 0-dim parameter
            if value.dim() > 0 or p.dim() == 0:
                found.append((key, value))
        return found

    @torch.no_grad()
    def heal_now(self, step: int) -> CheckedRound | None:
        """Every worker holding NaN/inf anywhere (``on_non_finite='skip'``), healed with the
        others' average of everything it holds, as a round to record; None when there is none."""
        held = self.held(step)
        offenders = self.layout.first_non_finite(held.tensors)
        if not offenders:
            return None
        excluded, skipped = self.leave_out(held, offenders)
        checked = CheckedRound([], [], skipped)
        self.heal(checked, excluded, step, skip=set())
        return checked

    def heal(self, checked: CheckedRound, workers: list[int], step: int, skip: set[int]) -> None:
        """Average, over the others, every tensor ``workers`` hold but those in ``skip`` (ids of
        the tensors the round already averaged): every worker takes part in the collective; only
        ``workers`` are overwritten, when ``checked`` is recorded."""
        held = self.held(step)
        kept = zip(held.tensors, held.kinds)
        tensors = [t for t, kind in kept if id(t) not in skip and kind != RESIDUAL]
        if not tensors:  # the round gave them everything; their residuals are still reset
            checked.heal = ([], [], workers)
            return
        result = self.communicator.average(tensors, ["heal"] * len(tensors), excluded=workers)
        averages = result.wait()
        if not self.layout.all_finite(averages):
            raise NonFiniteError(
                f"Cannot heal workers {workers} at step {step}: non-finite average"
            )
        checked.heal = (tensors, averages, workers)
        checked.events.append(SyncEvent(step, ["heal"], result.bytes, result.collectives))
        checked.skipped["healed_tensors"] = len(tensors)

    def leave_out(
        self, due: SyncRound, offenders: dict | None = None
    ) -> tuple[list[int], dict[str, Any]]:
        """(the workers to leave out of ``due``'s round, the record of it); raises with
        ``on_non_finite='raise'``, or when no worker would be left."""
        offenders = self.layout.first_non_finite(due.tensors) if offenders is None else offenders
        if not offenders:
            raise NonFiniteError(
                f"Averaging at step {due.step} overflowed although every worker's values are "
                "finite (values too large for their dtype)"
            )
        described = "; ".join(f"worker {w}: {due.names[i]}" for w, i in sorted(offenders.items()))
        if self.on_non_finite == "raise":
            raise NonFiniteError(
                f"Non-finite value (NaN/inf) at step {due.step} in {described}. Nothing was "
                "averaged; set `on_non_finite` to 'skip' to leave such workers out"
            )
        excluded = sorted(offenders)
        if len(excluded) == self.layout.num_workers:
            raise NonFiniteError(
                f"Non-finite value (NaN/inf) at step {due.step} on every worker ({described}); "
                "no worker is left to average"
            )
        logger.warning(
            "step %d: leaving worker(s) %s out (%s); they take the others' average of every "
            "tensor they hold",
            due.step,
            excluded,
            described,
        )
        return excluded, {"step": due.step, "workers": excluded, "tensors": described}
