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
committed (the communicator may still discard it, raising ``RoundNotCommitted``), then applied;
every committed round leaves a :class:`SyncEvent` in ``events``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from mtdao.sync.communicator import Communicator, SingleWorker, Traffic
from mtdao.sync.layout import WorkerLayout
from mtdao.sync.outer import NesterovOuterStep
from mtdao.sync.policy import NON_AVERAGED_STATE_KEYS, SyncPolicy
from mtdao.sync.rounds import CheckedRound, SyncEvent, SyncRound, alignment

logger = logging.getLogger(__name__)

NON_FINITE_ACTIONS = ("raise", "skip")


class NonFiniteError(FloatingPointError):
    """A worker's tensor held NaN or inf when it was due to be averaged."""


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
        try:
            if self.policy.average_gradients and owners:
                names = [f"gradient of {self.param_names[id(p)]}" for p in owners]
                grads = [p.grad for p in owners]
                due = SyncRound(self.step_count + 1, grads, ["grads"] * len(grads), names)
                checked = self._average(due)
                self._commit(checked)
                self.communicator.assign(grads, checked.averages)
        finally:
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
        try:
            if due.tensors:
                self._run_round(due, num_params)
        finally:
            self.seconds_syncing += time.perf_counter() - started

    def round_due(self, step: int) -> bool:
        """Whether step ``step`` (counted from 1) has a round: gradients averaged before it, or
        parameters or states after it. For a communicator that prepares each round (a quorum)
        before the step's forward pass; before the optimizer keeps any state, a state rule due
        at ``step`` counts."""
        if self.policy.average_gradients:
            return True
        due, _ = self._due_after_step(step)
        if due.tensors:
            return True
        if self._state_keys():
            return False
        rules = [self.policy.other_states, *self.policy.states.values()]
        return any(rule.is_due(step) for rule in rules)

    # -- one round ----------------------------------------------------------------------------

    def _run_round(self, due: SyncRound, num_params: int) -> None:
        """Average, check, commit, apply: nothing is written before the communicator commits."""
        checked = self._average(due, heal=True)
        averaged_params = checked.averages[:num_params]
        if num_params and self.track_alignment and self.anchors:
            # the per-worker gathers are part of the round: a peer lost in them discards it
            checked.alignment = alignment(
                self.layout, self.params, self.anchors, averaged_params, due.step
            )
        self._commit(checked)
        if num_params:
            self._finish_parameter_sync(averaged_params)
        if len(due.tensors) > num_params:
            self.communicator.assign(due.tensors[num_params:], checked.averages[num_params:])

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

    def _average(self, due: SyncRound, heal: bool = False) -> CheckedRound:
        """One communicator call for the round, checked; a worker holding NaN/inf is either
        reported (nothing averaged) or left out of a second call (``on_non_finite='skip'``).

        heal (rounds after the optimizer step): a worker holding NaN/inf in any tensor, due or
        not, is left out, then healed with the others' average of everything else it holds.
        """
        result = self.communicator.average(due.tensors, due.kinds)
        averages = result.wait()
        sent, collectives = result.bytes, result.collectives
        excluded: list[int] = []
        skipped = None
        if not self.layout.all_finite(averages):
            skipping = heal and self.on_non_finite == "skip"
            excluded, skipped = self._workers_to_leave_out(
                self._held(due.step) if skipping else due
            )
            retry = self.communicator.average(due.tensors, due.kinds, excluded=excluded)
            averages = retry.wait()
            sent, collectives = sent + retry.bytes, collectives + retry.collectives
            if not self.layout.all_finite(averages):
                raise NonFiniteError(
                    f"Non-finite average at step {due.step} even without workers {excluded}"
                )
        kinds = list(dict.fromkeys(due.kinds))
        checked = CheckedRound(averages, [SyncEvent(due.step, kinds, sent, collectives)], skipped)
        if heal and excluded:
            self._heal(checked, excluded, due.step, skip={id(t) for t in due.tensors})
        return checked

    def _commit(self, checked: CheckedRound) -> None:
        """The communicator's last word on a checked round; only a committed round is recorded
        and written."""
        self.communicator.commit()
        self._record(checked)

    def _record(self, checked: CheckedRound) -> None:
        self.events += checked.events
        if checked.skipped is not None:
            self.skipped_rounds.append(checked.skipped)
        if checked.alignment is not None:
            self.alignment.append(checked.alignment)
        if checked.heal is not None:  # the workers left out take the others' values
            self.layout.assign_to_workers(*checked.heal)

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
        tensors = [t for t in held.tensors if id(t) not in skip]
        if not tensors:
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

    def _finish_parameter_sync(self, averages: list[Tensor]) -> None:
        if self.outer is not None:
            self.outer.apply(self.anchors, averages)
            new_params = self.anchors
        else:
            for anchor, average in zip(self.anchors, averages):
                anchor.copy_(average)
            new_params = averages
        self.communicator.assign(self.params, new_params)

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
