"""The checkpoints of a training run, in training order: a folder of `checkpoint-N` subfolders (the layout of
transformers' Trainer and TRL) gives its order only when asked to read it from the names (`--order step`)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from mergekit_lite.errors import InputError
from mergekit_lite.io.layout import INDEX_FILE, SINGLE_FILE, WEIGHT_SUFFIXES

CHECKPOINT = re.compile(r"^checkpoint[-_](?P<step>\d{1,18})$")
ORDERS = ("step",)


def checkpoint_folders(folder: Path) -> dict[int, Path]:
    """step -> checkpoint-STEP subfolder of a folder that holds no weights of its own (links are not followed);
    {} for a model folder or a file."""
    folder = Path(folder)
    if not folder.is_dir() or folder.is_symlink() or (folder / SINGLE_FILE).exists() or (folder / INDEX_FILE).exists():
        return {}
    if any(item.name.endswith(WEIGHT_SUFFIXES) for item in folder.iterdir()):
        return {}
    found: dict[int, Path] = {}
    for item in sorted(folder.iterdir()):
        match = CHECKPOINT.match(item.name)
        if match and item.is_dir() and not item.is_symlink():
            step = int(match["step"])
            if step in found:
                raise InputError(f"{folder}: two checkpoints of step {step} ({found[step].name}, {item.name})")
            found[step] = item
    return found


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
            raise InputError(f"{path}: a folder of {len(found)} checkpoints ({names}) gives no training order: "
                             "list them as --model flags in training order, or add --order step to order them "
                             "by the step in their checkpoint-N names")
        ordered += [str(found[step]) for step in sorted(found)]
        expanded = True
    if order is not None and not expanded:
        raise InputError("--order step orders the checkpoint-N subfolders of a folder given as --model; none was given")
    return ordered
