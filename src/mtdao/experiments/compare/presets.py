"""Named settings of ``mtdao compare`` (``--preset NAME``): a whole comparison in one flag.

A preset replaces the defaults of the flags it names; a flag given on the command line still
wins, so ``--preset paper-16m --steps 20`` is the preset at 20 steps. The flags a preset may set
start out unset (None) in the parser, which is how an explicit value is told from a default.
"""

from __future__ import annotations

import argparse
from typing import Any

# The paper's smallest setting: the 16m shape (d_model 256, 4 layers, 4 heads), 2048-token
# sequences, a byte vocabulary (about 3.3M parameters), ADOPT with its default beta2 0.9999, a WSD
# schedule, K = 32, 4 simulated workers. 1000 steps of 4 x 8 sequences are 65.5M tokens, about 20
# tokens per parameter. One seed at ADOPT's default LR: sized for a single accelerator.
COMPARE_PRESETS: dict[str, dict[str, Any]] = {
    "paper-16m": dict(
        methods=["ddp", "local-adam", "mtdao"],
        model="16m",
        optimizer="adopt",
        tokenizer="byte",
        schedule="wsd",
        workers=4,
        sync_period=32,
        steps=1000,
        batch_size=8,
        seq_len=2048,
        seeds=[0],
    ),
}
# Not a comparison of its own but a grid of them (mtdao.experiments.defaults_card): the run
# lengths, sync periods and corpora are the card's; --quick runs a subset in minutes.
GRID_PRESETS = {
    "defaults-card": "every method at its defaults, 300 .. 10000 steps, K = 32 and 128, "
    "three corpora, 3 seeds (--quick: 300 steps, K = 32, built-in corpus, 1 seed)"
}
PRESET_FLAGS = tuple(sorted({name for preset in COMPARE_PRESETS.values() for name in preset}))


def add_preset_argument(parser: argparse.ArgumentParser) -> None:
    """``--preset``; the defaults of the flags a preset sets move to ``parser``'s
    ``plain_defaults``, so that :func:`apply_preset` can tell a given flag from an unset one."""
    plain = {name: parser.get_default(name) for name in PRESET_FLAGS}
    parser.set_defaults(plain_defaults=plain, **{name: None for name in PRESET_FLAGS})
    parser.add_argument(
        "--preset",
        choices=sorted([*COMPARE_PRESETS, *GRID_PRESETS]),
        help="named settings (flags given as well override them); paper-16m: "
        + describe(COMPARE_PRESETS["paper-16m"])
        + "; defaults-card: "
        + GRID_PRESETS["defaults-card"],
    )
    parser.add_argument(
        "--quick", action="store_true", help="with --preset defaults-card: its quick subset"
    )
    parser.add_argument(
        "--collect",
        action="store_true",
        help="with --preset defaults-card: report on the runs finished in --out, train none",
    )
    parser.add_argument(
        "--reuse",
        metavar="CARD_DIR",
        help="with --preset defaults-card: the final losses of runs not in --out from this "
        "card's results.json (a committed report), as measured there; the report names them",
    )


def apply_preset(args: argparse.Namespace) -> argparse.Namespace:
    """Fill every unset preset flag of ``args`` (in place) from the preset, else its default."""
    preset = COMPARE_PRESETS.get(args.preset, {}) if args.preset else {}
    for name in PRESET_FLAGS:
        if getattr(args, name) is None:
            setattr(args, name, preset.get(name, args.plain_defaults[name]))
    return args


def describe(preset: dict[str, Any]) -> str:
    return ", ".join(
        f"--{name.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
        for name, v in preset.items()
    )
