"""Validation loss of one model on a fixed set of held-out batches."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


@torch.no_grad()
def evaluate(model: nn.Module, batches: list, device: torch.device) -> float:
    """Mean token cross-entropy over ``batches`` of (inputs, targets)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for inputs, targets in batches:
        logits = model(inputs.to(device))
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(),
            targets.to(device).reshape(-1),
            reduction="sum",
        )
        total += loss.item()
        count += targets.numel()
    model.train(was_training)
    return total / max(count, 1)
