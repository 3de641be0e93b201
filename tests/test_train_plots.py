"""``loss.png`` of one run: curves read from hand-written run directories, sync rounds marked,
bytes sent, a reference run beside it."""

from __future__ import annotations

import json

import pytest

from mtdao.train.plots import MAX_MARKED_ROUNDS, figure, plot_run, pyplot, run_curves

TOKENS_PER_STEP = 256


def write_run(run_dir, steps, events, *, finished=True, every=2):
    """A run directory as the trainer leaves it: metrics.jsonl (train lines every ``every`` steps,
    an evaluation at the end) and, when finished, results.json with the communication events."""
    run_dir.mkdir(parents=True)
    lines = []
    for step in range(every, steps + 1, every):
        sent = sum(b for s, b in events if s <= step)
        tokens = step * TOKENS_PER_STEP
        lines.append(
            {"step": step, "tokens": tokens, "train_loss": 5.0 / step, "bytes_per_worker": sent}
        )
    lines.append({"step": steps, "tokens": steps * TOKENS_PER_STEP, "val_loss": 2.0})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    if finished:
        results = {"steps": steps, "tokens": steps * TOKENS_PER_STEP, "comm_events": events}
        (run_dir / "results.json").write_text(json.dumps(results))
    return run_dir


def test_rounds_and_bytes_come_from_the_comm_events(tmp_path):
    run = write_run(tmp_path / "mtdao", 10, [[4, 300], [8, 300]])
    curves = run_curves(run)
    assert curves.name == "mtdao"
    assert curves.rounds == [4 * 256, 8 * 256]
    assert not curves.every_step
    # a staircase from 0 to the total, held to the end of the run
    assert curves.sent == [(0, 0), (1024, 300), (2048, 600), (2560, 600)]
    assert curves.val == [(2560, 2.0)] and len(curves.train) == 5


def test_gradient_averaging_every_step_is_not_marked_round_by_round(tmp_path):
    run = write_run(tmp_path / "ddp", 6, [[s, 100] for s in range(1, 7)])
    curves = run_curves(run)
    assert curves.every_step and curves.rounds == []
    assert curves.sent[-1] == (6 * 256, 600)


def test_an_unfinished_run_plots_the_logged_bytes_without_rounds(tmp_path):
    run = write_run(tmp_path / "partial", 8, [[4, 300], [8, 300]], finished=False)
    curves = run_curves(run)
    assert curves.rounds == [] and not curves.every_step
    assert curves.sent == [(512, 0), (1024, 300), (1536, 300), (2048, 600)]


def test_comm_events_as_records_are_read_too(tmp_path):
    run = write_run(tmp_path / "records", 4, [[2, 10]])
    results = json.loads((run / "results.json").read_text())
    results["comm_events"] = [{"step": 2, "kinds": ["params"], "bytes": 10}]
    (run / "results.json").write_text(json.dumps(results))
    curves = run_curves(run)
    assert curves.rounds == [512] and curves.sent[-1] == (1024, 10)


def test_figure_marks_each_round_on_both_panels_and_draws_the_reference(tmp_path):
    run = run_curves(write_run(tmp_path / "mtdao", 10, [[4, 300], [8, 300]]))
    ddp = run_curves(write_run(tmp_path / "ddp", 10, [[s, 100] for s in range(1, 11)]))
    fig = figure(run, ddp)
    loss_ax, sent_ax = fig.axes
    for ax in (loss_ax, sent_ax):
        verticals = [
            line for line in ax.lines if list(line.get_xdata()) in ([1024, 1024], [2048, 2048])
        ]
        assert len(verticals) == 2
    labels = [line.get_label() for line in sent_ax.lines]
    assert labels[:2] == ["ddp, reference (averages every step)", "mtdao"]
    assert "sync rounds (2)" in [t.get_text() for t in loss_ax.get_legend().get_texts()]
    assert loss_ax.get_title() == "mtdao\nvs ddp"
    pyplot().close(fig)


def test_the_title_says_method_workers_and_sync_period(tmp_path):
    run = write_run(tmp_path / "x", 10, [[4, 300], [8, 300]])
    config = {"method": "mtdao", "optimizer": "adam", "workers": 4, "shards": 1, "sync_period": 32}
    (run / "config.json").write_text(json.dumps(config))
    ddp = write_run(tmp_path / "y", 10, [[s, 100] for s in range(1, 11)])
    (ddp / "config.json").write_text(json.dumps({**config, "method": "ddp", "shards": 2}))
    fig = figure(run_curves(run), run_curves(ddp))
    title = fig.axes[0].get_title()
    assert title == "x: mtdao (adam), 4 workers, K = 32\nvs y: ddp (adam), 4 workers x 2 shards"
    # bytes in the one decimal unit of every summary
    fig.canvas.draw()
    ticks = [t.get_text() for t in fig.axes[1].get_yticklabels() if t.get_text()]
    assert ticks and all(t.endswith(("B", "kB")) and "KiB" not in t for t in ticks), ticks
    pyplot().close(fig)


def test_too_many_rounds_are_counted_not_drawn(tmp_path):
    steps = 2 * (MAX_MARKED_ROUNDS + 1)
    events = [[s, 1] for s in range(2, steps + 1, 2)]
    fig = figure(run_curves(write_run(tmp_path / "long", steps, events, every=steps)))
    loss_ax, sent_ax = fig.axes
    assert len(sent_ax.lines) == 1  # the bytes alone
    legend = [t.get_text() for t in loss_ax.get_legend().get_texts()]
    assert f"{MAX_MARKED_ROUNDS + 1} sync rounds" in legend
    pyplot().close(fig)


def test_plot_run_writes_loss_png_beside_a_reference(tmp_path):
    run = write_run(tmp_path / "mtdao", 10, [[4, 300], [8, 300]])
    ddp = write_run(tmp_path / "ddp", 10, [[s, 100] for s in range(1, 11)])
    path = plot_run(run, reference=ddp)
    assert path == run / "loss.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (ddp / "loss.png").exists()


def test_a_reference_that_is_no_run_is_named(tmp_path):
    run = write_run(tmp_path / "mtdao", 10, [[4, 300]])
    with pytest.raises(FileNotFoundError, match="nowhere holds no metrics.jsonl"):
        plot_run(run, reference=tmp_path / "nowhere")


def test_mtdao_plot_draws_a_run_beside_a_reference_from_the_command_line(tmp_path, capsys):
    from mtdao.cli import main

    run = write_run(tmp_path / "mtdao", 10, [[4, 300], [8, 300]])
    ddp = write_run(tmp_path / "ddp", 10, [[s, 100] for s in range(1, 11)])
    assert main(["plot", str(run), "--reference", str(ddp)]) == 0
    assert capsys.readouterr().out.strip() == str(run / "loss.png")
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    assert main(["plot", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "nowhere holds no metrics.jsonl" in err and len(err.strip().splitlines()) == 1
