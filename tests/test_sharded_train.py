"""``mtdao train --workers 2 --shards 2`` in 4 real gloo processes: the simulated 2-worker run,
checkpoints that survive a kill -9 bit for bit, resharding on resume, and the recipe of docs/library.md.

Processes are forked from one server that has torch and mtdao imported (a torchrun job would
import them in every process); each sets what torchrun sets (RANK, WORLD_SIZE, MASTER_*) and calls
``trainer.train`` as ``mtdao train`` does.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import signal
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_checkpoint_forged import Payload, forge
from torch.testing import assert_close
from wait_limits import limit_s

from mtdao.testing.ports import unused_port
from mtdao.train import trainer
from mtdao.train.checkpoint import store as ckpt
from mtdao.train.checkpoint.agreement import SingleProcess
from mtdao.train.checkpoint.checkpointer import Checkpointer
from mtdao.train.checkpoint.dcp import ShardedCheckpointStore
from mtdao.train.config import TrainConfig

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"
    ),
]

# Imported once by the fork server instead of by every process (the sync test shares it).
FORKSERVER_PRELOAD = [
    "torch._dynamo",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "matplotlib.pyplot",
    "mtdao.train.trainer",
]
# the library page's recipe for workers bigger than one device
LIBRARY = Path(__file__).resolve().parents[1] / "docs" / "library.md"
SNIPPETS = re.findall(r"```python\n(.*?)```", LIBRARY.read_text(), flags=re.DOTALL)
RECIPE = next(s for s in SNIPPETS if "--nproc-per-node 4" in s)
RECIPE_STEPS = int(re.search(r"for step in range\((\d+)\)", RECIPE)[1])
# checkpoints at steps 3 and 6, between the syncs at 4 and 8: the workers differ there
FLAGS = dict(workers=2, shards=2, steps=8, sync_period=4, checkpoint_every=3, model="micro")
# evaluations at steps 2 and 6 too, in the middle of rounds: they must not change the training
FLAGS.update(batch_size=4, seq_len=32, eval_every=2, eval_tokens=512, log_every=4)
FLAGS.update(device="cpu", progress=False)
# every round option: at the checkpoint of step 3 the round sent at step 2 is in flight; no final
# round, so the runs end with one in flight too (what the last checkpoint must carry)
OPTIONS = dict(sync_delay=2, sync_fragments=2, sync_dtype=("int8",), error_feedback=True)
OPTIONS.update(final_round=False)


# -- the processes ------------------------------------------------------------------------------


def _process(rank: int, world: int, ports: list, jobs: list, out: str) -> None:
    """Train each job in turn; "recipe" runs docs/library.md's recipe, "die" makes process 1 kill -9
    itself once the next run's first checkpoint is committed (its last job: the others are then
    stuck in a collective with it, and are killed as torchrun would kill them)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports.pop()))
    try:
        torch.set_num_threads(1)
        for job in jobs:
            if job == "recipe":  # on a process group of its own
                dist.destroy_process_group()
                os.environ["MASTER_PORT"] = str(ports.pop())
                recipe = {"__name__": "__main__"}
                exec(compile(RECIPE, "docs/library.md", "exec"), recipe)
                os.environ["MASTER_PORT"] = str(ports.pop())  # the recipe ends its group
                shards = [p.to_local().detach().clone() for p in recipe["model"].parameters()]
                ended = {"shards": shards, "bytes": recipe["sync"].traffic.bytes}
                torch.save(ended, Path(out) / f"recipe-rank{rank}.pt")
            elif job == "die":
                save = Checkpointer.save

                def save_then_die(self, run, save=save, dies=rank == 1):
                    save(self, run)
                    if dies:
                        os.kill(os.getpid(), signal.SIGKILL)

                Checkpointer.save = save_then_die
            else:
                trainer.train(job)
    except BaseException:
        (Path(out) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def launch_limit_s(world: int, jobs: list) -> float:
    """The fork server's start, then each process's jobs in turn, ``world`` at once: a run's setup,
    evaluations and checkpoints (at most a start's work, the imports done) and its steps."""
    runs = [job for job in jobs if job != "die"]
    steps = sum(RECIPE_STEPS if job == "recipe" else job.total_steps() for job in runs)
    return limit_s(starts=1 + len(runs), steps=steps, processes=world)


def launch(world: int, jobs: list, out: Path) -> list[int]:
    """Run ``jobs`` in ``world`` processes (see _process); their exit codes."""
    out.mkdir(parents=True, exist_ok=True)
    if "forkserver" in mp.get_all_start_methods():
        context = mp.get_context("forkserver")
        context.set_forkserver_preload(FORKSERVER_PRELOAD + [__name__])
    else:
        context = mp.get_context("spawn")
    ports = [unused_port() for _ in range(3)]
    processes = [
        context.Process(target=_process, args=(rank, world, ports, jobs, str(out)))
        for rank in range(world)
    ]
    dies = "die" in jobs
    deadline = time.monotonic() + launch_limit_s(world, jobs)
    try:
        for process in processes:
            process.start()
        if dies:
            processes[1].join(max(0.0, deadline - time.monotonic()))
            for process in processes:
                process.kill()
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
    if not dies:
        errors = "\n".join(p.read_text() for p in sorted(out.glob("rank*.err")))
        assert all(p.exitcode == 0 for p in processes), errors or "a process failed"
    return [p.exitcode for p in processes]


@pytest.fixture(scope="module")
def runs(corpus_dir, tmp_path_factory) -> dict[str, Path]:
    """Every sharded run of this module: uninterrupted, killed and resumed, resharded."""
    root = tmp_path_factory.mktemp("sharded-train")
    data = dict(data=str(corpus_dir), **FLAGS)
    configs = {
        "mtdao": TrainConfig.of(method="mtdao", out=str(root / "mtdao"), **data),
        "options": TrainConfig.of(method="mtdao", out=str(root / "options"), **data, **OPTIONS),
        # one worker of 4 shards, resumed below with 2 shards per worker from step 6, where a
        # round is in flight and error feedback holds residuals; 7 steps: no round is sent after
        # the resume, so the two runs end within float rounding
        "diloco-4": TrainConfig.of(
            method="diloco",
            out=str(root / "diloco-4"),
            **{**data, "workers": 1, "shards": 4, "steps": 7, **OPTIONS},
        ),
    }
    killed = configs["options"].replace(out=str(root / "killed"))
    codes = launch(4, [*configs.values(), "recipe", "die", killed], root / "first")
    assert codes[1] == -signal.SIGKILL, codes
    assert not (root / "killed" / "results.json").exists()
    killed_at = ckpt.latest_checkpoint(root / "killed")
    assert killed_at.step == 3
    in_flight = torch.load(killed_at.path / "worker0.pt", weights_only=True)["sync"]["pending"]
    assert [(r["step"], r["finish_step"]) for r in in_flight] == [(2, 4)]
    # the finished run's last checkpoint, its DCP metadata replaced by a payload (checksum fixed)
    forged = root / "forged"
    shutil.copytree(root / "mtdao", forged)
    newest = ckpt.latest_checkpoint(forged).path
    forge(newest, "model/.metadata", pickle.dumps(Payload(root / "payload-ran")))
    resumes = [
        killed.replace(resume=True),
        configs["mtdao"].replace(out=str(forged), resume=True),
    ]
    launch(4, resumes, root / "resumed-processes")
    # the 4-shard run's step-6 checkpoint, resumed by 2 processes
    resharded = root / "diloco-2"
    shutil.copytree(root / "diloco-4", resharded)
    for path in resharded.glob("checkpoints/step-*"):
        if path.name != "step-00000006":
            shutil.rmtree(path)
    (resharded / "results.json").unlink()
    again = configs["diloco-4"].replace(out=str(resharded), shards=2, resume=True)
    launch(2, [again], root / "resharded-processes")
    return {name: Path(config.job.out) for name, config in configs.items()} | {
        "killed": root / "killed",
        "diloco-2": resharded,
        "forged": forged,
    }


def results(run_dir: Path) -> dict:
    return json.loads((run_dir / "results.json").read_text())


def final_tensors(run_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the run's final checkpoint, whole (DCP read back in one process)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    converted = run_dir / "final.pt"
    dcp_to_torch_save(ckpt.checkpoint_path(run_dir) / "model", converted)
    return flatten(torch.load(converted, weights_only=False))


def flatten(tree, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = enumerate(tree)
    else:
        return {}
    flat = {}
    for key, value in items:
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


@pytest.fixture(scope="module")
def simulated(corpus_dir, tmp_path_factory, one_thread) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("simulated")
    flags = {**FLAGS, "shards": 1, "data": str(corpus_dir)}
    return {
        "mtdao": trainer.train(TrainConfig.of(method="mtdao", out=str(root / "mtdao"), **flags))
    }


# -- the comparisons ----------------------------------------------------------------------------


def test_sharded_run_equals_simulated(runs, simulated):
    sharded, expected = results(runs["mtdao"]), simulated["mtdao"]
    assert sharded["simulated"] is False and expected["simulated"] is True
    assert sharded["shards"] == 2 and sharded["steps"] == expected["steps"] == FLAGS["steps"]
    for real, reference in zip(sharded["evals"], expected["evals"], strict=True):
        assert real["val_loss"] == pytest.approx(reference["val_loss"], abs=1e-5)
    assert sharded["final_val_loss"] == pytest.approx(expected["final_val_loss"], abs=1e-5)
    # traffic per worker: the sum over its 2 processes, each sending half of every tensor
    for key in ("bytes_per_worker", "bytes_by_kind", "comm_events", "parameters"):
        assert sharded[key] == expected[key], key
    assert sharded["bytes_per_process"] * 2 == sharded["bytes_per_worker"] > 0
    for real, reference in zip(sharded["alignment"], expected["alignment"], strict=True):
        assert real["cosine"] == pytest.approx(reference["cosine"], rel=1e-4)


def test_a_process_of_the_options_run_counts_its_encoded_shards(runs):
    options, plain = results(runs["options"]), results(runs["mtdao"])
    assert options["bytes_per_process"] * 2 == options["bytes_per_worker"] > 0  # equal shards
    assert options["config"]["sync_dtype"] == ["int8"]
    # int8 codes and a scale per 256: about a quarter of float32's bytes per element
    per_event = [b for _, b in options["comm_events"]], [b for _, b in plain["comm_events"]]
    assert max(per_event[0]) < 0.3 * max(per_event[1])


def test_memory_per_process_halves_with_two_shards(runs, simulated):
    sharded = results(runs["mtdao"])["memory_per_process"]
    all_workers = simulated["mtdao"]["memory_per_process"]  # both workers in one process
    assert sharded["parameter_bytes"] * 2 * FLAGS["workers"] == all_workers["parameter_bytes"]
    # the states halve too; only the step counters (4 bytes a parameter) are whole everywhere
    states = sharded["optimizer_state_bytes"] * 2 * FLAGS["workers"]
    assert states == pytest.approx(all_workers["optimizer_state_bytes"], rel=1e-3)


def test_final_checkpoint_holds_each_worker_whole(runs, simulated):
    tensors = final_tensors(runs["mtdao"])
    saved = ckpt.load_checkpoint(Path(simulated["mtdao"]["config"]["out"]), 0, 1)
    for name, stacked in saved["params"].items():
        for worker in range(FLAGS["workers"]):
            # Adam divides by sqrt(v): where a gradient is near eps, a sum taken in another order
            # (over shards) moves the update by more than one rounding; 1e-5 seen after 8 steps
            real = tensors[f"worker{worker}.model.{name}"]
            assert_close(real, stacked[worker], rtol=1e-4, atol=1e-4, msg=name)


def test_killed_run_resumes_bit_identically(runs):
    """Killed right after the checkpoint of step 3, with a round in flight (every option on)."""
    uninterrupted, resumed = results(runs["options"]), results(runs["killed"])
    assert resumed["evals"] and [e["val_loss"] for e in resumed["evals"]] == [
        e["val_loss"] for e in uninterrupted["evals"]
    ]
    for key in ("final_val_loss", "bytes_per_worker", "comm_events", "alignment"):
        assert resumed[key] == uninterrupted[key], key
    for key in ("bytes_per_process", "bytes_by_kind"):
        assert resumed[key] == uninterrupted[key], key
    expected, tensors = final_tensors(runs["options"]), final_tensors(runs["killed"])
    assert expected.keys() == tensors.keys()
    assert any(".engine.rounds." in name for name in tensors)  # one in flight at the end too
    assert any(".engine.residuals." in name for name in tensors)
    for name, tensor in tensors.items():
        assert torch.equal(tensor, expected[name]), name
    lines = (runs["killed"] / "metrics.jsonl").read_text().splitlines()
    reference = (runs["options"] / "metrics.jsonl").read_text().splitlines()
    losses = [json.loads(line).get("train_loss") for line in lines]
    assert losses == [json.loads(line).get("train_loss") for line in reference]


def test_resharded_resume_continues_the_run(runs):
    four, two = results(runs["diloco-4"]), results(runs["diloco-2"])
    assert two["shards"] == 2 and four["shards"] == 4
    assert two["final_val_loss"] == pytest.approx(four["final_val_loss"], abs=1e-5)
    expected, tensors = final_tensors(runs["diloco-4"]), final_tensors(runs["diloco-2"])
    assert expected.keys() == tensors.keys()
    for kind in ("outer_momentum", "rounds", "residuals"):  # the residuals reshard exactly
        assert any(f".engine.{kind}." in name for name in tensors), kind
    for name, tensor in tensors.items():
        if tensor.is_floating_point():
            assert_close(tensor, expected[name], msg=name)


def test_the_library_recipe_runs_in_four_processes(runs):
    """docs/library.md's recipe (2 workers of 2 shards, 64 steps, K = 32; launched with the first
    runs): its last round leaves both workers holding the same model, each process its own shard
    of it, and every process counts its worker's traffic."""
    first = runs["mtdao"].parent / "first"
    ended = [torch.load(first / f"recipe-rank{rank}.pt", weights_only=True) for rank in range(4)]
    for shard in (0, 1):  # rank = worker * 2 + shard (the mesh's replicate x shard layout)
        for mine, other in zip(ended[shard]["shards"], ended[2 + shard]["shards"], strict=True):
            assert torch.equal(mine, other)
    assert any(
        not torch.equal(a, b) for a, b in zip(ended[0]["shards"], ended[1]["shards"], strict=True)
    )
    assert ended[0]["bytes"] > 0 and len({e["bytes"] for e in ended}) == 1


def test_a_forged_metadata_runs_nothing_and_the_run_resumes_from_the_checkpoint_before(runs):
    """--resume of the finished run whose final checkpoint (step 8) holds a forged .metadata:
    no process ran the payload; they set it aside, resumed from step 6 and ended as the run did."""
    assert not (runs["forged"].parent / "payload-ran").exists()
    damaged = sorted(p.name for p in (runs["forged"] / "checkpoints").glob("*.damaged"))
    assert damaged == ["step-00000008.damaged"]
    forged, original = results(runs["forged"]), results(runs["mtdao"])
    assert forged["final_val_loss"] == original["final_val_loss"]
    assert [e["val_loss"] for e in forged["evals"]] == [e["val_loss"] for e in original["evals"]]


def test_another_number_of_workers_is_refused(runs, simulated):
    def store(workers: int) -> ShardedCheckpointStore:
        return ShardedCheckpointStore(runs["mtdao"], rank=0, workers=workers, shards=2)

    with pytest.raises(ckpt.CheckpointError, match="holds 2 workers, this run has 1"):
        store(1).load()
    with pytest.raises(ckpt.CheckpointError, match="written by sharded workers"):
        ckpt.CheckpointStore(runs["mtdao"], world_size=4).load()
    unsharded = Path(simulated["mtdao"]["config"]["out"])
    with pytest.raises(ckpt.CheckpointError, match="written by unsharded workers"):
        ShardedCheckpointStore(unsharded, rank=0, workers=2, shards=2).load()


def test_a_damaged_shard_file_is_found_and_the_checkpoint_before_it_used(runs, tmp_path):
    run_dir = tmp_path / "damaged"
    shutil.copytree(runs["mtdao"], run_dir)
    newest = ckpt.latest_checkpoint(run_dir)
    damaged = newest.path / "model" / "__3_0.distcp"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(data)
    # each process checks a share of the files: the one whose share holds the damaged file
    rank = sorted(newest.files).index("model/__3_0.distcp") % 4
    store = ShardedCheckpointStore(
        run_dir, rank=rank, workers=2, shards=2, collective=SingleProcess()
    )
    state, problem = store._try_load(newest)
    assert state is None and f"{damaged} is corrupted or incomplete" in problem
    loaded = store.load()  # the DCP files are read later, into the built run
    assert loaded.step == 6 and loaded.skipped[0].startswith(str(newest.path))
    assert loaded.state["worker"]["step"] == 6
