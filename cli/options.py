"""Click options made from a settings model (mergekit_lite.settings), so a command's flags, their defaults, bounds,
choices and help are those of the model and nowhere else (the pattern of mergekit's options.py).

Types map as a user of click expects: a bool is a flag (`--x/--no-x` where the field is negatable), an int or a
float with bounds a range (the bounds shown in --help), a `tuple[str, ...]` a repeatable option, a `Literal` a
choice. The decorated command receives the model, built and checked, as one argument instead of one per setting.
"""

from __future__ import annotations

import functools
import types
import typing

import annotated_types
import click
from pydantic import ValidationError

from mergekit_lite.cli.types import Number
from mergekit_lite.errors import InputError
from mergekit_lite.settings import Settings, one_line


def settings_options(model: type[Settings], into: str = "settings"):
    """Add one click option per field of `model`; the command gets `into=model(...)` in their place."""

    def decorate(command):
        @functools.wraps(command)
        def with_settings(*args, **kwargs):
            values = {name: kwargs.pop(name) for name in model.model_fields}
            try:
                settings = model(**values)
            except ValidationError as error:
                raise InputError(one_line(error, lambda name: flag_names(name, model.model_fields[name])[0])) from None
            return command(*args, **kwargs, **{into: settings})

        for name in reversed(list(model.model_fields)):
            with_settings = _option(name, model.model_fields[name])(with_settings)
        return with_settings

    return decorate


def flag_names(name: str, field) -> list[str]:
    """The command line's names of a field: its declared flags, else --field-name."""
    extra = field.json_schema_extra or {}
    return list(extra.get("flags") or [f"--{name.replace('_', '-')}"])


PATHS = {
    "file": {"dir_okay": False},
    "folder": {"file_okay": False},
    "existing": {"exists": True},
    "existing-file": {"exists": True, "dir_okay": False},
    "existing-folder": {"exists": True, "file_okay": False},
}


def _option(name: str, field):
    extra = field.json_schema_extra or {}
    names = flag_names(name, field)
    kind = _unless_none(field.annotation)
    keywords = {"help": field.description, "default": field.default}
    if extra.get("metavar"):
        keywords["metavar"] = extra["metavar"]
    if extra.get("path"):
        return click.option(*names, name, type=click.Path(**PATHS[extra["path"]]), **keywords)
    if kind is bool:
        if extra.get("negatable"):
            names = [f"{names[0]}/--no-{names[0].removeprefix('--')}", *names[1:]]
        else:
            keywords["is_flag"] = True
        return click.option(*names, name, **keywords)
    if typing.get_origin(kind) is tuple:
        item = typing.get_args(kind)[0]
        return click.option(*names, name, multiple=True, type=None if item is str else item, **keywords)
    if typing.get_origin(kind) is typing.Literal:
        choice = click.Choice(typing.get_args(kind))
        return click.option(*names, name, type=choice, show_default=field.default is not None, **keywords)
    keywords["type"] = _number_type(kind, field.metadata)
    keywords["show_default"] = field.default is not None
    return click.option(*names, name, **keywords)


def _unless_none(kind):
    """X for `X | None` (an option left out is None), else the type as it is."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        given = [arg for arg in typing.get_args(kind) if arg is not type(None)]
        return given[0] if len(given) == 1 else kind
    return kind


def _number_type(kind, metadata):
    """A range for a bounded int or float (click prints its bounds in --help); the plain type otherwise."""
    low = next((bound.ge for bound in metadata if isinstance(bound, annotated_types.Ge)), None)
    above = next((bound.gt for bound in metadata if isinstance(bound, annotated_types.Gt)), None)
    high = next((bound.le for bound in metadata if isinstance(bound, annotated_types.Le)), None)
    if kind is int:
        return click.IntRange(min=low, max=high) if low is not None or high is not None else int
    if kind is float:
        return Number(min=low if above is None else above, max=high, min_open=above is not None)
    return None


def output_file(flag: str, metavar: str, help: str):
    """A file the command writes (`--heatmap` gives the argument `heatmap_out`): never a folder, checked for
    safety where it is written (io/outputs.py)."""
    return click.option(flag, f"{flag[2:]}_out", type=click.Path(dir_okay=False), metavar=metavar, help=help)


def json_flag(what: str):
    """--json: print `what` as JSON instead of the table."""
    return click.option("--json", "as_json", is_flag=True, help=f"Print JSON ({what}) instead of the table.")


QUIET = click.option("--quiet", "-q", is_flag=True, help="No loading bars or logs from the libraries on stderr.")
