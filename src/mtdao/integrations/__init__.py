"""Where people already train: adapters from other trainers onto mtdao's optimizers and engine.

Each adapter is thin: it builds the optimizer, the policy and the engine with the library's
builders (:mod:`mtdao.methods`, the same the harness builds with) and only translates the
other trainer's hooks; nothing here imports the harness (:mod:`mtdao.train`). What the adapters
share (the method's settings, its optimizer and engine, each worker's checkpoint state) lives
here; ``mtdao.integrations.hf`` needs the ``hf`` extra (``pip install -e ".[hf]"``),
``mtdao.integrations.lightning`` the ``lightning`` extra.
"""
