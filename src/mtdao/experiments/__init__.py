"""Experiments that reproduce the paper's claims: each module runs one and writes a report."""
