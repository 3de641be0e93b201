"""mtdao: multi-timescale distributed adaptive optimizers with local updates, in PyTorch."""

from mtdao.optim import MTSGD, MTAdam, MTAdopt
from mtdao.timescales import beta_for_half_life, half_life

__version__ = "0.1.0"

__all__ = ["MTAdam", "MTAdopt", "MTSGD", "half_life", "beta_for_half_life", "__version__"]
