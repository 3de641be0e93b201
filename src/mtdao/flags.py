"""Command-line flags generated from a config dataclass, and the one way back from flags to argv.

:func:`add_dataclass_arguments` gives every field a flag (``--sync-period`` for ``sync_period``);
the help text is the docstring written under the field, followed by its default. A field's
``metadata`` may name ``choices``, a switch spelling (``flag``: ``--no-bf16`` for a field that
defaults to True) and a mutually ``exclusive`` group. A switch that turns a default-on field off
says what the *flag* does in ``metadata["off"]`` ("Hide the progress bar."): the field's docstring
describes the field, which is the opposite of what its ``--no-`` flag does. :func:`argv_from_namespace` is the inverse of
any parser's options: the argv that parses back to the same namespace; :func:`dataclass_to_argv`
applies it to a config, so that whatever launches ``mtdao train`` in a subprocess reproduces a
config exactly.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
import types
import typing
from collections.abc import Callable
from typing import Any


def no_description(name: str) -> str | None:
    return None


def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring: the string literal right below its annotation in the class body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, following in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(following.value.value)
    return docs


def _value_type(annotation: Any) -> tuple[type, bool]:
    """(element type, is a tuple) of ``int``, ``float | None``, ``tuple[float, ...] | None``, ..."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        (annotation,) = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is tuple:
        return typing.get_args(annotation)[0], True
    return annotation, False


def flag_name(field: dataclasses.Field) -> str:
    return field.metadata.get("flag", "--" + field.name.replace("_", "-"))


def add_dataclass_arguments(
    parser: argparse.ArgumentParser,
    cls: type,
    describe_default: Callable[[str], str | None] = no_description,
) -> None:
    """One flag per field of ``cls``; ``describe_default(name)`` explains a default of None."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    groups: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        kind, is_tuple = _value_type(hints[field.name])
        exclusive = field.metadata.get("exclusive")
        if exclusive and exclusive not in groups:
            groups[exclusive] = parser.add_mutually_exclusive_group()
        target = groups[exclusive] if exclusive else parser
        help_text = docs.get(field.name, "").replace("%", "%%")
        options: dict[str, Any] = dict(dest=field.name, default=field.default)
        if kind is bool and field.default:
            options["action"] = "store_false"
            help_text = _off_help(cls, field)
        elif kind is bool:
            options["action"] = "store_true"
            help_text += " (default: off)"
        else:
            shown = field.default if field.default is not None else describe_default(field.name)
            if shown is not None:
                help_text += f" (default: {shown})"
            options.update(type=kind, choices=field.metadata.get("choices"))
            if is_tuple:
                options["nargs"] = "+"
        target.add_argument(flag_name(field), help=help_text, **options)


def _off_help(cls: type, field: dataclasses.Field) -> str:
    """The help of a switch that turns a default-on field off: its ``metadata["off"]``."""
    off = field.metadata.get("off")
    if not off:
        raise TypeError(
            f"{cls.__name__}.{field.name} defaults to True: its switch {flag_name(field)} turns it "
            'off, so give metadata["off"], a help text saying what the switch does'
        )
    return off.replace("%", "%%")  # no "(default: ...)": the flag itself is the non-default


def dataclass_from_args(cls: type, args: argparse.Namespace):
    """The ``cls`` instance that parsed flags describe (lists become tuples)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    return cls(**values)


def argv_from_namespace(parser: argparse.ArgumentParser, namespace: Any) -> list[str]:
    """The options that make ``parser`` parse back to ``namespace`` (values None are left out).

    Floats are written with ``repr``, which round-trips exactly. Positional arguments are not
    supported (no parser here has any).
    """
    argv: list[str] = []
    for action in parser._actions:
        if not action.option_strings or not hasattr(namespace, action.dest):
            continue
        value = getattr(namespace, action.dest)
        flag = max(action.option_strings, key=len)
        if action.nargs == 0:  # a switch: given when the value is the one it stores
            if action.const is not None and value == action.const:
                argv.append(flag)
        elif isinstance(value, (list, tuple)):
            if value:
                argv += [flag, *map(_text, value)]
        elif value is not None:
            argv += [flag, _text(value)]
    return argv


def dataclass_to_argv(config: Any, describe_default=no_description) -> list[str]:
    """Flags that rebuild ``config`` through :func:`add_dataclass_arguments`' parser."""
    parser = argparse.ArgumentParser(add_help=False)
    add_dataclass_arguments(parser, type(config), describe_default)
    return argv_from_namespace(parser, config)


def _text(value: Any) -> str:
    return repr(float(value)) if isinstance(value, float) else str(value)
