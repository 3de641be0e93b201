"""The horizon and variants study: where MT-DAO wins, collected from ``mtdao train`` runs
(``python -m mtdao.experiments.horizon.run``)."""
