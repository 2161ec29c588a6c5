"""Click options made from a settings model (mergekit_lite.settings), so a command's flags, their defaults, bounds,
choices and help are those of the model and nowhere else (the pattern of mergekit's options.py).

Types map as a user of click expects: a bool is a flag (`--x/--no-x` where the field is negatable), an int or a
float with bounds a range (the bounds shown in --help), a `tuple[str, ...]` (or a field marked repeatable) a
repeatable option, a `Literal` a choice. The decorated command receives the model, built and checked, as one
argument instead of one per setting; or, for a command whose settings may also come from a file (`sweep`), only
the values given on the command line, which win over the file's.
"""

from __future__ import annotations

import functools
import types
import typing

import annotated_types
import click
from pydantic import BaseModel

from mergekit_lite.cli.types import Number, flag_name
from mergekit_lite.settings import Settings

PATHS = {
    "file": {"dir_okay": False},
    "folder": {"file_okay": False},
    "existing": {"exists": True},
    "existing-file": {"exists": True, "dir_okay": False},
    "existing-folder": {"exists": True, "file_okay": False},
}


def settings_options(model: type[Settings], into: str = "settings"):
    """Add one click option per field of `model`; the command gets `into=model(...)` in their place."""

    def build(values: dict) -> Settings:
        return model.checked(values, lambda name: flag_names(name, model.model_fields[name])[0])

    return _options(model, into, build, model_defaults=True)


def given_options(model: type[BaseModel], into: str = "given"):
    """Add one click option per command-line field of `model`, each None unless given; the command gets
    `into={field: value}` of those given (checked by the model's types where the settings are resolved)."""
    return _options(model, into, lambda values: {k: v for k, v in values.items() if v not in (None, ())}, False)


def command_line_fields(model: type[BaseModel]) -> list[str]:
    return [name for name, field in model.model_fields.items() if _extra(field).get("command_line", True)]


def flag_names(name: str, field) -> list[str]:
    """The command line's names of a field: its declared flags, else --field-name."""
    return list(_extra(field).get("flags") or [flag_name(name)])


def _options(model, into: str, build, model_defaults: bool):
    names = command_line_fields(model)

    def decorate(command):
        @functools.wraps(command)
        def with_settings(*args, **kwargs):
            values = {name: kwargs.pop(name) for name in names}
            return command(*args, **kwargs, **{into: build(values)})

        for name in reversed(names):
            with_settings = _option(name, model.model_fields[name], model_defaults)(with_settings)
        return with_settings

    return decorate


def _extra(field) -> dict:
    return field.json_schema_extra or {}


def _option(name: str, field, model_defaults: bool):
    extra = _extra(field)
    names = flag_names(name, field)
    kind = _unless_none(field.annotation)
    keywords = {"help": field.description, "default": field.default if model_defaults else None}
    if extra.get("metavar"):
        keywords["metavar"] = extra["metavar"]
    if field.is_required():  # no default at all: click 8.5 takes an explicit None for a given value
        del keywords["default"]
        keywords["required"] = True
    if extra.get("comma_list"):
        return click.option(*names, name, **keywords)
    if extra.get("flag_value") is not None:
        return click.option(*names, name, is_flag=False, flag_value=extra["flag_value"], **keywords)
    if extra.get("path"):
        return click.option(*names, name, type=click.Path(**PATHS[extra["path"]]), **keywords)
    if extra.get("repeatable"):
        return click.option(*names, name, multiple=True, **{**keywords, "default": ()})
    if kind is bool:
        if extra.get("negatable"):
            names = [f"{names[0]}/--no-{names[0].removeprefix('--')}", *names[1:]]
        else:
            keywords["is_flag"] = True
        return click.option(*names, name, **keywords)
    if typing.get_origin(kind) is tuple:
        item = typing.get_args(kind)[0]
        return click.option(*names, name, multiple=True, type=None if item is str else item, **keywords)
    shown = model_defaults and field.default is not None
    if typing.get_origin(kind) is typing.Literal:
        return click.option(*names, name, type=click.Choice(typing.get_args(kind)), show_default=shown, **keywords)
    return click.option(*names, name, type=_number_type(kind, field.metadata), show_default=shown, **keywords)


def _unless_none(kind):
    """X for `X | None` (an option left out is None), else the type as it is."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        given = [arg for arg in typing.get_args(kind) if arg is not type(None)]
        return given[0] if len(given) == 1 else kind
    return kind


def _bound(metadata, kind):
    return next((getattr(bound, kind.__name__.lower()) for bound in metadata if isinstance(bound, kind)), None)


def _number_type(kind, metadata):
    """A range for a bounded int or float (click prints its bounds in --help); the plain type otherwise."""
    ge, gt = _bound(metadata, annotated_types.Ge), _bound(metadata, annotated_types.Gt)
    le, lt = _bound(metadata, annotated_types.Le), _bound(metadata, annotated_types.Lt)
    if kind is int:
        return click.IntRange(min=ge, max=le) if ge is not None or le is not None else int
    if kind is float:
        low, high = (ge if gt is None else gt), (le if lt is None else lt)
        return Number(min=low, max=high, min_open=gt is not None, max_open=lt is not None)
    return None


def output_file(flag: str, metavar: str, help: str):
    """A file the command writes (`--heatmap` gives the argument `heatmap_out`): never a folder, checked for
    safety where it is written (io/outputs.py)."""
    return click.option(flag, f"{flag[2:]}_out", type=click.Path(dir_okay=False), metavar=metavar, help=help)


def json_flag(what: str):
    """--json: print `what` as JSON instead of the table."""
    return click.option("--json", "as_json", is_flag=True, help=f"Print JSON ({what}) instead of the table.")


QUIET = click.option("--quiet", "-q", is_flag=True, help="No loading bars or logs from the libraries on stderr.")
