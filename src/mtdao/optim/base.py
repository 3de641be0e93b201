"""Bookkeeping shared by the MT-DAO optimizers: validation, lazy state, bucketing, dispatch.

The math lives in :mod:`mtdao.optim.functional`; a subclass names its kernels and whether it keeps a
second moment. State keys per parameter are a contract with the sync engine: ``step``,
``exp_avg_0`` .. ``exp_avg_{N-1}`` and (Adam, ADOPT) ``exp_avg_sq``.
"""

from __future__ import annotations

import math
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable
from itertools import chain
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from mtdao.optim.flat import FlatBucket, FlatGroup, fits_flat, flat_by_default
from mtdao.optim.fused import FusedRule

# Parameters stored in these dtypes get float32 optimizer state and are updated through a float32
# copy: a bf16 EMA with beta = 0.999 cannot represent (1 - beta) * g against u and would stall.
LOW_PRECISION_DTYPES = (torch.float16, torch.bfloat16)


def state_dtype_of(param_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the states of a parameter of ``param_dtype``."""
    return torch.float32 if param_dtype in LOW_PRECISION_DTYPES else param_dtype


def momentum_key(index: int) -> str:
    """State key of the ``index``-th first momentum."""
    return f"exp_avg_{index}"


def check_decay(name: str, value: Any) -> float:
    value = float(value)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"Invalid {name}: {value} (a decay must lie in [0, 1))")
    return value


def check_non_negative(name: str, value: Any) -> float:
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"Invalid {name}: a tensor {name} must hold one value")
        value = value.item()
    value = float(value)
    if not value >= 0.0 or math.isinf(value):
        raise ValueError(f"Invalid {name}: {value} (must be a finite number >= 0)")
    return value


def check_momenta(betas: Any, omegas: Any) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Validate the N momentum decays and their N mixing weights."""
    if isinstance(betas, (int, float)) or isinstance(omegas, (int, float)):
        raise ValueError(
            f"Invalid betas/omegas: {betas!r}/{omegas!r} (pass sequences, e.g. betas=(0.999,))"
        )
    betas = tuple(check_decay(f"beta at index {i} of betas", b) for i, b in enumerate(betas))
    omegas = tuple(float(w) for w in omegas)
    if len(betas) == 0:
        raise ValueError("Invalid betas: () (at least one momentum is needed, N >= 1)")
    if len(omegas) != len(betas):
        raise ValueError(
            f"Invalid omegas: {omegas} has {len(omegas)} weights but betas {betas} has "
            f"{len(betas)} momenta (one mixing weight per momentum)"
        )
    for i, omega in enumerate(omegas):
        if not omega >= 0.0 or math.isinf(omega):
            raise ValueError(f"Invalid omega at index {i}: {omega} (must be >= 0)")
    if math.fsum(omegas) > 1.0 + 1e-9:
        raise ValueError(
            f"Invalid omegas: {omegas} sum to {math.fsum(omegas)} > 1 "
            "(the raw gradient gets 1 - sum(omegas), which must not be negative)"
        )
    return betas, omegas


def local_shards(tensors: list[Tensor]) -> list[Tensor]:
    """Sharded tensors (DTensors, as FSDP2 makes parameters) as their local shards, in place of
    which the kernels update them; other tensors unchanged. The update is element-wise, so a shard
    is updated exactly as the same slice of the whole tensor would be."""
    dtensor = sys.modules.get("torch.distributed.tensor")  # no DTensor exists unless imported
    if dtensor is None:
        return tensors
    return [t.to_local() if isinstance(t, dtensor.DTensor) else t for t in tensors]


class MultiTimescaleOptimizer(Optimizer):
    """Base class: a subclass names its kernels and the group entries they take.

    Two choices per group: where the tensors live (``flat=True``: in flat buffers, see
    :mod:`mtdao.optim.flat`; ``False``: where they are) and which kernels run (``fused``, see
    :mod:`mtdao.optim.fused`; ``foreach``; or a for-loop). The defaults (None) take the fastest
    measured combination per device: on the CPU the C++ kernel over the tensors where they are, on
    CUDA flat buffers and the compiled kernel where compiling pays, the foreach path otherwise (also
    where no fused kernel can be built, with one warning). Parameters that cannot live in a flat
    buffer (DTensors, views of a storage laid out elsewhere) are updated where they are."""

    _has_second_moment = True
    single_tensor_kernel: Callable[..., None]
    multi_tensor_kernel: Callable[..., None]
    fused_kernel: Callable[..., None]
    fused_rule: FusedRule
    hyperparameter_names: tuple[str, ...] = ()

    def __init__(self, params: Iterable, defaults: dict[str, Any]) -> None:
        self._flat_groups: dict[int, FlatGroup] = {}  # by group index, built at first step
        super().__init__(params, defaults)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # (load_state_dict calls it too: keep the buffers there)
        self.__dict__.setdefault("_flat_groups", {})  # a copy's are built at its first step
        for group in self.param_groups:  # optimizers pickled before these options existed
            group.setdefault("foreach", None)
            group.setdefault("fused", None)
            group.setdefault("flat", None)

    # -- validation ---------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        try:
            self._validate_group(self.param_groups[-1])
        except ValueError:
            self.param_groups.pop()  # a rejected group must not stay in the optimizer
            raise

    def _validate_group(self, group: dict[str, Any]) -> None:
        """Check (and normalize in place) one group's hyperparameters."""
        lr = check_non_negative("learning rate (lr)", group["lr"])
        if not isinstance(group["lr"], Tensor):  # a tensor lr stays one (schedulers fill it)
            group["lr"] = lr
        group["weight_decay"] = check_non_negative("weight_decay", group["weight_decay"])
        group["betas"], group["omegas"] = check_momenta(group["betas"], group["omegas"])
        if "eps" in group:
            group["eps"] = check_non_negative("eps", group["eps"])
        if "beta2" in group:
            group["beta2"] = check_decay("beta2", group["beta2"])
        if group.get("fused") and group.get("foreach"):
            raise ValueError(
                "Invalid fused/foreach: fused=True and foreach=True exclude each other"
            )
        if group.get("flat") not in (None, True, False):
            raise ValueError(f"Invalid flat: {group['flat']!r} (True, False or None)")
        for p in group["params"]:
            if p.is_complex():
                raise ValueError(f"{type(self).__name__} does not support complex parameters")

    # -- state --------------------------------------------------------------------------------

    def state_keys(self, num_momenta: int) -> list[str]:
        """The parameter-shaped state keys of a group of ``num_momenta`` momenta: the momenta's,
        then the second moment's (with ``step``, what a parameter's saved state holds)."""
        keys = [momentum_key(j) for j in range(num_momenta)]
        return keys + ["exp_avg_sq"] if self._has_second_moment else keys

    def _init_state(self, p: Tensor, num_momenta: int) -> dict[str, Any]:
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            for key in self.state_keys(num_momenta):
                state[key] = torch.zeros_like(
                    p, dtype=state_dtype_of(p.dtype), memory_format=torch.preserve_format
                )
        else:
            self._check_momenta_of_state(state, num_momenta)
        return state

    def _check_momenta_of_state(self, state: dict[str, Any], num_momenta: int) -> None:
        if momentum_key(num_momenta - 1) not in state or momentum_key(num_momenta) in state:
            raise ValueError(
                f"{type(self).__name__}: the number of betas of a param group changed from what "
                f"its state holds (state keys {sorted(state)})"
            )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        # torch casts loaded floating state to the parameter dtype (it calls
        # Optimizer._process_value_according_to_param_policy by name, so a subclass override is
        # never seen). State of bf16/fp16 parameters is float32 (see _init_state): rebuild it from
        # the saved tensors, so that it round-trips bit for bit.
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for saved_id, p in zip(saved_ids, params):
            if p.dtype not in LOW_PRECISION_DTYPES:
                continue
            for key, value in state_dict["state"].get(saved_id, {}).items():
                if key != "step" and isinstance(value, Tensor) and value.is_floating_point():
                    self.state[p][key] = value.to(device=p.device, dtype=torch.float32)
        for state in self.state.values():  # torch moves the step of a fused group to the device
            step = state.get("step")
            if isinstance(step, Tensor) and step.device.type != "cpu":
                state["step"] = step.to("cpu", torch.float32)  # read each step: not from a GPU
        # The loaded states are tensors of their own: copy them into the flat buffers (the
        # parameters are the same objects), so that no buffer is allocated twice.
        flat_groups, self._flat_groups = self._flat_groups, {}
        for index, flat_group in flat_groups.items():
            if index < len(self.param_groups):
                flat_group.group = self.param_groups[index]
                if flat_group.refresh(self.state):
                    self._flat_groups[index] = flat_group

    # -- step ---------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            self._step_group(group, index)
        return loss

    def _step_group(self, group: dict[str, Any], index: int) -> None:
        with_grad = [p for p in group["params"] if p.grad is not None]
        if any(p.grad.is_sparse for p in with_grad):
            raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
        if with_grad and self._wants_flat(group, with_grad[0]):
            with_grad = self._step_flat(group, index, with_grad)
        if with_grad:
            self._step_tensors(group, with_grad)

    # -- the tensors where they are -------------------------------------------------------------

    def _step_tensors(self, group: dict[str, Any], with_grad: list[Tensor]) -> None:
        num_momenta = len(group["betas"])
        # Bucket by (device, dtype, step) so kernels see uniform tensors and one scalar bias
        # correction; parameters normally share one step, so there is normally one bucket.
        buckets: dict[tuple, list[Tensor]] = defaultdict(list)
        steps = [self._init_state(p, num_momenta)["step"] for p in with_grad]
        torch._foreach_add_(steps, 1)  # one call: per-tensor adds cost more than a fused step
        for p, step in zip(with_grad, steps):
            buckets[(p.device, p.dtype, int(step.item()))].append(p)
        for (_, dtype, step), params in buckets.items():
            states = [self.state[p] for p in params]
            grads = [p.grad for p in params]
            exp_avgs = [[s[momentum_key(j)] for s in states] for j in range(num_momenta)]
            exp_avg_sqs = [s["exp_avg_sq"] for s in states] if self._has_second_moment else []
            params, grads, exp_avg_sqs = map(local_shards, (params, grads, exp_avg_sqs))
            exp_avgs = [local_shards(momenta) for momenta in exp_avgs]
            self._update(group, params, grads, exp_avgs, exp_avg_sqs, step, dtype)

    def _update(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        exp_avgs: list[list[Tensor]],
        exp_avg_sqs: list[Tensor],
        step: int,
        dtype: torch.dtype,
    ) -> None:
        """One update of tensors of one device, ``dtype`` and ``step``, by the group's path."""
        hyperparameters = {name: group[name] for name in self.hyperparameter_names}
        path = self._path(group, params, exp_avgs[0][0])
        if path == "fused":  # low-precision parameters are handled inside the kernel
            self._run(
                self.fused_kernel, params, grads, exp_avgs, exp_avg_sqs, step, hyperparameters
            )
            return
        kernel = self.multi_tensor_kernel if path == "foreach" else self.single_tensor_kernel
        hyperparameters["lr"] = float(hyperparameters["lr"])
        if dtype in LOW_PRECISION_DTYPES:
            params32 = [p.float() for p in params]
            grads32 = [g.float() for g in grads]
            self._run(kernel, params32, grads32, exp_avgs, exp_avg_sqs, step, hyperparameters)
            torch._foreach_copy_(params, params32)
        else:
            self._run(kernel, params, grads, exp_avgs, exp_avg_sqs, step, hyperparameters)

    # -- flat buffers ---------------------------------------------------------------------------

    def _wants_flat(self, group: dict[str, Any], param: Tensor) -> bool:
        flat = group.get("flat")
        return flat_by_default(param.device) if flat is None else flat

    def _step_flat(self, group: dict[str, Any], index: int, with_grad: list[Tensor]) -> list:
        """Step the group's parameters that live in flat buffers; the others of ``with_grad``
        (those that cannot) are returned, for the per-tensor path."""
        flat_group = self._flat_groups.get(index)
        if flat_group is not None and (
            flat_group.group is not group or not flat_group.refresh(self.state)
        ):
            flat_group = None
        if flat_group is not None and flat_group.is_exactly(with_grad):  # the usual step
            for bucket in flat_group.buckets:
                self._step_bucket(group, bucket, None)
            return []
        with_grad_ids = {id(p) for p in with_grad}
        if flat_group is None or any(
            id(p) not in flat_group.member_ids and fits_flat(p) for p in with_grad
        ):
            flat_group = self._flatten(group, index, with_grad_ids)
        for bucket in flat_group.buckets:
            indices = [i for i, p in enumerate(bucket.params) if id(p) in with_grad_ids]
            if indices:
                self._step_bucket(group, bucket, indices)
        return [p for p in with_grad if id(p) not in flat_group.member_ids]

    def _flatten(self, group: dict[str, Any], index: int, with_grad_ids: set[int]) -> FlatGroup:
        """(Re)build the group's flat buckets over its parameters that fit one and have a
        gradient now or state from before (any buckets of before are let go)."""
        num_momenta = len(group["betas"])
        self._flat_groups.pop(index, None)
        members = []
        for p in group["params"]:
            state = self.state.get(p)
            if (id(p) in with_grad_ids or state) and fits_flat(p):
                if state:
                    self._check_momenta_of_state(state, num_momenta)
                members.append(p)
        keys = self.state_keys(num_momenta)
        flat_group = FlatGroup(group, members, self.state, keys, state_dtype_of)
        self._flat_groups[index] = flat_group
        return flat_group

    def _step_bucket(self, group: dict[str, Any], bucket: FlatBucket, indices) -> None:
        """Step the bucket's parameters at ``indices`` (None: all of them): one update over the
        whole buffers when all are at one step, else one per run of neighbours at one step."""
        bucket.advance(indices)
        bucket.gather_gradients(indices)
        if indices is None and bucket.step is not None:
            ranges = [(slice(None), bucket.step)]
        else:
            ranges = bucket.runs(list(range(len(bucket.params))) if indices is None else indices)
        for where, step in ranges:
            params, grads, momenta, second_moment = bucket.tensors(where)
            exp_avg_sqs = [] if second_moment is None else [second_moment]
            exp_avgs = [[u] for u in momenta]
            self._update(group, [params], [grads], exp_avgs, exp_avg_sqs, step, bucket.dtype)

    def _path(self, group: dict[str, Any], params: list[Tensor], state: Tensor) -> str:
        """The implementation ("fused", "foreach" or "loop") for a bucket of ``params`` whose
        states are like ``state``."""
        fused, foreach = group.get("fused"), group.get("foreach")
        if foreach is False and not fused:
            return "loop"
        if fused is False or (fused is None and foreach):
            return "foreach"
        chosen = self.fused_rule.chosen(len(group["betas"]), params, state, fused)
        return "fused" if chosen else "foreach"

    def _run(
        self,
        kernel: Callable[..., None],
        params: list[Tensor],
        grads: list[Tensor],
        exp_avgs: list[list[Tensor]],
        exp_avg_sqs: list[Tensor],
        step: int,
        hyperparameters: dict[str, Any],
    ) -> None:
        if self._has_second_moment:
            kernel(params, grads, exp_avgs, exp_avg_sqs, step=step, **hyperparameters)
        else:
            kernel(params, grads, exp_avgs, **hyperparameters)
