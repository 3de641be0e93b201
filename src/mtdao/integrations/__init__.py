"""Where people already train: adapters from other trainers onto mtdao's optimizers and engine.

Each adapter is thin: it builds the optimizer, the policy and the engine with the harness's own
builders (:mod:`mtdao.train.methods`, :mod:`mtdao.train.setup`) and only translates the other
trainer's hooks. ``mtdao.integrations.hf`` needs the ``hf`` extra (``pip install -e ".[hf]"``).
"""
