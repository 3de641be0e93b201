"""Adapters from other trainers onto mtdao's optimizers and engine, built with the library's
builders (:mod:`mtdao.methods`); nothing here imports the harness (:mod:`mtdao.train`).
``mtdao.integrations.hf`` needs the ``hf`` extra, ``mtdao.integrations.lightning`` the
``lightning`` extra."""
