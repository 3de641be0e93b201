"""The local-update sync engine: around each optimizer step, average whatever the policy says is due.

The engine wraps an unmodified optimizer (any element-wise ``torch.optim`` optimizer, torch's
AdamW included) and a communicator. One step is

    gradients -> [average gradients (DDP)] -> gradient hooks (clipping) -> optimizer step
              -> average the parameters and states that are due -> [outer step (DiLoCo)]

Drive it explicitly::

    sync = LocalUpdateSync(optimizer, unified(32), communicator)
    sync.register_gradient_hook(lambda: clip(...))   # optional: runs between averaging and step
    loss.backward(); sync.step()                     # optimizer.step() plus what is due

or keep a plain loop and let optimizer step hooks call it::

    with sync.attached():
        for batch in data: ...; optimizer.step()

Step t counts optimizer steps from 1 and is the same on every worker. Each averaging is one
*round*: the tensors due are collected, averaged in one communicator call, checked for NaN/inf,
then applied; every round leaves a :class:`SyncEvent` in ``events``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from mtdao.sync.communicator import Communicator, SingleWorker, Traffic
from mtdao.sync.dtensors import local_shard
from mtdao.sync.layout import WorkerLayout
from mtdao.sync.outer import NesterovOuterStep
from mtdao.sync.policy import NON_AVERAGED_STATE_KEYS, SyncPolicy

logger = logging.getLogger(__name__)

NON_FINITE_ACTIONS = ("raise", "skip")


class NonFiniteError(FloatingPointError):
    """A worker's tensor held NaN or inf when it was due to be averaged."""


@dataclass
class SyncEvent:
    """One averaging round as it happened: at which step, which kinds, what it sent per worker."""

    step: int
    kinds: list[str]
    bytes: int
    collectives: int


@dataclass
class SyncRound:
    """The tensors due at one step, averaged together in one communicator call."""

    step: int
    tensors: list[Tensor]
    kinds: list[str]
    names: list[str]


class LocalUpdateSync:
    """Carries out a :class:`SyncPolicy` for one optimizer over one communicator.

    ``on_non_finite``: ``"raise"`` stops with an error naming worker, tensor and step before
    anything is averaged; ``"skip"`` leaves the offending workers out of that round and heals
    them: they receive the others' average of every tensor they hold (parameters and every
    state, due or not, counted as "heal" traffic), so they rejoin at once. Each such event is
    recorded in ``skipped_rounds``.
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
        self.events: list[SyncEvent] = []
        self.skipped_rounds: list[dict[str, Any]] = []
        self.alignment: list[dict[str, Any]] = []
        self.seconds_syncing = 0.0
        """Wall-clock seconds this process spent in rounds (a measurement, not state)."""
        # an OrderedDict, not a dict: RemovableHandle keeps a weak reference to it
        self._gradient_hooks: OrderedDict[int, Callable[[], Any]] = OrderedDict()
        self._state_keys_checked = False
        self.traffic.ddp_bytes_per_step = sum(self.layout.worker_bytes(p) for p in self.params)
        with torch.no_grad():
            if broadcast_initial:
                self.communicator.broadcast_from_first(self.params)
            needs_anchor = policy.outer is not None or track_alignment
            # The anchor is the global model after the last parameter sync (DiLoCo's x_start).
            self.anchors = (
                [self.layout.global_copy(p) for p in self.params]
                if needs_anchor and policy.params.period is not None
                else []
            )
        self.outer = NesterovOuterStep(policy.outer, self.anchors) if policy.outer else None

    @property
    def layout(self) -> WorkerLayout:
        return self.communicator.layout

    @property
    def traffic(self) -> Traffic:
        return self.communicator.traffic

    # -- driving ------------------------------------------------------------------------------

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """``optimizer.step(closure)`` with gradient averaging and hooks before, syncs after."""
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

    def register_gradient_hook(self, hook: Callable[[], Any]) -> RemovableHandle:
        """Call ``hook()`` once the gradients are final (averaged, for DDP), before the step.

        Gradient clipping belongs here. Returns a handle whose ``remove()`` unregisters the hook.
        """
        handle = RemovableHandle(self._gradient_hooks)
        self._gradient_hooks[handle.id] = hook
        return handle

    @torch.no_grad()
    def before_optimizer_step(self) -> None:
        """DDP: replace every worker's gradients by their average; then run the gradient hooks."""
        started = time.perf_counter()
        owners = [p for p in self.params if p.grad is not None]
        if self.policy.average_gradients and owners:
            names = [f"gradient of {self.param_names[id(p)]}" for p in owners]
            grads = [p.grad for p in owners]
            due = SyncRound(self.step_count + 1, grads, ["grads"] * len(grads), names)
            self.communicator.assign(grads, self._average(due))
        self.seconds_syncing += time.perf_counter() - started
        for hook in list(self._gradient_hooks.values()):
            hook()

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """Count the step and average the parameters and states that are due."""
        started = time.perf_counter()
        self.step_count += 1
        self.traffic.steps = self.step_count
        if not self._state_keys_checked:
            self.policy.check_state_keys(self._state_keys())
            self._state_keys_checked = True
        due, num_params = self._due_after_step(self.step_count)
        if due.tensors:
            averages = self._average(due, heal=True)
            if num_params:
                self._finish_parameter_sync(averages[:num_params], due.step)
            if len(due.tensors) > num_params:
                self.communicator.assign(due.tensors[num_params:], averages[num_params:])
        self.seconds_syncing += time.perf_counter() - started

    # -- one round ----------------------------------------------------------------------------

    def _due_after_step(self, step: int) -> tuple[SyncRound, int]:
        """The round of ``step`` and how many parameters lead it (all of them, or none)."""
        params = list(self.params) if self.policy.params.is_due(step) else []
        names = [self.param_names[id(p)] for p in params]
        due = SyncRound(step, list(params), ["params"] * len(params), names)
        for p in self.params:
            for key, value in self._worker_states(p):
                if self.policy.state_rule(key).is_due(step):
                    due.tensors.append(value)
                    due.kinds.append(key)
                    due.names.append(f"{key} of {self.param_names[id(p)]}")
        return due, len(params)

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

    def _average(self, due: SyncRound, heal: bool = False) -> list[Tensor]:
        """One communicator call for the round, checked; a worker holding NaN/inf is either
        reported (nothing averaged) or left out of a second call (``on_non_finite='skip'``).

        heal (rounds after the optimizer step): a worker holding NaN/inf in any tensor, due or
        not, is left out, then healed with the others' average of everything else it holds.
        """
        result = self.communicator.average(due.tensors, due.kinds)
        averages = result.wait()
        sent, collectives = result.bytes, result.collectives
        excluded: list[int] = []
        if not self.layout.all_finite(averages):
            skipping = heal and self.on_non_finite == "skip"
            excluded = self._workers_to_leave_out(self._held(due.step) if skipping else due)
            retry = self.communicator.average(due.tensors, due.kinds, excluded=excluded)
            averages = retry.wait()
            sent, collectives = sent + retry.bytes, collectives + retry.collectives
            if not self.layout.all_finite(averages):
                raise NonFiniteError(
                    f"Non-finite average at step {due.step} even without workers {excluded}"
                )
        kinds = list(dict.fromkeys(due.kinds))
        self.events.append(SyncEvent(due.step, kinds, sent, collectives))
        if heal and excluded:
            self._heal(excluded, due.step, skip={id(t) for t in due.tensors})
        return averages

    def _held(self, step: int) -> SyncRound:
        """Everything a worker holds its own copy of: its parameters and every parameter-shaped
        optimizer state (whether the policy averages it or keeps it local)."""
        held = SyncRound(step, [], [], [])
        for p in self.params:
            name = self.param_names[id(p)]
            for key, value in [("params", p), *self._worker_states(p)]:
                held.tensors.append(value)
                held.kinds.append(key)
                held.names.append(name if key == "params" else f"{key} of {name}")
        return held

    @torch.no_grad()
    def heal_non_finite_workers(self) -> list[int]:
        """Heal now every worker holding NaN/inf anywhere (``on_non_finite='skip'``): it takes
        the others' average of everything it holds. Returns the workers healed. Between rounds a
        worker left out stays non-finite; this makes the state finite, e.g. before a checkpoint."""
        held = self._held(self.step_count)
        offenders = self.layout.first_non_finite(held.tensors)
        if not offenders:
            return []
        excluded = self._workers_to_leave_out(held, offenders)
        self._heal(excluded, self.step_count, skip=set())
        return excluded

    def _heal(self, workers: list[int], step: int, skip: set[int]) -> None:
        """Give ``workers`` the others' average of every tensor they hold but those in ``skip``
        (ids of the tensors the round already averaged); every worker takes part in the
        collective, only ``workers`` are overwritten."""
        held = self._held(step)
        tensors = [t for t in held.tensors if id(t) not in skip]
        if not tensors:
            return
        result = self.communicator.average(tensors, ["heal"] * len(tensors), excluded=workers)
        averages = result.wait()
        if not self.layout.all_finite(averages):
            raise NonFiniteError(
                f"Cannot heal workers {workers} at step {step}: non-finite average"
            )
        layout = self.layout
        local = torch.arange(layout.rank, layout.rank + layout.local_workers)
        chosen = torch.isin(local, torch.tensor(workers))
        if bool(chosen.any()):
            for tensor, average in zip(tensors, averages):
                tensor = local_shard(tensor)  # a sharded tensor's average is its shard's
                mask = layout.per_worker_view(chosen.to(tensor.device), tensor)
                tensor.copy_(torch.where(mask, average.to(tensor.dtype), tensor))
        self.events.append(SyncEvent(step, ["heal"], result.bytes, result.collectives))
        self.skipped_rounds[-1]["healed_tensors"] = len(tensors)

    def _workers_to_leave_out(self, due: SyncRound, offenders: dict | None = None) -> list[int]:
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
        self.skipped_rounds.append({"step": due.step, "workers": excluded, "tensors": described})
        return excluded

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

    def _alignment(self, averages: list[Tensor], step: int) -> dict[str, Any]:
        layout = self.layout
        dot = norm_local = norm_global = drift = 0.0
        for param, anchor, average in zip(self.params, self.anchors, averages):
            param = local_shard(param)  # anchors and averages of a sharded tensor are shards
            local_update = (anchor - param).float()  # each worker's pseudo-gradient
            global_update = (anchor - average).float()
            dot = dot + layout.per_worker_sum(local_update * global_update)
            norm_local = norm_local + layout.per_worker_sum(local_update.square())
            norm_global = norm_global + layout.global_sum(global_update.square())
            drift = drift + layout.per_worker_sum((param - average).float().square())
        cosine = dot / (norm_local.sqrt() * norm_global.sqrt()).clamp_min(1e-30)
        return {
            "step": step,
            "cosine": layout.gather(cosine).tolist(),
            "drift": layout.gather(drift.sqrt()).tolist(),
        }

    def _state_keys(self) -> set[str]:
        return {key for p in self.params for key in self.optimizer.state.get(p, {})}

    # -- checkpointing ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything the engine carries between steps: the step, the anchors and the outer
        momentum (global tensors), the traffic account and the record of every round."""
        return {
            "step": self.step_count,
            "anchors": [a.clone() for a in self.anchors],
            "outer": self.outer.state_dict() if self.outer else None,
            "traffic": self.traffic.state_dict(),
            "events": [asdict(event) for event in self.events],
            "skipped_rounds": list(self.skipped_rounds),
            "alignment": list(self.alignment),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step_count = int(state["step"])
        for anchor, saved in zip(self.anchors, state["anchors"], strict=True):
            anchor.copy_(saved)
        if self.outer is not None:
            self.outer.load_state_dict(state["outer"])
        self.traffic.load_state_dict(state["traffic"])
        self.events = [SyncEvent(**event) for event in state["events"]]
        self.skipped_rounds = list(state["skipped_rounds"])
        self.alignment = list(state["alignment"])


def _param_names(optimizer: Optimizer) -> dict[int, str]:
    names: dict[int, str] = {}
    for g, group in enumerate(optimizer.param_groups):
        group_names = group.get("names") or group.get("param_names")
        for i, p in enumerate(group["params"]):
            names[id(p)] = group_names[i] if group_names else f"param {i} of group {g}"
    return names
