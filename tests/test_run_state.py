"""The run's state, defined once: what a checkpoint saves, what DCP holds, what a heal copies.

The engine gives its own sharded state (DTensors for DCP, the rest plain) and loads it back; a
heal carries exactly the trained part a checkpoint carries; the plain checkpoint's keys stay what
older checkpoints hold; and the sync package imports nothing of the harness.
"""

from __future__ import annotations

import ast
import copy
from pathlib import Path

import pytest
import torch
from optimizer_cases import make_params, train
from torch import Tensor

from mtdao import MTAdam
from mtdao.sync import LocalUpdateSync, OuterOptimizerConfig, explicit, unified
from mtdao.sync.codecs.compression import SyncCodecs
from mtdao.sync.trained_state import ShardedEngineState, TrainedState

SRC = Path(__file__).resolve().parents[1] / "src" / "mtdao"
ENGINES = {
    # a delayed, fragmented int8 round with error feedback is in flight at the split
    "delay fragments int8": lambda: dict(
        policy=unified(4),
        delay=2,
        fragments=2,
        codecs=SyncCodecs.parse(["int8"], error_feedback=True),
    ),
    "diloco (anchors, outer momentum)": lambda: dict(
        policy=explicit(4, outer=OuterOptimizerConfig())
    ),
    # a delayed radial-directional round (its norms) is in flight, the momenta have anchors
    "delay radial-directional": lambda: dict(
        policy=unified(4), delay=2, radial_directional=("params", "momenta")
    ),
}


def engine(name: str, seed: int = 0) -> tuple[list[torch.nn.Parameter], LocalUpdateSync]:
    """One worker in this process, as each process of a sharded worker holds its tensors (the
    simulated workers' stacked copies are not laid out like their averages)."""
    params = make_params(seed=seed, shapes=[(6, 4), (4,)])
    optimizer = MTAdam(params, lr=1e-2)
    sync = LocalUpdateSync(optimizer, **ENGINES[name]())
    return params, sync


def tensors_of(value) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for item in value.values() for t in tensors_of(item)]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in tensors_of(item)]
    return []


def assert_same(a, b, where: str = "state") -> None:
    """Same structure, same plain values, bitwise the same tensors."""
    if isinstance(a, Tensor):
        assert isinstance(b, Tensor) and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{where}: {list(a)} != {list(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{index}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def read_like_dcp(into, saved) -> None:
    """What DCP does on a load: read each saved tensor into the tensor laid out at its key."""
    if isinstance(into, Tensor):
        assert into.shape == saved.shape and into.dtype == saved.dtype
        into.copy_(saved)
        return
    assert isinstance(into, dict) and set(into) == set(saved), (sorted(into), sorted(saved))
    for key in into:
        read_like_dcp(into[key], saved[key])


@pytest.mark.parametrize("name", ENGINES)
def test_the_engines_sharded_state_resumes_bit_identically(name):
    """Saved as the engine's sharded form (tensors apart, the rest plain) mid-round and read
    back into a fresh engine's layout, the run goes on exactly as one never interrupted."""
    steps, split = 12, 6
    params, uninterrupted = engine(name)
    train(uninterrupted, params, steps)

    first, sync = engine(name)
    train(sync, first, split)
    trained = TrainedState(sync).state_dict()
    sharded, plain = copy.deepcopy(ShardedEngineState(sync.rounds).state_dict())
    assert not tensors_of(plain), "every tensor of the engine goes to DCP"
    if name == "delay radial-directional":
        assert sync.rounds.pending.rounds and set(sharded) == {
            "anchors",
            "rounds",
            "radial_anchors",
        }
        assert plain["pending"][0]["norms"]["averages"]
    elif name.startswith("delay"):
        assert sync.rounds.pending.rounds and set(sharded) >= {"anchors", "rounds", "residuals"}
    else:
        assert set(sharded) == {"anchors", "outer_momentum"}

    resumed, fresh = engine(name, seed=1)  # other values: everything must come from the save
    optimizer_only = {**copy.deepcopy(trained), "sync": fresh.state_dict()}
    TrainedState(fresh).load_state_dict(optimizer_only)
    layout = ShardedEngineState(fresh.rounds).layout(plain)
    before = copy.deepcopy(plain)
    read_like_dcp(layout, sharded)
    ShardedEngineState(fresh.rounds).load_state_dict(layout, plain)
    assert_same(plain, before, "the plain part")  # left unchanged by the load
    train(fresh, resumed, steps - split, split)

    for param, expected in zip(resumed, params):
        assert torch.equal(param, expected)
    assert_same(fresh.state_dict(), uninterrupted.state_dict(), "engine")
    assert fresh.events and fresh.events == uninterrupted.events


def test_without_its_plain_part_the_layout_holds_what_every_such_engine_holds():
    """What a checkpoint's shapes are checked against before its worker file is trusted."""
    _, sync = engine("diloco (anchors, outer momentum)")
    layout = ShardedEngineState(sync.rounds).layout()
    assert set(layout) == {"anchors", "outer_momentum"}
    assert [tuple(t.shape) for t in layout["anchors"].values()] == [(6, 4), (4,)]


@pytest.mark.parametrize("name", ENGINES)
def test_a_heal_carries_the_trained_state_a_checkpoint_saves(name):
    pytest.importorskip("torchft")
    from mtdao.ft.healing import HealedState

    params, sync = engine(name)
    train(sync, params, 6)
    healed = HealedState(TrainedState(sync)).state_dict()
    assert_same(healed, TrainedState(sync).state_dict(), "heal")
    assert list(healed) == ["params", "optimizer", "sync"]


def test_healing_refuses_a_peer_of_other_shapes_and_overwrites_nothing():
    pytest.importorskip("torchft")
    from mtdao.ft import ReplicaRefused
    from mtdao.ft.healing import HealedState

    params, sync = engine("diloco (anchors, outer momentum)")
    train(sync, params, 2)
    state = HealedState(TrainedState(sync)).state_dict()
    first = next(iter(state["params"]))
    state["params"][first] = torch.zeros(2, 2)
    before = [p.detach().clone() for p in params]
    with pytest.raises(ReplicaRefused, match="parameter shapes"):
        HealedState(TrainedState(sync)).load_state_dict(state)
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert sync.step_count == 2


def test_the_plain_checkpoint_holds_what_older_checkpoints_hold(tmp_path, corpus_dir):
    """Its keys and their order are the on-disk format: a checkpoint of before resumes."""
    from mtdao.train.checkpoint.run_state import RunState
    from mtdao.train.config import TrainConfig, resolve
    from mtdao.train.setup import build_run

    config = TrainConfig.of(
        model="micro",
        method="mtdao",
        steps=2,
        batch_size=2,
        seq_len=16,
        data=str(corpus_dir),
        out=str(tmp_path / "run"),
        device="cpu",
    )
    run = build_run(resolve(config))
    state = RunState(run).state_dict()
    assert list(state) == [
        "step",
        "params",
        "optimizer",
        "sync",
        "shards",
        "torch_rng",
        "clock",
        "evals",
        "extensions",
    ]
    assert list(state["params"]) == [name for name, _ in run.workers.named_parameters()]
    worker = RunState(run).worker_state_dict({})
    assert list(worker) == ["step", "sync", "shards", "torch_rng", "clock", "evals", "extensions"]


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at its top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


# What each package of the library may not import: the ones above it. The optimizers and the
# engine know nothing of each other; the named methods compose them; the integrations and the
# harness use the methods; only the harness reads flags.
ABOVE = {
    "optim": ("sync", "ft", "methods", "integrations", "train", "flags"),
    "sync": ("optim", "ft", "methods", "integrations", "train", "flags"),
    "methods": ("ft", "integrations", "train"),
    "integrations": ("train",),
}


@pytest.mark.parametrize("package", sorted(ABOVE))
def test_each_package_of_the_library_imports_nothing_above_it(package):
    paths = sorted((SRC / package).rglob("*.py"))
    assert len(paths) >= 5
    if package == "integrations":  # every adapter: Hugging Face's Trainer, Lightning's
        assert {"hf", "lightning"} <= {path.parent.name for path in paths}
    above = tuple(f"mtdao.{name}" for name in ABOVE[package])
    for path in paths:
        found = {
            name
            for name in imported_modules(path)
            if any(name == other or name.startswith(f"{other}.") for other in above)
        }
        assert not found, f"{path.relative_to(SRC)} imports {sorted(found)}"


def test_the_two_checkpoint_formats_know_nothing_of_each_other():
    """The Checkpointer chooses the format once; neither format file imports the other (or the
    Checkpointer): no branch on the format is left inside them."""
    checkpoint = SRC / "train" / "checkpoint"
    plain = imported_modules(checkpoint / "snapshot.py")
    sharded = imported_modules(checkpoint / "sharded_snapshot.py")
    assert "mtdao.train.checkpoint.store" in plain and "mtdao.train.checkpoint.dcp" in sharded
    assert not {"mtdao.train.checkpoint.sharded_snapshot", "mtdao.train.checkpoint.dcp"} & plain
    assert "mtdao.train.checkpoint.snapshot" not in sharded
    assert not {name for name in plain | sharded if name.endswith(".checkpointer")}


def test_parameters_that_share_a_name_are_refused():
    """Keyed by name, one would silently take the other's values in a checkpoint or a heal."""
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.ones(2))]
    groups = [{"params": [p], "names": ["weight"]} for p in params]
    sync = LocalUpdateSync(MTAdam(groups, lr=1e-2), unified(4))
    with pytest.raises(ValueError, match="share the name 'weight'"):
        TrainedState(sync)
