"""The file names of a Hugging Face model folder and a digest of what it holds, apart from the reader so that
path checks and a sweep's point identity need no torch."""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

from mergekit_lite.io.validation import is_regular_inside, open_regular

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".msgpack", ".h5")
MAX_READ_BYTES = 100 * 1024 * 1024  # the bound on a safetensors header (the reader's too), an index or a config
CONTENT_SAMPLES = 16  # blocks of CONTENT_BLOCK bytes read from each weight file's data by content_identity
CONTENT_BLOCK = 4096


def content_identity(path: str | Path) -> str:
    """A digest of what a model folder (or file) holds, cheap enough to take at every sweep start: per weight
    file (and the index and config.json) its name, size, safetensors header and CONTENT_SAMPLES blocks spread
    over its data. Re-trained or re-saved weights change the sampled bytes, so points evaluated on the old
    ones are not reused; an edit of a few values between the samples would go unseen."""
    path = Path(path)
    folder, names = (path, sorted(os.listdir(path))) if path.is_dir() else (path.parent, [path.name])
    digest = hashlib.sha256()
    for name in names:
        if (
            not (name.endswith(WEIGHT_SUFFIXES) or name in (INDEX_FILE, "config.json"))
            or name.startswith("adapter_")
            or not is_regular_inside(folder / name, folder)
        ):
            continue
        with open_regular(folder / name) as handle:
            size = os.fstat(handle.fileno()).st_size
            header = handle.read(min(size, 8))
            if name.endswith(".safetensors") and len(header) == 8:
                header += handle.read(min(struct.unpack("<Q", header)[0], MAX_READ_BYTES))
            elif not name.endswith(WEIGHT_SUFFIXES):
                header += handle.read(MAX_READ_BYTES)
            digest.update(f"{name}\0{size}\0".encode())
            digest.update(header)
            start = len(header)
            for index in range(CONTENT_SAMPLES if size > start else 0):
                digest.update(
                    os.pread(handle.fileno(), CONTENT_BLOCK, start + (size - start) * index // CONTENT_SAMPLES)
                )
    return digest.hexdigest()


def inner_models_hint(folder: Path) -> str:
    """Where a folder holds no weights but its subfolders do (PEFT saves an adapter named other than "default" in
    `NAME/`; a repository may keep several models): which ones to name instead, read by file names alone."""
    marks = (SINGLE_FILE, INDEX_FILE, "adapter_config.json")
    inner = [
        child.name
        for child in sorted(folder.iterdir())
        if child.is_dir() and any((child / mark).is_file() for mark in marks)
    ]
    if not inner:
        return ""
    shown = ", ".join(str(folder / name) for name in inner[:3]) + (
        f" and {len(inner) - 3} more" if len(inner) > 3 else ""
    )
    return f"; its subfolders hold {shown}: name one of them"
