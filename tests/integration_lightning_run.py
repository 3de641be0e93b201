"""One process of the Lightning checks that need real workers (run by
tests/test_integration_lightning.py under ``torchrun --nproc-per-node 2``; not collected by
pytest): ``integration_lightning_run.py OUT [EXAMPLE_ARG...]``.

It first runs examples/lightning_trainer.py with the EXAMPLE_ARGs (tests/run_example.py; the
example's output is the job's). Then each rank writes ``rank<r>.json`` into OUT:

- ``plain_loop_max_diff``: the largest difference between the parameters of a Lightning run and
  of a plain loop (MTAdam + LocalUpdateSync + ProcessGroupWorkers, clipping in its gradient
  hook) over the same batches;
- ``resume_max_diff``: between a straight run and one resumed from the checkpoint taken at the
  end of the first epoch, mid-round, while the workers differ;
- ``saved_at_validation_are_own``: whether the checkpoint taken when that epoch's validation
  ended (the average swapped in) holds this rank's own parameters;
- ``agree_mid_round`` / ``agree_after_sync``: whether the ranks hold the same parameters before
  and after the last sync (under DDP they would agree at every step), without the final round;
- ``agree_at_end_between_syncs``: whether they do at the end of a run stopped between syncs,
  with the final round (the default);
- ``val_loss_mid_round``, ``averaged_model_loss``, ``own_model_loss``: Lightning's validation
  at the end of the first epoch (mid-round), the loss of the workers' average model and of this
  rank's own over the same validation set at that step;
- ``logged_traffic``: the traffic metrics the run logged;
- ``ddp_agree_without_final_round``: whether the ranks agree after 3 steps of the ddp method
  (the engine averages the gradients before each step) with no final round.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from run_example import run_example
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import mtdao
from mtdao.integrations.lightning import LocalUpdates, LocalUpdateStrategy, method_optimizer
from mtdao.model import Llama, ModelConfig
from mtdao.sync import LocalUpdateSync, unified
from mtdao.sync.process_group import ProcessGroupWorkers

SEQ_LEN, BATCH, PERIOD, LR, VOCAB = 16, 4, 4, 3e-3, 64
EPOCH_STEPS = PERIOD + 3  # batches per worker per epoch: the first epoch ends mid-round
RUN_STEPS = 2 * EPOCH_STEPS  # two epochs: 3 K + 2 steps, the last sync 2 steps before the end
METHOD = LocalUpdates(
    method="mtdao", sync_period=PERIOD, betas=(0.99,), omegas=(0.9,), beta2=0.95, beta_warmup=0.0
)
LOCAL_MODELS = dataclasses.replace(METHOD, final_round=False)


def tokens(count: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (count, SEQ_LEN + 1), generator=generator)


TRAIN = tokens(2 * EPOCH_STEPS * BATCH, seed=1)  # two workers' epochs
VALID = tokens(2 * 4, seed=2)


def tiny_llama() -> Llama:
    torch.manual_seed(0)
    return Llama(ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=2, max_seq_len=16))


def loss_of(model: torch.nn.Module, block: torch.Tensor) -> torch.Tensor:
    logits = model(block[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), block[:, 1:].flatten())


class TinyLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = tiny_llama()

    def training_step(self, batch, batch_idx):
        return loss_of(self.model, batch[0])

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", loss_of(self.model, batch[0]), sync_dist=True)

    def configure_optimizers(self):
        return method_optimizer(self, LR)


class Probe(Callback):
    """At the end of the first epoch (before its validation): this rank's own parameters, the
    average's and its own loss over the validation set; after it, the loss Lightning logged."""

    def __init__(self) -> None:
        self.results: dict[str, object] = {}
        self.own: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == EPOCH_STEPS:
            self.own = {name: p.detach().clone() for name, p in pl_module.named_parameters()}
            model = pl_module.model
            self.results["own_model_loss"] = mean_loss(model)
            self.results["averaged_model_loss"] = mean_loss(averaged(model))

    def on_validation_end(self, trainer, pl_module):
        if trainer.global_step == EPOCH_STEPS:
            self.results["val_loss_mid_round"] = trainer.callback_metrics["val_loss"].item()


def lightning_run(out: Path, steps: int, method=LOCAL_MODELS, save=False, resume=None, probe=None):
    """``steps``: RUN_STEPS runs two epochs (Lightning resumes an epoch-based run where it
    stopped; with max_steps it replays part of the epoch a checkpoint ended)."""
    callbacks = [probe] if probe else []
    if save:
        # at each epoch's end (Lightning resumes exactly from there), and when a validation ends
        # (the workers' average swapped in for it)
        callbacks.append(ModelCheckpoint(out, save_top_k=-1, save_on_train_epoch_end=True))
        callbacks.append(
            ModelCheckpoint(
                out / "validated", monitor="val_loss", save_top_k=-1, save_on_train_epoch_end=False
            )
        )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=LocalUpdateStrategy(method),
        max_steps=-1 if steps == RUN_STEPS else steps,
        max_epochs=2,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=save,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=out,
    )
    module = TinyLM()
    train = DataLoader(TensorDataset(TRAIN), batch_size=BATCH)  # sequential: no shuffle
    valid = DataLoader(TensorDataset(VALID), batch_size=BATCH) if probe else None
    trainer.fit(module, train, valid, ckpt_path=resume)
    return trainer, module


def plain_loop(steps: int) -> torch.nn.Module:
    """The README's loop over the batches Lightning's distributed sampler gives this rank (it
    shuffles training data, seeded by the epoch), epoch after epoch."""
    model = tiny_llama()
    optimizer = mtdao.MTAdam(
        model.parameters(), lr=LR, betas=(0.99,), omegas=(0.9,), beta2=0.95, weight_decay=0.0
    )
    sync = LocalUpdateSync(optimizer, unified(PERIOD), ProcessGroupWorkers())
    params = list(model.parameters())
    sync.register_gradient_hook(lambda: torch.nn.utils.clip_grad_norm_(params, 1.0))
    sampler = DistributedSampler(TensorDataset(TRAIN), shuffle=True, seed=0)
    with sync.attached(final_round=False):
        for step in range(steps):
            epoch, index = divmod(step, EPOCH_STEPS)
            sampler.set_epoch(epoch)
            first = index * BATCH
            batch = TRAIN[list(sampler)[first : first + BATCH]]
            loss_of(model, batch).backward()
            optimizer.step()
            optimizer.zero_grad()
    return model


@torch.no_grad()
def mean_loss(model: torch.nn.Module) -> float:
    """The mean over the validation blocks of each block's loss."""
    return torch.stack([loss_of(model, row[None]) for row in VALID]).mean().item()


@torch.no_grad()
def averaged(model: torch.nn.Module) -> torch.nn.Module:
    """A model holding the ranks' average of ``model``'s parameters."""
    average = tiny_llama()
    for mine, theirs in zip(average.parameters(), model.parameters()):
        total = theirs.detach().clone()
        dist.all_reduce(total)
        mine.copy_(total / dist.get_world_size())
    return average


def max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def main(out: Path) -> None:
    results: dict[str, object] = {}
    probe = Probe()
    straight, module = lightning_run(out / "straight", RUN_STEPS, save=True, probe=probe)
    results.update(probe.results)
    results["agree_mid_round"] = straight.strategy.workers_agree()  # 2 local steps after a sync
    checkpoint = out / "straight" / f"epoch=0-step={EPOCH_STEPS}.ckpt"
    results["checkpoint_files"] = sorted(p.name for p in Path(f"{checkpoint}.mtdao").iterdir())
    validated = out / "straight" / "validated" / checkpoint.name
    rank_file = f"{validated}.mtdao/mtdao-rank{dist.get_rank()}-of-{dist.get_world_size()}.pt"
    saved = torch.load(rank_file, weights_only=True)["params"]
    results["saved_at_validation_are_own"] = all(
        torch.equal(saved[name], p) for name, p in probe.own.items()
    )
    resumed, resumed_module = lightning_run(out / "resumed", RUN_STEPS, resume=checkpoint)
    results["resume_max_diff"] = max_diff(module, resumed_module)
    results["resumed_engine_step"] = resumed.strategy.sync.step_count
    synced, synced_module = lightning_run(out / "synced", 3 * PERIOD)
    results["agree_after_sync"] = synced.strategy.workers_agree()
    results["plain_loop_max_diff"] = max_diff(synced_module.model, plain_loop(3 * PERIOD))
    results["traffic_bytes"] = synced.strategy.sync.traffic.bytes
    results["logged_traffic"] = {
        k: v.item() for k, v in synced.logged_metrics.items() if k.startswith("sync_")
    }
    final, _ = lightning_run(out / "final", RUN_STEPS, method=METHOD)
    results["agree_at_end_between_syncs"] = final.strategy.workers_agree()
    ddp, _ = lightning_run(out / "ddp", 3, method=LocalUpdates(method="ddp", final_round=False))
    results["ddp_agree_without_final_round"] = ddp.strategy.workers_agree()
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    run_example("lightning_trainer.py", sys.argv[2:])
    main(Path(sys.argv[1]))
