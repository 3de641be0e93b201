"""What a newcomer reads first: every help line says what its flag does, `mtdao --help` starts
without torch, the examples in each --help are cheap where they say so, and every wait says why."""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time

import pytest

from mtdao.cli import COMMANDS, build_parser
from mtdao.flags import add_dataclass_arguments

# How the help of a switch that turns something off begins
NEGATIVE_OPENINGS = ("Do not ", "Hide ", "Skip ", "Train nothing", "train nothing")


def every_parser(parser: argparse.ArgumentParser, prog: str = "mtdao"):
    """(prog, parser) of the parser and each of its subcommands, recursively."""
    yield prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from every_parser(sub, f"{prog} {name}")


def switches(parser: argparse.ArgumentParser):
    return [a for a in parser._actions if a.option_strings and a.nargs == 0 and a.dest != "help"]


def test_every_negative_switch_says_what_it_turns_off():
    negative = []
    for prog, parser in every_parser(build_parser()):
        for action in switches(parser):
            flag = max(action.option_strings, key=len)
            if flag.startswith("--no-") or isinstance(action, argparse._StoreFalseAction):
                negative.append(flag)
                assert action.help.startswith(NEGATIVE_OPENINGS), (prog, flag, action.help)
                assert "(default: on)" not in action.help, (prog, flag, action.help)
    assert {"--no-bf16", "--no-alignment", "--no-progress", "--no-train"} <= set(negative)


@dataclasses.dataclass
class Settings:
    progress: bool = dataclasses.field(default=True, metadata={"flag": "--no-progress"})
    """Show a progress bar."""


@dataclasses.dataclass
class SettingsConfig:  # a config is in sections
    job: Settings = dataclasses.field(default_factory=Settings)


def test_a_default_on_field_needs_the_help_of_its_switch():
    with pytest.raises(TypeError, match=r"Settings.progress defaults to True.*metadata\["):
        add_dataclass_arguments(argparse.ArgumentParser(), SettingsConfig)


def test_the_command_list_matches_each_command():
    """`mtdao --help` shows each command's line from cli.COMMANDS without importing it: the line
    is the one the command itself registers."""
    full = build_parser()
    (subcommands,) = [a for a in full._actions if isinstance(a, argparse._SubParsersAction)]
    shown = {choice.dest: choice.help for choice in subcommands._choices_actions}
    assert shown == {name: summary for name, (_, summary) in COMMANDS.items()}


def test_top_level_help_does_not_import_torch():
    code = (
        "import sys\nfrom mtdao.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "import mtdao\nassert mtdao.MTAdam.__name__ == 'MTAdam'  # still there, on first use\n"
    )
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "train" in done.stdout and "wan-drill" in done.stdout
    assert time.perf_counter() - started < 60


def test_short_runs_do_not_evaluate_every_step():
    from mtdao.experiments.common.study_flags import base_config
    from mtdao.experiments.common.suite import evaluations
    from mtdao.experiments.compare.presets import apply_preset

    def parsed(*flags):
        return apply_preset(build_parser("compare").parse_args(["compare", *flags]))

    config = base_config(parsed("--steps", "40"), 0)
    assert config.job.eval_every == 10 and evaluations(config) == 4
    long = base_config(parsed("--steps", "3000"), 0)
    assert long.job.eval_every == 100  # about 30 evaluations per run, as before


def test_a_suite_says_what_is_coming():
    from mtdao.experiments.common.suite import workload
    from mtdao.train.config import TrainConfig

    line = workload([TrainConfig.of(steps=40, eval_every=10, eval_tokens=4096)] * 3)
    assert line.startswith("to train: 3 run(s), 120 steps in all, 12 evaluations (4,096 held-out ")
    assert "a rerun of this command skips the runs that finished" in line


def test_the_first_kernel_build_says_so(tmp_path, monkeypatch, capsys):
    from torch.utils import cpp_extension

    from mtdao import native_build

    monkeypatch.setattr(cpp_extension, "load_inline", lambda **_: None)
    native_build._build("name", "source", [], tmp_path)
    err = capsys.readouterr().err
    assert err.startswith("mtdao: building the C++ optimizer kernel once for this machine (about ")
    assert str(tmp_path) in err


def test_an_unreachable_hub_turns_offline_mode_on(monkeypatch, capsys):
    from mtdao.data import sources

    for name in sources.OFFLINE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sources, "hub_reachable", lambda: False)
    sources.go_offline_if_the_hub_is_unreachable("hf:x")
    assert all(os.environ[name] == "1" for name in sources.OFFLINE_VARIABLES)
    assert "hf:x: the Hugging Face hub is unreachable; reading the local cache only" in (
        capsys.readouterr().err
    )


def test_a_users_offline_setting_is_not_probed(monkeypatch, capsys):
    from mtdao.data import sources

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(sources, "hub_reachable", lambda: pytest.fail("probed"))
    sources.go_offline_if_the_hub_is_unreachable("hf:x")
    assert capsys.readouterr().err == ""


def test_hub_probe_on_loopback(monkeypatch):
    import socket

    from mtdao.data.sources import hub_reachable
    from mtdao.testing.ports import unused_port

    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{unused_port()}")
    assert not hub_reachable(timeout=1.0)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
        assert hub_reachable(timeout=5.0)


def test_no_help_shows_markup():
    """Docstrings feed some help texts: none may show RST markup (``x``, :mod:) on a terminal."""
    for prog, parser in every_parser(build_parser()):
        text = parser.format_help()
        for markup in ("``", ":mod:", ":func:", ":class:"):
            assert markup not in text, (prog, markup)


@pytest.mark.parametrize("load, omp, expected", [(5.0, None, 1), (0.1, None, 2), (5.0, "2", 2)])
def test_a_busy_machine_trains_with_one_thread(monkeypatch, load, omp, expected):
    import torch

    from mtdao.train import threads

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.setattr(threads.os, "getloadavg", lambda: (load, load, load))
        monkeypatch.setattr(threads, "available_cores", lambda: 2)
        if omp is None:
            monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        else:
            monkeypatch.setenv("OMP_NUM_THREADS", omp)
        note = threads.one_thread_if_busy()
        assert torch.get_num_threads() == expected
        assert (note is not None) == (expected == 1)
        if note:
            assert note.startswith("the machine is busy (load 5.0 on 2 cores): training with 1 ")
    finally:
        torch.set_num_threads(before)


def test_a_suite_says_its_data_line_once(monkeypatch, tmp_path):
    """The runs of a suite share their data: the `data:` line is said for the first only."""
    from types import SimpleNamespace

    from mtdao.experiments.common import suite
    from mtdao.train import setup, trainer
    from mtdao.train.config import TrainConfig

    monkeypatch.setattr(setup, "build_run", lambda c, p: SimpleNamespace(data_summary="data: x"))
    shown = []

    def fake_train(config, *, build):
        shown.append(build(config, None).data_summary)
        return {}

    monkeypatch.setattr(trainer, "train", fake_train)
    said: set[str] = set()
    for name in ("a", "b", "c"):
        suite._train_in_process(name, TrainConfig.of(steps=2), tmp_path, lambda *_: None, said)
    assert shown == ["data: x", "", ""]


def test_the_progress_bar_counts_bytes_as_the_summary_does():
    """One unit convention: the progress bar's sent= is format_bytes (decimal MB), as in every
    summary and report."""
    from types import SimpleNamespace

    from mtdao.train.trainer import log_training
    from mtdao.units import format_bytes

    sent = 371_500_000
    run = SimpleNamespace(
        sync=SimpleNamespace(traffic=SimpleNamespace(bytes=sent)),
        step=10,
        config=SimpleNamespace(tokens_per_step=4096),
        optimizer=SimpleNamespace(param_groups=[{"lr": 1e-3}]),
        clock=SimpleNamespace(train_s=1.0, wall_s=lambda: 2.0),
    )
    postfix = {}
    progress = SimpleNamespace(set_postfix=lambda **values: postfix.update(values))
    log_training(run, SimpleNamespace(write=lambda record: None), progress, 1.5, 100.0)
    assert postfix["sent"] == format_bytes(sent) == "371.5 MB"


@pytest.mark.parametrize(
    "argv, expected",
    [
        (
            ["train", "--stepz", "3"],
            "mtdao train: error: unrecognized arguments: --stepz 3; did you mean --steps? "
            "(see mtdao train --help)",
        ),
        (
            ["lighthouse", "--prot=1"],
            "mtdao lighthouse: error: unrecognized arguments: --prot=1; did you mean --port? "
            "(see mtdao lighthouse --help)",
        ),
        (
            ["toy", "rosenbrock", "--sed", "1", "--bogus"],
            "mtdao toy rosenbrock: error: unrecognized arguments: --sed 1 --bogus; --sed: did you "
            "mean --seed or --seeds? (see mtdao toy rosenbrock --help)",
        ),
    ],
)
def test_a_mistyped_flag_names_the_command_and_the_closest_flags(capsys, argv, expected):
    from mtdao.cli import main

    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    assert capsys.readouterr().err == expected + "\n"


@pytest.mark.parametrize(
    "argv, hint",
    [
        (["trian"], "; did you mean train? (see mtdao --help)"),
        (["train", "--method", "mtdoa"], "; did you mean mtdao? (see mtdao train --help)"),
        (["xyz"], "'wan-drill') (see mtdao --help)"),  # nothing close: no guess
    ],
)
def test_a_mistyped_command_or_choice_is_given_the_closest(capsys, argv, hint):
    from mtdao.cli import main

    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    said = capsys.readouterr().err
    assert said.count("\n") == 1 and said.endswith(hint + "\n"), said


def test_every_help_states_its_default_once_and_never_as_none():
    """A default a help text states itself is not followed by the formatter's, and a flag
    without one (None, a switch, empty) shows no "(default: None)"."""
    for prog, parser in every_parser(build_parser()):
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.option_strings or action.help in (None, argparse.SUPPRESS):
                continue
            text = " ".join(formatter._expand_help(action).split())
            assert text.count("(default") <= 1, (prog, action.option_strings, text)
            for nothing in ("None", "False", "True", "[]", ""):
                assert f"(default: {nothing})" not in text, (prog, action.option_strings, text)
            assert "default since" not in text and "there the default" not in text, (prog, text)
