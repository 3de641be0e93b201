"""A checkpoint whose files verify and load but do not fit the run (edited or forged: its
checksums fixed up) is set aside with a warning, and the run resumes from the checkpoint before.

Each case edits the newest of a finished run's two checkpoints (steps 2 and 4) as whoever can
write to the run directory could, and resumes: the run falls back to step 2 and ends as the
uninterrupted run did.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from test_checkpoint_forged import forge
from test_train_resume import saved_bytes, tiny_config

from mtdao.train import trainer
from mtdao.train.checkpoint import store as ckpt

pytestmark = pytest.mark.usefixtures("one_thread")

FLAGS = dict(model="micro", steps=4, checkpoint_every=2, keep_checkpoints=2)


@pytest.fixture(scope="module")
def finished(tmp_path_factory, corpus_dir) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("fit") / "run"
    return out, trainer.train(tiny_config(out, corpus_dir, **FLAGS))


def narrower(state: dict) -> None:
    name = next(iter(state["params"]))
    state["params"][name] = state["params"][name][..., :-1].clone()


def renamed(state: dict) -> None:
    name = next(iter(state["params"]))
    state["params"]["not." + name] = state["params"].pop(name)


def without_clock(state: dict) -> None:
    del state["clock"]


def misshapen_state(state: dict) -> None:
    states = state["optimizer"]["state"]
    first = next(iter(states.values()))
    first["exp_avg_sq"] = first["exp_avg_sq"].flatten()[:3].clone()


def groups_none(state: dict) -> None:
    state["optimizer"]["param_groups"] = None


def extra_text_group(state: dict) -> None:
    state["optimizer"]["param_groups"].append("params")


def state_text(state: dict) -> None:
    next(iter(state["optimizer"]["state"].values()))["exp_avg"] = "0.1"


def without_second_moment(state: dict) -> None:
    del next(iter(state["optimizer"]["state"].values()))["exp_avg_sq"]


GROUPS_NOT_GROUPS = "parameter groups are not a list of groups of parameter indices"


@pytest.mark.parametrize(
    "edit, reason",
    [
        (narrower, "is (2, 256, 63) torch.float32, the model's (2, 256, 64)"),
        (renamed, "its parameters are not the model's"),
        (without_clock, "it holds no clock"),
        (misshapen_state, "optimizer state exp_avg_sq of parameter 0 is not shaped like it"),
        # the optimizer's parts that a restore would trip over with a traceback
        (groups_none, GROUPS_NOT_GROUPS),
        (extra_text_group, GROUPS_NOT_GROUPS),
        (state_text, "optimizer state exp_avg of parameter 0 is a str"),
        (without_second_moment, "optimizer state of parameter 0 holds no exp_avg_sq"),
    ],
)
def test_a_checkpoint_that_does_not_fit_falls_back_to_the_one_before(
    finished, corpus_dir, tmp_path, caplog, edit, reason
):
    original, reference = finished
    out = tmp_path / "run"
    shutil.copytree(original, out)
    newest = ckpt.latest_checkpoint(out).path
    state = torch.load(newest / "rank0.pt", weights_only=True)
    edit(state)
    forge(newest, "rank0.pt", saved_bytes(state))

    with caplog.at_level(logging.WARNING):
        resumed = trainer.train(tiny_config(out, corpus_dir, resume=True, **FLAGS))
    (warning,) = [r.getMessage() for r in caplog.records if "does not fit" in r.getMessage()]
    assert str(newest) in warning and reason in warning and "\n" not in warning
    assert newest.with_name(f"{newest.name}.damaged").is_dir()
    assert resumed["final_val_loss"] == reference["final_val_loss"]
    assert resumed["bytes_per_worker"] == reference["bytes_per_worker"]


@pytest.mark.filterwarnings("ignore::UserWarning")  # DCP: "no process group"
def test_sharded_tensors_must_all_be_there_with_their_global_shapes(tmp_path):
    """A sharded checkpoint's DCP metadata against the built run's DCP state dict."""
    import torch.distributed.checkpoint as dcp

    from mtdao.train.checkpoint.dcp_metadata import read_metadata
    from mtdao.train.checkpoint.fit import sharded_tensors_unfit

    saved = {"worker0": {"model": {"w": torch.zeros(4, 2), "b": torch.zeros(2)}}}
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(tmp_path, single_file_per_rank=True))
    metadata = read_metadata(tmp_path / ".metadata")

    def expected(**model):
        return {"worker0": {"model": model}}

    assert sharded_tensors_unfit(expected(w=torch.ones(4, 2), b=torch.ones(2)), metadata) is None
    reason = sharded_tensors_unfit(expected(w=torch.ones(4, 3)), metadata)
    assert reason == "its worker0.model.w has shape (4, 2), the model (4, 3)"
    reason = sharded_tensors_unfit(expected(w=torch.ones(4, 2), v=torch.ones(2)), metadata)
    assert reason == "it holds no worker0.model.v"
