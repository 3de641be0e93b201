"""The method settings the library and ``mtdao train`` share are one definition,
:class:`mtdao.methods.SyncConfig`, the harness's config's ``sync`` section, checked and
resolved by the same code; the library's messages name fields, the harness's the same fields'
flags (that the integrations built on it import nothing of the harness:
tests/test_run_state.py)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from mtdao.flags import add_dataclass_arguments, as_flags
from mtdao.methods.checks import check_method
from mtdao.methods.config import SyncConfig
from mtdao.methods.defaults import method_defaults
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
    library = SyncConfig(**settings).resolved(workers=4)  # mtdao train's default
    harness = resolve(TrainConfig.of(**settings))
    assert library == harness.sync
    assert method_defaults(harness.sync) == {
        name: getattr(harness.sync, name) for name in method_defaults(harness.sync)
    }


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"method": "lamb"}, "`method`: unknown value 'lamb'"),
        ({"sync_period": 0}, "`sync_period` must be a positive integer"),
        ({"method": "ddp", "sync_policy": "unified"}, "`sync_policy`: ddp does not average"),
        ({"optimizer": "sgdm", "beta2": 0.9}, "`beta2`: the sgdm optimizer has none"),
        ({"method": "ddp", "sync_delay": 2}, "`sync_delay`: ddp averages gradients every step"),
        ({"beta_ramp": float("nan")}, "`beta_ramp` must be a finite number"),
        ({"method": "ddp", "outer_momentum_warmup": 2}, "`outer_momentum_warmup`: ddp takes"),
    ],
)
def test_a_bad_method_setting_is_refused_alike_by_both(settings, message):
    """The library's message names the field (`sync_period`), the harness's its flag."""
    with pytest.raises(ValueError) as by_library:
        SyncConfig(**settings).resolved()
    with pytest.raises(ValueError) as by_harness:
        resolve(TrainConfig.of(**settings))
    said = str(by_library.value)
    assert said.startswith(message) and "--" not in said
    assert str(by_harness.value) == as_flags(said) and str(by_harness.value).startswith("--")
    with pytest.raises(ValueError):
        check_method(SyncConfig(**settings))


def test_mtdaos_rounds_by_workers_resolve_alike_in_the_library_harness_and_integrations(
    monkeypatch,
):
    """MT-DAO's rounds differ with one worker: ``resolved(workers=M)``, ``mtdao train`` and the
    integrations (which count the launched workers) agree on them."""
    from mtdao.integrations import local_updates

    library = SyncConfig().resolved(workers=16)
    assert library == resolve(TrainConfig.of(workers=16, batch_size=4)).sync
    assert library.sync_period == 4 and SyncConfig().resolved().sync_period == 32
    monkeypatch.setattr(local_updates, "launched_workers", lambda shards: 1)
    assert local_updates.LocalUpdates().resolved().sync_period == 32
    monkeypatch.setattr(local_updates, "launched_workers", lambda shards: 16)
    integrations = local_updates.LocalUpdates().resolved()
    assert (integrations.sync_period, integrations.sync_dtype) == (4, library.sync_dtype)


def test_an_unresolved_method_takes_the_defaults_of_its_communicators_workers():
    """``build_sync`` resolves a config left unresolved for the workers its communicator holds:
    MT-DAO's rounds with four, K = 32 with one."""
    import torch

    from mtdao.methods import build_optimizer, build_sync
    from mtdao.sync import SimulatedWorkers, SingleWorker

    def policy_period(communicator, workers):
        params = torch.nn.Linear(4, 2).weight.detach().expand(workers, 2, 4).clone()
        params.requires_grad_(True)
        optimizer = build_optimizer([params], SyncConfig().resolved(workers), lr=1e-3)
        return build_sync(SyncConfig(), optimizer, communicator).policy.params.period

    assert policy_period(SimulatedWorkers(4), 4) == 4
    assert policy_period(SingleWorker(), 1) == 32
