"""TrainConfig: validation names the bad flag, the step budget, the JSON round trip, the fields a
resume may change, and the one-to-one mapping of ``mtdao train`` flags onto fields."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from mtdao.cli import build_parser
from mtdao.train.command import config_from_args
from mtdao.train.config import RESUMABLE_FIELDS, TrainConfig


def test_defaults_are_valid():
    config = TrainConfig().validate()
    assert config.total_steps() == 1200
    assert config.run_name() == "mtdao-adam-M4-K32-seed0"


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
        ("betas", (1.5,), "--betas: 1.5 (index 0) is outside [0, 1)"),
        ("betas", (0.9, 1.0), "--betas: 1.0 (index 1)"),
        ("betas", (), "--betas: give at least one"),
        ("omegas", (-0.1,), "--omegas: -0.1"),
        ("omegas", (0.6, 0.6), "sum to 1.2 > 1"),
        ("beta2", 1.0, "--beta2: 1.0 is outside [0, 1)"),
        ("eps", -1e-8, "--eps must be a finite number >= 0"),
        ("outer_lr", 0.0, "--outer-lr must be > 0"),
        ("outer_momentum", 1.0, "--outer-momentum in [0, 1)"),
        ("warmup", 1.5, "--warmup must lie in [0, 1]"),
        ("decay_fraction", -0.1, "--decay-fraction must lie in [0, 1]"),
        ("omega_warmup", math.nan, "--omega-warmup must lie in [0, 1]"),
    ],
)
def test_validate_names_the_bad_flag(field, value, match):
    with pytest.raises(ValueError) as error:
        TrainConfig(**{field: value}).validate()
    assert match in str(error.value)


def test_validate_cross_field_rules():
    with pytest.raises(ValueError, match="give --steps or --tokens, not both"):
        TrainConfig(steps=10, tokens=1000).validate()
    with pytest.raises(ValueError, match=r"--omegas: 2 weights for 1 --betas"):
        TrainConfig(betas=(0.9,), omegas=(0.3, 0.3)).validate()
    TrainConfig(betas=(0.9, 0.99), omegas=(0.3, 0.6)).validate()


def test_step_budget_from_tokens():
    config = TrainConfig(workers=2, batch_size=2, seq_len=32)  # 128 tokens per step
    assert dataclasses.replace(config, steps=7).total_steps() == 7
    assert dataclasses.replace(config, tokens=1280).total_steps() == 10
    assert dataclasses.replace(config, tokens=1281).total_steps() == 11  # rounds up
    assert dataclasses.replace(config, tokens=1).total_steps() == 1


def test_json_round_trip():
    config = TrainConfig(betas=(0.9, 0.99), omegas=(0.3, 0.6), lr=1e-3, data="hf:x", tokens=99)
    restored = TrainConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert restored == config
    assert isinstance(restored.betas, tuple) and isinstance(restored.omegas, tuple)
    with pytest.raises(ValueError, match=r"unknown config field\(s\) \['colour'\]"):
        TrainConfig.from_dict({**config.to_dict(), "colour": "blue"})


def test_differences_ignore_exactly_the_resumable_fields():
    base = TrainConfig()
    changed_values = {
        str: "changed",
        int: 7,
        float: 0.123,
        bool: None,  # flipped below
    }
    for field in dataclasses.fields(TrainConfig):
        current = getattr(base, field.name)
        if isinstance(current, bool):
            other = not current
        elif current is None:
            other = (0.5,) if field.name in ("betas", "omegas") else 3
        else:
            other = changed_values[type(current)]
        differences = base.differences(dataclasses.replace(base, **{field.name: other}))
        if field.name in RESUMABLE_FIELDS:
            assert differences == [], field.name
        else:
            assert len(differences) == 1 and differences[0].startswith(f"{field.name}: "), (
                field.name
            )
    assert base.differences(dataclasses.replace(base, lr=0.01)) == ["lr: None -> 0.01"]
    assert {"steps", "tokens", "out", "resume"} <= RESUMABLE_FIELDS
    assert not {"method", "lr", "workers", "seed", "data", "sync_period"} & RESUMABLE_FIELDS


def test_cli_flags_map_onto_every_field():
    """`mtdao train` with no flags is TrainConfig(); each flag lands in its field."""
    parser = build_parser()
    assert config_from_args(parser.parse_args(["train"])) == TrainConfig()
    args = parser.parse_args(
        ["train", "--sync-period", "8", "--betas", "0.9", "0.99", "--omegas", "0.3", "0.6"]
        + ["--no-bf16", "--no-alignment", "--no-progress", "--resume", "--tokens", "5000"]
        + ["--on-non-finite", "skip", "--schedule", "wsd", "--data-split", "by-file"]
    )
    config = config_from_args(args)
    assert config == TrainConfig(
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
    assert TrainConfig(method="local-adam", state_sync_period=16).validate().state_sync_period == 16
    for method in ("ddp", "qh-ddp", "diloco"):
        with pytest.raises(ValueError, match="--state-sync-period"):
            TrainConfig(method=method, state_sync_period=16).validate()
    with pytest.raises(ValueError, match="--state-sync-period"):
        TrainConfig(state_sync_period=0).validate()
