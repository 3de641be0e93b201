"""MT-DAO in a Hugging Face ``transformers.Trainer`` run (``pip install -e ".[hf]"``).

``LocalUpdateTrainer(..., local_updates=LocalUpdates(method="mtdao", sync_period=32))`` trains
with an MT-DAO optimizer and the sync engine; under torchrun or ``accelerate launch`` every
process is one worker and only the engine communicates. ``stack_hf_workers`` simulates M workers
of a transformers model in one process. Guide: docs/integrations.md.
"""

from mtdao.integrations.hf.simulate import stack_hf_workers
from mtdao.integrations.hf.trainer import LocalUpdateTrainer
from mtdao.integrations.local_updates import LocalUpdates, traffic_summary, workers_agree

__all__ = [
    "LocalUpdateTrainer",
    "LocalUpdates",
    "stack_hf_workers",
    "traffic_summary",
    "workers_agree",
]
