"""One declaration per setting: a command's settings as a pydantic model (type, default, bounds, choices, help),
from which the Python API's validation, the command line's options (cli/options.py) and their help are all
derived, so a setting is written once and its copies cannot disagree.

A field is declared with `setting(...)`: pydantic's own `Field` for the type, default and bounds, plus what only the
command line needs (more flag names, a metavar, whether a boolean has a --no- form), kept in the field's
`json_schema_extra` so the model stays the one place to read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mergekit_lite.errors import InputError


def setting(
    default: Any = ...,
    help: str = "",
    *,
    flags: tuple[str, ...] = (),
    metavar: str | None = None,
    negatable: bool = False,
    path: str | None = None,
    repeatable: bool = False,
    flag_value: str | None = None,
    comma_list: bool = False,
    command_line: bool = True,
    **bounds: Any,
) -> Any:
    """A field of a `Settings` model (required when it has no `default`): `help` is its one-line description;
    `flags` the command line's names when they are not `--field-name` (aliases that users of mergekit or PEFT
    type); `negatable` gives a boolean a
    --no- form; `path` marks a path the command line checks as it parses ("file", "folder", "existing" for a
    file or folder that must exist, "existing-file", "existing-folder"); `repeatable` lets a field that also takes
    a list (in a YAML file) be given several times; `flag_value` is the value of the flag given bare (`--ray` alone:
    "local"); `comma_list` takes a list as one comma-separated value (`--weights 0.7,0.3`: the model's validator
    splits it); `command_line` False keeps a field to the file form; `bounds` are pydantic's (ge, gt, le, lt,
    allow_inf_nan)."""
    extra = {
        "flags": list(flags),
        "metavar": metavar,
        "negatable": negatable,
        "path": path,
        "repeatable": repeatable,
        "flag_value": flag_value,
        "comma_list": comma_list,
        "command_line": command_line,
    }
    return Field(default, description=help, json_schema_extra=extra, **bounds)


class Settings(BaseModel):
    """The settings of one command: frozen, unknown names refused (a typo never turns into a default)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    @classmethod
    def of(cls, settings: Settings | None = None, **values: Any) -> Settings:
        """`settings` (or the defaults) with `values` set: the Python API's keyword arguments, checked as the
        command line's are. A bad value is an InputError naming the setting."""
        return cls.checked({**(settings.model_dump() if settings is not None else {}), **values})

    @classmethod
    def checked(cls, values: dict[str, Any], label: Callable[[str], str] = str) -> Settings:
        """The model of `values`, or an InputError naming the setting as `label` names it (the command line: its
        flag)."""
        try:
            return cls(**values)
        except ValidationError as error:
            raise InputError(one_line(error, label)) from None


def one_line(error: ValidationError, label: Callable[[str], str] = str) -> str:
    """pydantic's first complaint as one line: the setting (as `label` names it: the command line names its
    flag), what was wrong and the value given."""
    first = error.errors()[0]
    name = label(".".join(str(part) for part in first["loc"])) if first["loc"] else "settings"
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        return f"{name}: not a setting"
    return f"{name}: {message[0].lower()}{message[1:]}, got {first.get('input')!r}"
