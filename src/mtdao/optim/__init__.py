"""The MT-DAO optimizer family as ``torch.optim`` optimizers."""

from mtdao.optim.mt_adam import MTAdam
from mtdao.optim.mt_adopt import MTAdopt
from mtdao.optim.mt_sgd import MTSGD

__all__ = ["MTAdam", "MTAdopt", "MTSGD"]
