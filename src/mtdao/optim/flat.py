"""Parameters and optimizer states in flat buffers, so that a step is a few kernel launches (on a
GPU a launch costs microseconds whatever its size: BENCHMARKS.md, "How fast is the optimizer
step?").

The parameters of one param group, device and dtype form a *bucket*: their data, gradients and
each state live in one flat buffer each. What the rest of the library sees does not change: each
parameter's ``.data`` and each of its states are views into the buffers with their own shape and
strides, so the engine, the codecs and checkpoints work on them in place. Before a step
:meth:`FlatBucket.refresh` copies whatever replaced one into its slot. Slots start on 256-byte
boundaries and are padded with zeros that stay zero (a zero gradient leaves them unchanged)."""

from __future__ import annotations

from itertools import repeat
from operator import is_

import torch
from torch import Tensor, nn

ALIGNMENT_BYTES = 256

# fused=None, flat=None: the device types whose parameters are laid out flat by default.
# - CUDA: one launch per tensor costs more than the step's arithmetic (an H200, 25M parameters in
#   100 tensors: the compiled kernels per tensor 4.2 ms a step, foreach 1.3 ms, the same compiled
#   kernel over one flat buffer 0.23 ms, fused AdamW 0.50 ms; BENCHMARKS.md, the step on a GPU).
# - CPU: the C++ kernel already walks all tensors of a bucket in one call, as fast as over one flat
#   copy of them (within 2%, same section); a flat layout would only add the gather of the
#   gradients, so the CPU keeps its per-tensor buckets.
FLAT_BY_DEFAULT = {"cuda": True}

# Set on a parameter whose data this module placed in a bucket: the data pointer of the bucket's
# storage. Only such a parameter may be moved to another bucket while it views a larger storage
# (one that a framework laid out, say, must keep its views).
_PLACED = "_mtdao_flat_storage"


def flat_by_default(device: torch.device) -> bool:
    """Whether ``flat=None`` lays out parameters on ``device`` flat."""
    return FLAT_BY_DEFAULT.get(device.type, False)


def is_dense(t: Tensor) -> bool:
    """Whether ``t``'s elements fill a block of memory exactly once (contiguous in some order of
    its dimensions): such a tensor has a view of the same strides in a flat slot of its size."""
    expected = 1
    for size, stride in sorted(
        ((size, stride) for size, stride in zip(t.shape, t.stride()) if size != 1),
        key=lambda pair: pair[1],
    ):
        if stride != expected:
            return False
        expected *= size
    return True


def fits_flat(p: Tensor) -> bool:
    """Whether parameter ``p`` can live in a bucket: a plain dense tensor (not a DTensor or other
    subclass), holding its storage alone or placed in a bucket before."""
    if type(p) not in (Tensor, nn.Parameter) or p.is_sparse or not is_dense(p):
        return False
    storage = p.untyped_storage()
    if getattr(p, _PLACED, None) == storage.data_ptr():
        return True
    return p.storage_offset() == 0 and storage.nbytes() == p.numel() * p.element_size()


def _slot_numel(numel: int, element_size: int) -> int:
    """Elements a tensor of ``numel`` takes in a bucket, padded to the alignment."""
    per_block = max(1, ALIGNMENT_BYTES // element_size)
    return -(-numel // per_block) * per_block


def _view(buffer: Tensor, like: Tensor, offset: int) -> Tensor:
    return buffer.as_strided(like.shape, like.stride(), offset)


def _shaped_like(value: Tensor, p: Tensor, key: str) -> Tensor:
    if not isinstance(value, Tensor) or value.shape != p.shape:
        shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        raise ValueError(
            f"optimizer state {key} of shape {shape} for a parameter of shape {tuple(p.shape)} "
            "(each state must be shaped like its parameter)"
        )
    return value


def _same_layout(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and a.stride() == b.stride()


class FlatBucket:
    """The parameters of one param group, device and dtype, with their gradients and states
    (``keys``, each a parameter-shaped tensor of ``state_dtype``, plus ``step``) in flat buffers.

    Building it copies each parameter's data and its existing states (zeros where it has none yet)
    into the buffers and makes them views of them.
    """

    def __init__(
        self,
        params: list[Tensor],
        state: dict,
        keys: list[str],
        state_dtype: torch.dtype,
    ) -> None:
        self.params = params
        self.keys = keys
        device, self.dtype = params[0].device, params[0].dtype
        self.offsets, total = [], 0
        for p in params:
            self.offsets.append(total)
            total += _slot_numel(p.numel(), p.element_size())
        self.numel = total
        self.param_buffer = torch.zeros(total, dtype=self.dtype, device=device)
        self.grad_buffer = torch.zeros(total, dtype=self.dtype, device=device)
        self.state_buffers = {
            key: torch.zeros(total, dtype=state_dtype, device=device) for key in keys
        }
        self.steps = torch.zeros(len(params), dtype=torch.float32)  # on the CPU, as _init_state's
        self.param_views = [_view(self.param_buffer, p, o) for p, o in zip(params, self.offsets)]
        self.grad_views = [_view(self.grad_buffer, p, o) for p, o in zip(params, self.offsets)]
        self.state_views = {
            key: [_view(buffer, p, o) for p, o in zip(params, self.offsets)]
            for key, buffer in self.state_buffers.items()
        }
        self.step_views = [self.steps[i] for i in range(len(params))]
        self.param_pointers = [view.data_ptr() for view in self.param_views]
        self.storage_pointer = self.param_buffer.untyped_storage().data_ptr()
        with torch.no_grad():
            for i, p in enumerate(params):
                self._place(i, p)
                param_state = state[p]
                for key in keys:
                    if key in param_state:
                        self.state_views[key][i].copy_(_shaped_like(param_state[key], p, key))
                    param_state[key] = self.state_views[key][i]
                if "step" in param_state:
                    self.step_views[i].fill_(float(param_state["step"]))
                param_state["step"] = self.step_views[i]
        self.param_states = [state[p] for p in params]
        self.views_by_key = {**self.state_views, "step": self.step_views}
        self.step = self._common_step()

    def _place(self, index: int, p: Tensor) -> None:
        """Copy ``p``'s data into its slot and make ``p`` a view of it."""
        view = self.param_views[index]
        view.copy_(p.detach())
        p.data = view
        setattr(p, _PLACED, self.storage_pointer)

    def _common_step(self) -> int | None:
        """The step every parameter of the bucket is at, or None where they differ."""
        if len(self.params) == 0:
            return None
        low, high = self.steps.aminmax()
        return int(low) if low == high else None

    # -- the views stay views -------------------------------------------------------------------

    def refresh(self, state: dict) -> bool:
        """Make every parameter and state a view of its slot again, copying in whatever replaced
        one; False where a replacement does not fit its slot (another shape or device: then the
        bucket must be built again)."""
        # The check runs every step: maps and identity tests only (a tensor-keyed lookup costs
        # ~0.3 us of Python, a 100-tensor model makes ~500 of them)
        if (
            list(map(Tensor.data_ptr, self.params)) == self.param_pointers
            and all(map(is_, map(state.get, self.params), self.param_states))
            and all(
                all(map(is_, map(dict.get, self.param_states, repeat(key)), views))
                for key, views in self.views_by_key.items()
            )
        ):
            return True
        return self._repair(state)

    @torch.no_grad()
    def _repair(self, state: dict) -> bool:
        steps_replaced = False
        for i, p in enumerate(self.params):
            if p.data_ptr() != self.param_pointers[i] or not _same_layout(p, self.param_views[i]):
                if not self._fits(p, self.param_views[i]):
                    return False
                self._place(i, p)
            param_state = state.get(p)
            if not param_state:
                return False
            self.param_states[i] = param_state
            for key, views in self.views_by_key.items():
                value = param_state.get(key)
                if value is not views[i]:
                    if value is None or not self._fits(value, views[i]):
                        return False
                    views[i].copy_(torch.as_tensor(value))
                    param_state[key] = views[i]
                    steps_replaced |= key == "step"
        if steps_replaced:
            self.step = self._common_step()
        return True

    @staticmethod
    def _fits(value: Tensor, view: Tensor) -> bool:
        """Whether ``value`` can be copied into ``view`` as it is (same shape and device; a state
        of another dtype, as a checkpoint's, is cast; a step may be a number)."""
        if not isinstance(value, Tensor):
            return view.dim() == 0 and isinstance(value, (int, float))
        if view.dim() == 0:
            return value.numel() == 1
        return value.shape == view.shape and value.device == view.device

    # -- a step ---------------------------------------------------------------------------------

    def gather_gradients(self, indices: list[int] | None = None) -> None:
        """Copy the parameters' gradients (those at ``indices``, default all) into the bucket."""
        if indices is None:
            torch._foreach_copy_(self.grad_views, [p.grad for p in self.params])
            return
        views = [self.grad_views[i] for i in indices]
        torch._foreach_copy_(views, [self.params[i].grad for i in indices])

    def advance(self, indices: list[int] | None = None) -> None:
        """Count one step of the parameters at ``indices`` (default all)."""
        if indices is None:
            self.steps.add_(1.0)
            if self.step is not None:
                self.step += 1
            return
        torch._foreach_add_([self.step_views[i] for i in indices], 1.0)
        self.step = self._common_step()

    def runs(self, indices: list[int]) -> list[tuple[slice, int]]:
        """The buffer ranges to update for the parameters at ``indices`` (ascending): maximal runs
        of neighbours at the same step, each as (range of the buffers, its step)."""
        steps = self.steps.tolist()
        found: list[tuple[int, int, int]] = []  # (first index, last index, step)
        for i in indices:
            step = int(steps[i])
            if found and found[-1][1] == i - 1 and found[-1][2] == step:
                found[-1] = (found[-1][0], i, step)
            else:
                found.append((i, i, step))
        ranges = []
        for first, last, step in found:
            stop = self.offsets[last + 1] if last + 1 < len(self.params) else self.numel
            ranges.append((slice(self.offsets[first], stop), step))
        return ranges

    def tensors(self, where: slice | None = None) -> tuple[Tensor, Tensor, list[Tensor], Tensor]:
        """(parameters, gradients, momenta, second moment or None) of the buffers' range
        ``where`` (default all); ``keys`` are the momenta's, then the second moment's."""
        where = where or slice(None)
        states = [self.state_buffers[key][where] for key in self.keys]
        has_second_moment = self.keys[-1] == "exp_avg_sq"
        momenta = states[:-1] if has_second_moment else states
        second_moment = states[-1] if has_second_moment else None
        return self.param_buffer[where], self.grad_buffer[where], momenta, second_moment


class FlatGroup:
    """The flat buckets of one param group: its parameters that fit a bucket and have state or a
    gradient, split by device and dtype (group order kept within a bucket)."""

    def __init__(
        self,
        group: dict,
        params: list[Tensor],
        state: dict,
        keys: list[str],
        state_dtype_of,
    ) -> None:
        self.group = group
        self.members = params
        self.member_ids = {id(p) for p in params}
        by_kind: dict[tuple, list[Tensor]] = {}
        for p in params:
            by_kind.setdefault((p.device, p.dtype), []).append(p)
        self.buckets = [
            FlatBucket(members, state, keys, state_dtype_of(dtype))
            for (_, dtype), members in by_kind.items()
        ]

    def refresh(self, state: dict) -> bool:
        return all(bucket.refresh(state) for bucket in self.buckets)

    def is_exactly(self, params: list[Tensor]) -> bool:
        """Whether ``params`` are the members, in order (the common step: every member has a
        gradient and no other parameter has)."""
        return len(params) == len(self.members) and all(
            p is q for p, q in zip(params, self.members)
        )
