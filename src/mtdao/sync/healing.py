"""Workers holding NaN/inf: found, left out of a round, and healed with the others' average.

A mixin of :class:`~mtdao.sync.engine.LocalUpdateSync` (it uses the engine's parameters,
optimizer, communicator and ``on_non_finite``): with ``on_non_finite="raise"`` the error names
worker, tensor and step; with ``"skip"`` the offending workers are left out of the round and take
the others' average of every tensor they hold (parameters and every state, due or not), counted
as "heal" traffic, so they rejoin at once.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

from mtdao.sync.layout import WorkerLayout
from mtdao.sync.policy import NON_AVERAGED_STATE_KEYS
from mtdao.sync.rounds import CheckedRound, SyncEvent, SyncRound

logger = logging.getLogger("mtdao.sync.engine")

NON_FINITE_ACTIONS = ("raise", "skip")
RESIDUAL = "residual"


class NonFiniteError(FloatingPointError):
    """A worker's tensor held NaN or inf when it was due to be averaged."""


class NonFiniteWorkers:
    """Leaving out and healing workers that hold NaN/inf (see the module docstring)."""

    params: list[Tensor]
    param_names: dict[int, str]
    optimizer: Any
    communicator: Any
    on_non_finite: str
    step_count: int
    layout: WorkerLayout
    plan: Any

    def _record(self, checked: CheckedRound) -> None:
        raise NotImplementedError

    def _held(self, step: int) -> SyncRound:
        """Everything a worker holds its own copy of: its parameters, every parameter-shaped
        optimizer state (whether the policy averages it or keeps it local) and its error-feedback
        residuals (searched, never averaged: a healed worker's are reset)."""
        held = SyncRound(step, [], [], [])
        for p in self.params:
            name = self.param_names[id(p)]
            for key, value in [("params", p), *self._worker_states(p)]:
                held.tensors.append(value)
                held.kinds.append(key)
                held.names.append(name if key == "params" else f"{key} of {name}")
        feedback = self.plan.pseudo_gradients
        for index, residual in sorted(feedback.residuals.items()) if feedback else []:
            held.tensors.append(residual)
            held.kinds.append(RESIDUAL)
            held.names.append(
                f"error-feedback residual of {self.param_names[id(self.params[index])]}"
            )
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
    def heal_non_finite_workers(self) -> list[int]:
        """Heal now every worker holding NaN/inf anywhere (``on_non_finite='skip'``): it takes
        the others' average of everything it holds. Returns the workers healed. Between rounds a
        worker left out stays non-finite; this makes the state finite, e.g. before a checkpoint."""
        held = self._held(self.step_count)
        offenders = self.layout.first_non_finite(held.tensors)
        if not offenders:
            return []
        excluded, skipped = self._workers_to_leave_out(held, offenders)
        checked = CheckedRound([], [], skipped)
        self._heal(checked, excluded, self.step_count, skip=set())
        self._record(checked)
        return excluded

    def _heal(self, checked: CheckedRound, workers: list[int], step: int, skip: set[int]) -> None:
        """Average, over the others, every tensor ``workers`` hold but those in ``skip`` (ids of
        the tensors the round already averaged): every worker takes part in the collective; only
        ``workers`` are overwritten, when ``checked`` is recorded."""
        held = self._held(step)
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

    def _workers_to_leave_out(
        self, due: SyncRound, offenders: dict | None = None
    ) -> tuple[list[int], dict[str, Any]]:
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
                "averaged; use on_non_finite='skip' (CLI: --on-non-finite skip) to leave such "
                "workers out"
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
