"""mtdao.integrations.hf: a transformers Trainer run through the sync engine.

In one process: the optimizer and engine are the method's, the logs carry the traffic, a resume
continues bit for bit, bad settings are refused. Under torchrun with two gloo processes
(tests/integration_hf_run.py and examples/hf_trainer.py): the Trainer run equals the README's
plain loop over the same batches, a resume from a checkpoint taken mid-round (the workers differ)
is exact, and the ranks differ between syncs (no DDP all-reduce) and agree after one, a run stopped
between syncs ends with one model (the final round) and ``evaluate()`` between syncs scores the
workers' average; with four processes, two workers of two FSDP2 shards each train and agree
after the final sync.
"""

from __future__ import annotations

import json
import subprocess
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
import torchrun_job
from sessions import killed_at_exit
from wait_limits import limit_s

from mtdao.optim import MTAdam
from mtdao.sync.communicator import Traffic

pytestmark = pytest.mark.skipif(find_spec("transformers") is None, reason="needs the hf extra")

ROOT = Path(__file__).resolve().parents[1]
# An HF process's start costs two of the model's: transformers beside torch, 10 s of CPU against
# mtdao train's 5.5 s (its steps, under 10 ms here, cost less than a micro model's).
HF_STARTS = 2


@pytest.fixture(scope="module", autouse=True)
def hf_imports() -> None:
    """transformers and what this file takes from it, imported once its first test runs, not at
    collection: every test process collects every file, and these imports cost seconds of CPU."""
    global LocalUpdates, LocalUpdateTrainer, traffic_summary, load_worker_state
    global PERIOD, Blocks, tiny_llama, training_args
    from integration_hf_run import PERIOD, Blocks, tiny_llama, training_args

    from mtdao.integrations.hf import LocalUpdates, LocalUpdateTrainer, traffic_summary
    from mtdao.integrations.worker_state import load_worker_state


def make_trainer(out: Path, steps: int, method: LocalUpdates, save_steps: int = 0, **kwargs):
    return LocalUpdateTrainer(
        model=tiny_llama(),
        args=training_args(out, steps, save_steps),
        train_dataset=Blocks(64),
        local_updates=method,
        **kwargs,
    )


def test_one_process_trains_with_the_methods_optimizer_and_engine(tmp_path):
    trainer = make_trainer(tmp_path, 6, LocalUpdates(method="mtdao", sync_period=PERIOD))
    trainer.train()
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # Accelerate's wrapper
    assert isinstance(inner, MTAdam)
    assert trainer.sync.step_count == 6
    assert not isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel)
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logged and all("sync_bytes_per_worker" in entry for entry in logged)
    per_step = trainer.sync.traffic.ddp_bytes_per_step
    assert [entry["sync_ddp_bytes_per_worker"] for entry in logged] == [4 * per_step]  # step 4
    assert trainer.state.log_history[-1]["sync_ddp_bytes_per_worker"] == 6 * per_step  # the end


@pytest.mark.parametrize("method", ["diloco", "mtdao"])
def test_one_process_resume_is_exact(tmp_path, method):
    """DiLoCo's outer step keeps an anchor and a momentum: lost on resume, the run would differ."""
    local = LocalUpdates(method=method, sync_period=PERIOD)
    straight = make_trainer(tmp_path / "a", 10, local, save_steps=6)
    straight.train()
    checkpoint = tmp_path / "a" / "checkpoint-6"
    assert (checkpoint / "mtdao-rank0-of-1.pt").is_file()
    resumed = make_trainer(tmp_path / "b", 10, local)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.sync.step_count == 10
    for p, q in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(p, q)


def test_resume_without_mtdao_state_is_refused(tmp_path):
    trainer = make_trainer(tmp_path, 1, LocalUpdates())
    trainer.train()
    with pytest.raises(FileNotFoundError, match="not saved by an mtdao integration"):
        load_worker_state(tmp_path, trainer.local_run, trainer.model, 0, 1)


def test_bad_settings_are_refused(tmp_path):
    model = tiny_llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="do not pass optimizers"):
        make_trainer(tmp_path, 1, LocalUpdates(), optimizers=(optimizer, None))
    args = training_args(tmp_path, 1)
    args.gradient_accumulation_steps = 2
    with pytest.raises(ValueError, match="gradient_accumulation_steps=1"):
        LocalUpdateTrainer(model=model, args=args, train_dataset=Blocks(8))
    with pytest.raises(ValueError, match="needs save_strategy='no'"):
        make_trainer(tmp_path, 4, LocalUpdates(shards=2), save_steps=2)
    with pytest.raises(ValueError, match="shards=2 does not divide the 1 launched processes"):
        make_trainer(tmp_path, 1, LocalUpdates(shards=2)).train()
    with pytest.raises(ValueError, match="^`method`: unknown value 'lamb'"):
        make_trainer(tmp_path, 1, LocalUpdates(method="lamb")).train()


def test_traffic_summary_says_how_much_less_than_ddp():
    traffic = Traffic(bytes=1000, rounds=2, steps=32, ddp_bytes_per_step=100)
    assert traffic_summary(traffic) == (
        "traffic: 1.0 kB sent per worker in 2 rounds over 32 steps, 3.2x less than DDP (3.2 kB)"
    )
    assert "nothing averaged" in traffic_summary(Traffic(steps=4, ddp_bytes_per_step=100))


# -- two gloo processes --------------------------------------------------------------------------


def torchrun(script: Path, *args: str, processes: int = 2) -> subprocess.Popen:
    return torchrun_job.start(
        [str(script), *args],
        processes=processes,
        standalone=False,
        env={"HF_HUB_OFFLINE": "1"},
        cwd=ROOT,
    )


# stopped between syncs (24 of K = 16): the final round makes one model
EXAMPLE_ARGS = ("--max-steps", "24", "--sync-period", "16", "--chars", "100000")


@pytest.fixture(scope="module")
def torchrun_jobs(tmp_path_factory) -> dict:
    """Both torchrun jobs, started together (each mostly waits on start-up): the example, then
    the checks, in the same two processes (tests/integration_hf_run.py: each process's start
    costs more than its steps), and the example with FSDP2 in four."""
    root = tmp_path_factory.mktemp("hf-torchrun")
    example_args = [*EXAMPLE_ARGS, "--output-dir", str(root / "example")]
    checks = torchrun(
        Path(__file__).parent / "integration_hf_run.py", str(root / "checks"), *example_args
    )
    sharded = torchrun(
        ROOT / "examples" / "hf_trainer.py",
        "--max-steps",
        "16",
        "--sync-period",
        "8",
        "--chars",
        "50000",
        "--shards",
        "2",
        "--output-dir",
        str(root / "sharded"),
        processes=4,
    )
    jobs = {"checks": checks, "sharded": sharded}
    # The two jobs at once (2 + 4 processes): torchrun's start, then its workers'; the longest
    # job, the checks, runs the example (its data, model and Trainer: about a start's work, and
    # its steps), then four Trainer runs and a plain loop in turn, of at most 3 K + 2 steps each.
    steps = int(EXAMPLE_ARGS[1]) + 5 * (3 * PERIOD + 2)
    timeout_s = limit_s(starts=1 + HF_STARTS + 1, steps=steps, processes=2 + 4)
    outputs = {}
    with killed_at_exit(*jobs.values()):
        for name, job in jobs.items():
            outputs[name] = job.communicate(timeout=timeout_s)[0]
            assert job.returncode == 0, outputs[name][-6000:]
    ranks = [json.loads((root / "checks" / f"rank{r}.json").read_text()) for r in range(2)]
    return {"ranks": ranks, "example": outputs["checks"], "sharded": outputs["sharded"]}


@pytest.mark.slow
def test_trainer_run_equals_the_plain_loop(torchrun_jobs):
    for rank in torchrun_jobs["ranks"]:
        assert rank["plain_loop_max_diff"] <= 1e-6
        assert rank["traffic_bytes"] > 0


@pytest.mark.slow
def test_resume_mid_round_is_exact_on_every_rank(torchrun_jobs):
    for rank in torchrun_jobs["ranks"]:
        assert rank["resume_max_diff"] == 0.0
        assert rank["resumed_engine_step"] == 3 * PERIOD + 2


@pytest.mark.slow
def test_workers_drift_between_syncs_and_agree_after_one(torchrun_jobs):
    """Under DDP the ranks would agree at every step: drifting proves no gradient all-reduce."""
    for rank in torchrun_jobs["ranks"]:
        assert rank["agree_mid_round"] is False
        assert rank["agree_after_sync"] is True


@pytest.mark.slow
def test_a_run_stopped_between_syncs_ends_with_one_model(torchrun_jobs):
    for rank in torchrun_jobs["ranks"]:
        assert rank["agree_at_end_between_syncs"] is True


@pytest.mark.slow
def test_evaluate_between_syncs_scores_the_global_model(torchrun_jobs):
    for rank in torchrun_jobs["ranks"]:
        assert rank["params_kept_by_evaluate"] is True
        assert abs(rank["eval_loss_mid_round"] - rank["averaged_model_loss"]) < 1e-5
        assert abs(rank["own_model_loss"] - rank["averaged_model_loss"]) > 1e-4  # they differ


@pytest.mark.slow
def test_example_prints_the_traffic_and_identical_ranks(torchrun_jobs):
    output = torchrun_jobs["example"]
    assert output.count("ranks identical: True") == 1, output[-3000:]
    line = next(line for line in output.splitlines() if line.startswith("traffic:"))
    assert "less than DDP" in line


@pytest.mark.slow
def test_fsdp2_workers_shard_their_model_and_agree_after_the_final_sync(torchrun_jobs):
    """2 workers x 2 processes: FSDP2 inside each worker, the engine across them."""
    output = torchrun_jobs["sharded"]
    assert "FSDP2: this process holds 50% of its worker's model" in output, output[-3000:]
    assert output.count("ranks identical: True") == 1, output[-3000:]
    assert "less than DDP" in output
