"""MT-DAO in a PyTorch Lightning run (``pip install -e ".[lightning]"``).

``Trainer(strategy=LocalUpdateStrategy(LocalUpdates(method="mtdao", sync_period=32)))``, with
``configure_optimizers`` returning ``method_optimizer(self, lr=...)``: every process is one
worker taking local steps, and only mtdao's engine communicates. Guide: docs/integrations.md.
"""

from mtdao.integrations.lightning.strategy import LocalUpdateStrategy, method_optimizer
from mtdao.integrations.local_updates import LocalUpdates, traffic_summary

__all__ = ["LocalUpdateStrategy", "LocalUpdates", "method_optimizer", "traffic_summary"]
