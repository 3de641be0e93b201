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
round (:class:`~mtdao.sync.rounds.Round`); the rounds, their lifecycle and the options that change
how they travel (``fragments``, ``delay``, ``codecs``, ``radial_directional``, on every
communicator) are drawn in docs/design.md ("The step sequence", "A round"). They are driven from
one place, ``sync.rounds`` (:class:`~mtdao.sync.round_driver.RoundDriver`), which is what a
communicator or a training harness calls; the engine's state, plain and sharded, is in
:mod:`~mtdao.sync.trained_state`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
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
from mtdao.sync.healing import NON_FINITE_ACTIONS, NonFiniteError
from mtdao.sync.layout import WorkerLayout
from mtdao.sync.policy import SyncPolicy
from mtdao.sync.repeated_lines import RepeatedLines
from mtdao.sync.round_driver import RoundDriver
from mtdao.sync.rounds import SyncEvent
from mtdao.sync.trained_state import TrainedState, engine_state_dict, load_engine_state_dict

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
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.param_names = _param_names(optimizer)
        self.rounds = RoundDriver(
            optimizer,
            policy,
            self.communicator,
            [self.param_names[id(p)] for p in self.params],
            on_non_finite=on_non_finite,
            track_alignment=track_alignment,
            broadcast_initial=broadcast_initial,
            fragments=fragments,
            delay=delay,
            codecs=codecs,
            state_decays=state_decays,
            radial_directional=radial_directional,
        )
        """The rounds and all they leave; what communicators and harnesses call."""
        self.discarded_rounds: list[dict[str, Any]] = []
        """Rounds the communicator discarded inside ``attached()`` (step, reason)."""
        self._repeated_lines = RepeatedLines()  # a discard at every step says one line a minute
        if self.communicator.heals_joiners:  # a worker joining late takes all this from a peer
            self.communicator.attach_trained_state(TrainedState(self))

    @property
    def layout(self) -> WorkerLayout:
        return self.communicator.layout

    @property
    def traffic(self) -> Traffic:
        return self.communicator.traffic

    @property
    def step_count(self) -> int:
        """Optimizer steps taken (counted from 1, the same on every worker)."""
        return self.rounds.step

    @property
    def events(self) -> list[SyncEvent]:
        """Every committed round, recorded at its commit."""
        return self.rounds.events

    @property
    def skipped_rounds(self) -> list[dict[str, Any]]:
        """Rounds that left out workers holding NaN/inf (``on_non_finite='skip'``)."""
        return self.rounds.skipped_rounds

    @property
    def alignment(self) -> list[dict[str, Any]]:
        """Per parameter sync (``track_alignment``): each worker's cosine and drift."""
        return self.rounds.alignment

    # -- driving ------------------------------------------------------------------------------

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """``optimizer.step(closure)`` with gradient averaging and hooks before, syncs after."""
        self.rounds.before_step()
        loss = self.optimizer.step(closure)
        self.rounds.after_step()
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
        pre = self.optimizer.register_step_pre_hook(lambda *_: self.rounds.before_step())
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
            self.rounds.after_step()
        except RoundNotCommitted as failure:
            self._note_discarded(failure)
        self._prepare_until_ready()

    def _prepare_until_ready(self) -> None:
        """:meth:`prepare`, again while it discards what it settles (each retry forms a new
        quorum, as a retried step would)."""
        while True:
            try:
                self.rounds.prepare()
                return
            except RoundNotCommitted as failure:
                self._note_discarded(failure)

    def _note_discarded(self, failure: RoundNotCommitted, then: str = "") -> None:
        """Record a discarded round; say so, each kind of line once a minute."""
        step = self.step_count
        self.discarded_rounds.append({"step": step, "reason": str(failure)})
        then = then or "every worker keeps its own state"
        line = self._repeated_lines.line(f"step {step}: {failure}; {then}")
        if line is not None:
            logger.warning(line)

    def prepare(self) -> Any:
        """Before the coming step's forward pass: let a communicator that prepares each round
        ahead (:attr:`~mtdao.sync.communicator.Communicator.prepares_rounds`: a quorum of the
        live replicas, where a joining one heals) do it, having settled the rounds in flight
        first when the communicator runs one round at a time and a round is due. Returns what
        the communicator reports (a torchft quorum's ``RoundStart``; None: nothing). ``attached()``
        calls it; a loop that calls :meth:`step` itself calls it before each forward pass."""
        return self.rounds.prepare()

    def register_gradient_hook(self, hook: Callable[[], Any]) -> RemovableHandle:
        """Call ``hook()`` once the gradients are final (averaged, for DDP), before the step.

        Gradient clipping belongs here. Returns a handle whose ``remove()`` unregisters the hook.
        """
        handle = RemovableHandle(self.rounds.gradient_hooks)
        self.rounds.gradient_hooks[handle.id] = hook
        return handle

    def finish(
        self, on_discarded: Callable[[RoundNotCommitted], None] | None = None
    ) -> SyncEvent | None:
        """The final round, once training ends: every worker then holds the same global model
        (what it averages, and what it leaves alone: docs/design.md, "The step sequence").

        A final round the communicator discards (a peer lost while it was in flight) is undone
        and formed again among the workers left, up to :data:`FINAL_ROUND_TRIES` tries in all;
        each discard goes to ``on_discarded`` (default: recorded in ``discarded_rounds`` and
        logged). Returns the round's event (None: nothing was left to average); raises
        ``FinalRoundNotCommitted`` when no try committed (each worker then holds its own
        model). ``attached()`` calls it when its block ends without an error."""
        on_discarded = on_discarded or self._note_final_discarded
        for _ in range(FINAL_ROUND_TRIES):
            try:
                return self.rounds.final_round()
            except RoundNotCommitted as failure:
                on_discarded(failure)
                last = failure
        raise FinalRoundNotCommitted(
            f"the final round was discarded {FINAL_ROUND_TRIES} times (the last: {last}): the "
            "workers do not hold the same model (each keeps its own); with enough of them alive "
            "and reachable, run again from the last checkpoint"
        )

    def _note_final_discarded(self, failure: RoundNotCommitted) -> None:
        self._note_discarded(failure, "the final round is formed again")

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

    # -- checkpointing ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything the engine carries between steps: the step, the anchors and the outer
        momentum (global tensors), the traffic account and the record of every round. A sharded
        worker's form: :class:`~mtdao.sync.trained_state.ShardedEngineState`."""
        return engine_state_dict(self.rounds)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_engine_state_dict(self.rounds, state)


def _param_names(optimizer: Optimizer) -> dict[int, str]:
    names: dict[int, str] = {}
    for g, group in enumerate(optimizer.param_groups):
        group_names = group.get("names") or group.get("param_names")
        for i, p in enumerate(group["params"]):
            names[id(p)] = group_names[i] if group_names else f"param {i} of group {g}"
    return names
