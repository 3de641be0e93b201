"""The training harness: config, one loop for every method, checkpoints, metrics."""

from mtdao.train.config import TrainConfig
from mtdao.train.launch import train

__all__ = ["TrainConfig", "train"]
