"""A Lightning strategy whose processes are workers taking local steps, averaged by mtdao's engine.

It is Lightning's ``DDPStrategy`` with what makes it DDP taken out and the engine put in, one
method each; which, and why: docs/integrations.md ("What the strategy changes, and why")."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy

from mtdao.integrations.local_updates import (
    LocalRun,
    LocalUpdates,
    build_local_run,
    traffic_logs,
    workers_agree,
)
from mtdao.integrations.worker_state import load_worker_state, save_worker_state
from mtdao.sync import LocalUpdateSync


class LocalUpdateStrategy(DDPStrategy):
    """``Trainer(strategy=LocalUpdateStrategy(LocalUpdates(method="mtdao", sync_period=32)))``.

    Every process Lightning launches (or torchrun starts) is one worker reading its own batches
    (Lightning's distributed sampler); gloo on CPUs, NCCL on GPUs, as under DDP. The
    LightningModule's ``configure_optimizers`` returns ``method_optimizer(self, lr=...,
    weight_decay=...)``, with any learning-rate scheduler over it.
    """

    def __init__(
        self,
        local_updates: LocalUpdates | None = None,
        *,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: str = "popen",
        **strategy_kwargs: Any,
    ) -> None:
        allowed = {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io"}
        allowed.add("precision_plugin")
        unknown = sorted(set(strategy_kwargs) - allowed)
        if unknown:
            raise ValueError(
                f"LocalUpdateStrategy does not take {', '.join(unknown)}: it does not wrap the "
                "model in DDP (only the engine's rounds cross the network)"
            )
        super().__init__(
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **strategy_kwargs,
        )
        self.local_updates = local_updates or LocalUpdates()
        if self.local_updates.shards != 1:
            raise ValueError(
                "LocalUpdateStrategy runs one process per worker (shards=1): FSDP2-sharded "
                "workers are not supported under Lightning (docs/integrations.md says why)"
            )
        self.local_run: LocalRun | None = None
        self._averaged: contextlib.ExitStack | None = None
        self._resumed_from: str | None = None

    @property
    def sync(self) -> LocalUpdateSync:
        """The engine (built by :func:`method_optimizer` in ``configure_optimizers``)."""
        if self.local_run is None:
            raise RuntimeError(
                "the engine is built by configure_optimizers: return "
                "method_optimizer(self, lr=...) from it, then call fit()"
            )
        return self.local_run.sync

    def workers_agree(self) -> bool:
        """Whether every worker holds the same parameters (a collective: every rank calls it)."""
        assert self.lightning_module is not None
        return workers_agree(self.lightning_module)

    # -- the optimizer and the engine ----------------------------------------------------------

    def _build_run(
        self, module: LightningModule, lr: float, weight_decay: float, decayed: set[str] | None
    ) -> torch.optim.Optimizer:
        # Lightning clips, after the averaging (optimizer_step): the engine does not clip
        self.local_run = build_local_run(module, self.local_updates, lr, weight_decay, 0.0, decayed)
        planned = module.trainer.estimated_stepping_batches
        self.local_run.plan(int(planned) if math.isfinite(planned) else 0)
        return self.local_run.optimizer

    def setup_optimizers(self, trainer: Trainer) -> None:
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                "LocalUpdateStrategy needs accumulate_grad_batches=1 (got "
                f"{trainer.accumulate_grad_batches}): an optimizer step is a local step; "
                "raise the batch size instead"
            )
        if not self.lightning_module.automatic_optimization:
            raise ValueError(
                "LocalUpdateStrategy needs automatic optimization: the engine runs inside "
                "the optimizer step Lightning drives"
            )
        precision = self.precision_plugin
        if isinstance(precision, MixedPrecision) and precision.scaler is not None:
            raise ValueError(
                "LocalUpdateStrategy does not take precision='16-mixed' (its gradient scaler "
                "skips steps the engine counts); use 'bf16-mixed' or '32-true'"
            )
        self.local_run = None
        super().setup_optimizers(trainer)
        built = self.local_run.optimizer if self.local_run is not None else None
        if self.optimizers != [built]:
            raise ValueError(
                "with LocalUpdateStrategy, configure_optimizers returns the one optimizer "
                "method_optimizer(self, lr=...) builds (and any scheduler)"
            )

    def configure_ddp(self) -> None:
        """No DDP wrapper: backward all-reduces nothing; the engine's rounds are the traffic."""

    def optimizer_step(self, optimizer, closure, model=None, **kwargs) -> Any:
        sync = self.sync
        self.local_run.apply_warmups()

        def closure_then_average() -> Any:
            loss = closure()  # forward, zero_grad, backward
            sync.rounds.before_step()  # DDP methods: the average replaces the gradients
            return loss  # Lightning's clipping follows, then the step

        output = super().optimizer_step(optimizer, closure_then_average, model, **kwargs)
        self.local_run.after_step()
        self.lightning_module.log_dict(
            traffic_logs(sync.traffic), on_step=True, on_epoch=False, batch_size=1
        )
        return output

    def on_train_end(self) -> None:
        """A run stopped before its planned steps (early stopping, a time limit) ends with one
        model too; without the final round, the rounds in flight land."""
        if self.local_run is None:
            return
        if self.local_updates.final_round:
            self.local_run.finish()
        else:
            self.sync.rounds.flush()

    # -- validation scores the global model ----------------------------------------------------

    def on_validation_start(self) -> None:
        if self.local_run is not None and self.lightning_module.trainer.state.fn == "fit":
            self._averaged = contextlib.ExitStack()
            self._averaged.enter_context(self.sync.averaged_parameters())

    def on_validation_end(self) -> None:
        if self._averaged is not None:
            self._averaged.close()  # each worker's own parameters back
            self._averaged = None

    @contextlib.contextmanager
    def _own_parameters(self) -> Iterator[None]:
        """Each worker's own parameters, also while a validation holds the average (a checkpoint
        taken when a validation ends: Lightning's callbacks save before this strategy's hook)."""
        validating = self._averaged is not None
        self.on_validation_end()
        try:
            yield
        finally:
            if validating:
                self.on_validation_start()

    # -- checkpoints ---------------------------------------------------------------------------

    def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
        super().save_checkpoint(checkpoint, filepath, storage_options)
        if self.local_run is not None and "optimizer_states" in checkpoint:
            with self._own_parameters():
                save_worker_state(
                    worker_state_dir(filepath),
                    self.local_run,
                    self.lightning_module,
                    self.global_rank,
                    self.world_size,
                )

    def remove_checkpoint(self, filepath) -> None:
        super().remove_checkpoint(filepath)
        if self.is_global_zero:
            shutil.rmtree(worker_state_dir(filepath), ignore_errors=True)

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict[str, Any]:
        self._resumed_from = os.path.realpath(checkpoint_path)  # "last.ckpt" may be a link
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    def load_optimizer_state_dict(self, checkpoint) -> None:
        super().load_optimizer_state_dict(checkpoint)
        if self.local_run is not None and self._resumed_from is not None:
            load_worker_state(
                worker_state_dir(self._resumed_from),
                self.local_run,
                self.lightning_module,
                self.global_rank,
                self.world_size,
            )


def worker_state_dir(checkpoint_file: str | os.PathLike) -> Path:
    """The folder beside a Lightning checkpoint file holding each process's own state."""
    return Path(f"{os.fspath(checkpoint_file)}.mtdao")


def method_optimizer(
    module: LightningModule, lr: float, weight_decay: float = 0.0, decayed: set[str] | None = None
) -> torch.optim.Optimizer:
    """The method's optimizer over ``module``'s trainable parameters (weight decay on those named
    in ``decayed``; default: all), with the strategy's engine built over it. Return it from
    ``configure_optimizers``, with any learning-rate scheduler over it (the schedule is yours)."""
    strategy = module.trainer.strategy
    if not isinstance(strategy, LocalUpdateStrategy):
        raise ValueError(
            f"method_optimizer needs Trainer(strategy=LocalUpdateStrategy(...)); the Trainer's "
            f"strategy is {type(strategy).__name__}"
        )
    return strategy._build_run(module, lr, weight_decay, decayed)
