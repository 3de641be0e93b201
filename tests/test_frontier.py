"""``mtdao frontier``: the grid as configs, the argv of a point, Pareto frontiers, the budget table
and frontier.json, and the whole command over finished runs (nothing trained)."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from mtdao.cli import build_parser, main
from mtdao.experiments.common.formatting import format_lr, stats
from mtdao.experiments.frontier.grid import (
    GRIDS,
    FrontierPoint,
    changed_flags,
    full_grid,
    quick_grid,
)
from mtdao.experiments.frontier.run import parse_lr_factors
from mtdao.experiments.frontier.study import point_config, run_name
from mtdao.experiments.frontier.summary import (
    budget_rows,
    frontier_json,
    fronts_by_method,
    goal_points,
    pareto_front,
)
from mtdao.train.command import config_from_args
from mtdao.train.config import TrainConfig, resolve


def row(name, method, loss, num_bytes, std=0.0, n=1):
    values = [loss] if n == 1 else [loss - std, loss + std][:n]
    loss_stats = stats(values)
    loss_stats["std"] = std
    return {
        "name": name,
        "method": method,
        "argv": ["--method", method],
        "lr": 1e-3,
        "val_loss": loss_stats,
        "seeds": list(range(n)),
        "bytes_per_worker": num_bytes,
        "comm_reduction_steady_state": 1000.0 / num_bytes,
    }


def test_every_point_of_both_grids_resolves_and_names_itself_uniquely():
    for grid in GRIDS.values():
        points = grid()
        assert len({p.name for p in points}) == len(points)
        for point in points:
            resolve(TrainConfig.of(model="micro", steps=64).replace(**point.fields()))
    assert {p.method for p in quick_grid()} == {"ddp", "local-adam", "diloco", "desloc", "mtdao"}
    assert {p.sync_period for p in full_grid() if p.sync_period} == {32, 64, 128, 256, 512}


def test_a_recipe_sends_state_codecs_only_where_the_method_sends_states():
    diloco = FrontierPoint("diloco", 128, "top8", states=512).fields()
    assert diloco["sync_dtype"] == ("params=top8",) and diloco["error_feedback"]
    assert diloco["state_sync_period"] is None  # DiLoCo keeps its states local
    mtdao = FrontierPoint("mtdao", 128, "top8-s4", states=512).fields()
    assert mtdao["sync_dtype"] == ("params=top8", "momenta=int4", "second-moment=int4")
    assert mtdao["state_sync_period"] == 512
    assert FrontierPoint("local-adam", 32).fields()["sync_dtype"] is None


def test_a_points_argv_is_every_changed_flag_and_rebuilds_its_run():
    args = build_parser().parse_args(["frontier", "--model", "micro", "--steps", "400"])
    point = FrontierPoint("mtdao", 128, "int2", states=512)
    config = point_config(args, point, 4e-3, seed=2)
    argv = changed_flags(config)
    assert argv[:2] == ["--method", "mtdao"] and "--steps" in argv and "--seed" not in argv
    assert "--out" not in argv and "--workers" not in argv  # 4 workers is the default
    parsed = build_parser().parse_args(["train", *argv, "--seed", "2", "--no-progress"])
    rebuilt = config_from_args(parsed)
    assert resolve(rebuilt) == resolve(config.replace(out=None, progress=False))


def test_pareto_front_keeps_what_no_cheaper_point_beats():
    rows = [
        row("a", "m", 2.0, 10),
        row("b", "m", 1.5, 100),
        row("c", "m", 1.7, 200),  # beaten by the cheaper b
        row("d", "m", 1.2, 1000),
        row("e", "m", float("inf"), 5),  # diverged: on no frontier
    ]
    assert [r["name"] for r in pareto_front(rows)] == ["a", "b", "d"]


def test_budget_table_names_the_best_method_and_whether_its_lead_is_beyond_noise():
    rows = [
        row("ddp", "ddp", 1.0, 10_000, std=0.01, n=2),
        row("mt-cheap", "mtdao", 1.10, 90, std=0.01, n=2),
        row("mt-mid", "mtdao", 1.05, 900, std=0.01, n=2),
        row("dl-cheap", "diloco", 1.12, 50, std=0.015, n=2),
        row("dl-mid", "diloco", 1.06, 800),
    ]
    table = {e["factor"]: e for e in budget_rows(rows, 10_000, (10, 100, 1000))}
    assert table[10]["winner"] == "mt-mid" and table[10]["runner_up"] == "dl-mid"
    assert table[10]["margin"] == pytest.approx(0.01)
    assert table[10]["beyond_noise"] is None  # dl-mid has one seed: no noise estimate
    assert (
        table[100]["winner"] == "mt-cheap" and table[100]["beyond_noise"] is False
    )  # 0.02 < 0.025
    assert table[1000]["winner"] is None  # nothing sent 10 bytes or fewer
    goals = goal_points(rows, 1.0)
    assert [g["point"] for g in goals] == [None, None]  # nothing within 3% of DDP
    goals = goal_points(rows, 1.03)
    assert goals[1]["point"] == "mt-mid" and goals[1]["met"] is False  # 1.1x < 500x
    assert fronts_by_method(rows)["diloco"][0]["name"] == "dl-cheap"


def test_frontier_json_holds_every_point_with_its_argv():
    (point,) = frontier_json([row("x", "diloco", 1.25, 1234, std=0.01, n=2)])["points"]
    assert set(point) == {
        "method",
        "argv",
        "final_val_loss_mean",
        "final_val_loss_std",
        "seeds",
        "bytes_per_worker",
        "comm_reduction_steady_state",
    }
    assert isinstance(point["bytes_per_worker"], int) and point["argv"][0] == "--method"


def fake_results(config: TrainConfig, loss: float, num_bytes: int) -> dict:
    return {
        "config": resolve(config).to_dict(),
        "final_val_loss": loss,
        "bytes_per_worker": num_bytes,
        "comm_reduction_steady_state": 1e9 / num_bytes,
    }


def finish_run(out, args, point, lr, seed, loss, num_bytes):
    """Write ``point``'s run at ``lr`` and ``seed`` into ``out`` as finished; its directory."""
    run = out / "runs" / run_name(point, lr, seed)
    run.mkdir(parents=True, exist_ok=True)
    results = fake_results(point_config(args, point, lr, seed), loss, num_bytes)
    (run / "results.json").write_text(json.dumps(results))
    return run


def quick_args(argv):
    """The parsed ``mtdao frontier --quick`` arguments of ``argv``, the quick grid's settings
    applied as the command applies them."""
    from mtdao.experiments.frontier.run import apply_quick

    args = build_parser().parse_args(argv)
    apply_quick(args)
    return args


def remove_run_directories(out):
    """What a new machine leaves of a study: no run directories."""
    shutil.rmtree(out / "runs")


def test_the_command_sweeps_references_adds_seeds_to_the_fronts_and_writes_the_report(tmp_path):
    """Every run the quick grid asks for is written as finished; --no-train reports them."""
    out, report = tmp_path / "runs", tmp_path / "report"
    argv = ["frontier", "--quick", "--lr-factors", "1", "2", "--frontier-seeds", "1"]
    argv += ["--out", str(out), "--report", str(report), "--no-train"]
    args = quick_args(argv)
    base = 8e-3
    for index, point in enumerate(quick_grid()):
        for lr in (base, 2 * base):
            for seed in (0, 1):
                # the doubled LR is better for every method but DDP
                better = lr > base and point.method != "ddp"
                loss = 1.5 + 0.01 * index - (0.05 if better else 0) + 0.001 * seed
                finish_run(out, args, point, lr, seed, loss, 10**9 // (index + 1))
    assert main(argv) == 0
    saved = json.loads((report / "frontier.json").read_text())
    by_method = {}
    for point in saved["points"]:
        by_method.setdefault(point["method"], []).append(point)
        lr = float(point["argv"][point["argv"].index("--lr") + 1])
        assert lr == (base if point["method"] == "ddp" else 2 * base)
    assert len(saved["points"]) == len(quick_grid())
    # each point cheaper and better than the last within a method: all on its front, 2 seeds
    assert all(p["seeds"] == [0, 1] for p in saved["points"])
    text = (report / "report.md").read_text()
    assert "## The best method at each budget" in text and (report / "frontier.png").is_file()


def test_an_lr_pin_for_a_method_outside_the_chosen_points_is_unused_and_a_typo_refused(
    tmp_path, capsys
):
    """One study command serves every --points slice: ``--lr mtdao=...`` with only DDP chosen
    trains nothing differently; a name no grid method has is still an error."""
    out, report = tmp_path / "runs", tmp_path / "report"
    argv = ["frontier", "--quick", "--lr-factors", "1", "--points", "ddp"]
    argv += ["--out", str(out), "--report", str(report), "--no-train"]
    args = quick_args(argv)
    ddp = next(point for point in quick_grid() if point.name == "ddp")
    finish_run(out, args, ddp, 8e-3, 0, 1.5, 10**9)
    assert main([*argv, "--lr", "mtdao=1e-2"]) == 0
    (point,) = json.loads((report / "frontier.json").read_text())["points"]
    assert float(point["argv"][point["argv"].index("--lr") + 1]) == 8e-3
    assert main([*argv, "--lr", "adam=1e-2"]) == 2
    assert "unknown method 'adam'" in capsys.readouterr().err


def test_reuse_takes_an_earlier_reports_runs_where_out_has_none_and_the_report_says_so(tmp_path):
    """A report grows by a point after its run directories are gone: the earlier report's runs
    stand in for the missing ones (same flags, LR and seed); a run --out holds wins over it."""
    out, first, second = tmp_path / "runs", tmp_path / "first", tmp_path / "second"
    argv = ["frontier", "--quick", "--lr-factors", "1", "--out", str(out), "--no-train"]
    args = quick_args(argv)
    points = {p.name: p for p in quick_grid()}

    def finish(name, loss):
        return finish_run(out, args, points[name], 8e-3, 0, loss, 10**6)

    ddp_run = finish("ddp", 1.5)
    # the earlier report also lists a point it has no run of
    assert main([*argv, "--points", "ddp", "desloc-k32-fp32", "--report", str(first)]) == 1
    remove_run_directories(out)
    finish("mtdao-k32-fp32", 1.6)
    both = ["--points", "ddp", "mtdao-k32-fp32", "--report", str(second)]
    assert main([*argv, *both]) == 1  # DDP is missing without --reuse
    assert main([*argv, *both, "--reuse", str(first)]) == 0
    rows = {r["name"]: r for r in json.loads((second / "results.json").read_text())["rows"]}
    assert rows["ddp"]["val_loss"]["values"] == [1.5]
    assert rows["mtdao-k32-fp32"]["val_loss"]["values"] == [1.6]
    assert "1 run(s) taken from an earlier report" in (second / "report.md").read_text()
    finish("ddp", 1.4)  # --out holds DDP again: its own run is used
    assert ddp_run.is_dir()
    assert main([*argv, *both, "--reuse", str(first)]) == 0
    rows = {r["name"]: r for r in json.loads((second / "results.json").read_text())["rows"]}
    assert rows["ddp"]["val_loss"]["values"] == [1.4]
    assert main([*argv, *both, "--reuse", str(tmp_path / "nowhere")]) == 2
    # runs of other settings (here: contiguous shards) are refused, not mixed in
    assert main([*argv, *both, "--reuse", str(first), "--data-split", "contiguous"]) == 2


def two_point_study(tmp_path, finished):
    """A --no-train study of two MT-DAO points with extra seeds 1 and 2, ``finished``
    ({(point, seed): (loss, bytes)}) written as finished runs: its argv, report directory, and
    a function that finishes one more run."""
    out, report = tmp_path / "runs", tmp_path / "report"
    argv = ["frontier", "--lr-factors", "1", "--frontier-seeds", "1", "2"]
    argv += ["--out", str(out), "--report", str(report), "--no-train"]
    argv += ["--points", "mtdao-k32-fp32", "mtdao-k32-int2-s128"]
    args = build_parser().parse_args(argv)
    points = {p.name: p for p in full_grid()}

    def finish(name, seed, loss, num_bytes):
        finish_run(out, args, points[name], 8e-3, seed, loss, num_bytes)

    for (name, seed), (loss, num_bytes) in finished.items():
        finish(name, seed, loss, num_bytes)
    return argv, report, finish


def test_a_point_off_the_front_keeps_the_extra_seeds_it_has_without_training_more(tmp_path):
    """Extra seeds go to the front; a point that left it (a cheaper, better point came) still
    reports the extra seeds already finished, and is not listed as missing the others."""
    finished = {
        ("mtdao-k32-fp32", 0): (1.6, 10**6),
        ("mtdao-k32-fp32", 1): (1.62, 10**6),  # from when it was on the front
        ("mtdao-k32-int2-s128", 0): (1.5, 10**5),  # cheaper and better: the front
        ("mtdao-k32-int2-s128", 1): (1.51, 10**5),
        ("mtdao-k32-int2-s128", 2): (1.49, 10**5),
    }
    argv, report, finish = two_point_study(tmp_path, finished)
    assert main(argv) == 0  # nothing missing: the off-front point is not owed seed 2
    rows = {r["name"]: r for r in json.loads((report / "results.json").read_text())["rows"]}
    assert rows["mtdao-k32-fp32"]["seeds"] == [0, 1]
    assert rows["mtdao-k32-int2-s128"]["seeds"] == [0, 1, 2]


def test_a_point_that_reaches_a_front_once_the_seeds_move_the_means_is_owed_them(tmp_path):
    """On the first seed the int2 point is cheaper and better than the fp32 one; its extra seeds
    raise its mean above fp32's, which puts fp32 on the front of the means: it is owed the
    extra seeds too (missing under --no-train until they finish), not left at one seed."""
    finished = {
        ("mtdao-k32-fp32", 0): (1.51, 10**6),
        ("mtdao-k32-int2-s128", 0): (1.5, 10**5),
        ("mtdao-k32-int2-s128", 1): (1.6, 10**5),
        ("mtdao-k32-int2-s128", 2): (1.62, 10**5),
    }
    argv, report, finish = two_point_study(tmp_path, finished)
    assert main(argv) == 1  # fp32's seeds 1 and 2 are missing
    for seed in (1, 2):
        finish("mtdao-k32-fp32", seed, 1.52, 10**6)
    assert main(argv) == 0
    rows = {r["name"]: r for r in json.loads((report / "results.json").read_text())["rows"]}
    assert rows["mtdao-k32-fp32"]["seeds"] == [0, 1, 2]


def test_lr_factors_may_give_one_method_its_own_sweep():
    methods = ["ddp", "local-adam", "mtdao"]
    factors = parse_lr_factors(["1", "local-adam=0.5,1,2"], methods)
    assert factors == {"ddp": [1.0], "local-adam": [0.5, 1.0, 2.0], "mtdao": [1.0]}
    # with no bare factor the others keep the default sweep
    assert parse_lr_factors(["mtdao=1"], methods)["ddp"] == pytest.approx([0.7071, 1, 1.4142], 1e-4)
    for bad, message in [
        (["adam=1,2"], "unknown method 'adam'"),
        (["local-adam=1,x"], "is not [METHOD=]F[,F...]"),
        (["0"], "must be > 0"),
        (["nan"], "must be > 0"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_lr_factors(bad, methods)


def test_a_method_with_its_own_factors_is_swept_and_trains_its_points_at_its_best(tmp_path):
    """``--lr-factors 1 local-adam=1,2``: Local Adam's reference is swept at 1x and 2x and its
    best LR is the report's; every other method trains at its LR alone."""
    out, report = tmp_path / "runs", tmp_path / "report"
    argv = ["frontier", "--quick", "--lr-factors", "1", "local-adam=1,2", "--frontier-seeds"]
    argv += ["--out", str(out), "--report", str(report), "--no-train"]
    args = quick_args(argv)
    base = 8e-3
    for index, point in enumerate(quick_grid()):
        lrs = (base, 2 * base) if point.method == "local-adam" else (base,)
        for lr in lrs:
            loss = 1.5 + 0.01 * index - (0.05 if lr > base else 0)
            finish_run(out, args, point, lr, 0, loss, 10**9 // (index + 1))
    assert main(argv) == 0
    results = json.loads((report / "results.json").read_text())
    assert results["settings"]["lr_factors"]["local-adam"] == [1.0, 2.0]
    assert set(results["sweeps"]["local-adam"]["losses"]) == {format_lr(base), format_lr(2 * base)}
    for row in results["rows"]:
        assert row["lr"] == (2 * base if row["method"] == "local-adam" else base)
    # a finished run of a reference at an LR outside its sweep is shown, and said to be better
    ddp = next(point for point in quick_grid() if point.method == "ddp")
    finish_run(out, args, ddp, 2 * base, 0, 1.0, 10**9)
    assert main(argv) == 0
    text = (report / "report.md").read_text()
    assert f"finished outside this sweep (not chosen from): {format_lr(2 * base)}: 1.0000" in text
    assert "DDP is not at its best LR here" in text
    # a sweep LR without a finished run is said so, not printed as a loss of inf
    assert main([*argv, "--lr-factors", "1", "local-adam=1,2,4"]) == 1
    text = (report / "report.md").read_text()
    assert f"{format_lr(4 * base)}: — (not run or diverged)" in text and "inf" not in text


def test_a_re_render_at_a_new_lr_keeps_the_points_runs_at_the_old_one(tmp_path):
    """A report re-rendered at another LR (``--lr``) keeps each point's runs at the LR it had
    (results.json ``other_lr_rows``, a table in report.md), and a later render back at that LR
    takes them from the report again once their run directories are gone."""
    out, first, second, third = (tmp_path / name for name in ("runs", "a", "b", "c"))
    argv = ["frontier", "--quick", "--lr-factors", "1", "--out", str(out), "--no-train"]
    argv += ["--points", "mtdao-k32-fp32"]
    args = quick_args(argv)
    point = next(p for p in quick_grid() if p.name == "mtdao-k32-fp32")
    finish_run(out, args, point, 8e-3, 0, 1.6, 10**6)
    assert main([*argv, "--report", str(first)]) == 0
    remove_run_directories(out)  # the 8e-3 run is gone
    finish_run(out, args, point, 1.6e-2, 0, 1.5, 10**6)
    assert main([*argv, "--lr", "mtdao=0.016", "--reuse", str(first), "--report", str(second)]) == 0
    results = json.loads((second / "results.json").read_text())
    assert [r["lr"] for r in results["rows"]] == [0.016]
    assert [(r["lr"], r["val_loss"]["values"]) for r in results["other_lr_rows"]] == [(8e-3, [1.6])]
    text = (second / "report.md").read_text()
    assert "## Points at other learning rates" in text
    assert f"| `mtdao-k32-fp32` | {format_lr(8e-3)} | 1.6000 | 0 | 0.016: 1.5000 | +6.7% |" in text
    for path in (out / "runs").iterdir():
        (path / "results.json").unlink()
        path.rmdir()
    # back at 8e-3 from the second report alone: its kept run is the row, the 0.016 one is kept
    assert main([*argv, "--reuse", str(second), "--report", str(third)]) == 0
    results = json.loads((third / "results.json").read_text())
    assert [(r["lr"], r["val_loss"]["values"]) for r in results["rows"]] == [(8e-3, [1.6])]
    assert [(r["lr"], r["val_loss"]["values"]) for r in results["other_lr_rows"]] == [
        (0.016, [1.5])
    ]


def test_lr_per_point_gives_each_point_the_best_of_its_methods_sweep_lrs(tmp_path):
    """Without --lr-per-point every MT-DAO point takes the reference's best LR; with it a point
    that does better at another of the sweep's LRs keeps that one, in its row and its argv."""
    out, report = tmp_path / "runs", tmp_path / "report"
    argv = ["frontier", "--quick", "--lr-factors", "1", "mtdao=1,2", "--frontier-seeds"]
    argv += ["--out", str(out), "--report", str(report), "--no-train"]
    argv += ["--points", "mtdao-k32-fp32", "mtdao-k32-int2-s128"]
    args = quick_args(argv)
    points = {p.name: p for p in quick_grid()}
    base = 8e-3
    losses = {  # the reference prefers 2x, the longer-period point 1x
        ("mtdao-k32-fp32", base): 1.6,
        ("mtdao-k32-fp32", 2 * base): 1.5,
        ("mtdao-k32-int2-s128", base): 1.55,
        ("mtdao-k32-int2-s128", 2 * base): 1.65,
    }
    for (name, lr), loss in losses.items():
        finish_run(out, args, points[name], lr, 0, loss, 10**6)

    def rows():
        results = json.loads((report / "results.json").read_text())
        return {r["name"]: (r["lr"], r["val_loss"]["values"]) for r in results["rows"]}

    assert main(argv) == 0
    assert rows() == {
        "mtdao-k32-fp32": (2 * base, [1.5]),
        "mtdao-k32-int2-s128": (2 * base, [1.65]),
    }
    assert main([*argv, "--lr-per-point"]) == 0
    assert rows() == {"mtdao-k32-fp32": (2 * base, [1.5]), "mtdao-k32-int2-s128": (base, [1.55])}
    text = (report / "report.md").read_text()
    assert "each point at the best of its method's sweep LRs" in text
    entry = next(
        p
        for p in json.loads((report / "frontier.json").read_text())["points"]
        if p["argv"][1:2] == ["mtdao"] and "int2" in " ".join(p["argv"])
    )
    assert entry["argv"][entry["argv"].index("--lr") + 1] == str(base)
    # a point that has not run at one of its LRs is reported missing, not silently skipped
    (out / "runs" / run_name(points["mtdao-k32-int2-s128"], base, 0) / "results.json").unlink()
    assert main([*argv, "--lr-per-point"]) == 1
    assert rows()["mtdao-k32-int2-s128"] == (2 * base, [1.65])


def test_a_point_at_another_lr_is_compared_over_the_seeds_both_lrs_ran():
    """The other LR ran seeds 0-2, the chosen one 0-1: the change is over seeds 0 and 1 only,
    and the table says so."""
    from mtdao.experiments.frontier.report import other_lrs_section

    def row(lr, values):
        return {
            "name": "mtdao-k32-fp32",
            "method": "mtdao",
            "lr": lr,
            "seeds": list(range(len(values))),
            "val_loss": stats(values),
            "bytes_per_worker": 10**6,
        }

    text = "\n".join(other_lrs_section([row(0.016, [1.0, 1.2])], [row(8e-3, [1.1, 1.3, 9.0])]))
    assert "| 0, 1, 2 | 0.016: 1.1000 ± 0.1414 (seeds 0, 1) | +9.1% |" in text


def test_a_report_is_reused_only_as_the_runs_it_records(tmp_path):
    """A report's points carry their flags in full (``--schedule cosine --warmup 0.05`` where
    they differ from ``mtdao train``'s defaults): reused, its runs stand for exactly those runs;
    a study at another schedule or warm-up refuses them, and so it does a report whose
    results.json names no kind and schema (one of an earlier version)."""
    out, first, second = tmp_path / "runs", tmp_path / "first", tmp_path / "second"
    argv = ["frontier", "--quick", "--lr-factors", "1", "--out", str(out), "--no-train"]
    argv += ["--points", "ddp"]
    args = quick_args(argv)
    ddp = next(point for point in quick_grid() if point.name == "ddp")
    finish_run(out, args, ddp, 8e-3, 0, 1.5, 10**6)
    assert main([*argv, "--report", str(first)]) == 0
    results = json.loads((first / "results.json").read_text())
    (row,) = results["rows"]
    at = row["argv"].index("--schedule")
    assert row["argv"][at : at + 4] == ["--schedule", "cosine", "--warmup", "0.05"]  # not defaults
    remove_run_directories(out)
    assert main([*argv, "--report", str(second), "--reuse", str(first)]) == 0
    (reused,) = json.loads((second / "results.json").read_text())["rows"]
    assert reused["val_loss"]["values"] == [1.5] and reused["argv"] == row["argv"]
    assert main([*argv, "--report", str(second), "--reuse", str(first), "--schedule", "wsd"]) == 2
    assert main([*argv, "--report", str(second), "--reuse", str(first), "--warmup", "0.1"]) == 2
    del results["kind"], results["schema"]
    (first / "results.json").write_text(json.dumps(results))
    assert main([*argv, "--report", str(second), "--reuse", str(first)]) == 2
