"""The Rosenbrock toy: its gradient, its degenerate case (one noiseless worker == plain MTAdam),
its JSON and report outputs, and one-line CLI errors. Small runs only (a few hundred steps)."""

from __future__ import annotations

import json

import pytest
import torch
from torch.testing import assert_close

from mtdao import MTAdam
from mtdao.cli import main
from mtdao.experiments.rosenbrock.run import (
    RosenbrockConfig,
    rosenbrock,
    rosenbrock_grad,
    run,
    run_study,
)

SMALL = dict(workers=8, steps=60, sync_period=4)
JSON_FIELDS = (
    "method",
    "workers",
    "noise",
    "beta",
    "omega",
    "lr",
    "sync_period",
    "steps",
    "seed",
    "final_loss",
    "final_distance",
    "diverged",
    "loss_curve",
    "trajectory",
)


def test_gradient_matches_autograd():
    x = torch.randn(16, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x.requires_grad_(True)
    rosenbrock(x).sum().backward()
    assert_close(rosenbrock_grad(x.detach()), x.grad)
    assert rosenbrock(torch.tensor([1.0, 1.0])).item() == 0.0
    assert rosenbrock(torch.tensor([-1.5, 2.0])).item() == pytest.approx(12.5)


@pytest.mark.parametrize("method", ["local-adam", "mtdao"])
def test_one_noiseless_worker_is_plain_mtadam(method):
    config = RosenbrockConfig(method=method, workers=1, noise=0.0, steps=150, sync_period=4)
    result = run(config)
    omega = 1.0 if method == "local-adam" else config.omega
    x = torch.tensor(config.start, dtype=torch.float64, requires_grad=True)
    optimizer = MTAdam([x], lr=config.lr, betas=(config.beta,), omegas=(omega,), beta2=config.beta2)
    for _ in range(config.steps):
        x.grad = rosenbrock_grad(x.detach())
        optimizer.step()
    assert_close(torch.tensor(result["final_point"], dtype=torch.float64), x.detach())
    assert result["final_loss"] == pytest.approx(rosenbrock(x.detach()).item(), rel=1e-12)


def test_runs_are_deterministic_and_seeded():
    first, again = run(RosenbrockConfig(seed=3, **SMALL)), run(RosenbrockConfig(seed=3, **SMALL))
    other = run(RosenbrockConfig(seed=4, **SMALL))
    assert first["loss_curve"] == again["loss_curve"]
    assert first["loss_curve"] != other["loss_curve"]


def test_ddp_reference_is_adam_beta_09_on_the_worker_averaged_noisy_gradient():
    config = RosenbrockConfig(method="ddp", **SMALL)
    result = run(config)
    # independently: one point, torch's Adam (beta1 0.9), fed the mean over the workers of the true
    # gradient plus each worker's noise, drawn from the seed in the toy's order
    x = torch.tensor(config.start, dtype=torch.float64, requires_grad=True)
    adam = torch.optim.Adam([x], lr=config.lr, betas=(0.9, config.beta2), foreach=False)
    noise = torch.Generator().manual_seed(config.seed)
    path = [[0, *config.start]]
    for step in range(1, config.steps + 1):
        gaussian = torch.randn((config.workers, 2), generator=noise, dtype=torch.float64)
        x.grad = (rosenbrock_grad(x.detach()) + config.noise * gaussian).mean(dim=0)
        adam.step()
        path.append([step, *x.detach().tolist()])
    assert config.steps <= 400  # so that the toy records every step
    assert_close(torch.tensor(result["trajectory"]), torch.tensor(path), rtol=1e-10, atol=1e-12)
    assert result["sync_period"] == 1 and result["beta"] == 0.9


def test_json_fields(tmp_path):
    path = tmp_path / "run.json"
    assert main(["toy", "rosenbrock", "--method", "local-adam", "--workers", "4", "--steps", "30",
                 "--json", str(path)]) == 0  # fmt: skip
    result = json.loads(path.read_text())
    assert set(JSON_FIELDS) <= set(result)
    assert result["method"] == "local-adam" and result["omega"] == 1.0
    assert result["loss_curve"][0] == [0, pytest.approx(12.5)]
    assert result["loss_curve"][-1][0] == 30 and result["trajectory"][-1][0] == 30
    assert result["final_loss"] == result["loss_curve"][-1][1]
    assert isinstance(result["diverged"], bool)


def test_divergence_is_reported_not_raised():
    # lr 50: every Adam step moves the point by about 50, far outside the start loss
    result = run(RosenbrockConfig(method="ddp", workers=2, steps=40, lr=50.0))
    assert result["diverged"] and not result["converged"]


def test_report_writes_table_results_and_plots(tmp_path):
    payload = run_study(RosenbrockConfig(**SMALL), [0, 1], tmp_path)
    assert set(payload["summary"]) == {"local-adam", "mtdao", "ddp"}
    assert len(payload["runs"]) == 6
    text = (tmp_path / "report.md").read_text()
    assert "| local-adam |" in text and "| mtdao |" in text
    json.loads((tmp_path / "results.json").read_text())
    for name in ("trajectories.png", "loss_curves.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--method", "adamw"], "invalid choice: 'adamw'"),
        (["--method", "mtdao", "--workers", "0"], "Invalid --workers: 0"),
        (["--workers", "4"], "--method is required"),
        (["--method", "mtdao", "--beta", "1"], "Invalid --beta: 1.0"),
    ],
)
def test_cli_errors_are_one_line(flags, message, capsys):
    try:
        code = main(["toy", "rosenbrock", *flags])
    except SystemExit as exit:  # argparse's own errors (bad choice) exit from the parser
        code = exit.code
    assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines
