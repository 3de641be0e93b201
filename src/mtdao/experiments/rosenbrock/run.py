"""``mtdao toy rosenbrock``: Local Adam vs MT-DAO on a noisy Rosenbrock function (the paper's toy).

f(x1, x2) = (1 - x1)^2 + 100 (x2 - x1^2)^2, minimum 0 at (1, 1). M workers each hold a copy of the
point x = (x1, x2) and see the true gradient plus IID Gaussian noise of std ``noise`` per coordinate
per step. The workers are simulated in one process (a parameter of shape [M, 2]) and driven by the
project's own optimizer and sync engine:

* ``local-adam``: ``MTAdam(betas=(beta,), omegas=(1,))`` = Adam, point and all states averaged
  every K steps;
* ``mtdao``: ``MTAdam(betas=(beta,), omegas=(omega,))``, the raw gradient gets ``1 - omega``, same
  sync;
* ``ddp``: reference, Adam with beta1 = 0.9 on gradients averaged over the workers every step.

What is evaluated is the global point, the mean of the workers' points (equal to every worker's
right after a parameter sync). The defaults are the paper's setting; the measured outcome is in
reports/rosenbrock/report.md. The function and the methods compared: :mod:`.problem`;
the report's numbers: :mod:`.summary`; report.md and the plots:
:mod:`.report`.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from mtdao.experiments.rosenbrock.problem import (
    CONVERGED_DISTANCE,
    METHODS,
    OPTIMUM,
    rosenbrock,
    rosenbrock_grad,
)
from mtdao.methods import SyncConfig, method_parts
from mtdao.optim import MTAdam
from mtdao.sync import LocalUpdateSync, NonFiniteError, SimulatedWorkers

DDP_BETA = 0.9  # the reference's first momentum: plain synchronous Adam
CURVE_POINTS = 400  # loss curve and trajectory are kept at about this many steps


@dataclass(frozen=True)
class RosenbrockConfig:
    """One run of the toy. The defaults are the paper's setting (reports/rosenbrock/report.md)."""

    method: str = "mtdao"
    """local-adam, mtdao or ddp."""
    workers: int = 256
    """M, the number of simulated workers."""
    noise: float = 2.0
    """sigma: std of the Gaussian noise added to each gradient coordinate, per worker per step."""
    beta: float = 0.9999
    """Decay of the first momentum of local-adam, of the slow momentum of mtdao (ddp uses 0.9)."""
    omega: float = 0.5
    """mtdao's weight on the slow momentum; the raw gradient gets 1 - omega."""
    beta2: float = 0.999
    """Second-moment decay (all methods)."""
    lr: float = 1e-2
    """Learning rate, constant."""
    sync_period: int = 16
    """K: the point and every optimizer state are averaged every K steps (local methods)."""
    steps: int = 2000
    """Optimizer steps per worker."""
    start: tuple[float, float] = (-1.5, 2.0)
    """Starting point, the same on every worker; f(-1.5, 2) = 12.5, on the far side of the valley."""
    seed: int = 0
    """Seed of the gradient noise."""

    def validate(self) -> RosenbrockConfig:
        if self.method not in METHODS:
            raise ValueError(f"Unknown method {self.method!r}; choose from {', '.join(METHODS)}")
        if self.workers < 1:
            raise ValueError(f"Invalid --workers: {self.workers} (must be >= 1)")
        if not (self.noise >= 0.0 and math.isfinite(self.noise)):
            raise ValueError(f"Invalid --noise: {self.noise} (must be a finite number >= 0)")
        if self.steps < 1:
            raise ValueError(f"Invalid --steps: {self.steps} (must be >= 1)")
        if self.sync_period < 1:
            raise ValueError(f"Invalid --sync-period: {self.sync_period} (must be >= 1)")
        if not (self.lr > 0.0 and math.isfinite(self.lr)):
            raise ValueError(f"Invalid --lr: {self.lr} (must be a finite number > 0)")
        for flag, decay in (("--beta", self.beta), ("--beta2", self.beta2)):
            if not 0.0 <= decay < 1.0:
                raise ValueError(f"Invalid {flag}: {decay} (a decay must lie in [0, 1))")
        if not 0.0 <= self.omega <= 1.0:
            raise ValueError(f"Invalid --omega: {self.omega} (must lie in [0, 1])")
        return self


# -- one run ----------------------------------------------------------------------------------


def optimizer_settings(config: RosenbrockConfig) -> tuple[float, float]:
    """(beta, omega) of the method's single first momentum."""
    if config.method == "ddp":
        return DDP_BETA, 1.0
    if config.method == "local-adam":
        return config.beta, 1.0
    return config.beta, config.omega


def _trace(config: RosenbrockConfig, sync: LocalUpdateSync, x: torch.nn.Parameter):
    """Step every worker ``config.steps`` times on its noisy gradient; returns the loss curve and
    path of the global point (about CURVE_POINTS entries each) and the step it diverged at."""
    noise = torch.Generator().manual_seed(config.seed)
    record_every = max(1, config.steps // CURVE_POINTS)
    loss_curve = [[0, rosenbrock(torch.tensor(config.start, dtype=torch.float64)).item()]]
    trajectory = [[0, *config.start]]
    for step in range(1, config.steps + 1):
        with torch.no_grad():
            gaussian = torch.randn(x.shape, generator=noise, dtype=x.dtype)
            x.grad = rosenbrock_grad(x) + config.noise * gaussian
        try:
            sync.step()
        except NonFiniteError:
            return loss_curve, trajectory, step
        point = x.detach().mean(dim=0)  # the global point
        loss = rosenbrock(point).item()
        if not math.isfinite(loss):
            return loss_curve, trajectory, step
        if step % record_every == 0 or step == config.steps:
            loss_curve.append([step, loss])
            trajectory.append([step, *point.tolist()])
    return loss_curve, trajectory, None


def run(config: RosenbrockConfig) -> dict[str, Any]:
    """Optimize f with ``config``; the result holds the global point's loss curve and path."""
    config.validate()
    beta, omega = optimizer_settings(config)
    point = torch.tensor(config.start, dtype=torch.float64)
    x = torch.nn.Parameter(point.repeat(config.workers, 1))  # [M, 2]: row w is worker w's point
    optimizer = MTAdam([x], lr=config.lr, betas=(beta,), omegas=(omega,), beta2=config.beta2)
    method = SyncConfig(method=config.method, sync_period=config.sync_period)
    policy = method_parts(method, optimizer).sync_policy()
    sync = LocalUpdateSync(optimizer, policy, SimulatedWorkers(config.workers))
    loss_curve, trajectory, diverged_at = _trace(config, sync, x)
    start_loss = loss_curve[0][1]
    final_loss = loss_curve[-1][1] if diverged_at is None else math.inf
    final_distance = math.dist(trajectory[-1][1:], OPTIMUM) if diverged_at is None else math.inf
    diverged = diverged_at is not None or final_loss > start_loss
    return {
        **asdict(config),
        "start": list(config.start),
        "beta": beta,
        "omega": omega,
        "sync_period": config.sync_period if config.method != "ddp" else 1,
        "policy": policy.name,
        "final_loss": final_loss,
        "final_distance": final_distance,
        "final_point": trajectory[-1][1:],
        "diverged": diverged,
        "diverged_at_step": diverged_at,
        "divergence_threshold": start_loss,
        "converged": not diverged and final_distance < CONVERGED_DISTANCE,
        "loss_curve": loss_curve,
        "trajectory": trajectory,
    }


def to_json(value: Any, indent: int | None = None) -> str:
    """JSON text in which a non-finite float (a diverged run's loss) is written as null."""

    def finite(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: finite(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [finite(x) for x in v]
        return v

    return json.dumps(finite(value), indent=indent, allow_nan=False) + "\n"


def summary_line(result: dict[str, Any]) -> dict[str, Any]:
    """The result without its curves, for the terminal."""
    return {k: v for k, v in result.items() if k not in ("loss_curve", "trajectory")}


# -- every method over seeds ------------------------------------------------------------------


def run_study(config: RosenbrockConfig, seeds: list[int], out_dir: Path) -> dict[str, Any]:
    """Run every method over ``seeds``; write report.md, results.json and the two plots."""
    from mtdao.experiments.common.results import stamped, write_report
    from mtdao.experiments.rosenbrock.report import render, write_plots
    from mtdao.experiments.rosenbrock.summary import KIND, SCHEMA, summarize

    results = [
        run(replace(config, method=method, seed=seed)) for method in METHODS for seed in seeds
    ]
    shared = {k: v for k, v in asdict(config).items() if k not in ("method", "seed")}
    content = {"config": shared, "seeds": seeds, "summary": summarize(results), "runs": results}
    payload = stamped(KIND, SCHEMA, content)
    write_report(out_dir, payload, render, to_text=to_json)
    write_plots(results, out_dir, shared)
    return payload


# -- command line -----------------------------------------------------------------------------

EPILOG = """
defaults reproduce the paper's toy: Local Adam stalls far from (1, 1), MT-DAO converges.

examples:
  mtdao toy rosenbrock --method local-adam --workers 256 --noise 2 --beta 0.9999
  mtdao toy rosenbrock --method mtdao --omega 0.5 --json runs/rosenbrock/mtdao.json
  mtdao toy rosenbrock --report runs/rosenbrock --seeds 0 1 2 3 4
"""


def add_parser(subparsers) -> None:
    toy = subparsers.add_parser("toy", help="toy problems (mtdao toy rosenbrock)")
    toys = toy.add_subparsers(dest="toy", metavar="TOY")
    toys.required = True
    defaults = RosenbrockConfig()
    parser = toys.add_parser(
        "rosenbrock",
        help="Local Adam vs MT-DAO on a noisy Rosenbrock function",
        description=__doc__.split("\n", 1)[0].replace("``", ""),  # no RST markup on a terminal
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--method", choices=METHODS, help="one run of this method (required without --report)")
    add("--workers", type=int, default=defaults.workers, help="workers M (default: %(default)s)")
    add("--noise", type=float, default=defaults.noise, help="gradient noise std (default: 2)")
    add(
        "--beta",
        type=float,
        default=defaults.beta,
        help="momentum decay: Local Adam's first, MT-DAO's slow one (default: %(default)s)",
    )
    add("--omega", type=float, default=defaults.omega, help="MT-DAO's momentum weight (0.5)")
    add("--beta2", type=float, default=defaults.beta2, help="second-moment decay (0.999)")
    add("--lr", type=float, default=defaults.lr, help="learning rate (default: %(default)s)")
    add("--sync-period", type=int, default=defaults.sync_period, help="K (default: %(default)s)")
    add("--steps", type=int, default=defaults.steps, help="steps (default: %(default)s)")
    add(
        "--start",
        type=float,
        nargs=2,
        default=defaults.start,
        metavar=("X1", "X2"),
        help="start point (default: -1.5 2)",
    )
    add("--seed", type=int, help="noise seed of one run (default: 0)")
    add("--json", type=Path, help="write the full result of one run (curves included) here")
    add("--out", type=Path, help="directory for one run's result.json and plots")
    add("--report", type=Path, metavar="DIR", help="run every method over --seeds, write a report")
    add("--seeds", type=int, nargs="+", help="seeds of --report (default: 0 1 2 3 4)")
    parser.set_defaults(func=run_command)


def run_command(args: argparse.Namespace) -> int:
    config = RosenbrockConfig(
        method=args.method or "mtdao",
        workers=args.workers,
        noise=args.noise,
        beta=args.beta,
        omega=args.omega,
        beta2=args.beta2,
        lr=args.lr,
        sync_period=args.sync_period,
        steps=args.steps,
        start=tuple(args.start),
        seed=args.seed or 0,
    ).validate()
    if args.report is not None:
        for flag, value in (("--method", args.method), ("--seed", args.seed)):
            if value is not None:
                raise ValueError(
                    f"{flag} does not apply to --report (it runs {', '.join(METHODS)})"
                )
        if args.json is not None or args.out is not None:
            raise ValueError(
                f"--json/--out do not apply to --report (it writes into {args.report})"
            )
        seeds = args.seeds if args.seeds is not None else [0, 1, 2, 3, 4]
        payload = run_study(config, seeds, args.report)
        from mtdao.experiments.rosenbrock.report import outcome

        for method, stats in payload["summary"].items():
            print(outcome(method, stats).replace("**", ""))
        print(f"report: {args.report / 'report.md'}  results: {args.report / 'results.json'}")
        return 0
    if args.method is None:
        raise ValueError("--method is required for one run (or use --report DIR)")
    if args.seeds is not None:
        raise ValueError("--seeds needs --report; use --seed for one run")
    result = run(config)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(to_json(result))
    if args.out is not None:
        from mtdao.experiments.rosenbrock.report import write_plots

        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "result.json").write_text(to_json(result))
        write_plots([result], args.out, asdict(config))
    print(to_json(summary_line(result)), end="")
    return 0
