"""The Llama-style language model, its named sizes, and its weight-decay groups."""

from mtdao.model.llama import Llama, ModelConfig
from mtdao.model.param_groups import split_weight_decay
from mtdao.model.presets import MODEL_PRESETS, model_config

__all__ = ["Llama", "ModelConfig", "MODEL_PRESETS", "model_config", "split_weight_decay"]
