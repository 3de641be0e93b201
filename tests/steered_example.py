"""examples/fault_tolerant_loop.py under a test's control, through files in a control folder.

``python tests/steered_example.py CONTROL NAME [--faulty] -- <example flags>`` runs the example;
the replica

* writes ``NAME.connected`` once it heartbeats to the lighthouse, then waits while
  ``CONTROL/start-gate`` exists before asking for its first quorum (so that a replica slower to
  start is in the first quorum, not a joiner the others have finished without);
* writes ``NAME.asked`` before each quorum request, and waits before its N-th while
  ``CONTROL/NAME.hold-quorum`` holds N;
* before each blocking sum of its final round (the round's quorum formed) writes
  ``NAME.entered-final`` and waits while ``CONTROL/NAME.hold-final`` exists;
* with ``--faulty``, serves a heal state whose parameters hold NaN: a faulty holder of the run's
  secret.

Used by tests/test_ft_final_round.py and tests/test_ft_faulty_source.py.
"""

from __future__ import annotations

import runpy
import sys
import time
from pathlib import Path

from mtdao.ft.healing import HealedState
from mtdao.ft.replicas import ReplicaGroups

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fault_tolerant_loop.py"


def wait_while(condition) -> None:
    while condition():
        time.sleep(0.02)


def steer(control: Path, name: str) -> None:
    connect = ReplicaGroups.connect
    quorums = [0]

    def held_quorum() -> bool:
        path = control / f"{name}.hold-quorum"
        return path.exists() and path.read_text().strip() == str(quorums[0])

    def connect_steered(replicas: ReplicaGroups) -> None:
        def before_quorum() -> None:
            quorums[0] += 1
            (control / f"{name}.asked").touch()
            wait_while(held_quorum)

        def before_collective() -> None:
            if replicas._final:  # a test helper may read it: the quorum is the final round's
                (control / f"{name}.entered-final").touch()
                wait_while((control / f"{name}.hold-final").exists)

        replicas.before_quorum = before_quorum
        replicas.quorum.before_collective = before_collective
        connect(replicas)
        (control / f"{name}.connected").touch()
        wait_while((control / "start-gate").exists)

    ReplicaGroups.connect = connect_steered


def serve_faulty_states() -> None:
    state_dict = HealedState.state_dict

    def faulty(healed: HealedState) -> dict:
        state = state_dict(healed)  # a copy: the replica's own parameters stay sound
        for param in state["params"].values():
            param.fill_(float("nan"))
        return state

    HealedState.state_dict = faulty


if __name__ == "__main__":
    control, name, *rest = sys.argv[1:]
    options, flags = rest[: rest.index("--")], rest[rest.index("--") + 1 :]
    steer(Path(control), name)
    if "--faulty" in options:
        serve_faulty_states()
    sys.argv = [str(EXAMPLE), *flags]
    runpy.run_path(str(EXAMPLE), run_name="__main__")
