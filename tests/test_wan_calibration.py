"""The drill-calibrated wall-clock model: the fit recovers a known round model, extrapolates in
the number of workers as documented, and the predictions at scale are ordered as the traffic is."""

from __future__ import annotations

import dataclasses

import pytest

from mtdao.experiments.wan_drill.calibration import (
    Calibration,
    DrillMeasurement,
    fit,
    heal_seconds,
    round_seconds,
)
from mtdao.experiments.wan_drill.predict import (
    assumptions,
    frontier_settings,
    grid,
    predict,
    prediction_table,
)

TRUE = Calibration(fixed_s=0.2, rtts_per_round=3.5, efficiency=0.6, heal_fixed_s=1.0,
                   heal_efficiency=0.05, calibrated_workers=3, heal_rtts=12.0)  # fmt: skip


def measurement(rtt_s: float, rate_mbit: float, bytes_per_round: float) -> DrillMeasurement:
    overhead = round_seconds(TRUE, bytes_per_round, 3, rtt_s, rate_mbit / 1000)
    heal_bytes = 4 * bytes_per_round / 3
    heal_s = heal_seconds(TRUE, heal_bytes, rate_mbit / 1000, rtt_s)
    return DrillMeasurement("m", 3, 1000, 16, 320, rtt_s, rate_mbit, 0.01, bytes_per_round,
                            overhead, 10, 60.0, ((heal_bytes, heal_s),))  # fmt: skip


def test_the_fit_recovers_the_round_and_heal_model_it_was_made_from():
    drills = [measurement(0.02, 100, 1.3e6), measurement(0.08, 100, 1.3e6),
              measurement(0.08, 100, 1.0e7), measurement(0.04, 20, 1.3e6)]  # fmt: skip
    fitted = fit(drills)
    names = ("fixed_s", "rtts_per_round", "efficiency", "heal_fixed_s", "heal_efficiency",
             "heal_rtts")  # fmt: skip
    for name in names:
        assert getattr(fitted, name) == pytest.approx(getattr(TRUE, name), rel=1e-6)
    assert fitted.quorum_rtts == pytest.approx(1.5)


def test_too_few_distinct_drills_are_refused():
    with pytest.raises(ValueError, match="3 or more"):
        fit([measurement(0.08, 100, 1.3e6)] * 4)
    with pytest.raises(ValueError, match="two RTTs"):  # three points, one RTT: no RTT term
        fit([measurement(0.08, 100, 1.3e6), measurement(0.08, 100, 1e7),
             measurement(0.08, 20, 1.3e6)])  # fmt: skip


def test_heals_at_one_rtt_fit_no_rtt_term():
    drills = [measurement(0.02, 100, 1.3e6), measurement(0.08, 100, 1.3e6),
              measurement(0.08, 100, 1.0e7), measurement(0.08, 20, 1.3e6)]  # fmt: skip
    drills[0] = dataclasses.replace(drills[0], heals=())  # every heal at 80 ms
    fitted = fit(drills)
    assert fitted.heal_rtts == 0.0
    assert fitted.heal_fixed_s == pytest.approx(TRUE.heal_fixed_s + TRUE.heal_rtts * 0.08)
    assert fitted.heal_efficiency == pytest.approx(TRUE.heal_efficiency)


def test_the_ring_latency_grows_with_the_workers_and_ddp_pays_no_quorum():
    small = round_seconds(TRUE, 0, 3, 0.08, 10)
    large = round_seconds(TRUE, 0, 1024, 0.08, 10)
    assert large - small == pytest.approx((1023 - 2) * 0.08)
    assert round_seconds(TRUE, 0, 3, 0.08, 10, quorum=False) == pytest.approx(2 * 0.08)


def test_local_methods_send_less_and_finish_sooner_on_slow_links():
    ddp, diloco, mtdao = (predict(TRUE, m, 64, 1.3e9, 1.0) for m in ("ddp", "diloco", "mtdao"))
    assert ddp.compute_s == diloco.compute_s == mtdao.compute_s
    assert diloco.communication_s < mtdao.communication_s < ddp.communication_s
    predictions = grid(TRUE)
    assert len(prediction_table(predictions).splitlines()) == 2 + len(predictions) // 3


def frontier_point(method, loss, sent, *flags):
    argv = ["--method", method, *flags, "--steps", "100", "--model", "micro"]
    return {"method": method, "argv": argv, "final_val_loss_mean": loss, "bytes_per_worker": sent}


def test_each_local_method_sends_what_its_cheapest_good_frontier_point_sent():
    # 1000 parameters: DDP sends 4 bytes per parameter per step, 400,000 bytes in 100 steps
    frontier = {"points": [
        frontier_point("ddp", 1.00, 400_000),
        frontier_point("diloco", 1.010, 12_500),  # K = 32, fp32: the best loss
        frontier_point("diloco", 1.014, 3_200, "--sync-dtype", "params=int8"),  # within 0.5 %
        frontier_point("diloco", 1.020, 800, "--sync-period", "128"),  # cheaper, too far off
        frontier_point("mtdao", 1.008, 5_000, "--sync-period", "64", "--state-sync-period", "128"),
        frontier_point("mtdao", 1.030, 1_000, "--sync-period", "512"),
    ]}  # fmt: skip
    settings = frontier_settings(frontier)
    diloco, mtdao = settings["diloco"], settings["mtdao"]
    assert (diloco.sync_period, diloco.flags) == (32, "--sync-dtype params=int8")
    assert diloco.bytes_per_parameter_step == pytest.approx(3_200 / 1000 / 100)
    assert diloco.loss_vs_ddp == pytest.approx(0.014)
    assert mtdao.sync_period == 64 and mtdao.bytes_per_parameter_step == pytest.approx(0.05)
    # the traffic ordering carries into the predictions: MT-DAO's point sends more than DiLoCo's
    diloco_s, mtdao_s = (predict(TRUE, m, 64, 1.3e9, 1.0, settings) for m in ("diloco", "mtdao"))
    rounds = (diloco_s.steps // 32, mtdao_s.steps // 64)
    per_round = [round_seconds(TRUE, b * 1.3e9, 64, 0.08, 1.0) for b in (0.032 * 32, 0.05 * 64)]
    assert diloco_s.communication_s == pytest.approx(rounds[0] * per_round[0])
    assert mtdao_s.communication_s == pytest.approx(rounds[1] * per_round[1])
    assert "125x less than DDP" in " ".join(assumptions(settings))


def test_a_frontier_without_ddp_or_a_method_is_refused_by_name():
    with pytest.raises(ValueError, match="no DDP point"):
        frontier_settings({"points": [frontier_point("diloco", 1.0, 100)]})
    with pytest.raises(ValueError, match="no mtdao point"):
        frontier_settings({"points": [frontier_point("ddp", 1.0, 400_000),
                                      frontier_point("diloco", 1.0, 100)]})  # fmt: skip
