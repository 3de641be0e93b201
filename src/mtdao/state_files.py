"""What may go into a state file, and how one is read back safely: for any loop's checkpoints.

A state is refused before anything is written when it holds a NaN/inf tensor (it would replace a
good checkpoint with a diverged one) or an object the safe loader cannot read back (it could never
be resumed). Files are read with ``weights_only=True``; when that refuses a file, the message says
why, without torch's advice to retry with ``weights_only=False``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

# Leaf types that ``torch.load(weights_only=True)`` reads back (checked against torch 2.13).
_SAFE_LEAVES = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    bytearray,
    torch.dtype,
    torch.device,
)


def first_unsavable(state: Any, prefix: str = "", finite: bool = True) -> str | None:
    """Describe the first value in ``state`` that must not be checkpointed, or None if all are fine.

    Paths join keys and indices with dots, as in ``optimizer.state.3.exp_avg_sq``. With
    ``finite=False`` NaN/inf tensors are accepted (only unreadable objects are refused).
    """
    stack: list[tuple[str, Any]] = [(prefix, state)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, torch.Tensor):
            if finite and _has_non_finite(value):
                return f"{path or 'the state'} holds NaN/inf"
        elif isinstance(value, Mapping):
            children = [(_join(path, key), item) for key, item in value.items()]
            stack.extend(reversed(children))  # depth first, in insertion order
        elif isinstance(value, (list, tuple, set)):
            items = sorted(value, key=repr) if isinstance(value, set) else value
            stack.extend(reversed([(_join(path, i), item) for i, item in enumerate(items)]))
        elif not isinstance(value, _SAFE_LEAVES):
            return (
                f"{path or 'the state'} is a {type(value).__qualname__}, which a safe load "
                "cannot read back (use tensors, numbers, strings, lists and dicts)"
            )
    return None


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _has_non_finite(tensor: torch.Tensor) -> bool:
    """NaN and inf propagate through a sum, so a finite sum proves the tensor finite: one fast
    reduction (about 15x cheaper than ``isfinite`` on a CPU); only a non-finite sum (a NaN/inf,
    or finite values overflowing) pays for the exact check."""
    if not (tensor.is_floating_point() or tensor.is_complex()) or tensor.is_sparse:
        return False
    low_precision = tensor.is_floating_point() and tensor.element_size() < 4
    total = tensor.sum(dtype=torch.float32) if low_precision else tensor.sum()
    if bool(torch.isfinite(total)):
        return False
    return not bool(torch.isfinite(tensor).all())


def read_state_file(path: Path) -> Any:
    """``torch.load`` with the safe loader onto the CPU; raises ValueError with one clean line."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except OSError:
        raise
    except Exception as error:  # torch raises many types for damaged or foreign files
        raise ValueError(explain_load_error(error)) from None


# torch's reason follows this; it may start on the next line (a raw pickle: "\n\nUnsupported ...")
_UNSAFE_REASON = re.compile(r"WeightsUnpickler error:\s*(.*?)(?: Please use|\n|$)")


def explain_load_error(error: BaseException) -> str:
    """One line for a failed safe load. Torch's text for a refused object suggests retrying with
    ``weights_only=False`` (which "will likely succeed"): never show that advice for a
    checkpoint, which should hold nothing the safe loader refuses."""
    text = str(error)
    if "Weights only load failed" in text or "WeightsUnpickler" in text:
        match = _UNSAFE_REASON.search(text)
        reason = match.group(1).strip().rstrip(".") if match else ""
        if reason.startswith("Unsupported operand"):  # an opcode torch.save never writes
            reason += ": a raw pickle, not a file torch.save wrote"
        reason = reason or "an object of an unknown type"
        return f"it holds an object the safe loader refuses ({reason})"
    first_line = next((line.strip() for line in text.splitlines() if line.strip()), "")
    if "weights_only" in first_line:
        first_line = ""
    return f"{type(error).__name__}: {first_line}" if first_line else type(error).__name__
