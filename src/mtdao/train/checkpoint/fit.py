"""Whether a checkpoint that loaded can be restored into the built run, checked before any of it
is: files that verify can still be edited, forged or another model's, and restoring them would
stop halfway or broadcast a wrong-shaped tensor. A misfit is set aside and the one before taken."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mtdao.train.checkpoint.run_state import RunState
from mtdao.train.setup import Run


def unfit(run: Run, state: Any) -> str | None:
    """Why the unsharded checkpoint ``state`` cannot be restored into ``run``; None if it fits."""
    template = RunState(run).state_dict()
    problem = _missing(state, list(template), "it")
    if problem:
        return problem
    sync = state["sync"]
    problem = _missing(sync, list(template["sync"]), "its sync state")
    if problem:
        return problem
    problem = _same_tensors("parameter", template["params"], state["params"])
    if problem:
        return problem
    anchors = template["sync"]["anchors"]
    if anchors or sync["anchors"]:
        problem = _same_tensors(
            "anchor", dict(enumerate(anchors)), _indexed(sync["anchors"], "anchors")
        )
        if problem:
            return problem
    problem = _optimizer_unfit(run, state["optimizer"])
    if problem:
        return problem
    if not isinstance(state["shards"], list) or len(state["shards"]) != len(run.shards):
        return f"it holds no data position for each of the {len(run.shards)} local workers"
    return _same_tensors("RNG state", {"": template["torch_rng"]}, {"": state["torch_rng"]})


def worker_file_unfit(run: Run, worker: Any) -> str | None:
    """Why a sharded checkpoint's worker file cannot be restored into ``run``."""
    template = RunState(run).worker_state_dict({})
    problem = _missing(worker, [key for key in template if key != "sync"], "it")
    if problem or not isinstance(worker.get("sync"), Mapping):
        return problem or "it holds no sync state"
    if not isinstance(worker["shards"], list) or len(worker["shards"]) != len(run.shards):
        return "it holds no data position of its worker"
    return _missing(worker["sync"], ["step", "traffic", "events"], "its sync state")


def sharded_tensors_unfit(expected: dict[str, Any], metadata) -> str | None:
    """Why DCP ``metadata`` does not hold every tensor of ``expected`` (a DCP state dict of the
    built run) with its global shape; None if it does."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(expected)
    stored = metadata.state_dict_metadata
    for key, value in flat.items():
        if not isinstance(value, torch.Tensor):
            continue
        if key not in stored:
            return f"it holds no {key}"
        size = getattr(stored[key], "size", None)
        if size is None or tuple(size) != tuple(value.shape):
            found = "no tensor" if size is None else f"shape {tuple(size)}"
            return f"its {key} has {found}, the model {tuple(value.shape)}"
    return None


# -- the checks -----------------------------------------------------------------------------------


def _missing(state: Any, keys: list[str], what: str) -> str | None:
    if not isinstance(state, Mapping):
        return f"{what} is a {type(state).__name__}, not a mapping of the run's state"
    absent = [key for key in keys if key not in state]
    if absent:
        return f"{what} holds no {', '.join(absent)}"
    return None


def _indexed(values: Any, what: str) -> dict:
    return dict(enumerate(values)) if isinstance(values, (list, tuple)) else {what: values}


def _same_tensors(kind: str, expected: dict, found: Any) -> str | None:
    """Same names, and for each a tensor of the same shape and dtype."""
    if not isinstance(found, Mapping):
        return f"its {kind}s are a {type(found).__name__}"
    if set(found) != set(expected):
        extra, absent = sorted(set(found) - set(expected)), sorted(set(expected) - set(found))
        named = f"{len(absent)} missing, e.g. {absent[0]}" if absent else f"e.g. {extra[0]}"
        return f"its {kind}s are not the model's ({named})"
    for name, tensor in expected.items():
        value = found[name]
        if not isinstance(value, torch.Tensor):
            return f"its {kind} {name} is a {type(value).__name__}"
        if value.shape != tensor.shape or value.dtype != tensor.dtype:
            return (
                f"its {kind} {name} is {tuple(value.shape)} {value.dtype}, the model's "
                f"{tuple(tensor.shape)} {tensor.dtype}"
            )
    return None


def _optimizer_unfit(run: Run, optimizer: Any) -> str | None:
    """Each group's number of parameters, and every parameter-shaped state of the right shape."""
    if not isinstance(optimizer, Mapping) or not {"state", "param_groups"} <= set(optimizer):
        return "it holds no optimizer state"
    groups = run.optimizer.param_groups
    saved = optimizer["param_groups"]
    if not isinstance(saved, list) or not all(
        isinstance(group, Mapping)
        and isinstance(group.get("params"), list)
        and all(type(i) is int for i in group["params"])
        for group in saved
    ):
        return "its optimizer's parameter groups are not a list of groups of parameter indices"
    sizes = [len(group["params"]) for group in saved]
    if sizes != [len(group["params"]) for group in groups]:
        return "its optimizer's parameter groups are not the model's"
    params = [p for group in groups for p in group["params"]]
    ids = [i for group in saved for i in group["params"]]
    by_id = dict(zip(ids, params))
    if not isinstance(optimizer["state"], Mapping):
        return "its optimizer state is not a mapping"
    for index, states in optimizer["state"].items():
        if index not in by_id or not isinstance(states, Mapping):
            return f"its optimizer holds a state of no parameter ({index!r})"
        shape = by_id[index].shape
        missing = sorted(_state_keys(run.optimizer, index, saved) - set(states)) if states else []
        if missing:
            return f"its optimizer state of parameter {index} holds no {', '.join(missing)}"
        for key, value in states.items():
            if not isinstance(value, torch.Tensor):
                return f"its optimizer state {key} of parameter {index} is a {type(value).__name__}"
            if value.dim() > 0 and value.shape != shape:
                return f"its optimizer state {key} of parameter {index} is not shaped like it"
    return None


def _state_keys(optimizer: Any, index: int, saved: list) -> set[str]:
    """The state keys ``optimizer`` (an mtdao optimizer) steps with for the saved parameter
    ``index`` (step and its parameter-shaped states); none where it does not say."""
    keys_of = getattr(optimizer, "state_keys", None)
    group = next((g for g in saved if index in g["params"]), None)
    betas = group.get("betas") if group is not None else None
    if keys_of is None or not isinstance(betas, (list, tuple)):
        return set()
    return {"step", *keys_of(len(betas))}
