"""`merge`'s method flags, generated from the method registry (mergekit_lite/merge/methods/): one flag per parameter
a method declares (`--epsilon`, `--gamma`, ...), its help built from the declarations (what it means for each
method that takes it, its bounds, its defaults and mergekit's), so a parameter is declared once and the command
copies no default, bound or meaning. A per-model-only parameter (a model's weight) comes with its model instead,
`--model PATH:WEIGHT`.

The flags carry no defaults and no bounds of their own: a value given goes into the config's `parameters:` as a
YAML key would, and the config checks it against the declaration (merge/config.py), so a flag and a config key
are refused with the same message, and a flag not given leaves the method's default.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import click

from mergekit_lite.cli.types import Number, flag_name
from mergekit_lite.merge.methods.registry import Method, Parameter

HELP_WIDTH = 100  # the methods' table is printed as written (a click \\b paragraph), so wrapped here


def flagged_parameters(registry: Mapping[str, Method]) -> dict[str, list[tuple[Method, Parameter]]]:
    """Every parameter that gets a flag, by name in the order the registry first declares it, with each method
    that takes it and that method's declaration (methods may declare one name with their own help or bounds)."""
    flagged: dict[str, list[tuple[Method, Parameter]]] = {}
    for method in registry.values():
        for parameter in method.parameters:
            if not parameter.per_model_only:
                flagged.setdefault(parameter.name, []).append((method, parameter))
    return flagged


def shown(value) -> str:
    """A default as a YAML config writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _by_value(pairs: Iterable[tuple[str, object]]) -> dict[object, list[str]]:
    grouped: dict[object, list[str]] = {}
    for method, value in pairs:
        grouped.setdefault(value, []).append(method)
    return grouped


def defaults_text(name: str, takers: list[Method]) -> str:
    """The defaults of `name` for these methods (`Method.default`: ours, and mergekit's in mergekit_compat mode
    where it differs), e.g. `default 0.5, mergekit's 1` or `default true for linear, ties; false for ...`;
    empty where no method has one (the method asks for the value, or derives it)."""
    ours = _by_value((method.name, method.default(name, False)) for method in takers)
    ours.pop(None, None)
    theirs = _by_value(
        (method.name, method.default(name, True))
        for method in takers
        if method.default(name, True) != method.default(name, False)
    )
    return "; ".join(_values_text("default", ours, takers) + _values_text("mergekit's", theirs, takers))


def _values_text(label: str, grouped: dict[object, list[str]], takers: list[Method]) -> list[str]:
    """`label value` where every method has that value, else `label value for methods; ...`; nothing for none."""
    if len(grouped) == 1 and len(next(iter(grouped.values()))) == len(takers):
        return [f"{label} {shown(next(iter(grouped)))}"]
    if not grouped:
        return []
    return [f"{label} " + "; ".join(f"{shown(value)} for {', '.join(names)}" for value, names in grouped.items())]


def flag_help(name: str, declared: list[tuple[Method, Parameter]]) -> str:
    """A flag's help: for each group of methods that declare it alike, the methods, its meaning, its bounds and
    its defaults (`slerp: the interpolation position ..., in [0.0, 1.0] (default 0.5); nearswap: ...`)."""
    groups: dict[tuple[str, str], list[Method]] = {}
    for method, parameter in declared:
        bounds = "" if parameter.low is None else parameter.bounds_text()
        groups.setdefault((parameter.help, bounds), []).append(method)
    parts = []
    for (meaning, bounds), takers in groups.items():
        text = f"{', '.join(method.name for method in takers)}: {meaning}"
        text += f", in {bounds}" if bounds else ""
        defaults = defaults_text(name, takers)
        parts.append(f"{text} ({defaults})" if defaults else text)
    return "; ".join(parts) + "."


def method_option(name: str, declared: list[tuple[Method, Parameter]]):
    """The click option of one parameter, its value under the parameter's own name (`lambda` too): a
    --name/--no-name pair for a boolean, an integer or a number (NaN refused) otherwise, None when not given."""
    kind = declared[0][1].kind
    flag = flag_name(name)
    text = flag_help(name, declared)
    if kind is bool:
        return click.option(f"{flag}/--no-{flag[2:]}", name, default=None, help=text)
    return click.option(flag, name, type=click.INT if kind is int else Number(), default=None, help=text)


def method_options(registry: Mapping[str, Method]) -> list:
    """A click option per flagged parameter of the registry (`flagged_parameters`), in its order."""
    return [method_option(name, declared) for name, declared in flagged_parameters(registry).items()]


def method_flags(method: Method) -> list[str]:
    """What one method takes on the command line: its flags, and `--model PATH:WEIGHT` for a per-model-only
    parameter."""
    return [
        f"--model PATH:{parameter.name.upper()}" if parameter.per_model_only else flag_name(parameter.name)
        for parameter in method.parameters
    ]


def methods_help(registry: Mapping[str, Method]) -> str:
    """The help's table of methods: each one's summary and the flags it takes, wrapped between flags."""
    indent = " " * (max(map(len, registry)) + 4)
    lines = []
    for name, method in registry.items():
        line = f"  {name:<{len(indent) - 4}}  {method.summary}; takes"
        flags = method_flags(method) or ["no parameters"]
        for number, flag in enumerate(flags):
            word = f" {flag}{',' if number < len(flags) - 1 else ''}"
            if len(line) + len(word) > HELP_WIDTH:
                lines.append(line)
                line = indent[:-1]  # the word starts with its space
            line += word
        lines.append(line)
    return "\b\nMethods, and the flags each takes:\n" + "\n".join(lines)
