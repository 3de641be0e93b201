"""Learning-rate schedules and the omega and beta warm-ups, as pure functions and as applied by
the trainer."""

from __future__ import annotations

import json
import math
import re

import pytest

from mtdao.optim.warmups import BetaWarmup, OmegaWarmup, ramp, step_capped_beta, warmed_beta
from mtdao.train.config import TrainConfig, resolve
from mtdao.train.schedule import (
    LRSchedule,
    lr_multiplier,
    lr_schedule_of,
    steps_change,
    warmup_steps_of,
)
from mtdao.train.trainer import build_run, set_hyperparameters, train_step

TOTAL, WARMUP, MIN_RATIO = 100, 10, 0.1


def multipliers(schedule: str, warmup: int = WARMUP, decay_fraction: float = 0.2) -> list[float]:
    return [
        lr_multiplier(step, TOTAL, schedule, warmup, MIN_RATIO, decay_fraction)
        for step in range(TOTAL)
    ]


@pytest.mark.parametrize("schedule", ["cosine", "wsd", "constant"])
def test_linear_warmup_reaches_the_peak_at_its_last_step(schedule):
    values = multipliers(schedule)
    assert values[:WARMUP] == pytest.approx([(step + 1) / WARMUP for step in range(WARMUP)])
    assert values[WARMUP - 1] == 1.0
    assert max(values) == 1.0


def test_cosine_decays_from_the_peak_to_the_floor():
    values = multipliers("cosine")
    assert values[WARMUP] == 1.0
    decay = values[WARMUP:]
    assert all(a > b for a, b in zip(decay, decay[1:]))
    # halfway through the decay: halfway between peak and floor
    assert lr_multiplier(55, TOTAL, "cosine", WARMUP, MIN_RATIO) == pytest.approx(0.55)
    assert lr_multiplier(TOTAL, TOTAL, "cosine", WARMUP, MIN_RATIO) == pytest.approx(MIN_RATIO)
    assert MIN_RATIO < values[-1] < MIN_RATIO + 1e-3
    assert lr_multiplier(10 * TOTAL, TOTAL, "cosine", WARMUP, MIN_RATIO) == pytest.approx(MIN_RATIO)


def test_wsd_is_flat_then_decays_linearly_to_the_floor():
    values = multipliers("wsd", decay_fraction=0.2)
    decay_start = TOTAL - 20
    assert values[WARMUP:decay_start] == [1.0] * (decay_start - WARMUP)
    decay = values[decay_start:]
    steps = [a - b for a, b in zip([1.0, *decay], decay)]
    assert steps == pytest.approx([(1 - MIN_RATIO) / 20] * 20)
    assert values[-1] == pytest.approx(MIN_RATIO)


def test_constant_and_no_warmup():
    assert multipliers("constant", warmup=0) == [1.0] * TOTAL
    assert multipliers("cosine", warmup=0)[0] == 1.0
    assert multipliers("wsd", warmup=0)[0] == 1.0


def test_unknown_schedule():
    with pytest.raises(ValueError, match="unknown schedule 'step'"):
        lr_multiplier(0, TOTAL, "step", 0, MIN_RATIO)


def test_ramp():
    assert [ramp(step, 4) for step in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert ramp(0, 0) == 1.0


def test_schedule_objects_and_their_state():
    schedule = LRSchedule(2e-3, TOTAL, "wsd", WARMUP, MIN_RATIO, decay_fraction=0.2)
    assert [schedule(step) for step in range(TOTAL)] == [
        2e-3 * m for m in multipliers("wsd", decay_fraction=0.2)
    ]
    copy = LRSchedule(1.0, 1)
    copy.load_state_dict(schedule.state_dict())
    assert copy == schedule and copy(55) == schedule(55)
    warmup = OmegaWarmup((0.3, 0.6), ramp_steps=4)
    assert warmup(1) == pytest.approx((0.15, 0.3)) and warmup(3) == (0.3, 0.6)
    restored = OmegaWarmup(())
    restored.load_state_dict(json.loads(json.dumps(warmup.state_dict())))
    assert restored == warmup
    betas = BetaWarmup((0.9, 0.99), ramp_steps=4)
    assert betas(1) == (0.9, warmed_beta(0.99, 0.5)) and betas(3) == (0.9, 0.99)
    restored_betas = BetaWarmup(())
    restored_betas.load_state_dict(json.loads(json.dumps(betas.state_dict())))
    assert restored_betas == betas


def half_life(beta: float) -> float:
    return math.log(0.5) / math.log(beta)


@pytest.mark.parametrize("target", [0.95, 0.99, 0.999])
def test_warmed_beta_grows_the_half_life_linearly(target):
    for progress in (0.0, 0.1, 0.25, 0.5, 0.9):
        expected = (1 - progress) * half_life(0.9) + progress * half_life(target)
        assert half_life(warmed_beta(target, progress)) == pytest.approx(expected, rel=1e-12)
    assert warmed_beta(target, 0.0) == pytest.approx(0.9, abs=1e-15)
    assert warmed_beta(target, 1.0) == target  # exactly the target once the warm-up is over
    values = [warmed_beta(target, step / 10) for step in range(11)]
    assert all(a < b for a, b in zip(values, values[1:]))


@pytest.mark.parametrize("target", [0.0, 0.5, 0.9])
def test_warmed_beta_leaves_fast_momenta_alone(target):
    assert [warmed_beta(target, p) for p in (0.0, 0.5, 1.0)] == [target] * 3


def test_the_step_capped_beta_remembers_a_fixed_fraction_of_the_steps_taken():
    ramp_c = 9.0
    for steps_taken in (100, 300, 600):  # where 1 - C / t lies between the floor and the target
        beta = step_capped_beta(0.99, steps_taken, ramp_c)
        assert beta == pytest.approx(1 - ramp_c / steps_taken, rel=1e-15)
        assert half_life(beta) == pytest.approx(math.log(2) * steps_taken / ramp_c, rel=0.05)
    assert step_capped_beta(0.99, 1, ramp_c) == 0.9  # the floor: Adam's fast decay
    assert step_capped_beta(0.99, 900, ramp_c) == pytest.approx(0.99, abs=1e-15)
    assert step_capped_beta(0.99, 10_000, ramp_c) == 0.99  # the target once reached
    assert step_capped_beta(0.99, 50, 0.0) == 0.99  # off
    assert [step_capped_beta(0.9, t, ramp_c) for t in (1, 1000)] == [0.9, 0.9]  # fast: untouched


def test_the_step_ramp_does_not_depend_on_the_planned_length():
    """A short run and the start of a long one use the same decays (unlike --beta-warmup)."""
    short = BetaWarmup((0.9, 0.99), 0, 9.0)
    long = BetaWarmup((0.9, 0.99), 0, 9.0)
    assert [short(step) for step in range(300)] == [long(step) for step in range(300)]
    flat = dict(schedule="constant", warmup=0.0)
    ramped = [
        resolve(TrainConfig.of(steps=n, beta_warmup=0.0, beta_ramp=9.0, **flat))
        for n in (300, 3000)
    ]
    assert steps_change(*ramped, step=200).exact  # extending a ramped run is exact
    warmed = [
        resolve(TrainConfig.of(steps=n, beta_warmup=0.3, beta_ramp=0.0, **flat))
        for n in (300, 3000)
    ]
    assert not steps_change(*warmed, step=200).exact  # a fraction of --steps is not
    both = BetaWarmup((0.99,), ramp_steps=100, step_ramp=9.0)  # with a warm-up too: the slower
    assert both(49)[0] == min(warmed_beta(0.99, 0.5), step_capped_beta(0.99, 50, 9.0))


# -- applied by the trainer -----------------------------------------------------------------------


def two_momenta_run(corpus_dir, tmp_path, **schedule):
    """A tiny 2-worker run of 8 steps with two momenta (0.9, 0.99) weighted (0.3, 0.6)."""
    config = TrainConfig.of(
        model="tiny",
        workers=2,
        sync_period=2,
        batch_size=2,
        seq_len=32,
        steps=8,
        betas=(0.9, 0.99),
        omegas=(0.3, 0.6),
        lr=1e-3,
        eval_tokens=64,
        data=str(corpus_dir),
        out=str(tmp_path / "run"),
        device="cpu",
        progress=False,
        **schedule,
    )
    return build_run(resolve(config))


def test_trainer_applies_lr_schedule_and_omega_warmup(one_thread, corpus_dir, tmp_path):
    run = two_momenta_run(corpus_dir, tmp_path, warmup=0.25, omega_warmup=0.5, schedule="cosine")
    assert run.lr_schedule.peak_lr == 1e-3 and run.omega_warmup.target_omegas == (0.3, 0.6)
    for group in run.optimizer.param_groups:
        assert "initial_lr" not in group and "target_omegas" not in group  # nothing stashed

    for step in range(8):
        expected_lr = 1e-3 * lr_multiplier(step, 8, "cosine", 2, 0.1)
        scale = ramp(step, 4)  # omega warm-up over half of the 8 steps
        if step < 3:  # a real step for the first few, the hyperparameters alone after
            train_step(run)
            assert run.step == step + 1
        else:
            set_hyperparameters(run, step)
        for group in run.optimizer.param_groups:
            assert group["lr"] == pytest.approx(expected_lr)
            assert group["omegas"] == pytest.approx((0.3 * scale, 0.6 * scale))
    assert run.optimizer.param_groups[0]["omegas"] == pytest.approx((0.3, 0.6))
    assert all(math.isfinite(p.sum().item()) for _, p in run.workers.named_parameters())


def test_trainer_applies_beta_warmup(one_thread, corpus_dir, tmp_path):
    run = two_momenta_run(corpus_dir, tmp_path, beta_warmup=0.5)
    assert run.beta_warmup.target_betas == (0.9, 0.99)
    for group in run.optimizer.param_groups:
        assert "target_betas" not in group  # nothing stashed
    for step in range(8):
        progress = ramp(step, 4)  # beta warm-up over half of the 8 steps
        if step < 3:
            train_step(run)
        else:
            set_hyperparameters(run, step)
        for group in run.optimizer.param_groups:
            assert group["betas"] == (0.9, warmed_beta(0.99, progress))
            assert group["omegas"] == (0.3, 0.6)  # untouched without an omega warm-up
    assert run.optimizer.param_groups[0]["betas"] == (0.9, 0.99)
    assert 0.9 < warmed_beta(0.99, ramp(0, 4)) < warmed_beta(0.99, ramp(2, 4)) < 0.99
    assert all(math.isfinite(p.sum().item()) for _, p in run.workers.named_parameters())


# -- re-planning a run for other --steps ---------------------------------------------------------


def planned(steps: int, **fields) -> TrainConfig:
    return resolve(TrainConfig.of(steps=steps, **fields))


def test_wsd_replanned_in_its_stable_phase_is_exact():
    """1000 -> 2000 steps at step 700: both plans warm up for 0 steps and stay at the peak until
    700 (the old decay would start at 800)."""
    flat = dict(schedule="wsd", warmup=0.0, beta_warmup=0.0)
    change = steps_change(planned(1000, **flat), planned(2000, **flat), 700)
    assert change.exact and change.lr_planned == change.lr_new == 8e-3
    assert (
        "exact here" in change.consequence()
        and "--steps 2000 from the start" in change.consequence()
    )
    # past the old decay start, the steps taken followed the old decay: a jump back to the peak
    late = steps_change(planned(1000, **flat), planned(2000, **flat), 900)
    assert not late.exact and late.first_difference == 801
    assert late.lr_new == 8e-3 > late.lr_planned
    assert f"jumps from {late.lr_planned:.4g} to 0.008 at step 901" in late.consequence()


def test_cosine_replanned_jumps_and_says_by_how_much():
    fraction = dict(schedule="cosine", warmup=0.05)
    old, new = planned(1200, **fraction), planned(2400, **fraction)
    change = steps_change(old, new, 600)
    expected_old = LRSchedule(8e-3, 1200, "cosine", 60, 0.1)(600)
    expected_new = LRSchedule(8e-3, 2400, "cosine", 120, 0.1)(600)
    assert (change.lr_planned, change.lr_new) == (expected_old, expected_new)
    assert not change.exact and change.first_difference == 1  # the warmups differ too
    text = change.consequence()
    assert (
        f"the learning rate jumps from {expected_old:.4g} to {expected_new:.4g} at step 601" in text
    )


def test_a_longer_warmup_is_not_exact_even_without_a_jump():
    """wsd with a 5% warmup: 60 steps planned for 1200, 120 for 2400; the rate at step 700 is the
    peak either way, but the steps taken warmed up faster than a 2400-step run would have."""
    fraction = dict(schedule="wsd", warmup=0.05)
    change = steps_change(planned(1200, **fraction), planned(2400, **fraction), 700)
    assert not change.exact and change.first_difference == 1
    assert change.lr_new == change.lr_planned
    assert change.consequence().startswith("the learning rate continues at 0.008, but")


def test_the_default_warmup_keeps_a_replan_exact_up_to_3000_steps():
    """The default warm-up is 150 steps for every run of up to 3000: a 1200-step run re-planned
    for 3000 before its decay is the 3000-step run; one re-planned for 6000 warms up over 300."""
    change = steps_change(planned(1200), planned(3000), 700)
    assert change.exact and change.lr_new == change.lr_planned == 8e-3
    longer = steps_change(planned(1200), planned(6000), 700)
    assert not longer.exact and longer.first_difference == 1


@pytest.mark.parametrize(
    "steps, expected",
    [(40, 20), (300, 150), (1000, 150), (3000, 150), (6000, 300), (10000, 500)],
)
def test_the_default_warmup_is_150_steps_or_5_percent_at_most_half_the_run(steps, expected):
    config = resolve(TrainConfig.of(steps=steps))
    assert warmup_steps_of(config) == lr_schedule_of(config).warmup_steps == expected


def test_a_warmup_given_as_a_fraction_or_in_steps():
    assert warmup_steps_of(resolve(TrainConfig.of(steps=1000, warmup=0.05))) == 50
    assert warmup_steps_of(resolve(TrainConfig.of(steps=1000, warmup_steps=70))) == 70
    assert warmup_steps_of(resolve(TrainConfig.of(steps=1000, warmup=0.0))) == 0


@pytest.mark.parametrize(
    "given, message",
    [
        (dict(warmup=0.1, warmup_steps=10), "not both"),
        (dict(warmup_steps=-1), "--warmup-steps must be a whole number"),
        (dict(steps=100, warmup_steps=101), "from 0 to the run's 100"),
        (dict(warmup_steps=2.5), "got 2.5"),
        (dict(warmup=1.5), "--warmup must lie in [0, 1]"),
    ],
)
def test_a_bad_warmup_is_refused_naming_it(given, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        resolve(TrainConfig.of(**given))


def test_the_default_beta_ramp_keeps_a_replan_exact():
    """mtdao's default beta ramp counts the steps taken, not --steps: a wsd run extended in its
    stable phase is the longer run from the start (the former 30% warm-up made it inexact)."""
    flat = dict(schedule="wsd", warmup=0.0)
    change = steps_change(planned(1000, **flat), planned(2000, **flat), 700)
    assert change.exact and change.lr_new == change.lr_planned == 8e-3
    former = dict(beta_warmup=0.3, beta_ramp=0.0, **flat)
    change = steps_change(planned(1000, **former), planned(2000, **former), 700)
    assert not change.exact and change.first_difference == 1


def test_a_beta_warmup_of_another_length_is_not_exact():
    """wsd without a LR warmup, 1000 -> 2000 steps at step 700: the LR plans agree, but a 10% beta
    warm-up took 100 steps in the old plan and takes 200 in the new one."""
    flat = dict(schedule="wsd", warmup=0.0, betas=(0.99,), omegas=(0.9,))
    same_lr = steps_change(planned(1000, **flat), planned(2000, **flat), 700)
    assert same_lr.exact
    change = steps_change(
        planned(1000, beta_warmup=0.1, **flat), planned(2000, beta_warmup=0.1, **flat), 700
    )
    assert not change.exact and change.first_difference == 1
    assert change.lr_new == change.lr_planned == 8e-3
