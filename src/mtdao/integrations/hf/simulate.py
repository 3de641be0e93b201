"""M workers of a transformers model in one process (:func:`mtdao.sync.stack_workers`).

A transformers forward runs under ``torch.func.vmap`` as it is, with two exceptions that are
transformers' own, not ours, each met here:

- the key/value cache: a forward with ``use_cache=True`` returns a ``DynamicCache`` object,
  which vmap cannot stack; training never needs it, so the workers' config turns it off;
- padding masks with SDPA attention: transformers decides whether it can skip the mask with
  ``padding_mask.all()``, a data-dependent branch vmap refuses. Packed sequences (no
  ``attention_mask``), the usual pre-training input, need no mask; with padding, load the model
  with ``attn_implementation="eager"``, whose masks are plain tensor arithmetic.
"""

from __future__ import annotations

from torch import nn

from mtdao.model.stacked_workers import StackedWorkers, stack_workers


def stack_hf_workers(model: nn.Module, num_workers: int) -> StackedWorkers:
    """``stack_workers(model, num_workers)`` for a transformers model, its cache turned off.

    Call ``workers(input_ids=ids, labels=labels)`` with ``ids`` and ``labels`` of shape
    [M, batch, sequence]: ``.loss`` is each worker's loss (shape [M]) and ``.logits`` stacks the
    workers' logits. Dropout draws differ across workers (``randomness="different"``).
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "use_cache"):
        raise ValueError(
            f"{type(model).__name__} has no transformers config; use mtdao.sync.stack_workers"
        )
    config.use_cache = False  # a cache object in the output cannot be stacked by vmap
    return stack_workers(model, num_workers)
