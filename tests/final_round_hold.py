"""examples/fault_tolerant_loop.py with a hold inside its final round, for killing a replica there.

``python tests/final_round_hold.py CONTROL NAME -- <example flags>`` runs the example. Once
connected to the lighthouse (heartbeating) the replica writes ``CONTROL/NAME.connected`` and waits
while ``CONTROL/start-gate`` exists, before asking for its first quorum (so that a replica slower
to start is in the first quorum, not a joiner the others have finished without); before each
blocking sum of its final round (the round's quorum formed) it writes
``CONTROL/NAME.entered-final`` and waits while ``CONTROL/NAME.hold-final`` exists. Used by
tests/test_ft_final_round.py.
"""

from __future__ import annotations

import runpy
import sys
import time
from pathlib import Path

from mtdao.sync.torchft.replicas import ReplicaGroups

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fault_tolerant_loop.py"


def hold_in_final_round(control: Path, name: str) -> None:
    connect = ReplicaGroups.connect

    def connect_with_hold(replicas: ReplicaGroups) -> None:
        def before_collective() -> None:
            if replicas._final:  # a test helper may read it: the quorum is the final round's
                (control / f"{name}.entered-final").touch()
                while (control / f"{name}.hold-final").exists():
                    time.sleep(0.02)

        replicas.before_collective = before_collective
        connect(replicas)
        (control / f"{name}.connected").touch()
        while (control / "start-gate").exists():
            time.sleep(0.02)

    ReplicaGroups.connect = connect_with_hold


if __name__ == "__main__":
    control, name, separator, *flags = sys.argv[1:]
    assert separator == "--", __doc__
    hold_in_final_round(Path(control), name)
    sys.argv = [str(EXAMPLE), *flags]
    runpy.run_path(str(EXAMPLE), run_name="__main__")
