"""One process of the Trainer checks that need real workers (run by tests/test_integration_hf.py
under ``torchrun --nproc-per-node 2``; not collected by pytest):
``integration_hf_run.py OUT [EXAMPLE_ARG...]``.

It first runs examples/hf_trainer.py with the EXAMPLE_ARGs (tests/run_example.py; the example's
output is the job's). Then each rank writes ``rank<r>.json`` into OUT:

- ``plain_loop_max_diff``: the largest difference between the parameters of a Trainer run and of
  a plain loop (MTAdam + LocalUpdateSync + ProcessGroupWorkers) over the same batches;
- ``resume_max_diff``: between a straight run and one resumed from a checkpoint taken mid-round,
  while the workers differ;
- ``agree_mid_round`` / ``agree_after_sync``: whether the ranks hold the same parameters before
  and after the last sync (under DDP they would agree at every step), without the final round;
- ``agree_at_end_between_syncs``: whether they do at the end of a run stopped between syncs,
  with the final round (the default);
- ``eval_loss_mid_round``, ``averaged_model_loss``, ``own_model_loss``: ``trainer.evaluate()``
  between syncs, the loss of the workers' average model and of this rank's own on the same
  evaluation set, and ``params_kept_by_evaluate``: whether the evaluation gave each worker its
  own parameters back.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from run_example import run_example

import mtdao
from mtdao.integrations.hf import LocalUpdates, LocalUpdateTrainer, workers_agree
from mtdao.sync import LocalUpdateSync, unified
from mtdao.sync.process_group import ProcessGroupWorkers

SEQ_LEN, BATCH, PERIOD, LR = 16, 4, 4, 3e-3
METHOD = LocalUpdates(
    method="mtdao", sync_period=PERIOD, betas=(0.99,), omegas=(0.9,), beta2=0.95, beta_warmup=0.0
)
LOCAL_MODELS = dataclasses.replace(METHOD, final_round=False)


class Blocks(torch.utils.data.Dataset):
    def __init__(self, count: int) -> None:
        generator = torch.Generator().manual_seed(1)
        self.tokens = torch.randint(0, 64, (count, SEQ_LEN), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def tiny_llama() -> transformers.PreTrainedModel:
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ_LEN,
        use_cache=False,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def training_args(out: Path, steps: int, save_steps: int = 0) -> transformers.TrainingArguments:
    return transformers.TrainingArguments(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=BATCH,
        learning_rate=LR,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        train_sampling_strategy="sequential",
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        logging_steps=4,
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
    )


def trainer_run(
    out: Path, steps: int, save_steps: int = 0, resume: str | None = None, method=LOCAL_MODELS
):
    trainer = LocalUpdateTrainer(
        model=tiny_llama(),
        args=training_args(out, steps, save_steps),
        train_dataset=Blocks(256),
        local_updates=method,
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def plain_loop(steps: int) -> torch.nn.Module:
    """The README's loop: rank r takes the Trainer's sequential batches r, r + W, r + 2W, ..."""
    model = tiny_llama()
    optimizer = mtdao.MTAdam(
        model.parameters(), lr=LR, betas=(0.99,), omegas=(0.9,), beta2=0.95, weight_decay=0.0
    )
    sync = LocalUpdateSync(optimizer, unified(PERIOD), ProcessGroupWorkers())
    grads = [p for p in model.parameters()]
    sync.register_gradient_hook(lambda: sync.layout.clip_grad_norm_([p.grad for p in grads], 1.0))
    data, rank, world = Blocks(256).tokens, dist.get_rank(), dist.get_world_size()
    with sync.attached():
        for step in range(steps):
            first = (step * world + rank) * BATCH
            batch = data[first : first + BATCH]
            model(input_ids=batch, labels=batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return model


@torch.no_grad()
def mean_loss(model: torch.nn.Module, data: Blocks) -> float:
    """The mean over the blocks of each block's loss."""
    losses = [model(input_ids=row[None], labels=row[None]).loss for row in data.tokens]
    return torch.stack(losses).mean().item()


@torch.no_grad()
def averaged(model: torch.nn.Module) -> torch.nn.Module:
    """A model holding the ranks' average of ``model``'s parameters."""
    average = tiny_llama()
    for mine, theirs in zip(average.parameters(), model.parameters()):
        total = theirs.detach().clone()
        dist.all_reduce(total)
        mine.copy_(total / dist.get_world_size())
    return average


def evaluation_checks(trainer: LocalUpdateTrainer) -> dict[str, object]:
    """``trainer.evaluate()`` while the workers differ, against the average's own loss."""
    data = Blocks(32)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    metrics = trainer.evaluate(eval_dataset=data)
    kept = all(torch.equal(p, q) for p, q in zip(trainer.model.parameters(), before))
    return {
        "eval_loss_mid_round": metrics["eval_loss"],
        "averaged_model_loss": mean_loss(averaged(trainer.model), data),
        "own_model_loss": mean_loss(trainer.model, data),
        "params_kept_by_evaluate": kept,
    }


def max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def main(out: Path) -> None:
    results: dict[str, object] = {}
    straight = trainer_run(out / "straight", 3 * PERIOD + 2, save_steps=2 * PERIOD + 2)
    results["agree_mid_round"] = workers_agree(straight.model)  # 2 local steps after a sync
    results.update(evaluation_checks(straight))
    checkpoint = out / "straight" / f"checkpoint-{2 * PERIOD + 2}"
    resumed = trainer_run(out / "resumed", 3 * PERIOD + 2, resume=str(checkpoint))
    results["resume_max_diff"] = max_diff(straight.model, resumed.model)
    results["resumed_engine_step"] = resumed.sync.step_count
    synced = trainer_run(out / "synced", 3 * PERIOD)
    results["agree_after_sync"] = workers_agree(synced.model)
    results["plain_loop_max_diff"] = max_diff(synced.model, plain_loop(3 * PERIOD))
    results["traffic_bytes"] = synced.sync.traffic.bytes
    final = trainer_run(out / "final", 3 * PERIOD + 2, method=METHOD)
    results["agree_at_end_between_syncs"] = workers_agree(final.model)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    run_example("hf_trainer.py", sys.argv[2:])
    main(Path(sys.argv[1]))
