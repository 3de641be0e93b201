"""Every round of one engine driven through its lifecycle, from this one file.

A step's trip and a round's stages are drawn in docs/design.md ("The step sequence", "A
round"): each round moves through the stages of :class:`~mtdao.sync.rounds.Round` here and only
here. The plan (:mod:`.round_plan`) does what fragments, delay and codecs change; the round
(:mod:`.rounds`) keeps its stage; neither calls back here.

:class:`~mtdao.sync.engine.LocalUpdateSync` holds a driver as ``sync.rounds``: its methods are
what a communicator or a training harness calls (``prepare``, ``due``, ``settle_in_flight``,
``complete_transfers``, ``before_step``/``after_step`` for a loop that runs the optimizer step
itself); a user's loop needs the engine's ``step``, ``attached`` and ``finish``.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from mtdao.sync.codecs.compression import SyncCodecs
from mtdao.sync.communicator import Communicator, RoundNotCommitted
from mtdao.sync.healing import NonFiniteError, NonFiniteWorkers
from mtdao.sync.outer import NesterovOuterStep
from mtdao.sync.policy import SyncPolicy
from mtdao.sync.round_plan import RoundPlan
from mtdao.sync.rounds import (
    CheckedRound,
    PendingAlignment,
    Round,
    RoundsInFlight,
    SyncEvent,
    SyncRound,
    alignment,
)


class RoundDriver:
    """The rounds of one engine (see the module docstring and ``LocalUpdateSync`` for the
    options), with everything they leave: the step, the anchors and outer step, the rounds in
    flight and the record of every round."""

    def __init__(
        self,
        optimizer: Optimizer,
        policy: SyncPolicy,
        communicator: Communicator,
        names: Sequence[str],
        *,
        on_non_finite: str,
        track_alignment: bool,
        broadcast_initial: bool,
        fragments: int,
        delay: int,
        codecs: SyncCodecs | None,
        state_decays: dict[str, float] | None,
        radial_directional: tuple[str, ...],
    ) -> None:
        self.optimizer, self.policy, self.communicator = optimizer, policy, communicator
        self.layout, self.traffic = communicator.layout, communicator.traffic
        self.on_non_finite, self.track_alignment = on_non_finite, track_alignment
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self._name_of = {id(p): name for p, name in zip(self.params, names, strict=True)}
        self.step = 0
        self.events: list[SyncEvent] = []
        self.skipped_rounds: list[dict[str, Any]] = []
        self._alignment: list[dict[str, Any] | PendingAlignment] = []
        self.seconds_syncing = 0.0
        """Wall-clock seconds this process spent in rounds (a measurement, not state)."""
        self.in_sync: dict[tuple[str, int], int] = {}
        """(kind, parameter index) -> the step at which a blocking round last assigned that
        tensor on every worker (what the final round may leave out)."""
        # an OrderedDict, not a dict: RemovableHandle keeps a weak reference to it
        self.gradient_hooks: OrderedDict[int, Callable[[], Any]] = OrderedDict()
        self._state_keys_checked = False
        self.traffic.ddp_bytes_per_step = sum(self.layout.worker_bytes(p) for p in self.params)
        self.plan = RoundPlan(
            policy,
            optimizer,
            communicator,
            names,
            fragments=fragments,
            delay=delay,
            codecs=codecs,
            decays=state_decays,
            radial=radial_directional,
        )
        pseudo_gradients = self.plan.pseudo_gradients
        self.non_finite = NonFiniteWorkers(
            on_non_finite, self.params, names, optimizer, communicator, pseudo_gradients
        )
        self.pending = RoundsInFlight()
        with torch.no_grad():
            if broadcast_initial:
                communicator.broadcast_from_first(self.params)
            needs_anchor = (
                policy.outer is not None
                or track_alignment
                or pseudo_gradients
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

    @property
    def alignment(self) -> list[dict[str, Any]]:
        """Per parameter sync (``track_alignment``): each worker's cosine and drift, the gathers
        still in flight waited for here."""
        self._alignment = [
            record.record() if isinstance(record, PendingAlignment) else record
            for record in self._alignment
        ]
        return self._alignment  # type: ignore[return-value]

    @alignment.setter
    def alignment(self, records: list[dict[str, Any]]) -> None:
        self._alignment = list(records)

    # -- around the optimizer step ------------------------------------------------------------

    @contextlib.contextmanager
    def _timed(self) -> Iterator[None]:
        """Count the block's wall-clock time in :attr:`seconds_syncing`, however it ends."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds_syncing += time.perf_counter() - started

    @torch.no_grad()
    def before_step(self) -> None:
        """DDP: replace every worker's gradients by their average; then run the gradient hooks."""
        owners = [p for p in self.params if p.grad is not None]
        with self._timed():
            if self.policy.average_gradients and owners:
                names = [f"gradient of {self._name_of[id(p)]}" for p in owners]
                grads = [p.grad for p in owners]
                due = SyncRound(self.step + 1, grads, ["grads"] * len(grads), names)
                gradients = self._open(due)
                self.communicator.assign(grads, self._settle(gradients).averages)
                gradients.applied()
        for hook in list(self.gradient_hooks.values()):
            hook()

    @torch.no_grad()
    def after_step(self) -> None:
        """Count the step; apply the delayed rounds that land now; open the round due now.

        A landing round that is discarded is undone and the step goes on (the round due now is
        still opened); the discard is raised at the end, as a blocking round's is."""
        with self._timed():
            self.step += 1
            self.traffic.steps = self.step
            if not self._state_keys_checked:
                self.policy.check_state_keys(self._state_keys())
                self._state_keys_checked = True
            discarded: RoundNotCommitted | None = None
            for landing in self.pending.pop_landing(self.step):
                try:
                    self._land(landing)
                except RoundNotCommitted as failure:
                    discarded = failure
            for in_flight in self.pending.to_advance(self.step):
                try:  # the exchange's second stage; a peer lost in the first discards it
                    in_flight.advance()
                except RoundNotCommitted as failure:
                    self.pending.remove(in_flight)
                    discarded = discarded or failure
            due = self.plan.collect(self.step)
            if due.tensors:
                opened = self._open(due)
                if self.plan.delay:
                    self.pending.add(opened)
                else:
                    self._land(opened)
        if discarded is not None:
            raise discarded

    # -- a communicator that prepares each round ahead (a quorum) -----------------------------

    def due(self, step: int) -> bool:
        """Whether step ``step`` (counted from 1) opens a round: gradients averaged before it,
        or parameters or states sent after it. Before the optimizer keeps any state, a state
        rule due at ``step`` counts."""
        if self.policy.average_gradients or self.plan.collect(step).tensors:
            return True
        if self._state_keys():
            return False
        rules = [self.policy.other_states, *self.policy.states.values()]
        return any(rule.is_due(step + self.plan.delay) for rule in rules)

    def prepare(self) -> Any:
        """See :meth:`~mtdao.sync.engine.LocalUpdateSync.prepare`."""
        if not self.communicator.prepares_rounds:
            return None
        coming = self.step + 1
        if not self.communicator.rounds_overlap and self.due(coming):
            self.settle_in_flight()  # its commit in its own quorum, before the next one forms
        return self.communicator.prepare(coming, self.due)

    @torch.no_grad()
    def settle_in_flight(self) -> None:
        """Land and commit (or discard) every round in flight now; each is still applied at its
        own step. A communicator that runs one round at a time has it done before it opens the
        next; the first discard is raised once every round is settled."""
        if self.communicator.rounds_overlap:
            return
        with self._timed():
            each_then_first_discard(self._settle, list(self.pending.rounds))

    def complete_transfers(self) -> None:
        """Wait until the collectives of every delayed round have completed; the rounds are
        still applied at their own steps (nothing changes but when the waiting happens). A
        communicator that runs one round at a time (a torchft manager) waits only inside the
        round's lifecycle, where a failure the wait sees can discard the round."""
        if not self.communicator.rounds_overlap:
            return
        for pending in self.pending.rounds:
            pending.result.wait()

    # -- the end of training ------------------------------------------------------------------

    @torch.no_grad()
    def flush(self) -> None:
        """Apply every delayed round now; the first discard is raised once every round has
        landed."""
        each_then_first_discard(self._land, self.pending.pop_landing(None))

    @torch.no_grad()
    def final_round(self) -> SyncEvent | None:
        """One try of the final round (see :meth:`~mtdao.sync.engine.LocalUpdateSync.finish`)."""
        with self._timed():
            self.flush()
            due = self._final_due()
            if self.communicator.prepares_rounds:  # (a heal there may bring another state)
                self.communicator.prepare(self.step + 1, lambda _: bool(due.tensors), True)
                due = self._final_due()
            if not due.tensors:
                return None
            final = self._open(due, final=True)
            self._land(final)
            return final.event

    def _final_due(self) -> SyncRound:
        step = self.step
        return self.plan.collect_final(
            step, lambda kind, index: self.in_sync.get((kind, index)) == step
        )

    @torch.no_grad()
    def heal_non_finite_workers(self) -> list[int]:
        """Heal now every worker holding NaN/inf anywhere (``on_non_finite='skip'``): it takes
        the others' average of everything it holds. Returns the workers healed. Between rounds a
        worker left out stays non-finite; this makes the state finite, e.g. before a checkpoint."""
        checked = self.non_finite.heal_now(self.step)
        if checked is None:
            return []
        self._record(checked)
        return checked.heal[2]

    # -- one round: opened, in flight, landed, committed or discarded, applied -----------------

    def _open(self, due: SyncRound, final: bool = False) -> Round:
        """Open the round: encode what is due and launch its collectives (``final``: the final
        round, blocking whatever the delay)."""
        opened = self.plan.open(due, self.anchors, blocking=final)
        try:
            opened.launch(self.plan.average(due, opened.sent))
        except RoundNotCommitted:  # a peer lost as it opened: as if it had not been sent
            opened.discard()
            raise
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
                # a quorum's gathers are part of the round (a peer lost in them discards it); a
                # process group's travel behind the next steps, waited for when read
                means = self.plan.global_params(
                    landing, checked.averages[:num_params], self.anchors
                )
                local = landing.snapshots[:num_params] if landing.snapshots else due.tensors
                anchors = [self.anchors[i] for i in due.param_indices]
                checked.alignment = alignment(self.layout, local, anchors, means, landing.step)
            landing.commit(self.communicator, checked)
        except RoundNotCommitted:
            self.discard(landing)
            raise
        if landing.recorded:  # a round from a checkpoint of before records at commit
            checked.events = checked.events[1:]
        self._record(checked)
        return checked

    def discard(self, discarded: Round) -> None:
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
            self._alignment.append(checked.alignment)
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


def each_then_first_discard(action: Callable[[Any], None], rounds: Iterable[Any]) -> None:
    """``action`` on every round, then the first discard raised (the others still land)."""
    discarded: RoundNotCommitted | None = None
    for one in rounds:
        try:
            action(one)
        except RoundNotCommitted as failure:
            discarded = discarded or failure
    if discarded is not None:
        raise discarded
