"""The defaults card: its runs are the defaults a user gets, its corpora are made right, its gaps
follow the significance rule, and the whole command runs end to end on a tiny grid."""

from __future__ import annotations

import dataclasses
import gzip
import json

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
from mtdao.experiments.defaults_card.summary import summarize_card
from mtdao.train.config import TrainConfig, default_lr

DATA = {"builtin": "builtin", "vim": "/vim", "gnu-info": "/info"}
PER_RUN = {"method", "model", "steps", "sync_period", "data", "seed", "progress"}


def test_every_card_run_is_the_methods_defaults_but_for_the_cells_own_fields():
    runs = card_runs(FULL, DATA)
    defaults = TrainConfig().to_dict()
    entry_settings = {entry.name: set(entry.settings) for entry in ENTRIES}
    for name, config in runs:
        entry = next(e for e in entry_settings if f"-{e}-s" in name)
        changed = {k for k, v in config.to_dict().items() if v != defaults[k]}
        assert changed <= PER_RUN | entry_settings[entry], name
    names = [name for name, _ in runs]
    assert len(names) == len(set(names))
    # DDP does not depend on K: one run per corpus, length and seed
    ddp = [name for name in names if "-ddp-s" in name]
    assert len(ddp) == (3 * 3 + 1) * 3
    assert "builtin-300-ddp-cosine-s0" in names and "builtin-300-K32-ddp-cosine-s0" not in names
    assert "builtin-10000-K32-mtdao-s0" in names and "vim-10000-K32-mtdao-s0" not in names


def test_the_card_runs_every_cell_at_the_first_seed_first_current_entries_first():
    runs = card_runs(FULL, DATA)
    seeds = [config.seed for _, config in runs]
    first_other = seeds.index(1)
    assert set(seeds[:first_other]) == {0} and 0 not in seeds[first_other:]
    seed_0 = runs[:first_other]
    current_names = {f"-{entry}-s" for entry in CURRENT_ENTRIES}
    earlier = [i for i, (name, _) in enumerate(seed_0) if not any(e in name for e in current_names)]
    assert earlier == list(range(earlier[0], len(seed_0)))  # earlier defaults, candidates last
    current = seed_0[: earlier[0]]
    assert {config.steps for _, config in current} == {300, 1000, 3000, 10000}
    steps = [config.steps for _, config in current]
    tiers = [0 if n <= 1000 else 1 if n <= 3000 else 2 for n in steps]
    assert tiers == sorted(tiers)  # short runs first within an entry group


def test_the_former_schedule_is_run_for_mtdao_and_for_each_baseline_alike():
    runs = dict(card_runs(FULL, DATA))
    for entry in ("mtdao", "ddp", "local-adam"):
        period = "" if entry == "ddp" else "-K128"
        current = runs[f"vim-1000{period}-{entry}-s2"]
        assert current.schedule == "wsd" and current.warmup is None  # the defaults
        former = runs[f"vim-1000{period}-{entry}-cosine-s2"]
        assert former == dataclasses.replace(current, schedule="cosine", warmup=0.05)
        fraction = runs[f"vim-1000{period}-{entry}-lr-warmup-0.05-s2"]
        assert fraction == dataclasses.replace(current, warmup=0.05)


def test_a_missing_corpus_leaves_its_cells_out():
    runs = card_runs(FULL, {"builtin": "builtin"})
    assert runs and all(config.data == "builtin" for _, config in runs)


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
    lines = "\n".join(card_report_lines(summary, plotted=False))
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
    lines = "\n".join(card_report_lines(summary, plotted=False))
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
    config = json.loads((out / "runs" / "builtin-4-K2-mtdao-s0" / "config.json").read_text())
    assert config["lr"] == default_lr("mtdao", "adam")  # no LR chosen by the card
    assert "Worker shards: `--data-split shuffled` (the default)" in (out / "report.md").read_text()
    # the cards of before 2026-12-02 (contiguous shards) are other runs, collected by that flag
    assert main([*argv, "--data-split", "contiguous"]) == 2
    assert "(data_split: 'shuffled' -> 'contiguous')" in capsys.readouterr().err


def test_quick_needs_the_card(capsys):
    assert main(["compare", "--quick", "--steps", "2"]) == 2
    assert "--quick and --collect belong to --preset defaults-card" in capsys.readouterr().err
