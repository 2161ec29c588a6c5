"""The checkpoints of a training run, in training order: a folder of `checkpoint-N` subfolders (the layout of
transformers' Trainer and TRL) gives its order only when asked to read it from the names (`--order step`)."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

from mergekit_lite.errors import InputError
from mergekit_lite.io.layout import INDEX_FILE, SINGLE_FILE, WEIGHT_SUFFIXES

CHECKPOINT = re.compile(r"^checkpoint[-_](?P<step>\d{1,18})$")
ORDERS = ("step",)


def checkpoint_folders(folder: Path) -> dict[int, Path]:
    """step -> checkpoint-STEP subfolder of a folder that holds no weights of its own (a link to a folder inside
    it is followed, any other link refused); {} for a model folder, a file or a link."""
    folder = Path(folder)
    if not folder.is_dir() or folder.is_symlink() or (folder / SINGLE_FILE).exists() or (folder / INDEX_FILE).exists():
        return {}
    if any(item.name.endswith(WEIGHT_SUFFIXES) for item in folder.iterdir()):
        return {}
    found: dict[int, Path] = {}
    for item in sorted(folder.iterdir()):
        match = CHECKPOINT.match(item.name)
        if match:
            _check_checkpoint(item, folder)
            step = int(match["step"])
            if step in found:
                raise InputError(f"{folder}: two checkpoints of step {step} ({found[step].name}, {item.name})")
            found[step] = item
    return found


def _check_checkpoint(item: Path, folder: Path) -> None:
    """A checkpoint-N entry is a folder, or a link to a folder inside the run folder (followed); anything else is
    refused, never skipped: an average that silently leaves a checkpoint out is not the one asked for."""
    real, root = Path(os.path.realpath(item)), Path(os.path.realpath(folder))
    if item.is_symlink() and root not in real.parents:
        raise InputError(
            f"{item}: a link out of {folder}; a run folder's checkpoints are read inside it only (copy "
            "the checkpoint in, or list the checkpoints as --model flags in training order)"
        )
    if not real.is_dir():
        raise InputError(
            f"{item}: not a checkpoint folder{' (a broken link)' if not real.exists() else ''}; move it "
            "out of the run folder, or list the checkpoints as --model flags in training order"
        )


def in_training_order(paths: Sequence[str], order: str | None) -> list[str]:
    """The inputs of a merge over a trajectory, in training order: paths given one by one keep the order given;
    a folder of checkpoint-N subfolders is refused unless `order` says how to order it ("step": by N)."""
    if order is not None and order not in ORDERS:
        raise InputError(f"--order must be one of {', '.join(ORDERS)}, got {order!r}")
    ordered, expanded = [], False
    for path in paths:
        found = checkpoint_folders(Path(path))
        if not found:
            ordered.append(path)
            continue
        if order is None:
            names = ", ".join(found[step].name for step in sorted(found)[:3]) + (", ..." if len(found) > 3 else "")
            raise InputError(
                f"{path}: a folder of {len(found)} checkpoints ({names}) gives no training order: "
                "list them as --model flags in training order, or add --order step to order them "
                "by the step in their checkpoint-N names"
            )
        ordered += [str(found[step]) for step in sorted(found)]
        expanded = True
    if order is not None and not expanded:
        raise InputError("--order step orders the checkpoint-N subfolders of a folder given as --model; none was given")
    return ordered
