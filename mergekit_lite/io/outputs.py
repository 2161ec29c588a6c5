"""Output folders: written beside their destination under a temporary name, renamed only when complete."""

from __future__ import annotations

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
