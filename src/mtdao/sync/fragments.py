"""Fragments: the model's layers split into P groups synchronized at staggered steps.

A *layer* is a module holding parameters (a linear map, an embedding, a norm): the parameters
whose names differ only in their last component (``blocks.0.attn.qkv.weight`` belongs to
``blocks.0.attn.qkv``); an unnamed parameter is a layer of its own. Layers are dealt into P
fragments balanced by size (the largest layer first, each to the lightest fragment so far), and a
parameter's optimizer states go with it.

Fragment f of a rule with period T is due at the steps t with ``t % T == f * T // P``: every
fragment is still averaged once per T steps (the bytes per period do not change), but fragments
come due at different steps, so one step sends about 1/P of what an unfragmented round sends.
With P = 1 every offset is 0 and the schedule is the policy's own.
"""

from __future__ import annotations

from collections.abc import Sequence

from mtdao.sync.policy import SyncRule
from mtdao.sync.round_options import check_fragments


def layer_of(name: str) -> str:
    """The layer a parameter name belongs to: the name without its last component."""
    return name.rsplit(".", 1)[0] if "." in name else name


class FragmentSchedule:
    """Which fragment each parameter belongs to, and when a fragment is due under a rule."""

    def __init__(self, names: Sequence[str], sizes: Sequence[int], num_fragments: int = 1) -> None:
        check_fragments(num_fragments)
        layers: dict[str, list[int]] = {}
        for index, name in enumerate(names):
            layers.setdefault(layer_of(name), []).append(index)
        if num_fragments > len(layers):
            raise ValueError(
                f"`sync_fragments` {num_fragments}: the model has only {len(layers)} layers "
                "(modules holding parameters) to split"
            )
        self.num_fragments = num_fragments
        self.fragment_of = [0] * len(names)
        load = [0] * num_fragments
        by_size = sorted(layers.values(), key=lambda members: -sum(sizes[i] for i in members))
        for members in by_size:  # stable: equal layers keep their order
            fragment = min(range(num_fragments), key=lambda f: (load[f], f))
            load[fragment] += sum(sizes[i] for i in members)
            for index in members:
                self.fragment_of[index] = fragment
        self.sizes = load
        """Elements per fragment."""

    def offset(self, fragment: int, period: int) -> int:
        return fragment * period // self.num_fragments

    def is_due(self, rule: SyncRule, index: int, step: int) -> bool:
        """Is parameter ``index`` (or one of its states) due at ``step`` under ``rule``?"""
        if rule.period is None:
            return False
        return step % rule.period == self.offset(self.fragment_of[index], rule.period)

    def describe(self, names: Sequence[str]) -> list[list[str]]:
        """The layers of each fragment, for logs and tests."""
        fragments: list[list[str]] = [[] for _ in range(self.num_fragments)]
        for name, fragment in zip(names, self.fragment_of):
            if layer_of(name) not in fragments[fragment]:
                fragments[fragment].append(layer_of(name))
        return fragments
