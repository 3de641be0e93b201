"""Whether a heal state may be applied: a secret holder may be faulty, so every tensor must match
the receiver's own key, shape and dtype and be finite, the records loaded first must be shaped
like the receiver's own, and the state must be at the commit count and step its sender proved;
:func:`heal_problem` names the first key that fails."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

TRAINED_STATE = frozenset({"params", "optimizer", "sync"})
"""The keys of a trained state (:class:`~mtdao.sync.trained_state.TrainedState`)."""
REPLICA_RECORD, CONFIG_RECORD = "replica", "config"
"""The records a replica loads first, by code that trusts their shape: ReplicaGroups' identity
(``replica_id``, ``step``, ``final``) and fault_tolerant_replica's shared settings
(``replica_id``, ``config``)."""


def heal_problem(
    received: Any,
    own: dict[str, Any],
    commits: int,
    step: int,
    allow_non_finite: bool = False,
    same_config: bool = True,
) -> str | None:
    """Why ``received`` (a heal state: ``{"torchft": {...}, "user": {key: state}}``) may not
    replace this replica's ``own`` user state (None: it may). ``commits`` and ``step`` are the
    commit count and training step its sender proved; ``same_config``: whether it claimed this
    replica's config digest (if not, its records alone are checked: this replica's config
    check then refuses this replica before anything else is loaded)."""
    if not isinstance(received, dict) or set(received) != {"torchft", "user"}:
        return "the state is not a heal state (it needs 'torchft' and 'user')"
    problem = _progress_problem(received["torchft"], commits)
    if problem:
        return problem
    user = received["user"]
    if not isinstance(user, dict):
        return f"the state's user state is {_a(user)}, here a dict"
    problem = _records_problem(user, own, step, same_config)
    if problem or not same_config:
        return problem
    return _Checker(allow_non_finite, step).compare(user, own, "")


def _progress_problem(progress: Any, commits: int) -> str | None:
    """torchft's record (its manager loads ``step`` and ``batches_committed``): at the proven
    commit count."""
    if not isinstance(progress, dict):
        return f"torchft is {_a(progress)}, here a dict"
    for key in ("step", "batches_committed"):
        if type(progress.get(key)) is not int:
            return f"torchft.{key} is {_a(progress.get(key))}, here an int"
    if progress["step"] != commits:
        return f"torchft.step is {_int(progress['step'])}, its sender proved {commits} commits"
    return None


def _records_problem(
    user: dict[str, Any], own: dict[str, Any], step: int, same_config: bool
) -> str | None:
    """Each record of this replica's: the same keys, each value of the same type (an int no
    bool), no tensors; the identity at the proven step; the settings as the claimed config
    digest says (equal to this replica's, or not)."""
    for name in (REPLICA_RECORD, CONFIG_RECORD):
        if not isinstance(own.get(name), dict):  # not tracked by a replica of this package
            continue
        record, mine = user.get(name), own[name]
        if not isinstance(record, dict) or set(record) != set(mine):
            return f"{name} is not a record like this replica's ({', '.join(sorted(mine))})"
        if _holds_tensors(record) and not _holds_tensors(mine):
            return f"{name} holds tensors, here none"
        for key, value in mine.items():
            if type(record[key]) is not type(value):
                return f"{name}.{key} is {_a(record[key])}, here {_a(value)}"
    identity = own.get(REPLICA_RECORD)
    if isinstance(identity, dict) and "step" in identity:
        sent = user[REPLICA_RECORD]["step"]
        if sent != step:
            return f"{REPLICA_RECORD}.step is {_int(sent)}, its sender proved step {step}"
    if isinstance(own.get(CONFIG_RECORD), dict):
        settings = user[CONFIG_RECORD].get("config")
        if (settings == own[CONFIG_RECORD].get("config")) != same_config:
            held, claimed = ("differs from", "the same") if same_config else ("holds", "another")
            return (
                f"{CONFIG_RECORD}.config {held} this replica's settings, though its sender "
                f"claimed {claimed} config digest"
            )
    return None


class _Checker:
    def __init__(self, allow_non_finite: bool, step: int) -> None:
        self.allow_non_finite, self.step = allow_non_finite, step

    def compare(self, received: Any, own: Any, path: str) -> str | None:
        if isinstance(own, Tensor):
            return self._tensor(received, own, path)
        if isinstance(own, dict):
            if not isinstance(received, dict):
                return f"{path or 'the state'} is {_a(received)}, here a dict"
            if set(own) >= TRAINED_STATE:
                return self._trained(received, own, path)
            return self._dict(received, own, path)
        if isinstance(own, (list, tuple)):
            return self._sequence(received, own, path)
        return _scalar(received, own, path)

    def _tensor(self, received: Any, own: Tensor | None, path: str) -> str | None:
        if not isinstance(received, Tensor):
            return f"{path} is {_a(received)}, here a tensor"
        if own is not None and received.dtype != own.dtype:
            return f"{path} is {_dtype(received)}, here {_dtype(own)}"
        if own is not None and received.shape != own.shape:
            return f"{path} has shape {_shape(received)}, here {_shape(own)}"
        if not self.allow_non_finite and _non_finite(received):
            return f"{path} holds NaN/inf"
        return None

    def _dict(self, received: dict, own: dict, path: str) -> str | None:
        if not _holds_tensors(own) and not _holds_tensors(received):
            return None  # plain records (counters by kind, settings) may differ
        # a record by index (residuals by tensor) fills as rounds come: the entries this
        # replica does not hold yet are checked for what can be checked without them
        by_index = all(_is_index(key) for key in (*own, *received))
        for key in own:
            if key not in received and not by_index:
                return f"{_join(path, key)} is missing"
        for key in received:
            if key not in own and not by_index:
                return f"{_join(path, key)} is no part of this replica's state"
        for key, value in received.items():
            where = _join(path, key)
            problem = (
                self.compare(value, own[key], where) if key in own else self._leaves(value, where)
            )
            if problem:
                return problem
        return None

    def _sequence(self, received: Any, own: Sequence, path: str) -> str | None:
        if not isinstance(received, (list, tuple)):
            return f"{path} is {_a(received)}, here a list"
        if len(received) == len(own):
            pairs = zip(received, own)
        else:  # a record that grows (rounds, events): each element like this replica's first
            pairs = ((item, own[0] if own else None) for item in received)
        for index, (item, mine) in enumerate(pairs):
            where = _join(path, index)
            problem = self._leaves(item, where) if mine is None else self.compare(item, mine, where)
            if problem:
                return problem
        return None

    def _trained(self, received: dict, own: dict, path: str) -> str | None:
        """A trained state: the parameters exactly; the optimizer's states like this replica's
        where it has them, else shaped like their parameter; the engine at the proven step."""
        optimizer, own_optimizer = received.get("optimizer"), own["optimizer"]
        problem = self._dict({**received, "optimizer": None}, {**own, "optimizer": None}, path)
        if problem:
            return problem
        sync_step = received["sync"].get("step")
        if sync_step != self.step:
            where = _join(path, "sync.step")
            return f"{where} is {sync_step!r}, its sender proved step {self.step}"
        params = list(own["params"].values())
        return self._optimizer(optimizer, own_optimizer, params, _join(path, "optimizer"))

    def _optimizer(self, received: Any, own: dict, params: list[Tensor], path: str) -> str | None:
        if not isinstance(received, dict) or set(received) != set(own):
            return f"{path} is not an optimizer's state_dict like this replica's"
        groups = f"{path}.param_groups"
        problem = self.compare(received["param_groups"], own["param_groups"], groups)
        if problem:
            return problem
        states, own_states = received["state"], own["state"]
        if not isinstance(states, dict):
            return f"{path}.state is {_a(states)}, here a dict"
        for index, state in states.items():
            where = f"{path}.state.{index}"
            if not isinstance(index, int) or not 0 <= index < len(params):
                return f"{where} names no parameter of this replica"
            if index in own_states:
                problem = self.compare(state, own_states[index], where)
            else:  # no step taken here yet: each state a counter or shaped like its parameter
                problem = self._fresh_state(state, params[index], where)
            if problem:
                return problem
        return None

    def _fresh_state(self, state: Any, param: Tensor, path: str) -> str | None:
        if not isinstance(state, dict):
            return f"{path} is {_a(state)}, here a dict"
        for key, value in state.items():
            where = _join(path, key)
            if isinstance(value, Tensor) and value.dim() > 0:
                if value.shape != param.shape:
                    return f"{where} has shape {_shape(value)}, its parameter {_shape(param)}"
                if value.is_floating_point() != param.is_floating_point():
                    return f"{where} is {_dtype(value)}, its parameter {_dtype(param)}"
            problem = self._leaves(value, where)
            if problem:
                return problem
        return None

    def _leaves(self, value: Any, path: str) -> str | None:
        """What is left to check of a value this replica has no counterpart of: finite."""
        if isinstance(value, Tensor):
            return self._tensor(value, None, path)
        for key, item in _children(value):
            problem = self._leaves(item, _join(path, key))
            if problem:
                return problem
        return None


def _scalar(received: Any, own: Any, path: str) -> str | None:
    """A plain value (a counter, a setting) may differ; a tensor or container in its place may
    not."""
    if isinstance(received, (Tensor, dict, list, tuple)):
        return f"{path} is {_a(received)}, here {_a(own)}"
    return None


def _is_index(key: object) -> bool:
    return isinstance(key, int) or (isinstance(key, str) and key.isdigit())


def _children(value: Any) -> Iterable[tuple[Any, Any]]:
    """The (key, item) pairs of a dict, list or tuple; none of anything else."""
    if isinstance(value, dict):
        return value.items()
    return enumerate(value) if isinstance(value, (list, tuple)) else ()


def _holds_tensors(value: Any) -> bool:
    return isinstance(value, Tensor) or any(_holds_tensors(item) for _, item in _children(value))


def _non_finite(tensor: Tensor) -> bool:
    if not (tensor.is_floating_point() or tensor.is_complex()):
        return False
    return not bool(torch.isfinite(tensor).all())


def _join(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


def _a(value: Any) -> str:
    """What ``value`` is, as a line says it: "an int", "a float32 tensor", "None"."""
    if value is None:
        return "None"
    kind = f"{_dtype(value)} tensor" if isinstance(value, Tensor) else type(value).__name__
    return f"{'an' if kind[0].lower() in 'aeio' else 'a'} {kind}"


def _int(value: int) -> str:
    """An int as a line shows it (str() refuses one of over 4,300 digits)."""
    return str(value) if value.bit_length() <= 64 else f"an int of {value.bit_length()} bits"


def _dtype(tensor: Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _shape(tensor: Tensor) -> str:
    return str(tuple(tensor.shape))
