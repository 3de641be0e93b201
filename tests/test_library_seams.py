"""The method settings the library and ``mtdao train`` share are one definition,
:class:`mtdao.sync.config.SyncConfig`, the harness's config's ``sync`` section, checked and
resolved by the same code (that the integrations built on it import nothing of the harness:
tests/test_run_state.py)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from mtdao.flags import add_dataclass_arguments
from mtdao.sync.config import SyncConfig, check_method, method_defaults
from mtdao.train.config import TrainConfig, resolve


def test_the_harness_holds_the_library_method_and_every_setting_of_it_is_a_flag():
    assert TrainConfig.of().sync == SyncConfig()
    parser = argparse.ArgumentParser()
    add_dataclass_arguments(parser, TrainConfig)
    flags = {action.dest for action in parser._actions}
    assert {f.name for f in dataclasses.fields(SyncConfig)} <= flags


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"method": "ddp"},
        {"method": "desloc", "optimizer": "sgdm"},
        {"method": "mtdao", "optimizer": "adopt", "sync_policy": "half-life"},
        {"method": "mtdao", "betas": (0.9, 0.99), "omegas": (0.3, 0.6)},
        {"method": "local-adam", "sync_dtype": ("int8",), "error_feedback": True},
    ],
)
def test_the_library_resolves_a_method_as_the_harness_does(settings):
    library = SyncConfig(**settings).resolved()
    harness = resolve(TrainConfig.of(**settings))
    assert library == harness.sync
    assert method_defaults(harness.sync) == {
        name: getattr(harness.sync, name) for name in method_defaults(harness.sync)
    }


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"method": "lamb"}, "--method: unknown value 'lamb'"),
        ({"sync_period": 0}, "--sync-period must be a positive integer"),
        ({"method": "ddp", "sync_policy": "unified"}, "--sync-policy: ddp does not average"),
        ({"optimizer": "sgdm", "beta2": 0.9}, "--beta2: sgdm has no beta2"),
        ({"method": "ddp", "sync_delay": 2}, "ddp"),
        ({"beta_ramp": float("nan")}, "--beta-ramp must be a finite number"),
    ],
)
def test_a_bad_method_setting_is_refused_alike_by_both(settings, message):
    for config in (SyncConfig(**settings), TrainConfig.of(**settings)):
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            resolve(config) if isinstance(config, TrainConfig) else config.resolved()
    with pytest.raises(ValueError):
        check_method(SyncConfig(**settings))
