"""Streaming safetensors I/O: read one tensor at a time, write shards whose layout is planned up front.

This layer knows files, shards and indices, and nothing about merge methods. Reading goes through positioned
reads (`read_at`) at the offsets the header gives, so a tensor costs its own bytes and nothing stays resident after
it is dropped: peak memory is bounded by the tensors in flight, not by the model. A pass that only looks at a
tensor before it is read for good maps its rows instead (`ModelSource.map_rows`): no copy, unmapped with the view.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import threading
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from mergekit_lite.errors import InputError
from mergekit_lite.io.direct import DirectFile
from mergekit_lite.io.layout import INDEX_FILE, MAX_READ_BYTES, SINGLE_FILE, inner_models_hint
from mergekit_lite.io.validation import (
    check_folder_files,
    open_regular,
    parse_json,
    read_json,
    require_regular_inside,
    validate,
)

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)
DTYPE_CODES = {dtype: code for code, dtype in SAFETENSORS_DTYPES.items()}
MAX_HEADER_BYTES = MAX_READ_BYTES


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes live: file, absolute byte offset, length, dtype and shape."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def read_at(handle, view: memoryview, offset: int) -> int:
    """Fill `view` from `offset` with positioned reads; the bytes read (fewer only at the end of the file).

    No shared file position, so threads may read one handle at once; and a loop, because Linux returns at most
    2 GiB per read call (a large vocabulary's embedding is bigger).
    """
    done = 0
    while done < len(view):
        count = os.preadv(handle.fileno(), [view[done:]], offset + done)
        if count == 0:
            break
        done += count
    return done


def read_header(path: Path) -> dict[str, TensorEntry]:
    """Parse and validate a safetensors header without touching tensor data.

    At least as strict as the `safetensors` library (`tests/test_safety.py` runs crafted headers through
    both): known dtypes, whole-number shapes, offsets that tile the data area exactly (no gaps, overlaps or
    aliases, nothing after the last tensor), string metadata; and stricter on duplicate names, which the
    library resolves silently (last wins). Every entry is checked
    against the file size here, so a truncated download fails at open, naming the file and the first tensor
    that does not fit, instead of halfway through a merge. Nothing of a file that fails is echoed.
    """
    path = Path(path)
    with open_regular(path) as handle:
        size = os.fstat(handle.fileno()).st_size
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise InputError(f"{path}: not a safetensors file (only {size} bytes)")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(size - 8, MAX_HEADER_BYTES):
            raise InputError(f"{path}: corrupted safetensors header (its declared length exceeds the file)")
        raw = handle.read(header_len)
    try:
        header = parse_json(raw.decode("utf-8"), path)
    except UnicodeDecodeError as error:
        raise InputError(f"{path}: corrupted safetensors header (not UTF-8 at byte {error.start})") from None
    except InputError as error:
        raise InputError(f"{path}: corrupted safetensors header ({str(error).removeprefix(f'{path}: ')})") from None
    if not isinstance(header, dict):
        raise InputError(f"{path}: corrupted safetensors header (not a JSON object)")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise InputError(f"{path}: corrupted safetensors header (__metadata__ must map names to strings)")
    data_start = 8 + header_len
    entries = {name: _header_entry(path, name, info, data_start) for name, info in header.items()}
    _check_layout(path, list(entries.values()), data_start, size)
    return entries


def _header_entry(path: Path, name: str, info, data_start: int) -> TensorEntry:
    def bad(reason: str) -> InputError:
        return InputError(f"{path}: corrupted safetensors header (tensor {name[:200]!r}: {reason})")

    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
        raise bad("needs dtype, shape and data_offsets")
    if not isinstance(info["dtype"], str) or info["dtype"] not in SAFETENSORS_DTYPES:
        raise bad(f"unsupported dtype {str(info['dtype'])[:20]!r}")
    dtype = SAFETENSORS_DTYPES[info["dtype"]]
    shape, offsets = info["shape"], info["data_offsets"]
    if not isinstance(shape, list) or not all(_whole(dim) for dim in shape):
        raise bad("shape must be a list of whole numbers >= 0")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_whole(x) for x in offsets)
        or offsets[0] > offsets[1]
    ):
        raise bad("data_offsets must be [begin, end] with 0 <= begin <= end")
    nbytes = math.prod(shape) * dtype.itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise bad(f"{offsets[1] - offsets[0]} bytes for shape {shape}")
    return TensorEntry(name, path, dtype, tuple(shape), data_start + offsets[0], nbytes)


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


def _check_layout(path: Path, entries: list[TensorEntry], data_start: int, size: int) -> None:
    """The tensors tile the data area: each starts where the previous one ends, the last one ends the file."""
    position = data_start
    for entry in sorted(entries, key=lambda e: (e.offset, e.nbytes)):
        if entry.offset != position:
            what = "overlaps the previous tensor" if entry.offset < position else "leaves a gap before it"
            raise InputError(f"{path}: corrupted safetensors header (tensor {entry.name[:200]!r} {what})")
        position += entry.nbytes
        if position > size:
            raise InputError(
                f"{path}: truncated file (tensor {entry.name[:200]} ends at byte {position}, file has {size})"
            )
    if position != size:
        raise InputError(f"{path}: corrupted safetensors header ({size - position} bytes after the last tensor)")


class ModelSource:
    """A model's tensors by name, read one at a time from its safetensors shards."""

    def __init__(self, path: Path, entries: dict[str, TensorEntry], config: dict | None):
        self.path = Path(path)
        self.config = config
        self._entries = dict(sorted(entries.items(), key=lambda item: (str(item[1].file), item[1].offset)))
        self._handles: dict[Path, object] = {}
        self._opening = threading.Lock()  # the engine's reader and statistician open shards at once

    @property
    def names(self) -> list[str]:
        """Tensor names in on-disk order, so a pass over them reads each shard front to back."""
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def entry(self, name: str) -> TensorEntry:
        try:
            return self._entries[name]
        except KeyError:
            raise InputError(f"{self.path}: has no tensor {name}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entry(name).shape

    def dtype(self, name: str) -> torch.dtype:
        return self.entry(name).dtype

    def load(self, name: str, into: torch.Tensor | None = None) -> torch.Tensor:
        """Read one tensor straight into `into` (a uint8 block of at least its bytes, e.g. from a BufferRing),
        or into fresh CPU memory (its own bytes, nothing more).

        float8 tensors come back upcast to float32 (exact): torch has almost no float8 kernels, and the
        merge stores them back in the planned dtype (`dtype(name)` still reports the stored one)."""
        entry = self.entry(name)
        return self._read(entry, entry.offset, entry.nbytes, entry.shape, into)

    def load_rows(self, name: str, begin: int, end: int, into: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [begin, end) of one tensor (its first dimension), read as `load` reads the whole."""
        entry = self.entry(name)
        return self._read(entry, *_rows(entry, begin, end), into)

    def map_rows(self, name: str, begin: int, end: int) -> torch.Tensor:
        """Rows [begin, end) of one tensor as a view of its shard's cached pages, mapped copy-on-write and never
        written: no copy, for a pass that only reads a tensor the merge then reads again (a statistic of the whole
        tensor). The mapping lives as long as the view, so its pages count as resident only meanwhile. A shard cut
        short before its rows are mapped is an InputError; one cut short while they are mapped ends the process with
        a bus error, as any mapped read does (safetensors' own), so the engine maps a slab at a time."""
        entry = self.entry(name)
        offset, nbytes, shape = _rows(entry, begin, end)
        if not nbytes:
            return self._read(entry, offset, nbytes, shape, None)
        start, handle = offset - offset % mmap.ALLOCATIONGRANULARITY, self._handle(entry.file)
        try:
            mapped = mmap.mmap(handle.fileno(), offset + nbytes - start, access=mmap.ACCESS_COPY, offset=start)
        except ValueError:  # the file is shorter now than its header says
            raise InputError(f"{entry.file}: truncated file (tensor {entry.name})") from None
        return _typed(torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes, offset=offset - start), entry, shape)

    def _read(
        self, entry: TensorEntry, offset: int, nbytes: int, shape: tuple[int, ...], into: torch.Tensor | None
    ) -> torch.Tensor:
        buffer = torch.empty(nbytes, dtype=torch.uint8) if into is None else into[:nbytes]
        if nbytes:
            if read_at(self._handle(entry.file), memoryview(buffer.numpy()), offset) != nbytes:
                raise InputError(f"{entry.file}: truncated file (tensor {entry.name})")
        return _typed(buffer, entry, shape)

    def close(self) -> None:
        """Close the shards opened so far; a later read opens its shard again."""
        handles, self._handles = self._handles, {}
        for handle in handles.values():
            handle.close()

    def _handle(self, file: Path):
        """The shard's one open handle: two threads opening it at once would each open one, and the handle that
        lost the race would close under its reader."""
        with self._opening:
            if file not in self._handles:
                self._handles[file] = open_regular(file)
            return self._handles[file]


def _rows(entry: TensorEntry, begin: int, end: int) -> tuple[int, int, tuple[int, ...]]:
    """Where rows [begin, end) of a tensor lie: absolute offset, bytes and shape."""
    row_bytes = entry.nbytes // entry.shape[0] if entry.shape and entry.shape[0] else 0
    return entry.offset + begin * row_bytes, (end - begin) * row_bytes, (end - begin, *entry.shape[1:])


def _typed(buffer: torch.Tensor, entry: TensorEntry, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor's bytes as its dtype and shape; float8 upcast to float32 (see `ModelSource.load`)."""
    tensor = buffer.view(entry.dtype).reshape(shape)
    return tensor.float() if entry.dtype in FLOAT8 else tensor


class PickleSource(ModelSource):
    """Legacy `pytorch_model*.bin` weights, loaded memory-mapped with weights_only=True; opt-in only."""

    def __init__(self, path: Path, files: Sequence[Path], config: dict | None):
        tensors, origin = {}, {}
        for file in files:
            try:
                state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except Exception as error:  # torch raises many types for a bad pickle
                raise InputError(f"{file}: cannot load pickle weights ({type(error).__name__})") from None
            tensors.update(state)
            origin.update(dict.fromkeys(state, file))
        entries = {
            name: TensorEntry(name, origin[name], t.dtype, tuple(t.shape), 0, t.numel() * t.element_size())
            for name, t in tensors.items()
        }
        super().__init__(path, entries, config)
        self._tensors = tensors

    def load(self, name: str, into: torch.Tensor | None = None) -> torch.Tensor:
        self.entry(name)
        return self._tensors[name].clone()


class ShardIndex(BaseModel):
    """model.safetensors.index.json: tensor name -> shard file name (a plain name inside the model folder)."""

    model_config = ConfigDict(strict=True, extra="allow")
    metadata: dict[str, Any] | None = None
    weight_map: dict[str, str]


class ModelConfigFile(BaseModel):
    """The keys of a model's config.json that mergekit-lite reads, typed; the rest passes through."""

    model_config = ConfigDict(strict=True, extra="allow")
    model_type: str | None = None
    architectures: list[str] | None = None
    num_hidden_layers: int | None = None
    tie_word_embeddings: bool | None = None
    torch_dtype: str | None = None
    dtype: str | None = None


def read_model_config(folder: Path) -> dict | None:
    """config.json of a model folder (a regular file inside it), checked for the keys the merge reads."""
    path = folder / "config.json"
    if not os.path.lexists(path):
        return None
    data = read_json(require_regular_inside(path, folder))
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a JSON object (got {type(data).__name__})")
    validate(ModelConfigFile, data, path)
    return data


def _weight_file(folder: Path, name: str, where: Path) -> Path:
    """A shard named by an index or found in the folder: a plain name, a regular file inside the folder."""
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise InputError(f"{where}: shard name {name[:200]!r} is not a plain file name in {folder}")
    path = folder / name
    if not os.path.lexists(path):
        raise InputError(f"{where}: names shard {name}, which is missing")
    return require_regular_inside(path, folder)


def _indexed_entries(folder: Path) -> dict[str, TensorEntry]:
    index_path = require_regular_inside(folder / INDEX_FILE, folder)
    index = validate(ShardIndex, read_json(index_path), index_path)
    if not index.weight_map:
        raise InputError(f"{index_path}: no weight_map")
    headers: dict[str, dict[str, TensorEntry]] = {}
    entries = {}
    for name, shard in index.weight_map.items():
        if shard not in headers:
            headers[shard] = read_header(_weight_file(folder, shard, index_path))
        if name not in headers[shard]:
            raise InputError(f"{index_path}: places tensor {name} in {shard}, which does not hold it")
        entries[name] = headers[shard][name]
    for shard, header in headers.items():
        unlisted = next((name for name in header if index.weight_map.get(name) != shard), None)
        if unlisted is not None:
            raise InputError(f"{index_path}: tensor {unlisted} in {shard} is not in the index (an incomplete index?)")
    return entries


def open_model(path: str | os.PathLike, allow_pickle: bool = False) -> ModelSource:
    """Open a HF model folder (single or sharded safetensors) or one .safetensors file, lazily.

    Reads stay inside what the user named: shards and config.json are regular files inside the folder.
    """
    path = Path(path)
    if os.path.lexists(path) and not path.is_dir():
        if path.suffix != ".safetensors":
            raise InputError(f"{path}: not a .safetensors file")
        return _nonempty(ModelSource(path, read_header(path), None))
    if not path.is_dir():
        raise InputError(f"{path}: no such file or folder")
    check_folder_files(path)  # every side file too: transformers and PEFT open them by name later
    config = read_model_config(path)
    if os.path.lexists(path / INDEX_FILE):
        return _nonempty(ModelSource(path, _indexed_entries(path), config))
    shards = sorted(p for p in path.glob("*.safetensors") if not p.name.startswith("adapter_model"))
    if shards:
        entries: dict[str, TensorEntry] = {}
        for shard in shards:
            for name, entry in read_header(_weight_file(path, shard.name, path)).items():
                if name in entries:
                    raise InputError(
                        f"{path}: tensor {name} is in both {entries[name].file.name} and {shard.name}, and there is no index"
                    )
                entries[name] = entry
        return _nonempty(ModelSource(path, entries, config))
    pickles = sorted(path.glob("pytorch_model*.bin"))
    if pickles:
        if not allow_pickle:
            raise InputError(
                f"{path}: only pickle weights ({pickles[0].name}); refusing to unpickle untrusted files "
                "(convert to safetensors, or pass --allow-pickle)"
            )
        return _nonempty(PickleSource(path, [_weight_file(path, p.name, path) for p in pickles], config))
    raise InputError(f"{path}: no weights found (expected {SINGLE_FILE} or {INDEX_FILE}){inner_models_hint(path)}")


def _nonempty(source: ModelSource) -> ModelSource:
    if not source.names:
        raise InputError(f"{source.path}: holds no tensors (an empty safetensors header)")
    return source


@dataclass(frozen=True)
class PlannedTensor:
    """An output tensor known before any data is computed: enough to lay out every shard header."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def split_into_shards(tensors: Sequence[PlannedTensor], max_shard_bytes: int) -> list[list[PlannedTensor]]:
    """Greedy, order-preserving split like HF's: a tensor larger than the limit gets a shard of its own."""
    shards: list[list[PlannedTensor]] = [[]]
    filled = 0
    for tensor in tensors:
        if shards[-1] and filled + tensor.nbytes > max_shard_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(tensor)
        filled += tensor.nbytes
    return shards


def _header_bytes(tensors: Sequence[PlannedTensor]) -> bytes:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for tensor in tensors:
        header[tensor.name] = {
            "dtype": DTYPE_CODES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + tensor.nbytes],
        }
        offset += tensor.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


class ShardedWriter:
    """Writes tensors in planned order straight to disk.

    The layout (which shard, which offset) is fixed from shapes and dtypes before any data exists, so every
    shard's header goes out first and each tensor is appended as soon as it is computed: no shard is ever
    buffered in memory. Shards are written past the page cache where the filesystem allows (`DirectFile`) and
    synced as each one is finished. Use it as a context manager: leaving on an error closes the open shard
    without finishing it.
    """

    def __init__(self, folder: Path, tensors: Sequence[PlannedTensor], max_shard_bytes: int):
        self.folder = Path(folder)
        self.shards = split_into_shards(tensors, max_shard_bytes)
        count = len(self.shards)
        self.file_names = (
            [SINGLE_FILE] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        )
        self._queue = [(shard_index, tensor) for shard_index, shard in enumerate(self.shards) for tensor in shard]
        self._position = 0
        self._rows_written = 0  # of the tensor at `_position`, when it comes in row slabs
        self._open_shard = -1
        self._handle = None

    def write(self, name: str, tensor: torch.Tensor, first_row: int = 0) -> None:
        """Append the planned tensor `name`, whole or as its rows from `first_row` on (row slabs, in order)."""
        shard_index, planned = self._queue[self._position]
        shape = tuple(tensor.shape)
        fits = (
            shape == planned.shape
            if not planned.shape
            else (
                shape[1:] == planned.shape[1:]
                and first_row == self._rows_written
                and first_row + shape[0] <= planned.shape[0]
            )
        )
        if name != planned.name or not fits or tensor.dtype != planned.dtype:
            raise RuntimeError(
                f"writer expected {planned} from row {self._rows_written}, got {name} {shape} "
                f"{tensor.dtype} from row {first_row}"
            )
        with self._naming_failed_file():
            if shard_index != self._open_shard:
                self._start_shard(shard_index)
            if tensor.numel():
                data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
                self._handle.write(memoryview(data.numpy()))
        self._rows_written += shape[0] if shape else 0
        if not planned.shape or self._rows_written == planned.shape[0]:
            self._position += 1
            self._rows_written = 0

    @contextmanager
    def _naming_failed_file(self):
        """A failed write (a full disk) names the file being written: OSError from write() carries no filename."""
        try:
            yield
        except OSError as error:
            if error.filename is not None:
                raise
            where = getattr(self._handle, "name", self.folder)
            raise OSError(error.errno, error.strerror or str(error), str(where)) from None

    def __enter__(self) -> ShardedWriter:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if self._handle is not None:
            self._handle.abandon()
            self._handle = None

    def _start_shard(self, shard_index: int) -> None:
        if self._handle is not None:
            with self._naming_failed_file():
                self._handle.close()
        self._handle = DirectFile(self.folder / self.file_names[shard_index])
        self._handle.write(_header_bytes(self.shards[shard_index]))
        self._open_shard = shard_index

    def close(self) -> None:
        """Finish the last shard and, for several shards, write the index; refuses an unfinished plan."""
        if self._position != len(self._queue):
            raise RuntimeError(f"writer closed after {self._position} of {len(self._queue)} tensors")
        if self._handle is not None:
            with self._naming_failed_file():
                self._handle.close()
            self._handle = None
        if len(self.shards) > 1:
            index = {
                "metadata": {"total_size": sum(t.nbytes for shard in self.shards for t in shard)},
                "weight_map": {t.name: self.file_names[i] for i, shard in enumerate(self.shards) for t in shard},
            }
            (self.folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
