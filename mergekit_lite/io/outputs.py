"""Output folders: written beside their destination under a temporary name, renamed only when complete."""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from mergekit_lite.errors import InputError
from mergekit_lite.io.safetensors import INDEX_FILE, WEIGHT_SUFFIXES


def _temp_name(out: Path) -> str:
    return f".{out.name}.partial-{os.getpid()}"


def stale_partials(out: Path) -> list[Path]:
    """Temporary folders left next to `out` by merges that were killed (their process is gone)."""
    stale = []
    for candidate in out.parent.glob(f".{out.name}.partial-*"):
        pid = candidate.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _process_alive(int(pid)):
            stale.append(candidate)
    return stale


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextmanager
def atomic_output_dir(out: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder beside `out`; rename it to `out` only if the block finishes.

    A failed or interrupted run removes its temporary folder; a killed one (SIGKILL) leaves a
    `.NAME.partial-PID` folder that no tool mistakes for a model, and the next run removes it.
    """
    out = Path(out)
    if out.exists() and not overwrite:
        raise InputError(f"{out}: already exists (pass --overwrite to replace it)")
    if out.exists() and not out.is_dir():
        raise InputError(f"{out}: exists and is not a folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in stale_partials(out):
        shutil.rmtree(stale, ignore_errors=True)
    temp = out.parent / _temp_name(out)
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir()
    try:
        yield temp
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    os.replace(temp, out)


def copy_side_files(source_folder: Path, out_folder: Path) -> list[str]:
    """Copy config, tokenizer and generation files (everything that is not weights) from a model folder."""
    copied = []
    if not Path(source_folder).is_dir():
        return copied
    for item in sorted(Path(source_folder).iterdir()):
        if item.is_file() and not item.name.endswith(WEIGHT_SUFFIXES) and item.name != INDEX_FILE \
                and not item.name.startswith("adapter_"):
            shutil.copy2(item, out_folder / item.name)
            copied.append(item.name)
    return copied


CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"


def has_chat_template(folder: Path) -> bool:
    """A chat template as its own file (transformers 5) or inside tokenizer_config.json (earlier versions)."""
    folder = Path(folder)
    if any((folder / name).is_file() for name in CHAT_TEMPLATE_FILES):
        return True
    return "chat_template" in _json_or_empty(folder / TOKENIZER_CONFIG)


def _json_or_empty(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def keep_post_trained_files(donor: Path, candidates: list[Path], out_folder: Path) -> list[str]:
    """The chat template and generation config of a post-trained input, when the donor (usually the
    pre-trained base) has none: a base merged with its instruct model should still chat and stop at the
    instruct model's eos. The first candidate that has one gives it; a note says which."""
    notes = []
    if not has_chat_template(donor):
        for candidate in candidates:
            if has_chat_template(candidate):
                _copy_chat_template(Path(candidate), out_folder)
                notes.append(f"chat template taken from {candidate} ({donor} has none)")
                break
    if not (Path(donor) / GENERATION_CONFIG).is_file():
        for candidate in candidates:
            if (Path(candidate) / GENERATION_CONFIG).is_file():
                shutil.copy2(Path(candidate) / GENERATION_CONFIG, out_folder / GENERATION_CONFIG)
                notes.append(f"{GENERATION_CONFIG} taken from {candidate} ({donor} has none)")
                break
    return notes


def _copy_chat_template(candidate: Path, out_folder: Path) -> None:
    files = [candidate / name for name in CHAT_TEMPLATE_FILES if (candidate / name).is_file()]
    for file in files:
        shutil.copy2(file, out_folder / file.name)
    if files:
        return
    template = _json_or_empty(candidate / TOKENIZER_CONFIG)["chat_template"]
    tokenizer_config = out_folder / TOKENIZER_CONFIG
    if tokenizer_config.is_file():
        data = _json_or_empty(tokenizer_config)
        data["chat_template"] = template
        tokenizer_config.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    else:
        (out_folder / CHAT_TEMPLATE_FILES[1]).write_text(json.dumps({"chat_template": template}, indent=2) + "\n")
