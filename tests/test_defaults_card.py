"""The defaults card: its runs are the defaults a user gets, its corpora are made right, its gaps
follow the significance rule, and the whole command runs end to end on a tiny grid."""

from __future__ import annotations

import dataclasses
import gzip
import json
from types import SimpleNamespace

import pytest

from mtdao.cli import main
from mtdao.experiments.common.corpora import write_gnu_info_corpus
from mtdao.experiments.defaults_card import run as defaults_card
from mtdao.experiments.defaults_card.grid import (
    CURRENT_ENTRIES,
    ENTRIES,
    FULL,
    Grid,
    card_runs,
    run_name,
)
from mtdao.experiments.defaults_card.report import card_report_lines
from mtdao.experiments.defaults_card.steps_to_loss import steps_to_reach
from mtdao.experiments.defaults_card.summary import reuse_card, summarize_card
from mtdao.train.config import TrainConfig, default_lr

DATA = {"builtin": "builtin", "vim": "/vim", "gnu-info": "/info"}
PER_RUN = {"method", "model", "steps", "sync_period", "data", "seed", "progress"}


def test_every_card_run_is_the_methods_defaults_but_for_the_cells_own_fields():
    runs = card_runs(FULL, DATA)
    defaults = TrainConfig.of().to_dict()
    entry_settings = {entry.name: set(entry.settings) for entry in ENTRIES}
    for name, config in runs:
        entry = next(e for e in entry_settings if f"-{e}-s" in name)
        changed = {k for k, v in config.to_dict().items() if v != defaults[k]}
        assert changed <= PER_RUN | entry_settings[entry], name
    names = [name for name, _ in runs]
    assert len(names) == len(set(names))
    # DDP and MT-DAO at its own rounds do not depend on K: one run per corpus, length and seed
    # (2400 steps included)
    for entry in ("ddp", "mtdao"):
        assert len([name for name in names if f"-{entry}-s" in name]) == (3 * 4 + 1) * 3
    assert dict(runs)["vim-300-mtdao-s0"].sync.sync_period is None  # its default rounds
    assert dict(runs)["vim-300-K128-mtdao-float32-s0"].sync.sync_period == 128
    # the approach length (steps to DDP's loss) is run by the current entries only
    assert "vim-2400-mtdao-s2" in names and "vim-2400-K128-local-adam-s2" in names
    assert not any(name.startswith("vim-2400") and "cosine" in name for name in names)
    assert "builtin-300-ddp-cosine-s0" in names and "builtin-300-K32-ddp-cosine-s0" not in names
    assert "builtin-10000-mtdao-s0" in names and "vim-10000-mtdao-s0" not in names


def test_the_card_runs_every_cell_at_the_first_seed_first_current_entries_first():
    runs = card_runs(FULL, DATA)
    seeds = [config.training.seed for _, config in runs]
    first_other = seeds.index(1)
    assert set(seeds[:first_other]) == {0} and 0 not in seeds[first_other:]
    seed_0 = runs[:first_other]
    current_names = {f"-{entry}-s" for entry in CURRENT_ENTRIES}
    earlier = [i for i, (name, _) in enumerate(seed_0) if not any(e in name for e in current_names)]
    assert earlier == list(range(earlier[0], len(seed_0)))  # earlier defaults, candidates last
    current = seed_0[: earlier[0]]
    assert {config.training.steps for _, config in current} == {300, 1000, 2400, 3000, 10000}
    steps = [config.training.steps for _, config in current]
    tiers = [0 if n <= 1000 else 1 if n <= 3000 else 2 for n in steps]
    assert tiers == sorted(tiers)  # short runs first within an entry group


def test_the_former_schedule_is_run_for_mtdao_and_for_each_baseline_alike():
    runs = dict(card_runs(FULL, DATA))
    for entry in ("mtdao", "ddp", "local-adam"):
        period = "" if entry == "ddp" else "-K128"
        # MT-DAO's earlier schedules ran at the cell's K in float32, its default then
        current = runs[f"vim-1000{period}-{entry}{'-float32' if entry == 'mtdao' else ''}-s2"]
        assert (
            current.lr_schedule.schedule == "wsd" and current.lr_schedule.warmup is None
        )  # the defaults
        former = runs[f"vim-1000{period}-{entry}-cosine-s2"]
        assert former == current.replace(schedule="cosine", warmup=0.05)
        fraction = runs[f"vim-1000{period}-{entry}-lr-warmup-0.05-s2"]
        assert fraction == current.replace(warmup=0.05)


def test_a_missing_corpus_leaves_its_cells_out():
    runs = card_runs(FULL, {"builtin": "builtin"})
    assert runs and all(config.text.data == "builtin" for _, config in runs)


def test_the_gnu_info_corpus_is_whole_nodes_without_control_characters(tmp_path):
    source = tmp_path / "info"
    source.mkdir()
    nodes = ["\x1f\nFile: a.info, Node: Top\n" + "word " * 3000 for _ in range(10)]
    (source / "sed.info.gz").write_bytes(gzip.compress(("preamble" + "".join(nodes)).encode()))
    (source / "ed.info.gz").write_bytes(gzip.compress(b"\x1f\nTag Table:\nx\x7f1\n"))
    target = tmp_path / "corpus"
    count = write_gnu_info_corpus(target, source)
    files = sorted(target.iterdir())
    assert count == len(files) > 1 and all(f.name.startswith("sed-") for f in files)
    text = "".join(f.read_text() for f in files)
    assert "\x1f" not in text and "\x7f" not in text and text.count("Node: Top") == 10
    assert all(len(f.read_text()) > 15_000 * 0.9 for f in files[:-1])  # over CHUNK_CHARS each
    (target / files[0].name).write_text("kept")  # written once: an existing corpus is kept
    assert write_gnu_info_corpus(target, source) == count and files[0].read_text() == "kept"
    assert write_gnu_info_corpus(tmp_path / "none", tmp_path / "no-info") == 0


def _results(loss: float) -> dict:
    return {"final_val_loss": loss}


def test_the_gaps_follow_the_significance_rule():
    grid = Grid(("builtin",), (300,), (32,), (0, 1, 2), ("ddp", "local-adam", "mtdao"))
    losses = {
        "ddp": [1.00, 1.01, 1.02],
        "local-adam": [1.20, 1.21, 1.22],
        "mtdao": [1.01, 1.0, 1.03],
    }
    results = {
        run_name("builtin", 300, 32, entry, seed): _results(values[seed])
        for entry, values in losses.items()
        for seed in grid.seeds
    }
    summary = summarize_card(grid, {"builtin": "builtin"}, {}, results, {})
    gaps = summary["cells"][0]["gaps"]["mtdao"]
    assert gaps["local-adam"]["verdict"] == "better" and gaps["local-adam"]["lower_on"] == 3
    assert gaps["ddp"]["verdict"] == "tie"
    assert gaps["ddp"]["difference"] == pytest.approx(sum(losses["mtdao"]) / 3 - 1.01)
    one_seed = {k: v for k, v in results.items() if k.endswith("-s0")}
    summary = summarize_card(grid, {"builtin": "builtin"}, {}, one_seed, {})
    assert summary["cells"][0]["gaps"]["mtdao"]["ddp"]["verdict"] == "one seed"
    lines = "\n".join(card_report_lines(summary))
    assert "| builtin | 300 | 32 | 1.0000 | 1.2000 | 1.0100 |" in lines
    assert "+0.0100 (+1.0%) one seed, lower on 0/1" in lines


def test_a_short_run_is_held_to_the_longer_run_at_its_last_step():
    grid = Grid(("builtin",), (300, 3000), (32,), (0, 1), ("ddp", "mtdao"))
    evals = [{"step": 200, "val_loss": 2.2}, {"step": 400, "val_loss": 1.8}]  # 2.0 at 300
    results = {}
    for entry, short in (("ddp", 1.9), ("mtdao", 2.2)):
        for seed in (0, 1):
            results[run_name("builtin", 300, 32, entry, seed)] = _results(short)
            results[run_name("builtin", 3000, 32, entry, seed)] = {**_results(1.0), "evals": evals}
    del results[run_name("builtin", 3000, 32, "mtdao", 1)]  # seed 1 has no longer run
    (check,) = summarize_card(grid, {"builtin": "builtin"}, {}, results, {})["horizons"]
    assert (check["short"], check["long"]) == (300, 3000)
    assert check["entries"]["ddp"] == {"mean": pytest.approx(-0.05), "seeds": 2}
    assert check["entries"]["mtdao"] == {"mean": pytest.approx(0.10), "seeds": 1}
    summary = summarize_card(grid, {"builtin": "builtin"}, {}, results, {})
    lines = "\n".join(card_report_lines(summary))
    assert "| builtin | 32 | 300 / 3000 | -5.0% (2) | +10.0% (1) |" in lines


def test_a_card_run_in_part_plots_with_nothing_on_its_first_corpus(tmp_path):
    """Only the vim cells finished: the plot's legend comes from the panel that has lines."""
    from mtdao.experiments.defaults_card.report import plot_card

    grid = Grid(("builtin", "vim"), (3000,), (32,), (0, 1), ("ddp", "local-adam", "mtdao"))
    results = {
        run_name("vim", 3000, 32, entry, seed): _results(loss + 0.01 * seed)
        for entry, loss in (("ddp", 1.6), ("local-adam", 1.7), ("mtdao", 1.65))
        for seed in grid.seeds
    }
    data = {"builtin": "builtin", "vim": "vim-docs"}
    summary = summarize_card(grid, data, {}, results, {})
    assert plot_card(summary, tmp_path / "card.png") and (tmp_path / "card.png").is_file()


@pytest.mark.slow
def test_the_card_command_runs_end_to_end(tmp_path, corpus_dir, monkeypatch, capsys):
    tiny = Grid(("builtin",), (4,), (2,), (0,), ("ddp", "local-adam", "mtdao"))
    monkeypatch.setattr(defaults_card, "QUICK", tiny)
    monkeypatch.setattr(
        defaults_card, "corpus_paths", lambda names, cache: ({"builtin": str(corpus_dir)}, {})
    )
    out = tmp_path / "card"
    assert main(["compare", "--preset", "defaults-card", "--quick", "--out", str(out)]) == 0
    summary = json.loads((out / "results.json").read_text())
    assert summary["runs_finished"] == 3
    entries = summary["cells"][0]["entries"]
    assert all(entries[name]["stats"]["n"] == 1 for name in tiny.entries)
    assert (out / "card.png").exists() and "MT-DAO − Local Adam" in (out / "report.md").read_text()
    (out / "report.md").unlink()
    (out / "runs" / "builtin-4-ddp-s0" / "results.json").unlink()
    argv = ["compare", "--preset", "defaults-card", "--quick", "--collect", "--out", str(out)]
    assert main(argv) == 0  # a report on what finished; nothing trained
    assert not (out / "runs" / "builtin-4-ddp-s0" / "results.json").exists()
    assert json.loads((out / "results.json").read_text())["runs_finished"] == 2
    config = json.loads((out / "runs" / "builtin-4-mtdao-s0" / "config.json").read_text())
    assert config["lr"] == default_lr("mtdao", "adam")  # no LR chosen by the card
    assert "Worker shards: `--data-split shuffled` (the default)" in (out / "report.md").read_text()
    # the cards of before 2026-12-02 (contiguous shards) are other runs, collected by that flag
    assert main([*argv, "--data-split", "contiguous"]) == 2
    assert "(data_split: 'shuffled' -> 'contiguous')" in capsys.readouterr().err


def test_quick_needs_the_card(capsys):
    assert main(["compare", "--quick", "--steps", "2"]) == 2
    assert "--quick, --collect and --reuse belong to --preset defaults-card" in (
        capsys.readouterr().err
    )


def test_steps_to_a_loss_interpolate_between_the_lengths_around_the_first_that_reaches_it():
    assert steps_to_reach({1000: 1.2, 2400: 1.1, 3000: 1.05}, 1.06) == pytest.approx(2880)
    assert steps_to_reach({1000: 1.2, 3000: 1.07}, 1.06) is None  # never reached
    assert steps_to_reach({1000: 1.0, 3000: 0.9}, 1.06) == 1000  # the shortest: a bound
    assert steps_to_reach({1000: float("nan"), 3000: 1.0}, 1.06) == 3000  # after a divergence
    assert steps_to_reach({1000: 1.2, 2400: None, 3000: 1.0}, 1.1) == pytest.approx(2000)


def test_the_card_times_each_current_entry_to_ddps_loss_per_seed():
    grid = dataclasses.replace(
        FULL,
        corpora=("builtin",),
        steps=(1000, 3000),
        sync_periods=(32,),
        seeds=(0, 1),
        long_steps=(),
    )
    finals = {  # (steps, entry, seed) -> final loss; DDP's mean at 3000 is 1.05
        (1000, "ddp", 0): 1.2,
        (3000, "ddp", 0): 1.04,
        (1000, "ddp", 1): 1.2,
        (3000, "ddp", 1): 1.06,
        (1000, "mtdao", 0): 1.25,
        (2400, "mtdao", 0): 1.1,
        (3000, "mtdao", 0): 1.0,
        (1000, "mtdao", 1): 1.25,
        (2400, "mtdao", 1): 1.1,
        (3000, "local-adam", 0): 1.2,
        (3000, "local-adam", 1): 1.2,
    }
    results = {
        run_name("builtin", n, 32, entry, seed): {"final_val_loss": loss}
        for (n, entry, seed), loss in finals.items()
    }
    summary = summarize_card(grid, {"builtin": "builtin"}, {}, results, {})
    (timed,) = summary["steps_to_ddp"]
    assert timed["target"] == pytest.approx(1.05)
    mtdao = timed["entries"]["mtdao"]
    # seed 0 reaches 1.05 halfway from 2400 to 3000; seed 1's 3000-step run has not finished
    assert mtdao["by_seed"] == {"0": pytest.approx(2700)} and mtdao["reached"] == 1
    assert mtdao["fraction"] == pytest.approx(0.9)
    assert timed["entries"]["local-adam"]["reached"] == 0
    assert timed["entries"]["local-adam"]["seeds"] == 2
    lines = "\n".join(card_report_lines(summary))
    assert "## Steps to DDP's loss" in lines
    assert "2700 ± 0 (0.90x; 1/1 seeds)" in lines and "not by 3000 (0/2 seeds)" in lines


def test_a_reused_card_fills_the_runs_this_one_lacks_and_says_so():
    grid = dataclasses.replace(
        FULL, corpora=("builtin",), steps=(3000,), sync_periods=(32,), seeds=(0,), long_steps=()
    )
    earlier = summarize_card(
        grid,
        {"builtin": "builtin"},
        {},
        {run_name("builtin", 3000, 32, e, 0): {"final_val_loss": 1.1} for e in CURRENT_ENTRIES},
        {},
    )
    fresh = {run_name("builtin", 2400, 32, "mtdao", 0): {"final_val_loss": 1.2}}
    suite = SimpleNamespace(results=fresh, failures={})
    plain = summarize_card(grid, {"builtin": "builtin"}, {}, fresh, {})
    merged = reuse_card(plain, earlier, grid, {"builtin": "builtin"}, suite, "shuffled", "old")
    reused = merged["reused"]
    assert reused["from"] == "old" and len(reused["runs"]) == len(CURRENT_ENTRIES)
    assert run_name("builtin", 2400, 32, "mtdao", 0) not in reused["runs"]  # trained here
    (reference,) = [c for c in merged["cells"] if c["steps"] == 3000]
    assert reference["entries"]["mtdao"]["by_seed"]["0"] == 1.1
    assert merged["runs_finished"] == 1
    assert "more runs are those recorded in `old`" in "\n".join(card_report_lines(merged))
