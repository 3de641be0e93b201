"""Command-line flags generated from a config dataclass in sections, and the one way back.

Every setting gets a flag (``--sync-period`` for ``sync_period``) under its section's title; its
help is the docstring under the field. ``metadata`` may name ``choices``, a switch spelling
(``flag``) with the switch's own help (``off``: the field's docstring says the opposite), and a
mutually ``exclusive`` group. :func:`dataclass_to_argv` is the inverse, so that whatever launches
``mtdao train`` in a subprocess reproduces a config exactly."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import re
import textwrap
import types
import typing
from collections.abc import Callable
from typing import Any


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's help followed by its default, once: not where the help says its default
    itself, nor for a switch or a flag whose default is nothing (None, empty)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text, default = action.help or "", action.default
        nothing = default is None or default is argparse.SUPPRESS or isinstance(default, bool)
        if "(default" in text or nothing or default in ("", [], ()):
            return text
        shown = " ".join(map(str, default)) if isinstance(default, list | tuple) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


def flag(name: str) -> str:
    """A field's flag, without its dashes (``sync-period`` for ``sync_period``)."""
    return name.replace("_", "-")


def as_flags(message: str) -> str:
    """A library message, which names each setting as its field (`sync_period`), spelled with the
    flags instead (--sync-period): what ``mtdao train`` shows."""
    return re.sub(r"`([a-z][a-z0-9_]*)`", lambda found: f"--{flag(found.group(1))}", message)


def no_description(name: str) -> str | None:
    return None


def choice(default: str, choices: tuple[str, ...], **metadata: Any) -> Any:
    """A field whose flag takes one of ``choices``."""
    return dataclasses.field(default=default, metadata={"choices": choices, **metadata})


def switch_off(flag: str, off: str, **metadata: Any) -> Any:
    """A field that defaults to True, turned off by ``flag``, whose help says ``off``."""
    return dataclasses.field(default=True, metadata={"flag": flag, "off": off, **metadata})


def sections(cls: type) -> list[tuple[str, type]]:
    """(name, class) of each section of a config in sections: its fields, each a dataclass."""
    hints = _type_hints(cls)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(cls)]


def leaf_fields(cls: type) -> list[tuple[type, dataclasses.Field]]:
    """(the section class that declares it, field) for every setting of ``cls``, in the
    sections' order: one flag each."""
    return [(part, f) for _, part in sections(cls) for f in dataclasses.fields(part)]


def flat_values(config: Any) -> dict[str, Any]:
    """Every setting of ``config`` by its field name, across its sections."""
    parts = [getattr(config, name) for name, _ in sections(type(config))]
    return {f.name: getattr(part, f.name) for part in parts for f in dataclasses.fields(part)}


def from_flat(cls: type, values: dict[str, Any]):
    """The ``cls`` holding ``values`` (setting name -> value; the others keep their defaults);
    a TypeError names a setting ``cls`` does not have."""
    parts = sections(cls)
    owner = {f.name: name for name, part in parts for f in dataclasses.fields(part)}
    unknown = sorted(set(values) - set(owner))
    if unknown:
        raise TypeError(f"{cls.__name__} has no setting(s) {unknown}")
    grouped: dict[str, dict[str, Any]] = {name: {} for name, _ in parts}
    for name, value in values.items():
        grouped[owner[name]][name] = value
    return cls(**{name: part(**grouped[name]) for name, part in parts})


@functools.cache  # a parser is built per config written out as flags: parse each source once
def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring: the string literal right below its annotation in the class body
    (shared between callers: read it, do not change it)."""
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


@functools.cache  # as field_docs: once per section
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


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
    """One flag per setting of ``cls`` (a section's settings under its title in ``--help``);
    ``describe_default(name)`` explains a default of None."""
    groups: dict[Any, Any] = {}
    docs: dict[type, dict[str, str]] = {}
    hints: dict[type, dict[str, Any]] = {}
    for owner, field in leaf_fields(cls):
        if owner not in groups:
            groups[owner] = parser.add_argument_group(_title(owner))
            docs[owner], hints[owner] = field_docs(owner), _type_hints(owner)
        kind, is_tuple = _value_type(hints[owner][field.name])
        exclusive = field.metadata.get("exclusive")
        if exclusive and exclusive not in groups:
            groups[exclusive] = groups[owner].add_mutually_exclusive_group()
        target = groups[exclusive] if exclusive else groups[owner]
        help_text = docs[owner].get(field.name, "").replace("%", "%%")
        options: dict[str, Any] = dict(dest=field.name, default=field.default)
        if kind is bool and field.default:
            options["action"] = "store_false"
            help_text = _off_help(owner, field)
        elif kind is bool:
            options["action"] = "store_true"
            help_text += " (default: off)"
        else:
            shown = describe_default(field.name)  # where the value alone would mislead
            shown = field.default if shown is None else shown
            if shown is not None:
                help_text += f" (default: {shown})"
            options.update(type=kind, choices=field.metadata.get("choices"))
            if is_tuple:
                options["nargs"] = "+"
        target.add_argument(flag_name(field), help=help_text, **options)


def _title(section: type) -> str:
    """A section's title in ``--help``: the first line of its docstring."""
    return inspect.cleandoc(section.__doc__ or section.__name__).splitlines()[0].rstrip(".")


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
    values = {f.name: getattr(args, f.name) for _, f in leaf_fields(cls)}
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    return from_flat(cls, values)


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
    return argv_from_namespace(parser, argparse.Namespace(**flat_values(config)))


def _text(value: Any) -> str:
    return repr(float(value)) if isinstance(value, float) else str(value)
