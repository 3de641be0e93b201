"""A picture of one run: training and validation loss against tokens."""

from __future__ import annotations

from pathlib import Path

from mtdao.train.metrics import read_metrics


def plot_run(run_dir: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    train = [(r["tokens"], r["train_loss"]) for r in records if "train_loss" in r]
    val = [(r["tokens"], r["val_loss"]) for r in records if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    if train:
        ax.plot(*zip(*train), color="0.6", lw=1, label="train (mean over workers)")
    if val:
        ax.plot(*zip(*val), "o-", color="C0", lw=2, label="validation (global model)")
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(Path(run_dir).name)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(run_dir) / "loss.png"
    fig.savefig(path)
    plt.close(fig)
    return path
