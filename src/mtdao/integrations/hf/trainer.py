"""A ``transformers.Trainer`` whose run takes local steps and averages through mtdao's engine.

What the subclass changes, one method each, and why: docs/integrations.md ("What the subclass
changes, and why")."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from mtdao.integrations.local_updates import (
    LocalRun,
    LocalUpdates,
    build_local_run,
    traffic_logs,
    workers_agree,
)
from mtdao.integrations.sharding import reshard
from mtdao.integrations.worker_state import load_worker_state, save_worker_state
from mtdao.sync import LocalUpdateSync


class LocalUpdateTrainer(Trainer):
    """``Trainer(...)`` plus ``local_updates``: the method, its periods and its options.

    Every process of a torchrun or ``accelerate launch`` job is one worker (or, with
    ``LocalUpdates(shards=S)``, one of the S processes sharding a worker with FSDP2), reading its
    own batches from the Trainer's data loader.
    """

    def __init__(self, *args, local_updates: LocalUpdates | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.local_updates = local_updates or LocalUpdates()
        self.local_run: LocalRun | None = None
        if self.optimizer is not None:
            raise ValueError(
                "LocalUpdateTrainer builds its optimizer from local_updates; do not pass optimizers="
            )
        if self.is_deepspeed_enabled or self.is_fsdp_enabled or self.args.fsdp:
            raise ValueError(
                "LocalUpdateTrainer does not take DeepSpeed or the Trainer's FSDP (they reduce "
                "gradients every step); shard each worker with LocalUpdates(shards=S) instead"
            )
        if self.local_updates.shards > 1 and self.args.save_strategy != "no":
            raise ValueError(
                "LocalUpdates(shards>1) needs save_strategy='no': the Trainer saves process 0's "
                "model alone, and gathering FSDP2 shards there waits for processes that never "
                "join; checkpoint sharded workers with `mtdao train --shards` (DCP) instead"
            )
        if self.args.gradient_accumulation_steps != 1:
            raise ValueError(
                "LocalUpdateTrainer needs gradient_accumulation_steps=1 (got "
                f"{self.args.gradient_accumulation_steps}); raise per_device_train_batch_size"
            )
        # Each worker's loss is its own mean: counting tokens across processes would all-gather
        # every step and make each worker wait for the others.
        self.args.average_tokens_across_devices = False

    @property
    def sync(self) -> LocalUpdateSync:
        """The engine (after ``train()`` has built it)."""
        if self.local_run is None:
            raise RuntimeError("the engine is built when training starts: call train() first")
        return self.local_run.sync

    def workers_agree(self) -> bool:
        """Whether every worker holds the same parameters (e.g. after the final sync)."""
        return workers_agree(self.model, getattr(self.sync.communicator, "group", None))

    # -- the optimizer and the engine ----------------------------------------------------------

    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        if self.optimizer is None:
            model = self.model if model is None else model
            args = self.args
            decayed = set(self.get_decay_parameter_names(model))
            self.local_run = build_local_run(
                model,
                self.local_updates,
                args.learning_rate,
                args.weight_decay,
                args.max_grad_norm,
                decayed,
            )
            self.optimizer = self.local_run.optimizer
            self.local_run.plan(args.max_steps)
            self.optimizer.register_step_pre_hook(lambda *_: self._before_step())
            self.optimizer.register_step_post_hook(lambda *_: self.local_run.after_step())
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        if self.local_run is not None:  # the run the Trainer plans (its state.max_steps)
            self.local_run.plan(num_training_steps)
        return scheduler

    def _before_step(self) -> None:
        self.local_run.apply_warmups()
        self.sync.rounds.before_step()

    def evaluate(self, *args, **kwargs):
        """The Trainer's evaluation of the global model: between syncs the workers' average is
        swapped into the model for it (each process scoring its share of the evaluation set),
        and every worker's own parameters come back after."""
        if self.local_run is None:
            return super().evaluate(*args, **kwargs)
        try:
            with self.sync.averaged_parameters():
                return super().evaluate(*args, **kwargs)
        finally:
            reshard(self.model)

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        model = super()._wrap_model(model, training, dataloader)
        if training and model is self.model:
            # Marks the model prepared: Accelerate's prepare() then leaves it unwrapped by DDP.
            model = self.accelerator.prepare_model(model, evaluation_mode=True)
        return model

    def _clip_grad_norm(self, model):
        """Clipping happens in the engine (after gradient averaging, per worker); the Trainer
        only measures the norm it logs (``_get_grad_norm`` does, given None)."""
        return None

    def train(self, *args, **kwargs):
        output = super().train(*args, **kwargs)
        if self.local_run is not None:  # (without the final round) rounds in flight land now
            self.sync.rounds.flush()
        return output

    # -- checkpoints ---------------------------------------------------------------------------

    def _save_checkpoint(self, model, trial) -> None:
        super()._save_checkpoint(model, trial)
        if self.local_run is None or self.args.save_only_model:
            return
        folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        checkpoint_dir = os.path.join(self._get_output_dir(trial=trial), folder)
        save_worker_state(
            checkpoint_dir,
            self.local_run,
            self.model,
            self.args.process_index,
            self.args.world_size,
        )
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # every worker's file is written before anyone moves on

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None and self.local_run is not None:
            load_worker_state(
                checkpoint,
                self.local_run,
                self.model,
                self.args.process_index,
                self.args.world_size,
            )

    # -- logs ----------------------------------------------------------------------------------

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.local_run is not None and "eval_loss" not in logs:
            logs = {**logs, **traffic_logs(self.sync.traffic)}
        super().log(logs, start_time)
