"""``mtdao toy rosenbrock``: Local Adam against MT-DAO on the paper's noisy Rosenbrock toy."""
