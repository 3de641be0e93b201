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
*round* (:class:`~mtdao.sync.rounds.Round`), with one lifecycle on every communicator: opened
(the tensors due collected and encoded), in flight (the transport's work), landed (averages
waited for, decoded, checked for NaN/inf), committed (the communicator may still discard it,
raising ``RoundNotCommitted``: the round is then undone, as if never sent), then applied; every
committed round leaves a :class:`SyncEvent` in ``events``, recorded at its commit. Three options
change how a round travels, each in its own module the engine composes:

* ``fragments=P`` (:mod:`.fragments`): the layers fall into P fragments due at staggered steps;
* ``delay=D`` (:mod:`.overlap`): a round is sent D steps before it is applied (at the policy's
  step), merged with the local progress made meanwhile, its collectives running while the
  workers compute;
* ``codecs`` (:mod:`.compression`, :mod:`.quantize`): a dtype on the link per kind, parameters
  sent as pseudo-gradients;
* ``radial_directional`` (:mod:`.radial`): the parameters' and/or momenta's updates averaged
  as a mean norm and a mean direction apart.

They work on every communicator. One whose transport runs a single round at a time (a torchft
manager: one quorum, one commit) settles the rounds in flight, landed and committed, before it
opens the next (:meth:`LocalUpdateSync.settle_in_flight`); they are still applied at their own
steps. A communicator that prepares each round ahead (a quorum of fault-tolerant replicas) is
handed the coming step and what is due then (:meth:`LocalUpdateSync.prepare`, which
``attached()`` calls after every step); it never calls into the engine.
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

from mtdao.sync.codecs.compression import SyncCodecs
from mtdao.sync.communicator import (
    Communicator,
    FinalRoundNotCommitted,
    RoundNotCommitted,
    SingleWorker,
    Traffic,
)
from mtdao.sync.dtensors import local_shard
from mtdao.sync.healing import NON_FINITE_ACTIONS, NonFiniteError, NonFiniteWorkers
from mtdao.sync.layout import WorkerLayout
from mtdao.sync.outer import NesterovOuterStep
from mtdao.sync.policy import SyncPolicy
from mtdao.sync.repeated_lines import RepeatedLines
from mtdao.sync.round_plan import RoundPlan
from mtdao.sync.rounds import (
    CheckedRound,
    Round,
    RoundsInFlight,
    SyncEvent,
    SyncRound,
    alignment,
)
from mtdao.sync.sharded_state import ShardedEngineState
from mtdao.sync.trained_state import TrainedState

__all__ = [
    "FINAL_ROUND_TRIES",
    "FinalRoundNotCommitted",
    "LocalUpdateSync",
    "NonFiniteError",
    "NON_FINITE_ACTIONS",
    "SyncEvent",
]

logger = logging.getLogger(__name__)

FINAL_ROUND_TRIES = 3
"""How many times the final round is formed before the run gives up: a round the communicator
discards (a peer lost while it was in flight) is formed again among the workers left, each try
in a quorum of its own (at most ``--quorum-timeout`` to form, ``--collective-timeout`` per
collective)."""


class LocalUpdateSync:
    """Carries out a :class:`SyncPolicy` for one optimizer over one communicator.

    ``on_non_finite``: ``"raise"`` stops with an error naming worker, tensor and step before
    anything is averaged; ``"skip"`` leaves the offending workers out of that round and heals
    them: they receive the others' average of every tensor they hold (parameters and every
    state, due or not, counted as "heal" traffic), so they rejoin at once (a delayed round's
    offenders take the round's average, without a merge). Each such event is recorded in
    ``skipped_rounds``.
    ``track_alignment`` records, at each parameter sync, each worker's cosine similarity between
    its pseudo-gradient and the global one, and its parameter drift from the average.
    ``fragments``, ``delay`` and ``codecs`` (a :class:`~mtdao.sync.codecs.compression.SyncCodecs`) split,
    overlap and quantize the rounds (see the module docstring); ``state_decays`` gives each state
    key's EMA decay for the delayed merge (default: :func:`~mtdao.sync.policy.state_decays`).
    ``radial_directional`` names the kinds (``params``, ``momenta``) averaged as norm and
    direction apart (:mod:`~mtdao.sync.radial`).
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
        fragments: int = 1,
        delay: int = 0,
        codecs: SyncCodecs | None = None,
        state_decays: dict[str, float] | None = None,
        radial_directional: tuple[str, ...] = (),
    ) -> None:
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
        self.discarded_rounds: list[dict[str, Any]] = []
        self._repeated_lines = RepeatedLines()  # a discard at every step says one line a minute
        self.in_sync: dict[tuple[str, int], int] = {}
        """(kind, parameter index) -> the step at which a blocking round last assigned that
        tensor on every worker (what the final round may leave out)."""
        """Rounds the communicator discarded inside ``attached()`` (step, reason)."""
        self.alignment: list[dict[str, Any]] = []
        self.seconds_syncing = 0.0
        """Wall-clock seconds this process spent in rounds (a measurement, not state)."""
        # an OrderedDict, not a dict: RemovableHandle keeps a weak reference to it
        self._gradient_hooks: OrderedDict[int, Callable[[], Any]] = OrderedDict()
        self._state_keys_checked = False
        self.traffic.ddp_bytes_per_step = sum(self.layout.worker_bytes(p) for p in self.params)
        names = [self.param_names[id(p)] for p in self.params]
        self.plan = RoundPlan(
            policy,
            optimizer,
            self.communicator,
            names,
            fragments=fragments,
            delay=delay,
            codecs=codecs,
            decays=state_decays,
            radial=radial_directional,
        )
        self.non_finite = NonFiniteWorkers(
            on_non_finite,
            self.params,
            names,
            optimizer,
            self.communicator,
            self.plan.pseudo_gradients,
        )
        self.sharded = ShardedEngineState(self.params, names, self.plan, self.layout)
        self.pending = RoundsInFlight()
        with torch.no_grad():
            if broadcast_initial:
                self.communicator.broadcast_from_first(self.params)
            needs_anchor = (
                policy.outer is not None
                or track_alignment
                or self.plan.pseudo_gradients
                or self.plan.radial_params
            )
            # The anchor is the global model after the last parameter sync (DiLoCo's x_start).
            self.anchors = (
                [self.layout.global_copy(p) for p in self.params]
                if needs_anchor and policy.params.period is not None
                else []
            )
        self.outer = (
            NesterovOuterStep(policy.outer, self.anchors, policy.params.period)
            if policy.outer
            else None
        )
        if self.communicator.heals_joiners:  # a worker joining late takes all this from a peer
            self.communicator.attach_trained_state(TrainedState(self))

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
    def attached(self, final_round: bool = True) -> Iterator[LocalUpdateSync]:
        """Hook the engine into ``optimizer.step()`` for the duration of the block; when the
        block ends without an error, the final round (:meth:`finish`; ``final_round=False``
        leaves each worker its own model): a final round the communicator discards is formed
        again, and ``FinalRoundNotCommitted`` raised when no try commits.

        A communicator that prepares its rounds ahead (fault-tolerant replicas: a quorum, where
        a joining replica heals) is prepared on entry and after every step, so a plain loop
        needs nothing more: loop while ``sync.step_count`` is below the run's steps (a healed
        replica continues at its source's step). A round such a communicator discards after a
        step is undone and recorded in ``discarded_rounds``; the loop goes on, each worker on
        its own state. (A discarded gradient round, DDP, raises ``RoundNotCommitted`` out of
        ``optimizer.step()``: the step is not taken.)"""
        pre = self.optimizer.register_step_pre_hook(lambda *_: self.before_optimizer_step())
        post = self.optimizer.register_step_post_hook(lambda *_: self._after_attached_step())
        try:
            self._prepare_until_ready()
            yield self
            if final_round:
                self.finish()
        finally:
            pre.remove()
            post.remove()

    def _after_attached_step(self) -> None:
        try:
            self.after_optimizer_step()
        except RoundNotCommitted as failure:
            self._note_discarded(failure)
        self._prepare_until_ready()

    def _prepare_until_ready(self) -> None:
        """:meth:`prepare`, again while it discards what it settles (each retry forms a new
        quorum, as a retried step would)."""
        while True:
            try:
                self.prepare()
                return
            except RoundNotCommitted as failure:
                self._note_discarded(failure)

    def _note_discarded(self, failure: RoundNotCommitted, then: str = "") -> None:
        """Record a discarded round; say so, each kind of line once a minute."""
        self.discarded_rounds.append({"step": self.step_count, "reason": str(failure)})
        then = then or "every worker keeps its own state"
        line = self._repeated_lines.line(f"step {self.step_count}: {failure}; {then}")
        if line is not None:
            logger.warning(line)

    def _note_final_discarded(self, failure: RoundNotCommitted) -> None:
        self._note_discarded(failure, "the final round is formed again")

    def prepare(self) -> Any:
        """Before the coming step's forward pass: let a communicator that prepares each round
        ahead (:attr:`~mtdao.sync.communicator.Communicator.prepares_rounds`: a quorum of the
        live replicas, where a joining one heals) do it, having settled the rounds in flight
        first when the communicator runs one round at a time and a round is due. Returns what
        the communicator reports (a torchft quorum's ``RoundStart``; None: nothing). ``attached()``
        calls it; a loop that calls :meth:`step` itself calls it before each forward pass."""
        if not self.communicator.prepares_rounds:
            return None
        coming = self.step_count + 1
        if not self.communicator.rounds_overlap and self.round_due(coming):
            self.settle_in_flight()  # its commit in its own quorum, before the next one forms
        return self.communicator.prepare(coming, self.round_due)

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
                gradients = self._open(due)
                self.communicator.assign(grads, self._settle(gradients).averages)
                gradients.applied()
        finally:
            self.seconds_syncing += time.perf_counter() - started
        for hook in list(self._gradient_hooks.values()):
            hook()

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """Count the step; apply the delayed rounds that land now; open the round due now.

        A landing round that is discarded is undone and the step goes on (the round due now is
        still opened); the discard is raised at the end, as a blocking round's is."""
        started = time.perf_counter()
        self.step_count += 1
        self.traffic.steps = self.step_count
        if not self._state_keys_checked:
            self.policy.check_state_keys(self._state_keys())
            self._state_keys_checked = True
        discarded: RoundNotCommitted | None = None
        try:
            for landing in self.pending.pop_landing(self.step_count):
                try:
                    self._land(landing)
                except RoundNotCommitted as failure:
                    discarded = failure
            for in_flight in self.pending.to_advance(self.step_count):
                try:  # the exchange's second stage; a peer lost in the first discards it
                    in_flight.advance()
                except RoundNotCommitted as failure:
                    self.pending.remove(in_flight)
                    discarded = discarded or failure
            due = self.plan.collect(self.step_count)
            if due.tensors:
                opened = self._open(due)
                if self.plan.delay:
                    self.pending.add(opened)
                else:
                    self._land(opened)
        finally:
            self.seconds_syncing += time.perf_counter() - started
        if discarded is not None:
            raise discarded

    def round_due(self, step: int) -> bool:
        """Whether step ``step`` (counted from 1) opens a round: gradients averaged before it,
        or parameters or states sent after it. For a communicator that prepares each round (a
        quorum) before the step's forward pass; before the optimizer keeps any state, a state
        rule due at ``step`` counts."""
        if self.policy.average_gradients or self.plan.collect(step).tensors:
            return True
        if self._state_keys():
            return False
        rules = [self.policy.other_states, *self.policy.states.values()]
        return any(rule.is_due(step + self.plan.delay) for rule in rules)

    @torch.no_grad()
    def settle_in_flight(self) -> None:
        """Land and commit (or discard) every round in flight now; each is still applied at its
        own step. A communicator that runs one round at a time calls it before it opens the
        next; the first discard is raised once every round is settled."""
        if self.communicator.rounds_overlap:
            return
        started = time.perf_counter()
        discarded: RoundNotCommitted | None = None
        try:
            for in_flight in list(self.pending.rounds):
                try:
                    self._settle(in_flight)
                except RoundNotCommitted as failure:
                    discarded = discarded or failure
        finally:
            self.seconds_syncing += time.perf_counter() - started
        if discarded is not None:
            raise discarded

    def complete_transfers(self) -> None:
        """Wait until the collectives of every delayed round have completed; the rounds are
        still applied at their own steps (nothing changes but when the waiting happens). A
        communicator that runs one round at a time (a torchft manager) waits only inside the
        round's lifecycle, where a failure the wait sees can discard the round."""
        if not self.communicator.rounds_overlap:
            return
        for pending in self.pending.rounds:
            pending.result.wait()

    @torch.no_grad()
    def flush(self) -> None:
        """Apply every delayed round now (e.g. before using the model once training ends); the
        first discard is raised once every round has landed."""
        discarded: RoundNotCommitted | None = None
        for pending in self.pending.pop_landing(None):
            try:
                self._land(pending)
            except RoundNotCommitted as failure:
                discarded = discarded or failure
        if discarded is not None:
            raise discarded

    def finish(
        self, on_discarded: Callable[[RoundNotCommitted], None] | None = None
    ) -> SyncEvent | None:
        """The final round, once training ends: every worker then holds the same global model.

        The rounds in flight land first (:meth:`flush`); then one blocking round averages every
        tensor the policy averages (the parameters and every state with a period), whatever its
        fragment, except those every worker holds alike already: the tensors a blocking round
        assigned at this very step. Under an outer step (DiLoCo) the parameters take the plain
        average: the outer step belongs to the syncs, and its anchor and momentum stay the last
        sync's. A run whose last step synced everything without delay sends nothing here, and
        nothing changes. With a codec the final round is quantized like any other; a
        communicator that prepares its rounds (a quorum of fault-tolerant replicas) prepares
        this one too, so replicas that join at its quorum heal and end with the same model.

        A final round the communicator discards (a peer lost while it was in flight) is undone
        and formed again among the workers left, up to :data:`FINAL_ROUND_TRIES` tries in all;
        each discard goes to ``on_discarded`` (default: recorded in ``discarded_rounds`` and
        logged). Returns the round's event (None: nothing was left to average); raises
        ``FinalRoundNotCommitted`` when no try committed (each worker then holds its own
        model). ``attached()`` calls it when its block ends without an error."""
        on_discarded = on_discarded or self._note_final_discarded
        for _ in range(FINAL_ROUND_TRIES):
            try:
                return self._final_round()
            except RoundNotCommitted as failure:
                on_discarded(failure)
                last = failure
        raise FinalRoundNotCommitted(
            f"the final round was discarded {FINAL_ROUND_TRIES} times (the last: {last}): the "
            "workers do not hold the same model (each keeps its own); with enough of them alive "
            "and reachable, run again from the last checkpoint"
        )

    @torch.no_grad()
    def _final_round(self) -> SyncEvent | None:
        """One try of the final round (see :meth:`finish`)."""
        started = time.perf_counter()
        try:
            self.flush()
            due = self._final_due()
            if self.communicator.prepares_rounds:  # (a heal there may bring another state)
                self.communicator.prepare(self.step_count + 1, lambda _: bool(due.tensors), True)
                due = self._final_due()
            if not due.tensors:
                return None
            final = self._open(due, final=True)
            self._land(final)
            return final.event
        finally:
            self.seconds_syncing += time.perf_counter() - started

    @contextlib.contextmanager
    def averaged_parameters(self) -> Iterator[None]:
        """Within the block every worker holds the workers' average of the parameters (control
        traffic, not counted), its own coming back after: evaluating the global model between
        syncs. A fault-tolerant replica, which coordinates nothing between rounds, keeps its
        own (right after a parameter sync that is the global model)."""
        if self.communicator.prepares_rounds or self.layout.num_workers == 1:
            yield
            return
        with torch.no_grad():
            own = [local_shard(p).detach().clone() for p in self.params]
            for p, average in zip(self.params, self.layout.global_mean(self.params)):
                local_shard(p).copy_(average)  # (a stacked tensor takes it in every row)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, mine in zip(self.params, own):
                    local_shard(p).copy_(mine)

    def _final_due(self) -> SyncRound:
        step = self.step_count
        return self.plan.collect_final(
            step, lambda kind, index: self.in_sync.get((kind, index)) == step
        )

    # -- one round: opened, in flight, landed, committed or discarded, applied -----------------

    def _open(self, due: SyncRound, final: bool = False) -> Round:
        """Open the round: encode what is due and launch its collectives (``final``: the final
        round, blocking whatever the delay)."""
        opened = self.plan.open(due, self.anchors, blocking=final)
        result, kinds = opened.result, list(dict.fromkeys(due.kinds))
        opened.event = SyncEvent(due.step, kinds, result.bytes, result.collectives, final)
        return opened

    def _settle(self, landing: Round) -> CheckedRound:
        """Land the round (wait, decode, check), then commit and record it; a round the
        communicator discards is undone and ``RoundNotCommitted`` raised."""
        if landing.committed:
            return landing.checked
        try:
            averages = landing.land()
            checked = self._check(landing, averages, heal=landing.due.kinds[0] != "grads")
            checked.averages = self.plan.decoded(landing, checked.averages, self.anchors)
            due, num_params = landing.due, len(landing.due.param_indices)
            if num_params and self.track_alignment and self.anchors:
                # the per-worker gathers are part of the round: a peer lost in them discards it
                means = self.plan.global_params(
                    landing, checked.averages[:num_params], self.anchors
                )
                local = landing.snapshots[:num_params] if landing.snapshots else due.tensors
                anchors = [self.anchors[i] for i in due.param_indices]
                checked.alignment = alignment(self.layout, local, anchors, means, landing.step)
            landing.commit(self.communicator, checked)
        except RoundNotCommitted:
            self._discard(landing)
            raise
        if landing.recorded:  # a round from a checkpoint of before records at commit
            checked.events = checked.events[1:]
        self._record(checked)
        return checked

    def _discard(self, discarded: Round) -> None:
        """Undo what opening the round changed (nothing else was written): its residuals."""
        discarded.discard()
        self.pending.remove(discarded)

    def _land(self, landing: Round) -> None:
        """Settle the round (unless it was settled early), then apply it: nothing is written
        before the communicator commits."""
        checked = self._settle(landing)
        due = landing.due
        num_params = len(due.param_indices)
        if num_params:
            means = self.plan.global_params(landing, checked.averages[:num_params], self.anchors)
            self._finish_parameter_sync(means, landing)
        if len(due.tensors) > num_params:
            self.plan.apply(landing, num_params, checked.averages[num_params:])
        landing.applied()
        if landing.snapshots is None:  # assigned, not merged: every worker holds these alike
            for kind, owner in zip(due.kinds, due.owners):
                self.in_sync[(kind, owner)] = landing.land_step

    def _check(self, pending: Round, averages: list[Tensor], heal: bool = False) -> CheckedRound:
        """The round's averages, checked; a worker holding NaN/inf is either reported (nothing
        averaged) or left out of a second call (``on_non_finite='skip'``).

        heal (blocking rounds after the optimizer step): a worker holding NaN/inf in any tensor,
        due or not, is left out, then healed with the others' average of everything else."""
        due, event = pending.due, pending.event
        checked = CheckedRound(averages, [event])
        if self.layout.all_finite(averages):
            return checked
        healing = heal and self.on_non_finite == "skip" and not self.plan.delay
        sent = SyncRound(due.step, pending.sent, due.kinds, due.names)
        searched = self.non_finite.held(due.step) if healing else sent
        excluded, checked.skipped = self.non_finite.leave_out(searched)
        retry = self.plan.average(due, pending.sent, excluded)
        checked.averages = retry.wait()
        event.bytes += retry.bytes
        event.collectives += retry.collectives
        if not self.layout.all_finite(checked.averages):
            raise NonFiniteError(
                f"Non-finite average at step {due.step} even without workers {excluded}"
            )
        pending.excluded = excluded
        if healing:
            self.non_finite.heal(checked, excluded, due.step, skip={id(t) for t in due.tensors})
        return checked

    def _record(self, checked: CheckedRound) -> None:
        self.events += checked.events
        if checked.skipped is not None:
            self.skipped_rounds.append(checked.skipped)
        if checked.alignment is not None:
            self.alignment.append(checked.alignment)
        if checked.heal is not None:  # the workers left out take the others' values
            self.layout.assign_to_workers(*checked.heal)
            if self.plan.pseudo_gradients is not None:  # and forget what they had not sent
                self.plan.pseudo_gradients.forget(self.layout, checked.heal[2])

    def _finish_parameter_sync(self, averages: list[Tensor], pending: Round) -> None:
        indices = pending.due.param_indices
        anchors = [self.anchors[i] for i in indices] if self.anchors else []
        if self.outer is not None and pending.event is not None and pending.event.final:
            # the final round of an outer-step policy: the plain average; the anchor and its
            # momentum stay the last sync's, so a run continued from here takes its next outer
            # step over the whole round
            new_params = averages
        elif self.outer is not None:
            self.outer.apply(anchors, averages, indices, pending.land_step)
            new_params = anchors
        else:
            for anchor, average in zip(anchors, averages):
                anchor.copy_(average)
            new_params = averages
        self.plan.apply(pending, 0, new_params)

    def _state_keys(self) -> set[str]:
        return {key for p in self.params for key in self.optimizer.state.get(p, {})}

    @torch.no_grad()
    def heal_non_finite_workers(self) -> list[int]:
        """Heal now every worker holding NaN/inf anywhere (``on_non_finite='skip'``): it takes
        the others' average of everything it holds. Returns the workers healed. Between rounds a
        worker left out stays non-finite; this makes the state finite, e.g. before a checkpoint."""
        checked = self.non_finite.heal_now(self.step_count)
        if checked is None:
            return []
        self._record(checked)
        return checked.heal[2]

    # -- checkpointing ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything the engine carries between steps: the step, the anchors and the outer
        momentum (global tensors), the traffic account and the record of every round. A sharded
        worker's engine gives it as DTensors and the rest: :meth:`sharded_state_dict`."""
        return {
            "step": self.step_count,
            "anchors": [a.clone() for a in self.anchors],
            "outer": self.outer.state_dict() if self.outer else None,
            "traffic": self.traffic.state_dict(),
            "events": [asdict(event) for event in self.events],
            "skipped_rounds": list(self.skipped_rounds),
            "alignment": list(self.alignment),
            "pending": self._rounds_in_flight(),
            "in_sync": [[kind, index, step] for (kind, index), step in self.in_sync.items()],
            "pseudo_gradients": self.plan.pseudo_gradients.state_dict()
            if self.plan.pseudo_gradients
            else None,
            "radial": self.plan.radial.state_dict() if self.plan.radial.groups else None,
        }

    def _rounds_in_flight(self) -> list[dict[str, Any]]:
        """Each round in flight with its averages; one whose transport failed meanwhile is
        discarded (undone) and left out, as it would be when it lands."""
        saved = []
        for in_flight in list(self.pending.rounds):
            try:
                saved.append(in_flight.state_dict())
            except RoundNotCommitted:
                self._discard(in_flight)
        return saved

    def sharded_state_dict(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the engine's sharded tensors as DTensors, for DCP; the rest of its ``state_dict``,
        plain, for the worker's file): see :mod:`~mtdao.sync.sharded_state`. A collective over
        the worker's shard group."""
        plain = self.state_dict()  # (first: a round that failed meanwhile leaves the rounds)
        return self.sharded.split(plain, self.pending.rounds, self.anchors, self.outer)

    def sharded_layout(self, plain: dict[str, Any] | None = None) -> dict[str, Any]:
        """DTensors shaped as :meth:`sharded_state_dict` saved them (``plain``: its plain part),
        for DCP to read into."""
        return self.sharded.layout_of(self.anchors, self.outer, plain)

    def load_sharded_state_dict(self, sharded: dict[str, Any], plain: dict[str, Any]) -> None:
        """Load what :meth:`sharded_state_dict` gave (``sharded`` read by DCP into
        :meth:`sharded_layout` of ``plain``)."""
        self.load_state_dict(self.sharded.join(sharded, plain, self.outer is not None))

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
        self.in_sync = {
            (kind, int(index)): int(step) for kind, index, step in state.get("in_sync", [])
        }
        if self.plan.radial.groups and state.get("radial"):
            self.plan.radial.load_state_dict(state["radial"])
        self.pending = RoundsInFlight()
        for saved in state.get("pending", []):
            restored = self.plan.restore(saved)
            kinds = list(dict.fromkeys(restored.due.kinds))
            restored.event = SyncEvent(restored.step, kinds, saved["bytes"], saved["collectives"])
            if "committed" not in saved:  # saved when rounds were recorded as they opened
                restored.recorded = True
            elif saved["committed"]:  # settled early (one round at a time): only to apply
                restored.restore_committed()
                checked = restored.checked
                checked.averages = self.plan.decoded(restored, checked.averages, self.anchors)
            self.pending.add(restored)
        if self.plan.pseudo_gradients is not None and state.get("pseudo_gradients"):
            self.plan.pseudo_gradients.load_state_dict(state["pseudo_gradients"])


def _param_names(optimizer: Optimizer) -> dict[int, str]:
    names: dict[int, str] = {}
    for g, group in enumerate(optimizer.param_groups):
        group_names = group.get("names") or group.get("param_names")
        for i, p in enumerate(group["params"]):
            names[id(p)] = group_names[i] if group_names else f"param {i} of group {g}"
    return names
