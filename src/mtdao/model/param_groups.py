"""Weight-decay groups, decided by parameter name only.

By name, not by ``ndim``: the simulator stacks each parameter along a worker dimension, so a
norm gain is 2-D there and 1-D in a single-process run; names are the same in both.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from torch import Tensor

# Matched at the end of the name, so prefixes such as "module." or "_orig_mod." do not matter.
_DECAYED = re.compile(
    r"(^|\.)(attn\.qkv|attn\.out_proj|mlp\.gate_proj|mlp\.up_proj|mlp\.down_proj)\.weight$"
)
# Norm gains pull towards 1, not 0; embeddings (and an untied LM head, the output embedding)
# are lookup tables whose rows see gradient only when their token appears.
_NOT_DECAYED = re.compile(r"(^|\.)(embed|lm_head|attn_norm|mlp_norm|final_norm)\.weight$")


def split_weight_decay(
    named_parameters: Iterable[tuple[str, Tensor]], weight_decay: float
) -> list[dict]:
    """Two optimizer param groups: [decayed matrices, undecayed gains and embeddings].

    Each group also carries ``"names"``, parallel to ``"params"``. Raises ValueError on a name
    that matches neither rule or both, and on a name seen twice.
    """
    decay = {"params": [], "weight_decay": weight_decay, "names": []}
    no_decay = {"params": [], "weight_decay": 0.0, "names": []}
    seen: set[str] = set()
    for name, param in named_parameters:
        if name in seen:
            raise ValueError(f"parameter {name!r} appears twice")
        seen.add(name)
        is_decayed, is_not_decayed = bool(_DECAYED.search(name)), bool(_NOT_DECAYED.search(name))
        if is_decayed == is_not_decayed:
            raise ValueError(
                f"parameter {name!r} matches {'both' if is_decayed else 'no'} weight-decay rule; "
                "add it to mtdao/model/param_groups.py"
            )
        group = decay if is_decayed else no_decay
        group["params"].append(param)
        group["names"].append(name)
    return [decay, no_decay]
