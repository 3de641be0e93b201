"""A small byte-level language model trained with MT-DAO under PyTorch Lightning (no download).

The model is mtdao's micro Llama; the text is the interpreter's own standard library (mtdao's
built-in corpus), one token per byte. Every process is one worker reading its own batches; only
mtdao's engine communicates.

    pip install -c constraints.txt -e ".[lightning]"
    python examples/lightning_trainer.py --max-steps 64
    torchrun --nproc-per-node 2 examples/lightning_trainer.py --max-steps 24 --sync-period 16
    python examples/lightning_trainer.py --devices 2 --max-steps 24   # Lightning starts them
"""

from __future__ import annotations

import argparse
import math
import os

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset

from mtdao.data import ByteTokenizer, load_corpus
from mtdao.integrations.lightning import (
    LocalUpdates,
    LocalUpdateStrategy,
    method_optimizer,
    traffic_summary,
)
from mtdao.methods.table import METHODS
from mtdao.model import Llama, model_config


class TokenBlocks(Dataset):
    """Consecutive blocks of ``seq_len + 1`` tokens: the inputs and, shifted by one, targets."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        count = (len(tokens) - 1) // seq_len
        if count == 0:
            raise ValueError(f"{len(tokens)} tokens do not fill one block of {seq_len}")
        self.tokens, self.seq_len, self.count = tokens, seq_len, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        block = self.tokens[index * self.seq_len : (index + 1) * self.seq_len + 1]
        return block[:-1], block[1:]


def builtin_text_blocks(num_chars: int, seq_len: int) -> TokenBlocks:
    """The first ``num_chars`` characters of the built-in corpus's training documents."""
    text, size = [], 0
    for doc in load_corpus("builtin").train_docs:
        text.append(doc)
        size += len(doc)
        if size >= num_chars:
            break
    ids = ByteTokenizer().encode("\n".join(text)[:num_chars])
    return TokenBlocks(torch.from_numpy(ids).long(), seq_len)


class ByteLM(L.LightningModule):
    """Next-byte prediction with a Llama; the optimizer is the strategy's method's."""

    def __init__(
        self, seq_len: int, lr: float, weight_decay: float, warmup_steps: int, seed: int = 0
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)  # the engine also broadcasts process 0's model at the start
        self.model = Llama(model_config("micro", ByteTokenizer.vocab_size, seq_len))
        self.lr, self.weight_decay, self.warmup_steps = lr, weight_decay, warmup_steps

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        logits = self.model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        # weight decay on the matrices, not on the norms' gains
        decayed = {name for name, p in self.named_parameters() if p.dim() >= 2}
        optimizer = method_optimizer(self, self.lr, self.weight_decay, decayed)
        total, warmup = self.trainer.estimated_stepping_batches, self.warmup_steps

        def cosine_with_warmup(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_with_warmup)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-steps", type=int, required=True, help="optimizer steps")
    parser.add_argument("--method", default="mtdao", choices=METHODS)
    parser.add_argument("--sync-period", type=int, default=16, help="K: local steps per sync")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per worker")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--chars", type=int, default=200_000, help="characters of text")
    parser.add_argument(
        "--devices",
        type=int,
        default=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        help="processes on this machine (under torchrun: its --nproc-per-node)",
    )
    parser.add_argument("--output-dir", help="logs (metrics.csv) and checkpoints go here")
    parser.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps")
    parser.add_argument("--resume", help="a checkpoint file to resume from (or 'last')")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.save_every and not args.output_dir:
        raise SystemExit("--save-every needs --output-dir")
    callbacks = []
    if args.save_every:
        callbacks.append(
            ModelCheckpoint(
                dirpath=os.path.join(args.output_dir, "checkpoints"),
                every_n_train_steps=args.save_every,
                save_top_k=-1,
                save_last=True,
            )
        )
    trainer = L.Trainer(
        accelerator="gpu" if torch.cuda.is_available() else "cpu",
        devices=args.devices,
        strategy=LocalUpdateStrategy(
            LocalUpdates(method=args.method, sync_period=args.sync_period)
        ),
        max_steps=args.max_steps,
        gradient_clip_val=1.0,  # each worker's, after any gradient averaging
        log_every_n_steps=max(1, args.max_steps // 4),
        logger=CSVLogger(args.output_dir, name="") if args.output_dir else False,
        enable_checkpointing=bool(args.save_every),
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.output_dir,
    )
    data = DataLoader(
        builtin_text_blocks(args.chars, args.seq_len), batch_size=args.batch_size, drop_last=True
    )
    warmup_steps = max(1, args.max_steps // 20)
    module = ByteLM(args.seq_len, args.lr, weight_decay=0.1, warmup_steps=warmup_steps)
    trainer.fit(module, data, ckpt_path=args.resume)
    strategy = trainer.strategy
    identical = strategy.workers_agree()  # a collective: every rank takes part
    if trainer.is_global_zero:
        print(traffic_summary(strategy.sync.traffic))
        print(f"ranks identical: {identical}")
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
