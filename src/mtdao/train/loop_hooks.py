"""What a caller adds to the one training loop (:func:`mtdao.train.trainer.loop`): the plain run
uses :class:`LoopHooks` as it is; a fault-tolerant replica overrides them."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from mtdao.sync.engine import NonFiniteError

if TYPE_CHECKING:
    from mtdao.sync.communicator import RoundNotCommitted
    from mtdao.train.setup import Run


class LoopHooks:
    """The loop's extension points, called in this order at every step: :meth:`before_step`,
    the step, then :meth:`after_round` when it committed a round or :meth:`on_discarded` when
    its round was discarded; :meth:`check_losses` on the steps the loop gathers the losses;
    :meth:`may_checkpoint` before a periodic checkpoint."""

    def describe(self, run: Run) -> str:
        """The progress bar's label."""
        return run.config.sync.method

    def tokens_per_step(self, run: Run) -> int:
        """The tokens one step trains in the processes this loop speaks for (throughput)."""
        return run.config.tokens_per_step

    def before_step(self, run: Run) -> None:
        """Before the step's forward pass (may raise ``RoundNotCommitted``)."""

    def after_round(self, run: Run) -> None:
        """After a step whose round committed."""

    def on_discarded(self, run: Run, failure: RoundNotCommitted) -> None:
        """A round was discarded and undone; the step's local progress is kept. Only a
        communicator that may lose a peer discards rounds, so elsewhere it is an error."""
        raise failure

    def check_losses(
        self, run: Run, worker_losses: torch.Tensor, resumed: tuple[int, Path] | None
    ) -> None:
        """Stop on losses that cannot go on (NaN/inf, see ``--on-non-finite``)."""
        check_finite_losses(run, worker_losses, resumed)

    def may_checkpoint(self, run: Run) -> bool:
        """Whether the periodic checkpoint due now may be written."""
        return True


def check_finite_losses(
    run: Run, worker_losses: torch.Tensor, resumed: tuple[int, Path] | None = None
) -> None:
    """Stop on a diverged worker (on_non_finite 'raise'), or when none is left to skip.

    The message names the likely cause: at the first step after a resume, the checkpoint's state
    (it was finite, or it would not have been saved, but it may be bad); otherwise the run itself
    diverged (the learning rate)."""
    finite = torch.isfinite(worker_losses)
    if bool(finite.all()):
        return
    diverged = torch.nonzero(~finite).flatten().tolist()
    every = len(diverged) == len(worker_losses)
    if run.config.sync.on_non_finite == "skip" and not every:
        return
    where = f"worker(s) {diverged}" if not every else "every worker"
    text = f"training loss is NaN/inf at step {run.step} on {where}"
    if resumed is not None and run.step == resumed[0] + 1:
        text += (
            f", the first step after resuming from {resumed[1]}: that checkpoint's state may be "
            f"bad (rename it to {resumed[1].name}.damaged to resume from the one before it), or "
            "the run diverged right there (lower --lr)"
        )
    elif every and run.config.sync.on_non_finite == "skip":
        text += "; none is left to average (lower --lr)"
    else:
        text += "; lower --lr, or pass --on-non-finite skip to leave diverged workers out"
    raise NonFiniteError(text)
