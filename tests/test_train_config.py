"""TrainConfig: resolution fills every default once and names a bad flag, the step budget, the JSON
round trip, the fields a resume may change, and the flags generated from the fields and back."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import pytest
import torch

from mtdao.cli import build_parser
from mtdao.flags import add_dataclass_arguments, as_flags, flat_values
from mtdao.methods import SyncConfig, method_parts
from mtdao.methods.optimizers import BASE_OPTIMIZERS
from mtdao.methods.recipes import outer_step_of
from mtdao.methods.table import METHODS
from mtdao.sync import SyncCodecs
from mtdao.sync.round_options import check_round_options
from mtdao.train.command import config_from_args, config_to_argv
from mtdao.train.config import (
    ADDED_AT_THEIR_DEFAULTS,
    RESUMABLE_FIELDS,
    SETTINGS,
    WARMUP_FIELDS,
    TrainConfig,
    config_warnings,
    describe_default,
    resolve,
)


def test_defaults_resolve():
    config = resolve(TrainConfig.of())
    assert config.total_steps() == config.training.steps == 1200
    assert config.run_name() == "mtdao-adam-M4-K4-seed0"
    assert config.job.out == "runs/mtdao-adam-M4-K4-seed0"
    assert TrainConfig.of(method="ddp").run_name() == "ddp-adam-M4-seed0"  # no K: nothing periodic


@pytest.mark.parametrize("optimizer", BASE_OPTIMIZERS)
@pytest.mark.parametrize("method", METHODS)
def test_resolved_configs_are_complete_and_resolve_to_themselves(method, optimizer):
    config = resolve(TrainConfig.of(method=method, optimizer=optimizer, tokens=100_000))
    assert resolve(config) == config
    not_applicable = {"state_sync_period", "checkpoint_every", "tokens"}
    not_applicable |= {"replica_id", "lighthouse", "auth_token_file"}  # only with --fault-tolerant
    # the default LR warm-up stays a rule of the run's length (warmup_steps_of), so that a run
    # re-planned for other --steps (--resume --extend) follows the rule for its new length
    not_applicable |= {"warmup", "warmup_steps"}
    if optimizer == "sgdm":
        not_applicable |= {"beta2", "eps"}  # SGDM keeps no second moment
    if method in ("ddp", "qh-ddp", "diloco"):
        not_applicable.add("sync_policy")  # these never average optimizer states
    if (method, optimizer) == ("mtdao", "adam"):
        not_applicable.discard("state_sync_period")  # its default rounds average them every 32
    unset = {name for name, value in config.to_dict().items() if value is None}
    assert unset == not_applicable
    assert config.training.steps == math.ceil(100_000 / config.tokens_per_step)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.lr_schedule.lr = 1.0  # type: ignore[misc]


def test_mtdao_adam_defaults_to_the_paper_momentum_with_a_step_counted_ramp():
    config = resolve(TrainConfig.of())
    assert (config.sync.betas, config.sync.omegas) == ((0.99,), (0.9,))
    assert (config.sync.beta_ramp, config.sync.beta_warmup, config.sync.omega_warmup) == (
        9.0,
        0.0,
        0.0,
    )
    assert resolve(TrainConfig.of(method="qh-ddp")).sync.beta_ramp == 9.0  # the same optimizer
    # every method's default learning rate is the same, each one's own best at 1000 steps
    assert {
        resolve(TrainConfig.of(method=m)).lr_schedule.lr for m in ("ddp", "local-adam", "mtdao")
    } == {8e-3}


@pytest.mark.parametrize(
    "given",
    [
        dict(method="local-adam"),  # a baseline: no slow momentum to warm up
        dict(optimizer="adopt"),  # the paper's ADOPT defaults, not measured with the warm-up
        dict(betas=(0.95,), omegas=(0.7,)),  # the user's own momenta get exactly what was asked
    ],
)
def test_the_default_beta_ramp_applies_to_the_default_adam_momenta_only(given):
    assert resolve(TrainConfig.of(**given)).sync.beta_ramp == 0.0


def test_a_given_beta_warmup_or_ramp_survives_resolution():
    assert resolve(TrainConfig.of(beta_warmup=0.0)).sync.beta_warmup == 0.0
    assert resolve(TrainConfig.of(betas=(0.9, 0.99), beta_warmup=0.2)).sync.beta_warmup == 0.2
    assert resolve(TrainConfig.of(beta_ramp=0.0)).sync.beta_ramp == 0.0
    assert resolve(TrainConfig.of(betas=(0.9, 0.99), beta_ramp=4.0)).sync.beta_ramp == 4.0


def test_a_config_of_an_earlier_version_is_refused_in_one_line():
    """Every field is saved, so a config.json without one (beta_ramp: a run of before the ramp)
    was written by an earlier version, whose defaults this one would silently change."""
    old = resolve(TrainConfig.of(beta_warmup=0.3, beta_ramp=0.0)).to_dict()
    del old["beta_ramp"]
    with pytest.raises(ValueError, match=r"without the field\(s\) \['beta_ramp'\], written by an "):
        TrainConfig.from_dict(old)


def test_a_config_saved_before_the_averaging_options_reads_as_their_defaults():
    """The outer momentum's schedule and radial-directional averaging came later, off by
    default, which is what a run saved before them did: it reads back as the same config."""
    saved = resolve(TrainConfig.of(method="diloco", sync_period=8)).to_dict()
    for name in ADDED_AT_THEIR_DEFAULTS:
        del saved[name]
    assert TrainConfig.from_dict(saved) == resolve(TrainConfig.of(method="diloco", sync_period=8))
    del saved["beta_ramp"]  # any other field still marks an earlier version
    with pytest.raises(ValueError, match=r"without the field\(s\) \['beta_ramp'\]"):
        TrainConfig.from_dict(saved)


def test_given_values_survive_resolution():
    given = TrainConfig.of(lr=1e-3, betas=(0.9, 0.99), omegas=(0.3, 0.6), beta2=0.9, eps=1e-6)
    config = resolve(given)
    assert (
        config.lr_schedule.lr,
        config.sync.betas,
        config.sync.omegas,
        config.sync.beta2,
        config.sync.eps,
    ) == (
        1e-3,
        (0.9, 0.99),
        (0.3, 0.6),
        0.9,
        1e-6,
    )


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("method", "foo", "--method: unknown value 'foo'"),
        ("optimizer", "lamb", "--optimizer: unknown value"),
        ("model", "huge", "--model: unknown value"),
        ("schedule", "step", "--schedule: unknown value"),
        ("device", "tpu", "--device: unknown value"),
        ("on_non_finite", "ignore", "--on-non-finite: unknown value"),
        ("sync_policy", "sometimes", "--sync-policy: unknown value"),
        ("workers", 0, "--workers must be a positive integer"),
        ("workers", True, "--workers must be a positive integer"),
        ("sync_period", 0, "--sync-period must be a positive integer"),
        ("sync_period", 2.0, "--sync-period must be a positive integer"),
        ("batch_size", -1, "--batch-size must be a positive integer"),
        ("seq_len", 0, "--seq-len must be a positive integer"),
        ("eval_tokens", 0, "--eval-tokens must be a positive integer"),
        ("steps", 0, "--steps must be a positive integer"),
        ("tokens", -5, "--tokens must be a positive integer"),
        ("checkpoint_every", 0, "--checkpoint-every must be a positive integer"),
        ("lr", -1.0, "--lr must be a finite number >= 0"),
        ("lr", math.inf, "--lr must be a finite number >= 0"),
        ("weight_decay", -0.1, "--weight-decay must be a finite number >= 0"),
        ("grad_clip", math.nan, "--grad-clip must be a finite number >= 0"),
        ("betas", (1.5,), "--betas/--omegas: Invalid beta at index 0 of betas: 1.5"),
        ("betas", (0.9, 1.0), "Invalid beta at index 1 of betas: 1.0"),
        ("betas", (), "--betas/--omegas: Invalid betas: () (at least one momentum"),
        ("omegas", (-0.1,), "--betas/--omegas: Invalid omega at index 0: -0.1"),
        ("omegas", (1.2,), "sum to 1.2 > 1"),
        ("beta2", 1.0, "--beta2: 1.0 is outside [0, 1)"),
        ("eps", -1e-8, "--eps must be a finite number >= 0"),
        ("outer_lr", 0.0, "--outer-lr must be a finite number > 0"),
        ("outer_lr", math.nan, "--outer-lr must be a finite number > 0, got nan"),
        ("outer_lr", math.inf, "--outer-lr must be a finite number > 0, got inf"),
        ("outer_momentum", 1.0, "--outer-momentum must lie in [0, 1)"),
        ("outer_momentum", math.nan, "--outer-momentum must lie in [0, 1)"),
        ("min_lr_ratio", 1.5, "--min-lr-ratio must lie in [0, 1]"),
        ("keep_checkpoints", 0, "--keep-checkpoints must be a positive integer"),
        ("collective_timeout", 0.0, "--collective-timeout must be a finite number > 0"),
        ("collective_timeout", math.nan, "--collective-timeout must be a finite number > 0"),
        ("warmup", 1.5, "--warmup must lie in [0, 1]"),
        ("decay_fraction", -0.1, "--decay-fraction must lie in [0, 1]"),
        ("omega_warmup", math.nan, "--omega-warmup must lie in [0, 1]"),
        ("beta_warmup", 1.5, "--beta-warmup must lie in [0, 1]"),
        ("beta_ramp", -1.0, "--beta-ramp must be a finite number >= 0"),
        ("beta_ramp", math.inf, "--beta-ramp must be a finite number >= 0"),
        ("outer_step", "sgd", "--outer-step: unknown value 'sgd'"),
        ("outer_momentum_start", 1.0, "--outer-momentum-start must lie in [0, 1)"),
        ("outer_momentum_final", -0.5, "--outer-momentum-final must lie in [0, 1)"),
        ("outer_momentum_warmup", -2, "--outer-momentum-warmup must be an integer >= 0"),
        ("outer_momentum_decay", 1.5, "--outer-momentum-decay must lie in [0, 1]"),
        ("radial_directional", ("exp_avg_sq",), "--radial-directional: unknown value 'exp_avg_sq'"),
    ],
)
def test_resolve_names_the_bad_flag(field, value, match):
    with pytest.raises(ValueError) as error:
        resolve(TrainConfig.of(**{field: value}))
    assert match in str(error.value)


def test_resolve_cross_field_rules():
    with pytest.raises(ValueError, match="give --steps or --tokens, not both"):
        resolve(TrainConfig.of(steps=10, tokens=1000))
    with pytest.raises(ValueError, match=r"has 2 weights but betas \(0.9,\) has 1 momenta"):
        resolve(TrainConfig.of(betas=(0.9,), omegas=(0.3, 0.3)))
    with pytest.raises(ValueError, match="--beta2: the sgdm optimizer has none"):
        resolve(TrainConfig.of(optimizer="sgdm", beta2=0.9))
    with pytest.raises(ValueError, match="--sync-policy: ddp does not average optimizer states"):
        resolve(TrainConfig.of(method="ddp", sync_policy="unified"))
    resolve(TrainConfig.of(betas=(0.9, 0.99), omegas=(0.3, 0.6)))
    for method in ("ddp", "qh-ddp"):
        with pytest.raises(ValueError, match=f"--outer-step: {method} averages gradients"):
            resolve(TrainConfig.of(method=method, outer_step="nesterov"))
    for method in ("local-adam", "desloc", "mtdao", "diloco"):
        resolve(TrainConfig.of(method=method, outer_step="nesterov"))
    with pytest.raises(ValueError, match="--outer-momentum-warmup: mtdao takes no outer step"):
        resolve(TrainConfig.of(outer_momentum_warmup=3))
    with pytest.raises(ValueError, match="--outer-momentum-decay: local-adam takes no outer"):
        resolve(TrainConfig.of(method="local-adam", outer_momentum_decay=0.1))
    with pytest.raises(ValueError, match="--radial-directional: ddp averages gradients"):
        resolve(TrainConfig.of(method="ddp", radial_directional=("params",)))
    resolve(TrainConfig.of(method="diloco", outer_momentum_warmup=3, outer_momentum_decay=0.1))
    resolve(TrainConfig.of(radial_directional=("params", "momenta")))
    with pytest.raises(ValueError, match="give --resume .* or --overwrite, not both"):
        resolve(TrainConfig.of(resume=True, overwrite=True))
    with pytest.raises(ValueError, match="--extend re-plans a resumed run: it needs --resume"):
        resolve(TrainConfig.of(extend=True))


@pytest.mark.parametrize(
    "fields, engine, config_says, engine_says",
    [
        (dict(sync_fragments=0), dict(fragments=0), "", ""),
        (dict(sync_delay=-1), dict(delay=-1), "", ""),
        (dict(sync_delay=2.0), dict(delay=2.0), "", ""),
        (
            dict(method="ddp", sync_dtype=("int8",)),
            dict(codecs=SyncCodecs.parse(("int8",))),
            "--sync-dtype: ddp",
            "--sync-dtype: policy 'ddp'",
        ),
        (
            dict(sync_delay=8, sync_period=8),
            dict(delay=8),
            "--sync-delay 8 must be below --sync-period 8",
            "--sync-delay 8 must be below every sync period (the shortest is 8)",
        ),
    ],
)
def test_the_round_option_rules_are_the_sync_packages(fields, engine, config_says, engine_says):
    """The config refuses a bad delay, fragment count or dtype by the rule the engine applies, in
    the same words (the engine's naming the setting, the harness's its flag): only the subject (the
    method's flag, the policy) differs."""
    with pytest.raises(ValueError) as by_config:
        resolve(TrainConfig.of(**fields))
    method = fields.get("method", "mtdao")
    config = SyncConfig(method=method, sync_period=fields.get("sync_period", 8))
    policy = method_parts(config, torch.optim.SGD([torch.zeros(1)])).sync_policy()
    with pytest.raises(ValueError) as by_engine:
        check_round_options(policy, **engine)
    said_by_config, said_by_engine = str(by_config.value), as_flags(str(by_engine.value))
    assert said_by_config.replace(config_says, engine_says, 1) == said_by_engine


def test_a_sync_period_longer_than_the_run_is_warned():
    """Allowed (M independent runs, averaged only for evaluation) but rarely meant: one line."""
    no_ramp = dict(beta_ramp=0.0)  # its own warning for runs this short: see below
    assert config_warnings(resolve(TrainConfig.of(steps=64, sync_period=64, **no_ramp))) == []
    (warning,) = config_warnings(resolve(TrainConfig.of(steps=64, sync_period=65, **no_ramp)))
    assert "--sync-period 65 is larger than --steps 64" in warning
    assert "average their parameters only in the final round" in warning
    alone = TrainConfig.of(steps=64, sync_period=65, final_round=False, **no_ramp)
    (warning,) = config_warnings(resolve(alone))
    assert "never average their parameters" in warning
    assert config_warnings(resolve(TrainConfig.of(method="ddp", steps=8, sync_period=32))) == []
    short = TrainConfig.of(steps=8, sync_period=4, state_sync_period=9, **no_ramp)
    (warning,) = config_warnings(resolve(short))
    assert "--state-sync-period 9 is larger than --steps 8" in warning
    assert "averaged only by the final round" in warning
    (warning,) = config_warnings(resolve(short.replace(final_round=False)))
    assert "are never averaged" in warning


def test_a_run_that_ends_before_the_slow_momentum_has_ramped_up_is_warned():
    """A run below the defaults card's shortest runs (300 steps) says that it was never measured
    and where the ramp (min(0.99, 1 - 9 / t), 0.99 from step 900) leaves it; from 300 steps on the
    card measured the default (within 1% of DDP), ramping or not."""
    (warning,) = config_warnings(resolve(TrainConfig.of(steps=200)))
    assert "--steps 200 is shorter than any run MT-DAO's default was measured at" in warning
    assert "ends this run at decay 0.955 (target 0.99 from step 900)" in warning
    assert config_warnings(resolve(TrainConfig.of(steps=300))) == []
    assert config_warnings(resolve(TrainConfig.of(steps=200, method="local-adam"))) == []
    assert config_warnings(resolve(TrainConfig.of(steps=200, beta_ramp=0.0))) == []


def test_mtdao_with_many_workers_is_warned_of_its_measured_gap_to_ddp():
    """From 16 workers on, MT-DAO trails DDP on the workers study: the run says by how much, with
    its default rounds there and with K = 32; fewer workers, or another method, say nothing."""
    (warning,) = config_warnings(resolve(TrainConfig.of(workers=16, batch_size=4)))
    assert warning.startswith("--workers 16: from 16 workers on MT-DAO trails DDP")
    assert "every 4 steps as int4" in warning and "K = 32" in warning
    assert "BENCHMARKS.md" in warning
    assert config_warnings(resolve(TrainConfig.of(workers=8))) == []
    assert config_warnings(resolve(TrainConfig.of(workers=64, method="local-adam"))) == []


def test_mtdao_adam_averages_often_in_few_bits_with_more_than_one_worker():
    """With more than one worker MT-DAO-Adam's rounds default to K = 4 as int4 pseudo-gradients
    with error feedback, the states as int8 every 32; any round setting the user gives keeps the
    plain defaults for the others (K = 32 in float32), as do other methods and one worker."""

    def rounds(**settings):
        sync = resolve(TrainConfig.of(batch_size=4, **settings)).sync
        return sync.sync_period, sync.state_sync_period, sync.sync_dtype, sync.error_feedback

    rule = (4, 32, ("params=int4", "momenta=int8", "second-moment=int8"), True)
    assert rounds(workers=2) == rounds(workers=4) == rounds(workers=64) == rule
    assert resolve(TrainConfig.of(workers=16, batch_size=4)).run_name() == "mtdao-adam-M16-K4-seed0"
    plain = (32, None, ("fp32",), False)
    assert rounds(workers=1) == plain
    assert rounds(sync_period=32) == plain
    assert rounds(sync_dtype=("bf16",)) == (32, None, ("bf16",), False)
    assert rounds(state_sync_period=8) == (32, 8, ("fp32",), False)
    assert rounds(sync_policy="half-life")[0] == 32
    assert rounds(radial_directional=("params",))[0] == 32  # no error feedback there
    for other in (dict(method="local-adam"), dict(method="diloco"), dict(optimizer="adopt")):
        assert rounds(**other)[:3] == (32, None, ("fp32",))
    assert SyncConfig().resolved(workers=2).sync_period == 4
    assert SyncConfig().resolved().sync_period == 32
    assert method_parts(SyncConfig(), torch.optim.SGD([torch.zeros(1)])).policy.params.period == 32
    # a setting the rule's K refuses names the rule and the flag that overrides it
    with pytest.raises(
        ValueError, match=r"--sync-delay 8 must be below --sync-period 4.*more than"
    ):
        resolve(TrainConfig.of(sync_delay=8))


def test_mtdaos_default_rounds_step_past_the_average_from_32_workers():
    """From 32 workers MT-DAO-Adam's default rounds take an outer SGD step of 1.5 past the
    average (no momentum); any outer setting the user gives, other rounds, another method or
    fewer workers keep the plain average (and DiLoCo's 0.7 and 0.9)."""

    def outer(**settings):
        sync = resolve(TrainConfig.of(batch_size=1, **settings)).sync
        return sync.outer_step, sync.outer_lr, sync.outer_momentum

    plain = ("average", 0.7, 0.9)
    assert outer(workers=32) == outer(workers=64) == outer(workers=256) == ("nesterov", 1.5, 0.0)
    assert outer(workers=31) == outer(workers=16) == outer(workers=1) == plain
    assert outer(workers=64, outer_lr=1.2) == ("average", 1.2, 0.9)
    assert outer(workers=64, outer_step="nesterov") == ("nesterov", 0.7, 0.9)
    assert outer(workers=64, outer_momentum=0.5) == ("average", 0.7, 0.5)
    assert outer(workers=64, sync_period=4) == plain
    assert outer(workers=64, method="local-adam") == plain
    assert outer(workers=64, method="diloco", sync_period=32) == ("average", 0.7, 0.9)
    assert SyncConfig().resolved(workers=64).outer_lr == 1.5
    # the rule's outer step is the one its flags ask for
    explicit = resolve(
        TrainConfig.of(
            workers=64,
            batch_size=1,
            outer_step="nesterov",
            outer_lr=1.5,
            outer_momentum=0.0,
        )
    ).sync
    assert outer_step_of(SyncConfig().resolved(workers=64)) == outer_step_of(explicit)
    assert outer_step_of(SyncConfig().resolved(workers=16)) is None


def test_step_budget_from_tokens():
    config = TrainConfig.of(workers=2, batch_size=2, seq_len=32)  # 128 tokens per step
    assert config.replace(steps=7).total_steps() == 7
    assert config.replace(tokens=1280).total_steps() == 10
    assert config.replace(tokens=1281).total_steps() == 11  # rounds up
    assert config.replace(tokens=1).total_steps() == 1


def test_json_round_trip():
    config = TrainConfig.of(betas=(0.9, 0.99), omegas=(0.3, 0.6), lr=1e-3, data="hf:x", tokens=99)
    restored = TrainConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert restored == config
    resolved = resolve(config)
    assert TrainConfig.from_dict(json.loads(json.dumps(resolved.to_dict()))) == resolved
    assert isinstance(restored.sync.betas, tuple) and isinstance(restored.sync.omegas, tuple)
    with pytest.raises(ValueError, match=r"unknown config field\(s\) \['colour'\]"):
        TrainConfig.from_dict({**config.to_dict(), "colour": "blue"})


def test_a_study_run_on_another_split_is_stale():
    from mtdao.experiments.common.suite import stale_settings

    saved = TrainConfig.of(method="mtdao", steps=100, data_split="contiguous").to_dict()
    assert TrainConfig.of().text.data_split == "shuffled"
    stale = stale_settings({"config": saved}, TrainConfig.of(method="mtdao", steps=100))
    assert stale == ["data_split: 'contiguous' -> 'shuffled'"]
    assert not stale_settings(
        {"config": saved}, TrainConfig.of(method="mtdao", steps=100, data_split="contiguous")
    )
    # the split of an earlier version's name ("iid", which cut the path order) is no split now
    old = {**saved, "data_split": "iid"}
    assert stale_settings({"config": old}, TrainConfig.of(method="mtdao", steps=100)) == [
        "the saved config is unusable (--data-split: unknown value 'iid'; choose from shuffled, "
        "by-file, contiguous)"
    ]


def test_a_study_run_started_with_overwrite_is_the_same_experiment():
    from mtdao.experiments.common.suite import stale_settings

    kept = TrainConfig.of(method="mtdao", steps=100, overwrite=True, keep_checkpoints=5)
    assert not stale_settings({"config": kept.to_dict()}, TrainConfig.of(method="mtdao", steps=100))
    other = TrainConfig.of(method="mtdao", steps=100, seed=1)
    assert stale_settings({"config": kept.to_dict()}, other) == ["seed: 0 -> 1"]


def test_a_run_saved_with_the_former_warmup_fraction_is_the_default_where_the_steps_agree():
    """Until 2026-12-04 the LR warm-up was 5% of --steps, saved as warmup 0.05: at 3000 steps
    that is the default's 150 steps (reused, resumed), at 1000 it is 50 (another run)."""
    from mtdao.experiments.common.suite import stale_settings

    for steps, differs in ((3000, False), (1000, True)):
        saved = resolve(TrainConfig.of(steps=steps, warmup=0.05))
        today = resolve(TrainConfig.of(steps=steps))
        stale = stale_settings({"config": saved.to_dict()}, today)
        assert stale == (["warmup_steps: 50 -> 150"] if differs else [])
        expected = ["LR warm-up: 50 -> 150 steps (of 1000)"] if differs else []
        assert saved.differences(today) == expected


def test_differences_ignore_exactly_the_resumable_fields():
    base = TrainConfig.of()
    changed_values = {
        str: "changed",
        int: 7,
        float: 0.123,
        bool: None,  # flipped below
        tuple: ("changed",),
    }
    for name, current in flat_values(base).items():
        if isinstance(current, bool):
            other = not current
        elif current is None:
            other = (0.5,) if name in ("betas", "omegas") else 3
        else:
            other = changed_values[type(current)]
        differences = base.differences(base.replace(**{name: other}))
        if name in RESUMABLE_FIELDS:
            assert differences == [], name
        elif name in WARMUP_FIELDS:  # compared by the steps they come to
            assert len(differences) == 1 and differences[0].startswith("LR warm-up: 150 -> ")
        else:
            assert len(differences) == 1 and differences[0].startswith(f"{name}: "), name
    assert base.differences(base.replace(lr=0.01)) == ["lr: None -> 0.01"]
    assert {"steps", "tokens", "out", "resume"} <= RESUMABLE_FIELDS
    assert not {"method", "lr", "workers", "seed", "data", "sync_period"} & RESUMABLE_FIELDS


def test_cli_flags_map_onto_every_field():
    """`mtdao train` with no flags is TrainConfig.of(); each flag lands in its field."""
    parser = build_parser()
    assert config_from_args(parser.parse_args(["train"])) == TrainConfig.of()
    args = parser.parse_args(
        ["train", "--sync-period", "8", "--betas", "0.9", "0.99", "--omegas", "0.3", "0.6"]
        + ["--no-bf16", "--no-alignment", "--no-progress", "--resume", "--tokens", "5000"]
        + ["--on-non-finite", "skip", "--schedule", "wsd", "--data-split", "by-file"]
    )
    config = config_from_args(args)
    assert config == TrainConfig.of(
        sync_period=8,
        betas=(0.9, 0.99),
        omegas=(0.3, 0.6),
        bf16=False,
        track_alignment=False,
        progress=False,
        resume=True,
        tokens=5000,
        on_non_finite="skip",
        schedule="wsd",
        data_split="by-file",
    )


def test_state_sync_period_only_for_methods_that_average_states():
    assert (
        resolve(TrainConfig.of(method="local-adam", state_sync_period=16)).sync.state_sync_period
        == 16
    )
    for method in ("ddp", "qh-ddp", "diloco"):
        with pytest.raises(ValueError, match="--state-sync-period"):
            resolve(TrainConfig.of(method=method, state_sync_period=16))
    with pytest.raises(ValueError, match="--state-sync-period"):
        resolve(TrainConfig.of(state_sync_period=0))


def test_a_config_saved_before_the_warmup_default_keeps_its_settings():
    """A run resumed from a config.json of the former default (0.95 / 0.7, warm-up 0) stays so."""
    old = resolve(TrainConfig.of(betas=(0.95,), omegas=(0.7,))).to_dict()
    config = resolve(TrainConfig.from_dict(old))
    assert (config.sync.betas, config.sync.omegas, config.sync.beta_warmup) == (
        (0.95,),
        (0.7,),
        0.0,
    )


def test_a_config_saved_with_unset_fields_resolves_to_todays_values():
    """config.json as older versions wrote it (nulls for method defaults) is read, not refused."""
    old = {**TrainConfig.of(method="desloc", steps=100).to_dict()}
    assert old["lr"] is None and old["betas"] is None
    assert resolve(TrainConfig.from_dict(old)) == resolve(
        TrainConfig.of(method="desloc", steps=100)
    )


@pytest.mark.parametrize(
    "config",
    [
        TrainConfig.of(),
        TrainConfig.of(
            method="mtdao",
            betas=(0.95, 0.99),
            omegas=(0.3, 0.4),
            lr=1.6e-2,
            steps=7,
            sync_policy="half-life",
            progress=False,
            bf16=False,
            model="micro",
            track_alignment=False,
            omega_warmup=0.25,
            data="x.txt",
            resume=True,
        ),
        resolve(TrainConfig.of(method="ddp", optimizer="sgdm", tokens=5000, eval_tokens=4096)),
    ],
)
def test_config_to_argv_is_the_inverse_of_the_train_parser(config):
    args = build_parser().parse_args(["train", *config_to_argv(config)])
    assert config_from_args(args) == config


def test_help_shows_every_default():
    parser = argparse.ArgumentParser()
    add_dataclass_arguments(parser, TrainConfig, describe_default)
    helps = {action.dest: action.help for action in parser._actions if action.dest != "help"}
    assert set(helps) == set(SETTINGS)
    without = [name for name, text in helps.items() if "(default: " not in text]
    # the alternative to --steps, whose default is shown; and the --no- switches, whose help says
    # what giving them does (tests/test_cli_help.py)
    assert sorted(without) == ["bf16", "final_round", "progress", "tokens", "track_alignment"]
    for name, default in [
        ("batch_size", "16"),
        ("seq_len", "64"),
        ("model", "tiny"),
        ("eval_tokens", "65536"),
        ("lr", "adam 0.008, adopt 0.004, sgdm 0.3"),
        ("steps", "1200"),
        ("fault_tolerant", "off"),
    ]:
        assert helps[name].endswith(f"(default: {default})"), name
    assert helps["seq_len"].startswith("Tokens per sequence.")  # the field's docstring


@pytest.mark.parametrize(
    "world_size, flags, workers",
    [
        ("1", [], 4),  # simulated: the default
        ("3", [], 3),  # torchrun --nproc-per-node 3: one worker per process
        ("8", ["--shards", "2"], 4),
        ("8", ["--workers", "2"], 2),  # given: kept (check_topology refuses the mismatch)
        ("2", ["--fault-tolerant", "--shards", "2"], 4),  # a replica's processes are one worker
    ],
)
def test_workers_default_to_torchruns_processes(monkeypatch, world_size, flags, workers):
    monkeypatch.setenv("WORLD_SIZE", world_size)
    args = build_parser("train").parse_args(["train", *flags])
    assert config_from_args(args).parallel.workers == workers
