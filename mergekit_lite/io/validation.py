"""Typed reading of the JSON and YAML files users hand in: parse with limits, then validate with a schema.

pydantic (installed with lm-eval) checks the types in strict mode, so a quoted "false" is not a boolean
and "3" is not a number; its errors name the key and the expected type, and `validate` puts the file in
front. Parsing has limits of its own: nesting depth (json and PyYAML recurse, deep input ends in a
RecursionError), file size, and the size of a YAML document once its aliases are expanded (a "billion
laughs" anchor bomb is a few hundred bytes that expand to gigabytes in whatever consumes it).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from mergekit_lite.errors import InputError

MAX_DEPTH = 64
MAX_TEXT_BYTES = 64 * 1024 * 1024
MAX_YAML_NODES = 100_000
Model = TypeVar("Model", bound=BaseModel)


def read_text(path: Path, limit: int = MAX_TEXT_BYTES) -> str:
    """A text file as UTF-8, refusing huge files and naming the byte offset of bad encoding (not the bytes)."""
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            raw = handle.read(limit + 1)
    except OSError as error:
        raise InputError(f"{path}: cannot read ({error.strerror})") from None
    if len(raw) > limit:
        raise InputError(f"{path}: larger than {limit // 2**20} MiB, not a config file")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InputError(f"{path}: not UTF-8 text (bad byte at offset {error.start})") from None


def parse_json(text: str | bytes, where: str | Path) -> Any:
    """JSON with duplicate keys refused and a depth limit; errors give the position, never the content."""
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except RecursionError:
        raise InputError(f"{where}: nested too deeply (more than {MAX_DEPTH} levels)") from None
    except json.JSONDecodeError as error:
        raise InputError(f"{where}: invalid JSON ({error.msg} at line {error.lineno} column {error.colno})") from None
    except (ValueError, UnicodeDecodeError) as error:
        raise InputError(f"{where}: invalid JSON ({_safe_reason(error)})") from None
    check_depth(data, where)
    return data


def check_pattern(pattern: str, where: str = "") -> None:
    """A regular expression a user gave (an option, a field of an input file) must compile: refused in one line,
    before any work, rather than failing as re.error wherever it is first used."""
    try:
        re.compile(pattern)
    except re.error as error:
        raise InputError(f"{where}{pattern[:80]!r} is not a regular expression ({error.msg})") from None


def _safe_reason(error: Exception) -> str:
    if isinstance(error, UnicodeDecodeError):
        return f"not UTF-8 at byte {error.start}"
    return str(error).splitlines()[0][:200]


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    data = dict(pairs)
    if len(data) != len(pairs):
        seen = set()
        duplicate = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise ValueError(f"duplicate key {duplicate[:80]!r}")
    return data


def _no_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def check_depth(data: Any, where: str | Path, limit: int = MAX_DEPTH) -> None:
    """Refuse structures nested deeper than `limit` (iteratively: the check itself cannot overflow the stack)."""
    stack = [(data, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                raise InputError(f"{where}: nested too deeply (more than {limit} levels)")
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))


def read_json(path: str | Path) -> Any:
    path = Path(path)
    return parse_json(read_text(path), path)


class _LimitedLoader(yaml.SafeLoader):
    """SafeLoader that refuses documents whose alias-expanded size exceeds MAX_YAML_NODES."""


def parse_yaml(text: str, where: str | Path) -> Any:
    loader = _LimitedLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if _expanded_size(node, {}) > MAX_YAML_NODES:
            raise InputError(f"{where}: YAML expands to more than {MAX_YAML_NODES} values through its aliases "
                             "(an anchor bomb?); write the values out")
        data = loader.construct_document(node)
    except RecursionError:
        raise InputError(f"{where}: nested too deeply (more than {MAX_DEPTH} levels)") from None
    except yaml.YAMLError as error:
        raise InputError(f"{where}: invalid YAML ({str(error).splitlines()[0]})") from None
    finally:
        loader.dispose()
    check_depth(data, where)
    return data


def _expanded_size(node: yaml.Node, memo: dict[int, int], depth: int = 0) -> int:
    """Nodes after alias expansion; shared (aliased) nodes are counted once per use, computed once."""
    if id(node) in memo:
        return memo[id(node)]
    if depth > MAX_DEPTH:
        raise RecursionError
    if isinstance(node, yaml.SequenceNode):
        size = 1 + sum(_expanded_size(child, memo, depth + 1) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        size = 1 + sum(_expanded_size(key, memo, depth + 1) + _expanded_size(value, memo, depth + 1)
                       for key, value in node.value)
    else:
        size = 1
    memo[id(node)] = size
    return size


def read_yaml(path: str | Path) -> Any:
    path = Path(path)
    return parse_yaml(read_text(path), path)


def validate(model: type[Model], data: Any, where: str | Path) -> Model:
    """`model` from `data`, or one line naming the file, the key and the expected type of the first error."""
    try:
        return model.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        key = ".".join(str(part) for part in first["loc"]) or "top level"
        got = _json_type(first.get("input"))
        message = first["msg"].replace("Input should be", "expected").replace("Input", "value")
        if first["type"] in ("model_type", "dict_type"):
            message = "expected a mapping (JSON object)"
        raise InputError(f"{where}: {key}: {message} (got {got})") from None


def _json_type(value: Any) -> str:
    """The type of a parsed value in the file's own terms (a quoted "false" is a string)."""
    names = {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
             float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)
