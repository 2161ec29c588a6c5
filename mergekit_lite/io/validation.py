"""Typed reading of the JSON and YAML files users hand in: parse with limits, then validate with a schema.

pydantic (installed with lm-eval) checks the types in strict mode, so a quoted "false" is not a boolean
and "3" is not a number; its errors name the key and the expected type, and `validate` puts the file in
front. Parsing has limits of its own: nesting depth (json and PyYAML recurse, deep input ends in a
RecursionError), file size, and the size of a YAML document once its aliases are expanded (a "billion
laughs" anchor bomb is a few hundred bytes that expand to gigabytes in whatever consumes it).
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from mergekit_lite.errors import InputError

MAX_DEPTH = 64
MAX_TEXT_BYTES = 64 * 1024 * 1024
MAX_YAML_NODES = 100_000
Model = TypeVar("Model", bound=BaseModel)
HUB_CACHE_REPO_PREFIXES = ("models--", "datasets--", "spaces--")  # huggingface_hub's cache folder of a repository


def is_regular_inside(path: Path, folder: Path) -> bool:
    """A regular file (after links) whose real path stays inside `folder`.

    Links inside a Hugging Face cache snapshot (`models--ORG--NAME/snapshots/REV/x -> ../../blobs/HASH`, or from a
    folder inside it, `.../snapshots/REV/sub/x -> ../../../blobs/HASH`) point into the repository's own `blobs/`
    folder, which counts as inside: that is how every hub download is laid out.
    """
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return False
    except OSError:
        return False
    real, root = Path(os.path.realpath(path)), Path(os.path.realpath(folder))
    roots = [root]
    snapshot = next(
        (
            folder
            for folder in (root, *root.parents)
            if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith(HUB_CACHE_REPO_PREFIXES)
        ),
        None,
    )
    if snapshot is not None:
        roots.append(snapshot.parent.parent / "blobs")
    return any(real == allowed or allowed in real.parents for allowed in roots)


def require_regular_inside(path: Path, folder: Path) -> Path:
    """`path` if `is_regular_inside(path, folder)`; otherwise a user error, before anything opens it."""
    if not is_regular_inside(path, folder):
        raise InputError(f"{path}: not a regular file inside {folder} ({_why_not_inside(path)})")
    return path


def _why_not_inside(path: Path) -> str:
    if os.path.islink(path) and not os.path.exists(path):
        return "a broken link"
    if os.path.islink(path):
        return "a link out of the folder; refused, nothing outside the folders named is read"
    return "a FIFO, socket or device" if os.path.exists(path) else "missing"


def check_folder_files(folder: str | os.PathLike) -> Path:
    """A model or adapter folder whose every entry is a regular file or folder inside it (Hugging Face cache
    snapshots: links into the repository's blobs/), else one line naming the first that is not.

    transformers, PEFT and lm-eval open a folder's side files by name (tokenizer files, chat templates,
    generation_config.json, adapter_config.json, README.md, additional_chat_templates/), so checking the few
    files our own code reads is not enough: this runs before anything hands the folder to them, and a link to a
    file elsewhere (a secret rendered into every prompt, say) is refused rather than followed or skipped."""
    folder = Path(folder)
    if not folder.is_dir():
        return folder
    stack = [folder]
    while stack:
        current = stack.pop()
        for entry in sorted(os.scandir(current), key=lambda item: item.name):
            path = Path(entry.path)
            if entry.is_dir(follow_symlinks=False):
                if current == folder:  # one level down: additional_chat_templates/, a hub repository's subfolder
                    stack.append(path)
                continue
            if entry.is_symlink() and os.path.isdir(path):
                real, root = Path(os.path.realpath(path)), Path(os.path.realpath(folder))
                if root not in real.parents:
                    raise InputError(
                        f"{path}: a link out of {folder}; refused, nothing outside the folders named is read"
                    )
                continue
            require_regular_inside(path, folder)
    return folder


def require_regular(path: str | Path, what: str = "file") -> Path:
    """A file the user named: it must exist and be a regular file (after links), checked with stat before
    anything opens it, so a FIFO, socket or device is refused instead of blocking the run."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except OSError as error:
        raise InputError(
            f"{path}: no such {what}" if error.errno == errno.ENOENT else f"{path}: cannot read ({error.strerror})"
        ) from None
    if not stat.S_ISREG(mode):
        kind = "a folder" if stat.S_ISDIR(mode) else "a FIFO, socket or device"
        raise InputError(f"{path}: not a regular file ({kind}); give a {what}")
    return path


def open_regular(path: Path):
    """Open for reading only if it is a regular file: a FIFO or device is refused without blocking on it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        if error.errno == errno.ENXIO:  # a UNIX socket
            raise InputError(f"{path}: not a regular file") from None
        raise InputError(f"{path}: cannot read ({error.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise InputError(f"{path}: not a regular file")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb", buffering=0)


def read_text(path: Path, limit: int = MAX_TEXT_BYTES) -> str:
    """A text file as UTF-8, refusing FIFOs and devices before they can block, huge files, binary data (a NUL
    byte) and bad encoding, naming the byte offset (not the bytes)."""
    path = Path(path)
    with open_regular(path) as handle:
        try:
            raw = handle.read(limit + 1)
        except OSError as error:
            raise InputError(f"{path}: cannot read ({error.strerror})") from None
    if len(raw) > limit:
        raise InputError(f"{path}: larger than {limit // 2**20} MiB, not a text file this reads")
    return decode_text(raw, path)


def decode_text(raw: bytes, where: str | Path, offset: int = 0) -> str:
    """Bytes of a text file as UTF-8; a NUL byte (binary data) or bad encoding is one line naming the offset."""
    if (nul := raw.find(b"\0")) >= 0:
        raise InputError(f"{where}: binary data, not text (NUL byte at offset {offset + nul})")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InputError(f"{where}: not UTF-8 text (bad byte at offset {offset + error.start})") from None


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
    """SafeLoader that refuses documents whose alias-expanded size exceeds MAX_YAML_NODES, and mappings that
    give a key twice (PyYAML keeps the last value silently; JSON input is refused the same way)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, typing.Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {str(key)[:80]!r} at line {key_node.start_mark.line + 1}"
                )
            seen.add(key) if isinstance(key, typing.Hashable) else None
        return super().construct_mapping(node, deep)


class TagsIgnoredLoader(_LimitedLoader):
    """_LimitedLoader that reads a value with a custom tag (lm-eval's `!function utils.f`) as null instead of
    refusing it: for reading the plain keys of a file that another program interprets."""


TagsIgnoredLoader.add_multi_constructor("!", lambda loader, suffix, node: None)


def parse_yaml(text: str, where: str | Path, loader_class: type[yaml.SafeLoader] = _LimitedLoader) -> Any:
    loader = loader_class(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if _expanded_size(node, {}) > MAX_YAML_NODES:
            raise InputError(
                f"{where}: YAML expands to more than {MAX_YAML_NODES} values through its aliases "
                "(an anchor bomb?); write the values out"
            )
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
        size = 1 + sum(
            _expanded_size(key, memo, depth + 1) + _expanded_size(value, memo, depth + 1) for key, value in node.value
        )
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
    names = {
        dict: "a mapping",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        type(None): "null",
    }
    return names.get(type(value), type(value).__name__)


def parse_size(text: str | int) -> int:
    """'2GB', '500MB', '1.5GiB' or a byte count -> bytes (decimal units like HF, binary with 'i'); positive."""
    if isinstance(text, bool) or not isinstance(text, (int, str)):
        raise InputError(f"bad size {text!r} (use e.g. 500MB, 2GB, 5GiB or a byte count)")
    if isinstance(text, int):
        value = text
    else:
        units = {
            "": 1,
            "B": 1,
            "KB": 10**3,
            "MB": 10**6,
            "GB": 10**9,
            "TB": 10**12,
            "KIB": 2**10,
            "MIB": 2**20,
            "GIB": 2**30,
            "TIB": 2**40,
        }
        cleaned = text.strip().upper().replace(" ", "")
        number = cleaned.rstrip("KMGTIB")
        unit = cleaned[len(number) :]
        try:
            value = int(float(number) * units[unit])
        except (ValueError, KeyError, OverflowError):
            raise InputError(f"bad size {text!r} (use e.g. 500MB, 2GB, 5GiB)") from None
    if value <= 0:
        raise InputError(f"bad size {text!r} (must be positive)")
    return value
