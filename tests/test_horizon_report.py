"""Report math of the horizon study on hand-built experiments (no training): the state of an
experiment, the significance rule on gaps, the crossing step, and the rendered tables."""

from __future__ import annotations

import pytest

from mtdao.experiments.horizon import plots
from mtdao.experiments.horizon import report as hr
from mtdao.experiments.horizon import summary as hs


def experiment(eid, values, sweep=((4e-3, 1.5), (5.657e-3, 1.4), (8e-3, 1.45)), curve=(), **extra):
    steps = int(eid.split("/")[-1])
    return {
        "id": eid,
        "steps": steps,
        "flags": ["--method", eid.split("/")[1]],
        "planned_seeds": [0, 1, 2],
        "sweep": [{"lr": lr, "loss": loss} for lr, loss in sweep],
        "best_lr": 5.657e-3,
        "bracketed": True,
        "refined": True,
        "values": list(values),
        "seeds": list(range(len(values))),
        "curve": [list(point) for point in curve],
        "cosine": None,
        **extra,
    }


def test_state_names_what_is_missing():
    assert hs.state(experiment("p1/ddp/1000", [1.0, 1.1, 1.2])) == "final"
    assert hs.state(experiment("p1/ddp/1000", [1.0])) == "provisional: 1/3 seeds"
    unbracketed = experiment("p1/ddp/1000", [1.0], bracketed=False)
    assert hs.state(unbracketed) == "provisional: sweep not bracketed yet, 1/3 seeds"
    assert hs.state({"id": "p1/ddp/1000", "sweep": [], "planned_seeds": [0]}) == "not started"
    # at another experiment's LR (the held-out corpus): one LR, no sweep to bracket
    one_lr = dict(sweep=((8e-3, 1.7),), bracketed=False, refined=False)
    held_out = experiment("p6/vim-ddp/3000", [1.7, 1.8, 1.75], **one_lr, lr_from="p1/ddp/3000")
    assert hs.state(held_out) == "final"
    assert hs.state({**held_out, "values": [1.7]}) == "provisional: 1/3 seeds"


def test_gap_counts_only_beyond_the_summed_stds():
    base = experiment("p1/local-adam/1000", [1.00, 1.01, 1.02])  # std 0.01
    assert hs.gap(experiment("p1/mtdao/1000", [0.95, 0.96, 0.97]), base)["verdict"] == "better"
    assert hs.gap(experiment("p1/mtdao/1000", [1.10, 1.11, 1.12]), base)["verdict"] == "worse"
    tie = hs.gap(experiment("p1/mtdao/1000", [0.995, 1.005, 1.015]), base)
    assert tie["verdict"] == "tie" and tie["diff"] == pytest.approx(-0.005)
    single = hs.gap(experiment("p1/mtdao/1000", [0.5]), base)
    assert single["verdict"] == "no noise estimate"
    assert hs.gap(experiment("p1/mtdao/1000", []), base) is None


def test_paired_differences_follow_the_seeds():
    base = experiment("p1/local-adam/1000", [1.00, 1.01, 1.02], seeds=[0, 1, 2])
    other = experiment("p1/mtdao/1000", [0.99, 1.02], seeds=[0, 2])
    assert hs.paired(other, base) == {"diff": pytest.approx(-0.005), "lower": 1, "n": 2}
    assert hs.paired(experiment("p1/mtdao/1000", [], seeds=[]), base) is None


def test_crossing_first_and_lasting():
    base = experiment("p1/local-adam/1000", [1.0], curve=[(40, 3.0), (80, 2.0), (120, 1.5)])
    stays = experiment("p1/mtdao/1000", [1.0], curve=[(40, 3.1), (80, 1.9), (120, 1.4)])
    assert hs.crossing(stays, base) == "step 80, below from 80 on"
    back = experiment("p1/mtdao/1000", [1.0], curve=[(40, 2.9), (80, 2.1), (120, 1.6)])
    assert hs.crossing(back, base) == "step 40, not at the end"
    never = experiment("p1/mtdao/1000", [1.0], curve=[(40, 3.1), (80, 2.1), (120, 1.6)])
    assert hs.crossing(never, base) == "never"


def test_report_tables():
    summary = {
        "collected": "now",
        "finished_runs": 7,
        "running": ["p1_ddp_3000_lr0.008_s0"],
        "protocol": ["one line"],
        "experiments": [
            experiment("p1/ddp/1000", [1.00, 1.01, 1.02]),
            experiment("p1/local-adam/1000", [1.20, 1.21, 1.22]),
            experiment("p1/mtdao-default/1000", [1.10, 1.11, 1.12]),
            experiment("p1/ddp/3000", [0.9], sweep=((8e-3, None), (4e-3, 0.9))),
        ],
    }
    text = hr.render_horizon_report(summary)
    assert "| ddp | 1.0100 ± 0.0100 (3/3) @ 0.00566 | 0.9000 (1/3) @ 0.00566 * |" in text
    assert "| p1/mtdao-default/1000 | -0.1000 (-8.3%, noise 0.0200): better |" in text
    assert "| -0.1000, lower on 3/3 seeds |" in text
    assert "+0.1000 (+9.9%, noise 0.0200): worse" in text
    assert "- p1/ddp/3000: 0.008: diverged, 0.004: 0.9000" in text


def test_a_variant_joins_the_horizon_curve_from_the_variants_screen():
    """both-wu ran 3000 steps as a K = 32 variant (p3): the horizon row takes it from there."""
    summary = {
        "collected": "now",
        "finished_runs": 4,
        "running": [],
        "protocol": ["one line"],
        "experiments": [
            experiment("p1/local-adam/1000", [1.20, 1.21, 1.22]),
            experiment("p1/local-adam/3000", [1.10, 1.11, 1.12]),
            experiment("p1/both-wu/1000", [1.30, 1.31, 1.32]),
            experiment("p3/both-wu/3000", [1.00, 1.01, 1.02]),
        ],
    }
    text = hr.render_horizon_report(summary)
    assert "| both-wu | 1.3100 ± 0.0100 (3/3) @ 0.00566 | 1.0100 ± 0.0100 (3/3) @ 0.00566 |" in text
    ids = [e["id"] for e in hs.horizon_experiments(summary, "both-wu")]
    assert ids == ["p1/both-wu/1000", "p3/both-wu/3000"]


def test_each_experiment_is_compared_with_the_baselines_of_its_setting():
    def baselines(eid):
        return hs.baselines({"id": eid})

    assert baselines("p1/mtdao-default/3000") == ("p1/local-adam/3000", "p1/ddp/3000")
    assert baselines("p4/k128-mtdao-default/3000") == ("p4/k128-local-adam/3000", "p1/ddp/3000")
    assert baselines("p6/vim-mtdao-default/3000") == ("p6/vim-local-adam/3000", "p6/vim-ddp/3000")
    for baseline in ("p1/ddp/3000", "p1/local-adam/3000", "p4/k128-local-adam/3000"):
        assert baselines(baseline) is None  # never compared with itself


def test_other_periods_and_batches_are_compared_within_their_setting():
    def baselines(eid):
        return hs.baselines({"id": eid})

    assert baselines("p4/k512-mtdao-default-state16/3000") == (
        "p4/k512-local-adam/3000",
        "p1/ddp/3000",
    )
    assert baselines("p4/k512-local-adam/3000") is None
    assert baselines("p5/b64-mtdao-default/750") == ("p5/b64-local-adam/750", "p5/b64-ddp/750")
    assert baselines("p5/b64-local-adam/750") is None
    assert baselines("p6/vim-both-wu/3000") == ("p6/vim-local-adam/3000", "p6/vim-ddp/3000")
    assert baselines("p6/vim-k128-ddp/3000") is None
    assert baselines("p7/cos-both-wu/3000") == ("p7/cos-local-adam/3000", "p7/cos-ddp/3000")
    assert baselines("p7/cos-local-adam/3000") is None
    assert baselines("p6/vim-k128-mtdao-default/3000") == (
        "p6/vim-k128-local-adam/3000",
        "p6/vim-ddp/3000",
    )


def test_seed0_screen_pairs_each_configuration_with_its_setting():
    def sweep(*losses):
        return tuple(zip((2.828e-3, 4e-3, 5.657e-3), losses))

    summary = {
        "collected": "now",
        "finished_runs": 9,
        "running": [],
        "protocol": ["one line"],
        "experiments": [
            experiment("p1/local-adam/3000", [1.31], sweep=sweep(1.33, 1.32, 1.3126)),
            experiment("p1/mtdao-default/3000", [1.29], sweep=sweep(1.31, 1.2948, 1.30)),
            experiment(
                "p3/outer-nesterov/3000",
                [],
                sweep=sweep(1.30, 1.2848, None),
                best_lr=4e-3,
                reduction=10.66,
            ),
            experiment("p4/k128-local-adam/3000", [], sweep=sweep(1.35, 1.3475, 1.36)),
            experiment("p4/k128-mtdao-default-state16/3000", [], sweep=sweep(1.3375, 1.34, 1.35)),
        ],
    }
    by_id = hs.experiments_by_id(summary)
    rows = {e["id"]: (loss, a, b) for e, loss, a, b in hs.screen_rows(summary, by_id)}
    assert rows["p3/outer-nesterov/3000"] == pytest.approx((1.2848, -0.01, -0.0278))
    # no MT-DAO default at K = 128 yet: only the Local Adam difference
    loss, vs_default, vs_local = rows["p4/k128-mtdao-default-state16/3000"]
    assert (loss, vs_default) == (1.3375, None) and vs_local == pytest.approx(-0.01)
    assert rows["p4/k128-local-adam/3000"][2] is None  # not compared with itself
    text = hr.render_horizon_report(summary)
    assert (
        "| p3/outer-nesterov/3000 | 1.2848 @ 0.004 | -0.0100 | -0.0278 | 10.7x less | bracketed |"
        in text
    )
    assert "![seed-0 screen](screen.png)" in text
    assert hr._traffic({"reduction": 1.0}) == "-" and hr._traffic({}) == "-"


def test_screen_plot_draws_one_panel_per_setting(tmp_path):
    summary = {
        "experiments": [
            experiment("p3/state16/3000", [], sweep=((4e-3, 1.29),)),
            experiment("p4/k512-local-adam/3000", [], sweep=((4e-3, 1.4),), bracketed=False),
        ]
    }
    plots.plot_screen(summary, tmp_path / "screen.png")
    assert (tmp_path / "screen.png").stat().st_size > 1000
    plots.plot_traffic(
        {"experiments": [experiment("p1/ddp/3000", [1.2, 1.21], reduction=1.0)]},
        tmp_path / "traffic.png",
    )
    assert (tmp_path / "traffic.png").stat().st_size > 1000
    plots.plot_screen({"experiments": []}, tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()
