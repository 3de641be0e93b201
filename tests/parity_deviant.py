"""A replica of examples/fault_tolerant_loop.py whose parameters go wrong right after one round.

``python tests/parity_deviant.py STEP <the example's flags>`` runs the example; at the round of
step STEP, once the round has assigned its averages and before the replicas compare what they
hold, one element of its first parameter moves one float32 step, as a flipped bit or a faulty copy
would leave it. Used by tests/test_ft_parity_replicas.py: the parity check must name it, and it
must heal from the others.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import torch

from mtdao.ft import parity

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fault_tolerant_loop.py"
STEP = int(sys.argv[1])
record = parity.ParityCheck.assigned
perturbed: list[int] = []


def perturbed_record(self, tensors, quorum, final):
    if self.sync is not None and self.sync.step_count == STEP and not perturbed:
        with torch.no_grad():
            flat = tensors[0].view(-1)
            flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf")))
        perturbed.append(STEP)
        print(f"parity_deviant: perturbed after the round at step {STEP}", flush=True)
    return record(self, tensors, quorum, final)


parity.ParityCheck.assigned = perturbed_record
sys.argv = [str(EXAMPLE), *sys.argv[2:]]
runpy.run_path(str(EXAMPLE), run_name="__main__")
