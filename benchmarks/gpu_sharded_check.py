"""Sharded workers on a GPU: NCCL, bf16 autocast, FSDP2's MixedPrecisionPolicy, fp32 states.

Needs CUDA; prints one PASS/FAIL line per check with its figures and exits 1 if any check fails.

1. ``fsdp-cuda`` (any GPU; one process, NCCL, a 1 x 1 device mesh): a small Llama sharded with
   FSDP2 (parameters in bf16 for compute, gradients reduced in fp32) under bf16 autocast, stepped
   by the MT-DAO optimizer through the sync engine with a shard group. Sharded parameters,
   gradients and optimizer states must stay float32 DTensors; the loss must fall, and end within
   bf16 noise of the same model trained unsharded with bf16 autocast; a DCP save and load must
   restore every parameter and state bit for bit.
2. ``vmapped-workers`` (any GPU): each simulated worker's gradients (the workers vmapped, float32
   and bf16 autocast) match the same worker's computed alone. torch's fused CUDA attention kernels
   under vmap once gave NaN (bf16) or refused (float32); the simulator now takes the math kernel.
3. ``harness-s1`` (any GPU): ``mtdao train --device cuda`` (unsharded, simulated workers) ends
   with a finite loss.
4. ``harness-s2`` (4 GPUs or more): ``torchrun --nproc-per-node 4 ... --workers 2 --shards 2``
   against ``--nproc-per-node 2 ... --shards 1`` on NCCL: validation losses within bf16 noise,
   the same bytes per worker, half the parameter and optimizer-state bytes per process.
5. ``cpu-sharded``: the sharded test files on CPU (gloo), the 2 x 2 topology with one GPU or none.

    python benchmarks/gpu_sharded_check.py --out /tmp/gpu-sharded-check
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from mtdao.testing.ports import unused_port

BF16_LOSS_TOLERANCE = 0.05  # bf16 compute moves a tiny model's loss by ~1e-2 over these steps
STEPS, BATCH, SEQ_LEN = 30, 8, 64


@dataclass(frozen=True)
class Check:
    """One check's verdict (true when it passed) and its figures."""

    name: str
    passed: bool
    details: str

    def __bool__(self) -> bool:
        return self.passed


def report(name: str, passed: bool, details: str) -> Check:
    print(f"{'PASS' if passed else 'FAIL'} {name}: {details}", flush=True)
    return Check(name, passed, details)


# -- 1. FSDP2 on one GPU, in this process ---------------------------------------------------------


def small_llama(sharded: bool, mesh, device: str = "cuda"):
    """(model, worker set, optimizer, engine) of a small Llama on ``device``, sharded or not."""
    from mtdao.methods.optimizers import build_optimizer
    from mtdao.model import Llama, ModelConfig, split_weight_decay
    from mtdao.sync.process_group import ProcessGroupWorkers
    from mtdao.train.config import TrainConfig, resolve
    from mtdao.train.setup import build_sync
    from mtdao.train.sharding import ShardedWorkerSet, shard_model
    from mtdao.train.workers import ProcessWorkerSet

    torch.manual_seed(0)
    model = Llama(ModelConfig(256, 128, 4, 4, SEQ_LEN)).to(device)
    if sharded:
        shard_model(model, mesh, bf16=True)
        shard_group = mesh.get_group("shard")
        communicator = ProcessGroupWorkers(mesh.get_group("replicate"), shard_group=shard_group)
        workers = ShardedWorkerSet(model, communicator.layout, mesh)
    else:
        communicator = ProcessGroupWorkers(mesh.get_group("replicate"))
        workers = ProcessWorkerSet(model, communicator.layout)
    workers.autocast_dtype = torch.bfloat16
    config = resolve(TrainConfig.of(method="mtdao", workers=1, sync_period=4))
    named = workers.named_parameters()
    optimizer = build_optimizer(
        split_weight_decay(named, config.training.weight_decay),
        config.sync,
        config.lr_schedule.lr,
        config.training.weight_decay,
    )
    return model, workers, optimizer, build_sync(config, optimizer, communicator, workers)


def train_small_llama(sharded: bool, mesh, device: str = "cuda", steps: int = STEPS) -> dict:
    model, workers, optimizer, sync = small_llama(sharded, mesh, device)
    named = workers.named_parameters()
    generator = torch.Generator().manual_seed(1)
    losses, grad_dtypes = [], set()
    for _ in range(steps):
        # a learnable stream: each token is the previous one plus one
        starts = torch.randint(0, 256, (BATCH, 1), generator=generator)
        tokens = ((starts + torch.arange(SEQ_LEN + 1)) % 256).to(device)
        loss = workers.losses(tokens[:, :-1], tokens[:, 1:])
        loss.sum().backward()
        grad_dtypes |= {p.grad.dtype for _, p in named}
        sync.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    states = [v for _, p in named for k, v in optimizer.state[p].items() if k != "step"]
    return {
        "model": model,
        "optimizer": optimizer,
        "losses": losses,
        "param_types": {(type(p).__name__, p.dtype) for _, p in named},
        "grad_dtypes": grad_dtypes,
        "state_types": {(type(v).__name__, v.dtype) for v in states},
    }


def dcp_round_trip(run: dict, mesh, directory: Path, device: str = "cuda") -> bool:
    """Save the trained run with DCP, load it into a fresh (untrained) one: equal bit for bit?"""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(run["model"], run["optimizer"])
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=directory)
    model, _, optimizer, _ = small_llama(True, mesh, device)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    loaded = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(loaded, checkpoint_id=directory)
    set_state_dict(
        model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"]
    )
    same = True
    for saved, restored in zip(run["model"].parameters(), model.parameters()):
        same &= torch.equal(saved.full_tensor(), restored.full_tensor())
        saved_state, restored_state = run["optimizer"].state[saved], optimizer.state[restored]
        for key, value in saved_state.items():
            other = restored_state[key]
            if key != "step":
                value, other = value.full_tensor(), other.full_tensor()
            same &= torch.equal(value, other)
    return same


def check_fsdp(out: Path, device: str = "cuda", steps: int = STEPS) -> Check:
    """``fsdp-cuda`` (on a CPU, with gloo and without bf16 compute, the same code at work)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(unused_port()))
    if device == "cuda":
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    else:
        dist.init_process_group("gloo")
    try:
        mesh = init_device_mesh(device, (1, 1), mesh_dim_names=("replicate", "shard"))
        sharded = train_small_llama(True, mesh, device, steps)
        unsharded = train_small_llama(False, mesh, device, steps)
        fp32 = torch.float32
        types_ok = sharded["param_types"] == {("DTensor", fp32)}
        types_ok &= sharded["grad_dtypes"] == {fp32}
        types_ok &= sharded["state_types"] == {("DTensor", fp32)}
        first, last = sharded["losses"][0], sharded["losses"][-1]
        gap = abs(last - unsharded["losses"][-1])
        learning = math.isfinite(last) and last < first
        round_trip = dcp_round_trip(sharded, mesh, out / "dcp", device)
        grads = sorted(map(str, sharded["grad_dtypes"]))
        details = (
            f"parameters {sorted(map(str, sharded['param_types']))}, gradients {grads}, states "
            f"{sorted(map(str, sharded['state_types']))}; loss {first:.4f} -> {last:.4f}, unsharded "
            f"{unsharded['losses'][-1]:.4f} (gap {gap:.4f}); DCP round trip "
            f"{'exact' if round_trip else 'DIFFERS'}"
        )
        passed = types_ok and learning and gap < BF16_LOSS_TOLERANCE and round_trip
        return report(f"fsdp-{device}", passed, details)
    finally:
        dist.destroy_process_group()


# -- 2. the simulator's vmapped workers -----------------------------------------------------------

VMAP_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}  # worst relative gradient difference


def vmapped_gradient_gap(device: str, dtype: torch.dtype) -> float:
    """Worst relative difference between a worker's gradient in the simulator (all workers vmapped)
    and the same worker's alone, over every parameter and worker."""
    from mtdao.model import Llama, ModelConfig
    from mtdao.sync.simulated import SimulatedWorkers
    from mtdao.train.workers import SimulatedWorkerSet, language_model_loss

    torch.manual_seed(0)
    model = Llama(ModelConfig(256, 128, 2, 4, SEQ_LEN)).to(device)
    workers = SimulatedWorkerSet(model, SimulatedWorkers(4).layout)
    workers.autocast_dtype = None if dtype == torch.float32 else dtype
    tokens = torch.randint(0, 256, (4, BATCH, SEQ_LEN + 1), device=device)
    inputs, targets = tokens[..., :-1], tokens[..., 1:]
    workers.losses(inputs, targets).sum().backward()
    worst = 0.0
    for index in range(4):
        model.zero_grad()
        with torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32):
            logits = model(inputs[index])
        language_model_loss(logits, targets[index]).backward()
        for (_, stacked), param in zip(workers.named_parameters(), model.parameters()):
            gap = (stacked.grad[index] - param.grad).norm() / param.grad.norm().clamp_min(1e-12)
            worst = max(worst, gap.item())
    return worst


def check_vmapped_workers(device: str = "cuda") -> Check:
    gaps = {}
    for dtype in VMAP_TOLERANCE:
        try:
            gaps[dtype] = vmapped_gradient_gap(device, dtype)
        except RuntimeError as error:  # the fused attention kernels refused vmapped inputs once
            gaps[dtype] = math.inf
            print(f"  {dtype}: {str(error).splitlines()[0]}")
    passed = all(gaps[dtype] < tolerance for dtype, tolerance in VMAP_TOLERANCE.items())
    details = ", ".join(f"{str(d).split('.')[-1]} {g:.1e}" for d, g in gaps.items())
    return report("vmapped-workers", passed, f"worst relative gradient gap {details}")


# -- 3, 4. the harness --------------------------------------------------------------------------


def mtdao_train(processes: int, flags: list[str], out: Path) -> dict:
    base = ["--device", "cuda", "--model", "tiny", "--steps", str(STEPS), "--sync-period", "8"]
    base += ["--eval-every", str(STEPS), "--no-progress", "--out", str(out)]
    if processes == 1:
        command = [sys.executable, "-m", "mtdao", "train", *base, *flags]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command += ["--nproc-per-node", str(processes), "-m", "mtdao", "train", *base, *flags]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1:] or ["exit code != 0"]}
    return json.loads((out / "results.json").read_text())


def check_harness_unsharded(out: Path) -> Check:
    results = mtdao_train(1, ["--workers", "2"], out / "s1")
    loss = results.get("final_val_loss")
    passed = loss is not None and math.isfinite(loss)
    return report("harness-s1", passed, f"final_val_loss {loss} {results.get('error', '')}")


def check_harness_sharded(out: Path) -> Check:
    two = mtdao_train(2, ["--workers", "2", "--shards", "1"], out / "M2-S1")
    four = mtdao_train(4, ["--workers", "2", "--shards", "2"], out / "M2-S2")
    if "error" in two or "error" in four:
        return report("harness-s2", False, f"{two.get('error')} {four.get('error')}")
    gap = abs(two["final_val_loss"] - four["final_val_loss"])
    memory_one, memory_two = two["memory_per_process"], four["memory_per_process"]
    halved = all(memory_two[key] * 2 <= memory_one[key] * 1.01 for key in memory_one)
    passed = gap < BF16_LOSS_TOLERANCE and two["bytes_per_worker"] == four["bytes_per_worker"]
    details = (
        f"val loss S1 {two['final_val_loss']:.4f} S2 {four['final_val_loss']:.4f} (gap "
        f"{gap:.4f}); bytes per worker {two['bytes_per_worker']} / {four['bytes_per_worker']}; "
        f"memory per process {memory_one} -> {memory_two}"
    )
    return report("harness-s2", passed and halved, details)


def check_cpu_sharded() -> Check:
    tests = ["tests/test_sharded_sync.py", "tests/test_sharded_train.py"]
    tests.append("tests/test_sharded_config.py")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "pytest", "-q", *tests]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    summary = (done.stdout.strip().splitlines() or ["no output"])[-1]
    return report("cpu-sharded", done.returncode == 0, summary)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="gpu-sharded-")))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("FAIL no CUDA device")
        return 1
    gpus = torch.cuda.device_count()
    print(f"{gpus} GPU(s): {torch.cuda.get_device_name(0)}; torch {torch.__version__}")
    args.out.mkdir(parents=True, exist_ok=True)
    results = [check_fsdp(args.out), check_vmapped_workers()]
    results.append(check_harness_unsharded(args.out))
    if gpus >= 4:
        results.append(check_harness_sharded(args.out))
    else:
        print(f"SKIP harness-s2: needs 4 GPUs, found {gpus}")
    results.append(check_cpu_sharded())
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
