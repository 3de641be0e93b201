"""A small causal LM trained with MT-DAO under the Hugging Face Trainer (no download).

The model is a tiny Llama (or GPT-2) built from a transformers config; the text is the
interpreter's own standard library (mtdao's built-in corpus), one token per byte. Every process
of a torchrun job is one worker; only mtdao's engine communicates.

    pip install -c constraints.txt -e ".[hf]"
    python examples/hf_trainer.py --max-steps 64 --output-dir /tmp/hf-mtdao
    torchrun --nproc-per-node 2 examples/hf_trainer.py --max-steps 64 --output-dir /tmp/hf-mtdao
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import transformers
from torch.utils.data import Dataset

from mtdao.data import ByteTokenizer, load_corpus
from mtdao.integrations.hf import LocalUpdates, LocalUpdateTrainer, traffic_summary
from mtdao.methods.table import METHODS


class TokenBlocks(Dataset):
    """Consecutive blocks of ``seq_len`` tokens, each its own labels (the model shifts them)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        count = len(tokens) // seq_len
        if count == 0:
            raise ValueError(f"{len(tokens)} tokens do not fill one block of {seq_len}")
        self.blocks = tokens[: count * seq_len].view(count, seq_len)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        block = self.blocks[index]
        return {"input_ids": block, "labels": block}


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


def tiny_causal_lm(kind: str, seq_len: int, seed: int = 0) -> transformers.PreTrainedModel:
    """A randomly initialised ~100k-parameter model over the 256 byte tokens."""
    common = dict(vocab_size=ByteTokenizer.vocab_size, use_cache=False, tie_word_embeddings=True)
    if kind == "llama":
        config = transformers.LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=seq_len,
            **common,
        )
    elif kind == "gpt2":
        config = transformers.GPT2Config(
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=seq_len,
            bos_token_id=0,
            eos_token_id=0,
            **common,
        )
    else:
        raise ValueError(f"unknown model {kind!r}; choose llama or gpt2")
    torch.manual_seed(seed)  # the engine also broadcasts process 0's model at the start
    return transformers.AutoModelForCausalLM.from_config(config)


def held_fraction(model: torch.nn.Module) -> float:
    """The share of the parameters' elements this process holds (its FSDP2 shards)."""
    params = list(model.parameters())
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in params)
    return local / sum(p.numel() for p in params)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-steps", type=int, required=True, help="optimizer steps")
    parser.add_argument("--output-dir", required=True, help="the Trainer's output directory")
    parser.add_argument("--method", default="mtdao", choices=METHODS)
    parser.add_argument("--sync-period", type=int, default=16, help="K: local steps per sync")
    parser.add_argument("--model", default="llama", choices=("llama", "gpt2"))
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per worker")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--chars", type=int, default=400_000, help="characters of text")
    parser.add_argument("--save-steps", type=int, default=0, help="checkpoint every N (0: none)")
    parser.add_argument("--resume", action="store_true", help="resume from the last checkpoint")
    parser.add_argument("--shards", type=int, default=1, help="processes per worker (FSDP2)")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    training_args = transformers.TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, args.max_steps // 20),
        weight_decay=0.1,
        max_grad_norm=1.0,
        logging_steps=max(1, args.max_steps // 4),
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        report_to=[],
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
        dataloader_drop_last=True,
    )
    trainer = LocalUpdateTrainer(
        model=tiny_causal_lm(args.model, args.seq_len),
        args=training_args,
        train_dataset=builtin_text_blocks(args.chars, args.seq_len),
        local_updates=LocalUpdates(
            method=args.method, sync_period=args.sync_period, shards=args.shards
        ),
    )
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    identical = trainer.workers_agree()  # a collective: every rank takes part
    if trainer.is_world_process_zero():
        if args.shards > 1:
            print(
                f"FSDP2: this process holds {held_fraction(trainer.model):.0%} of its worker's model"
            )
        print(traffic_summary(trainer.sync.traffic))
        print(f"ranks identical: {identical}")
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
