"""The checkpoint store across two real processes agreeing through a gloo process group: each
writes its own file, a damaged file on one rank makes both fall back to the same checkpoint, and a
NaN on one rank makes both refuse the save."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from sessions import killed_at_exit
from wait_limits import limit_s

# both ranks start at once, then save and load a few small checkpoints
RANKS_S = limit_s(starts=1, processes=2)

RANK_SCRIPT = textwrap.dedent(
    """
    import datetime, json, os, sys
    import torch
    import torch.distributed as dist
    from mtdao.train.checkpoint import store as ckpt
    from mtdao.train.checkpoint.agreement import ProcessGroupCollective

    rank, run_dir, store_path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2,
        timeout=datetime.timedelta(seconds=30),
    )
    collective = ProcessGroupCollective()
    store = ckpt.CheckpointStore(run_dir, rank=rank, world_size=2, collective=collective)

    def state(step, value=None):
        return {"step": step, "w": torch.full((8,), float(step * 10 + rank) if value is None else value)}

    report = {}
    for step in (10, 20):
        store.save(step, state(step), {"config": {}})
    if rank == 0:  # damage the other rank's newest file
        newest = ckpt.latest_checkpoint(run_dir).path / "rank1.pt"
        data = bytearray(newest.read_bytes()); data[len(data) // 2] ^= 1; newest.write_bytes(data)
    collective.all_true(True)
    loaded = ckpt.CheckpointStore(run_dir, rank=rank, world_size=2, collective=collective).load()
    report["loaded"] = [loaded.step, loaded.state["w"][0].item()]
    try:
        store.save(30, state(30, float("nan") if rank == 1 else None), {})
    except ckpt.UnsavableStateError as error:
        report["refused"] = str(error)
    report["steps"] = [info.step for info in ckpt.list_checkpoints(run_dir)]
    dist.destroy_process_group()
    print(json.dumps(report), flush=True)
    os._exit(0)  # skip the interpreter's slow teardown of torch
    """
)


@pytest.mark.slow
def test_two_processes_agree_on_fallback_and_on_refusal(tmp_path):
    run_dir, store_path = tmp_path / "run", tmp_path / "store"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT, str(rank), str(run_dir), str(store_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        for rank in range(2)
    ]
    with killed_at_exit(*ranks):
        outputs = [process.communicate(timeout=RANKS_S) for process in ranks]
    for process, (_, err) in zip(ranks, outputs):
        assert process.returncode == 0, err
    reports = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]

    assert [r["loaded"] for r in reports] == [[10, 100.0], [10, 101.0]]  # both fell back to 10
    assert "rank1.pt is corrupted" in outputs[1][1]  # the damaged rank's warning names its file
    assert "w holds NaN/inf" in reports[1]["refused"]
    assert "another process's state" in reports[0]["refused"]
    assert reports[0]["steps"] == [10]  # nothing written at step 30; the damaged 20 set aside
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "step-00000010",
        "step-00000020.damaged",
    ]
