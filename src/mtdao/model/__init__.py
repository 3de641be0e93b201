"""The Llama-style language model, its named sizes, its weight-decay groups, and any module
stacked as M simulated workers."""

from mtdao.model.llama import Llama, ModelConfig
from mtdao.model.param_groups import split_weight_decay
from mtdao.model.presets import MODEL_PRESETS, model_config
from mtdao.model.stacked_workers import StackedWorkers, stack_workers

__all__ = [
    "Llama",
    "ModelConfig",
    "MODEL_PRESETS",
    "StackedWorkers",
    "model_config",
    "split_weight_decay",
    "stack_workers",
]
