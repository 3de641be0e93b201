"""The local-update sync engine: after each optimizer step, average whatever the policy says is due.

The engine wraps an unmodified optimizer (any element-wise ``torch.optim`` optimizer, torch's
AdamW included) and a communicator. Use it explicitly::

    sync = LocalUpdateSync(optimizer, unified(32), communicator)
    loss.backward(); sync.step()            # optimizer.step() plus the averaging that is due

or keep a plain loop and let optimizer step hooks call it::

    with sync.attached():
        for batch in data: ...; optimizer.step()

Step t counts optimizer steps from 1 and is the same on every worker.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from mtdao.sync.communicator import Communicator, SingleWorker
from mtdao.sync.outer import NesterovOuterStep
from mtdao.sync.policy import NON_AVERAGED_STATE_KEYS, SyncPolicy

logger = logging.getLogger(__name__)

NON_FINITE_ACTIONS = ("raise", "skip")


class NonFiniteError(FloatingPointError):
    """A worker's tensor held NaN or inf when it was due to be averaged."""


class LocalUpdateSync:
    """Carries out a :class:`SyncPolicy` for one optimizer over one communicator.

    ``on_non_finite``: ``"raise"`` stops with an error naming worker, tensor and step before
    anything is averaged; ``"skip"`` leaves the offending workers out of that round (they receive
    the others' average) and records the event in ``skipped_rounds``.
    ``track_alignment`` records, at each parameter sync, each worker's cosine similarity between
    its pseudo-gradient and the global one, and its parameter drift from the average.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        policy: SyncPolicy,
        communicator: Communicator | None = None,
        *,
        on_non_finite: str = "raise",
        track_alignment: bool = False,
        broadcast_initial: bool = True,
    ) -> None:
        if on_non_finite not in NON_FINITE_ACTIONS:
            raise ValueError(
                f"Invalid on_non_finite: {on_non_finite!r} (choose from {NON_FINITE_ACTIONS})"
            )
        self.optimizer = optimizer
        self.policy = policy
        self.communicator = communicator or SingleWorker()
        self.on_non_finite = on_non_finite
        self.track_alignment = track_alignment
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.param_names = _param_names(optimizer)
        self.step_count = 0
        self.skipped_rounds: list[dict[str, Any]] = []
        self.alignment: list[dict[str, Any]] = []
        self._state_keys_checked = False
        with torch.no_grad():
            if broadcast_initial:
                self.communicator.broadcast_from_first(self.params)
            needs_anchor = policy.outer is not None or track_alignment
            # The anchor is the global model after the last parameter sync (DiLoCo's x_start).
            self.anchors = (
                [self.communicator.global_copy(p) for p in self.params]
                if needs_anchor and policy.params.period is not None
                else []
            )
        self.outer = NesterovOuterStep(policy.outer, self.anchors) if policy.outer else None

    # -- driving ------------------------------------------------------------------------------

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """``optimizer.step(closure)`` with gradient averaging before and state sync after."""
        self.before_optimizer_step()
        loss = self.optimizer.step(closure)
        self.after_optimizer_step()
        return loss

    @contextlib.contextmanager
    def attached(self) -> Iterator[LocalUpdateSync]:
        """Hook the engine into ``optimizer.step()`` for the duration of the block."""
        pre = self.optimizer.register_step_pre_hook(lambda *_: self.before_optimizer_step())
        post = self.optimizer.register_step_post_hook(lambda *_: self.after_optimizer_step())
        try:
            yield self
        finally:
            pre.remove()
            post.remove()

    @torch.no_grad()
    def before_optimizer_step(self) -> None:
        """DDP: replace every worker's gradients by their average."""
        if not self.policy.average_gradients:
            return
        owners = [p for p in self.params if p.grad is not None]
        grads = [p.grad for p in owners]
        if grads:
            names = [f"gradient of {self.param_names[id(p)]}" for p in owners]
            averages = self._average(grads, ["grads"] * len(grads), names, self.step_count + 1)
            self.communicator.assign(grads, averages)

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """Count the step and average the parameters and states that are due."""
        self.step_count += 1
        step = self.step_count
        if not self._state_keys_checked:
            self.policy.check_state_keys(self._state_keys())
            self._state_keys_checked = True
        params_due = self.policy.params.is_due(step)
        tensors: list[Tensor] = list(self.params) if params_due else []
        kinds = ["params"] * len(tensors)
        names = [self.param_names[id(p)] for p in tensors]
        for p in self.params:
            for key, value in sorted(self.optimizer.state.get(p, {}).items()):
                if key in NON_AVERAGED_STATE_KEYS or not isinstance(value, Tensor):
                    continue
                # 0-dim states are counters (NAdam's mu_product), except those of a 0-dim parameter
                param_shaped = value.dim() > 0 or p.dim() == 0
                if param_shaped and self.policy.state_rule(key).is_due(step):
                    tensors.append(value)
                    kinds.append(key)
                    names.append(f"{key} of {self.param_names[id(p)]}")
        if not tensors:
            return
        averages = self._average(tensors, kinds, names, step)
        num_params = len(self.params) if params_due else 0
        if params_due:
            self._finish_parameter_sync(averages[:num_params], step)
        self.communicator.assign(tensors[num_params:], averages[num_params:])

    # -- internals ----------------------------------------------------------------------------

    def _finish_parameter_sync(self, averages: list[Tensor], step: int) -> None:
        if self.track_alignment and self.anchors:
            self.alignment.append(self._alignment(averages, step))
        if self.outer is not None:
            self.outer.apply(self.anchors, averages)
            new_params = self.anchors
        else:
            for anchor, average in zip(self.anchors, averages):
                anchor.copy_(average)
            new_params = averages
        self.communicator.assign(self.params, new_params)

    def _average(
        self, tensors: list[Tensor], kinds: list[str], names: list[str], step: int
    ) -> list[Tensor]:
        comm = self.communicator
        averages = comm.mean(tensors, kinds)
        if _all_finite(averages):
            return averages
        offenders = comm.first_non_finite(tensors)
        if not offenders:
            raise NonFiniteError(
                f"Averaging at step {step} overflowed although every worker's values are finite "
                "(values too large for their dtype)"
            )
        described = "; ".join(f"worker {w}: {names[i]}" for w, i in sorted(offenders.items()))
        if self.on_non_finite == "raise":
            raise NonFiniteError(
                f"Non-finite value (NaN/inf) at step {step} in {described}. Nothing was averaged; "
                "use on_non_finite='skip' (CLI: --on-non-finite skip) to leave such workers out"
            )
        excluded = sorted(offenders)
        if len(excluded) == comm.num_workers:
            raise NonFiniteError(
                f"Non-finite value (NaN/inf) at step {step} on every worker ({described}); "
                "no worker is left to average"
            )
        logger.warning(
            "step %d: leaving worker(s) %s out of this round (%s)", step, excluded, described
        )
        self.skipped_rounds.append({"step": step, "workers": excluded, "tensors": described})
        averages = comm.mean(tensors, kinds, excluded=excluded)
        if not _all_finite(averages):
            raise NonFiniteError(
                f"Non-finite average at step {step} even without workers {excluded}"
            )
        return averages

    def _alignment(self, averages: list[Tensor], step: int) -> dict[str, Any]:
        comm = self.communicator
        dot = norm_local = norm_global = drift = 0.0
        for param, anchor, average in zip(self.params, self.anchors, averages):
            local_update = (anchor - param).float()  # each worker's pseudo-gradient
            global_update = (anchor - average).float()
            dot = dot + comm.per_worker_sum(local_update * global_update)
            norm_local = norm_local + comm.per_worker_sum(local_update.square())
            norm_global = norm_global + global_update.square().sum()
            drift = drift + comm.per_worker_sum((param - average).float().square())
        cosine = dot / (norm_local.sqrt() * norm_global.sqrt()).clamp_min(1e-30)
        return {
            "step": step,
            "cosine": comm.gather_scalars(cosine).tolist(),
            "drift": comm.gather_scalars(drift.sqrt()).tolist(),
        }

    def _state_keys(self) -> set[str]:
        return {key for p in self.params for key in self.optimizer.state.get(p, {})}

    # -- checkpointing ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step_count,
            "anchors": [a.clone() for a in self.anchors],
            "outer": self.outer.state_dict() if self.outer else None,
            "traffic": self.communicator.traffic.state_dict(),
            "skipped_rounds": list(self.skipped_rounds),
            "alignment": list(self.alignment),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step_count = int(state["step"])
        for anchor, saved in zip(self.anchors, state["anchors"], strict=True):
            anchor.copy_(saved)
        if self.outer is not None:
            self.outer.load_state_dict(state["outer"])
        self.communicator.traffic.load_state_dict(state["traffic"])
        self.skipped_rounds = list(state["skipped_rounds"])
        self.alignment = list(state["alignment"])


def _all_finite(tensors: Sequence[Tensor]) -> bool:
    return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())


def _param_names(optimizer: Optimizer) -> dict[int, str]:
    names: dict[int, str] = {}
    for g, group in enumerate(optimizer.param_groups):
        group_names = group.get("names") or group.get("param_names")
        for i, p in enumerate(group["params"]):
            names[id(p)] = group_names[i] if group_names else f"param {i} of group {g}"
    return names
