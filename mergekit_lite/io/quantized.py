"""Quantized checkpoints read as the dense model they stand for: one float32 tensor at a time, scales hidden.

Many post-trained models ship only quantized. Merging their stored codes and scales as if they were weights
averages numbers that mean nothing apart (a code is only a weight times its block's scale), so a quantized input
is recognised (config.json's `quantization_config`, else its tensor layout) and every packed weight is read back
under the dense weight's name, dequantized in float32. The schemes read:

- `fp8` (DeepSeek-V3/R1, Qwen3-*-FP8; transformers' FineGrainedFP8): `W.weight` in float8 (e4m3fn or e5m2) and
  `W.weight_scale_inv`, one float32 per `weight_block_size` block (ceil(rows/128) x ceil(cols/128) for 128x128;
  the last blocks of a dimension that is no multiple are partial), or a single one when the block size is null.
  Despite its name the scale multiplies: it is the inverse of the quantizer's scale. MXFP8's ue8m0 scales,
  stored as bytes, are 2**(byte - 127). Static activation scales are hidden.
- `compressed-tensors` float-quantized (llm-compressor's FP8): `W.weight` in float8 and `W.weight_scale`, per
  tensor, per output channel, per group or per block (the strategy in `config_groups`); `input_scale` and the
  kv-cache scales are hidden; a module the `ignore` list names must be stored dense.
- `mxfp4` (gpt-oss, OCP Microscaling Formats v1.0 §5): `P_blocks` uint8, two e2m1 codes a byte (the low nibble
  first), 32 codes a block, and `P_scales` uint8, one e8m0 exponent a block (bias 127, 255 is NaN). The dense
  tensor is named `P` and laid out (experts, in, out) as transformers' mxfp4 integration loads it, the layout
  of gpt-oss's dense checkpoints.

Other schemes (gptq, awq, bitsandbytes, gguf, ...) are refused in one line naming the scheme. Only the reading
is here; the merge writes dense tensors in bf16 (or --dtype, or a dense base's dtype) and drops the
`quantization_config` from the config it writes (merge/engine.py).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from mergekit_lite.errors import InputError
from mergekit_lite.io.safetensors import FLOAT8, ModelSource, open_model

SUPPORTED = ("fp8", "compressed-tensors", "mxfp4")
DENSE_DTYPE = torch.bfloat16  # what a dequantized tensor is written in unless --dtype (or a dense base) says
FP8_BLOCK = (128, 128)  # DeepSeek-V3's weight_block_size, the default when only the tensor layout says fp8
MX_BLOCK = 32  # OCP MX v1.0 §5: 32 elements share one e8m0 scale
E8M0_BIAS = 127
E8M0_NAN = 255
# OCP MX v1.0 §5.3.3: the 16 e2m1 codes (sign, 2 exponent bits with bias 1, 1 mantissa bit)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
COMPRESSED_FLOAT_FORMATS = ("float-quantized", "naive-quantized")
# Tensors a quantized checkpoint keeps for quantized inference only: static activation and kv-cache scales
ACTIVATION_SCALES = (".activation_scale", ".input_scale", ".output_scale", ".k_scale", ".v_scale", ".q_scale")
MXFP4_ROWS_PER_CHUNK = 1 << 16  # rows of 32 codes decoded at once: bounds the index temporaries


@dataclass(frozen=True)
class Packed:
    """One dense tensor as the checkpoint stores it: its codes, its scales, and how the two combine."""

    codes: str
    scales: str
    shape: tuple[int, ...]
    block: tuple[int, int] | None  # rows x columns sharing one scale; None for MXFP4 (32 along a row)
    grid: tuple[int, ...] = ()  # the scales' shape as the blocks lie ([..., row blocks, column blocks])


@dataclass(frozen=True)
class Quantization:
    """What a checkpoint's quantization is: the method (config.json's quant_method) and its description."""

    method: str
    description: str
    block: tuple[int, int] | None = None  # fp8's weight_block_size (None: one scale per tensor)


class QuantizedSource:
    """A quantized model seen as its dense model: packed weights dequantized to float32 on read, named as the
    dense weights, their scales hidden; every other tensor passed through as stored.

    `dtype` of a dequantized tensor is DENSE_DTYPE (what the merge writes it in by default), while `load` gives
    float32, as ModelSource does for float8 (the codes are read into `into`, the result is new memory)."""

    def __init__(self, source: ModelSource, quantization: Quantization, packed: dict[str, Packed], hidden: set[str]):
        self.source, self.quantization, self.packed = source, quantization, packed
        self.path, self.config = source.path, source.config
        codes = {item.codes: name for name, item in packed.items()}
        self._names = [codes.get(name, name) for name in source.names if name not in hidden or name in codes]
        self._shown = set(self._names)

    @property
    def names(self) -> list[str]:
        return list(self._names)

    def __contains__(self, name: str) -> bool:
        return name in self._shown

    def shape(self, name: str) -> tuple[int, ...]:
        return self.packed[name].shape if name in self.packed else self.source.shape(name)

    def dtype(self, name: str) -> torch.dtype:
        return DENSE_DTYPE if name in self.packed else self.source.dtype(name)

    def load(self, name: str, into: torch.Tensor | None = None) -> torch.Tensor:
        if name not in self.packed:
            return self.source.load(name, into)
        item = self.packed[name]
        codes, scales = self.source.load(item.codes, into), self.source.load(item.scales)
        if item.block is None:
            return mxfp4_dense(codes, scales)
        return scaled_dense(codes.to(torch.float32), scale_values(scales).reshape(item.grid), item.block)

    def close(self) -> None:
        self.source.close()

    def describe(self) -> str:
        """One line for notes and the model card: what was dequantized."""
        return f"{len(self.packed)} tensors dequantized from {self.quantization.description}"


# --- the arithmetic ------------------------------------------------------------------------------------------


def scale_values(scales: torch.Tensor) -> torch.Tensor:
    """Stored scales as float32: floats as they are, ue8m0 bytes (MXFP8) as 2**(byte - 127)."""
    if scales.dtype == torch.uint8:
        return e8m0_values(scales)
    return scales.to(torch.float32)


def e8m0_values(exponents: torch.Tensor) -> torch.Tensor:
    """OCP MX v1.0 §5.4.1: an e8m0 byte is 2**(byte - 127), 255 is NaN; exact in float32 (2**-127 is subnormal)."""
    values = torch.exp2(exponents.to(torch.float32) - E8M0_BIAS)
    return values.masked_fill_(exponents == E8M0_NAN, math.nan)


def scaled_dense(codes: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """`codes` (float32, [..., rows, cols]) times the scale of the block each entry is in, in place: block
    (i, j) holds rows [i*br, (i+1)*br) and columns [j*bc, (j+1)*bc), the last ones partial. One float32
    product per entry (the codes are exact in float32), the whole column blocks in one broadcast product and
    a partial last one after it, so no scale tensor of the weight's size is made."""
    return _by_blocks(codes, scales, block, torch.Tensor.mul_)


def _by_blocks(values: torch.Tensor, scales: torch.Tensor, block: tuple[int, int], operation) -> torch.Tensor:
    """`operation(part, its scales)` in place over `values` ([..., rows, cols]) block by block: the whole column
    blocks in one broadcast, a partial last one after them."""
    rows, cols = values.shape[-2:]
    block_rows, block_cols = block
    by_row = scales.repeat_interleave(block_rows, dim=-2)[..., :rows, :]  # [..., rows, column blocks]
    whole = cols // block_cols
    if whole:
        operation(values[..., : whole * block_cols].unflatten(-1, (whole, block_cols)), by_row[..., :whole, None])
    if cols % block_cols:
        operation(values[..., whole * block_cols :], by_row[..., whole:])
    return values


def mxfp4_dense(blocks: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """gpt-oss's MXFP4 experts, [experts, rows, groups, 16] bytes and [experts, rows, groups] exponents, as the
    dense (experts, groups*32, rows) float32 tensor: each byte's low nibble is the earlier element, each element
    its e2m1 value times its block's 2**(exponent - 127) (exact, short of overflow). Decoded in chunks of rows
    straight into the transposed output, so the index temporaries stay small."""
    experts, rows, groups, width = blocks.shape
    out = torch.empty((experts, groups * 2 * width, rows), dtype=torch.float32)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    flat_blocks = blocks.reshape(-1, groups, width)
    flat_scales = e8m0_values(exponents).reshape(-1, groups, 1)
    for begin in range(0, flat_blocks.shape[0], MXFP4_ROWS_PER_CHUNK):
        end = min(begin + MXFP4_ROWS_PER_CHUNK, flat_blocks.shape[0])
        codes = flat_blocks[begin:end]
        values = torch.stack((table[(codes & 0x0F).long()], table[(codes >> 4).long()]), dim=-1)
        values = values.reshape(end - begin, groups, 2 * width).mul_(flat_scales[begin:end])
        _store_rows(out.transpose(-1, -2), begin, values.reshape(end - begin, groups * 2 * width))
    return out


def _store_rows(decoded_rows: torch.Tensor, begin: int, values: torch.Tensor) -> None:
    """Write `values`, the flat rows from `begin` on (the rows of every expert, in order), into `decoded_rows`
    ([experts, rows, cols], a transposed view of the output)."""
    rows, end = decoded_rows.shape[-2], begin + values.shape[0]
    while begin < end:
        expert, row = divmod(begin, rows)
        stop = min(end, (expert + 1) * rows)
        decoded_rows[expert, row : row + stop - begin].copy_(values[: stop - begin])
        values, begin = values[stop - begin :], stop


def fp8_blocks(
    tensor: torch.Tensor, block: tuple[int, int], dtype: torch.dtype = torch.float8_e4m3fn
) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense [..., rows, cols] tensor as block-scaled FP8, the inverse of `scaled_dense`: per block the
    scale maps its largest magnitude onto the format's largest finite value (DeepSeek-V3's weight quantizer;
    1 for an all-zero block), codes = value / scale rounded to nearest. Returns (codes, scale_inv), the scales
    as the `weight_scale_inv` a checkpoint stores (float32, [..., ceil(rows/br), ceil(cols/bc)]). One float32
    copy of the tensor; the largest magnitudes are found a column band of blocks at a time."""
    codes = tensor.to(torch.float32, copy=True)
    cols, (block_rows, block_cols) = codes.shape[-1], block
    bands = [slice(start, min(start + block_cols, cols)) for start in range(0, cols, block_cols)]
    largest = torch.stack([_row_block_max(codes[..., band], block_rows) for band in bands], dim=-1)
    limit = torch.finfo(dtype).max
    scales = torch.where(largest > 0, largest / limit, torch.ones_like(largest))
    _by_blocks(codes, scales, block, torch.Tensor.div_)
    return codes.clamp_(-limit, limit).to(dtype), scales


def _row_block_max(band: torch.Tensor, block_rows: int) -> torch.Tensor:
    """The largest magnitude of each block of `block_rows` rows of a column band ([..., rows, band columns])."""
    by_row = band.abs().amax(dim=-1)
    by_row = torch.nn.functional.pad(by_row, (0, -by_row.shape[-1] % block_rows))
    return by_row.unflatten(-1, (-1, block_rows)).amax(dim=-1)


# --- recognising a checkpoint --------------------------------------------------------------------------------


def quantization_of(source: ModelSource) -> Quantization | None:
    """The checkpoint's quantization from config.json's `quantization_config`, else from its tensor layout; None
    for a dense checkpoint. A scheme this module does not read is refused, naming it."""
    settings = (source.config or {}).get("quantization_config")
    if settings is None:
        return _from_layout(source)
    if not isinstance(settings, dict) or not isinstance(settings.get("quant_method"), str):
        raise InputError(f"{source.path}: config.json's quantization_config names no quant_method")
    method = settings["quant_method"]
    if method == "fp8":
        return _fp8(source, settings)
    if method == "compressed-tensors":
        return _compressed_tensors(source, settings)
    if method == "mxfp4":
        return Quantization("mxfp4", "mxfp4 (e2m1 codes, e8m0 scales per 32)")
    raise _unsupported(source, method)


def _unsupported(source: ModelSource | Path, scheme: str) -> InputError:
    return InputError(
        f"{getattr(source, 'path', source)}: quantized with {scheme}, which mergekit-lite does not read (it reads "
        f"{', '.join(SUPPORTED)}); give the dense checkpoint"
    )


def _fp8(source: ModelSource, settings: dict) -> Quantization:
    block = settings.get("weight_block_size", list(FP8_BLOCK))
    if block is not None and not (
        isinstance(block, list) and len(block) == 2 and all(isinstance(n, int) and n > 0 for n in block)
    ):
        raise InputError(f"{source.path}: config.json's weight_block_size must be [rows, cols] or null, got {block}")
    shown = "per tensor" if block is None else f"{block[0]}x{block[1]} blocks"
    return Quantization("fp8", f"fp8 ({shown})", None if block is None else tuple(block))


def _compressed_tensors(source: ModelSource, settings: dict) -> Quantization:
    """compressed-tensors checkpoints: only float-quantized (naive-quantized) 8-bit float weights, dense-sparse."""
    groups = settings.get("config_groups") or {}
    if not isinstance(groups, dict):
        raise InputError(f"{source.path}: config.json's config_groups must be an object")
    formats = {settings.get("format")} | {group.get("format") for group in groups.values() if isinstance(group, dict)}
    formats.discard(None)
    unread = sorted(str(name) for name in formats - set(COMPRESSED_FLOAT_FORMATS))
    if unread:
        raise _unsupported(source, f"compressed-tensors {unread[0]}")
    if settings.get("sparsity_config"):
        kind = (
            settings["sparsity_config"].get("format", "sparse")
            if isinstance(settings["sparsity_config"], dict)
            else "sparse"
        )
        raise _unsupported(source, f"compressed-tensors {kind}")
    strategies, blocks = set(), set()
    for group in groups.values():
        weights = (group or {}).get("weights") if isinstance(group, dict) else None
        if not weights:
            continue
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise _unsupported(
                source, f"compressed-tensors {weights.get('num_bits')}-bit {weights.get('type')} weights"
            )
        if weights.get("symmetric") is False:
            raise _unsupported(source, "compressed-tensors asymmetric FP8 (zero points)")
        strategies.add(str(weights.get("strategy", "tensor")))
        if weights.get("block_structure"):
            blocks.add(tuple(weights["block_structure"]))
    if len(blocks) > 1:
        raise _unsupported(source, f"compressed-tensors FP8 in several block sizes ({sorted(blocks)})")
    shown = ", ".join(sorted(strategies)) or "tensor"
    return Quantization("compressed-tensors", f"compressed-tensors FP8 ({shown})", blocks.pop() if blocks else None)


def _from_layout(source: ModelSource) -> Quantization | None:
    """A checkpoint without quantization_config is still quantized when its tensors say so."""
    names = set(source.names)

    def float8(name: str) -> bool:
        return name in names and source.dtype(name) in FLOAT8

    def uint8(name: str) -> bool:
        return name in names and source.dtype(name) == torch.uint8

    if any(name.endswith(".weight_scale_inv") and float8(name.removesuffix("_scale_inv")) for name in names):
        return Quantization("fp8", f"fp8 ({FP8_BLOCK[0]}x{FP8_BLOCK[1]} blocks, from the tensor layout)", FP8_BLOCK)
    if any(
        name.endswith("_blocks") and uint8(name) and uint8(name.removesuffix("_blocks") + "_scales") for name in names
    ):
        return Quantization("mxfp4", "mxfp4 (from the tensor layout)")
    if any(name.endswith(".weight_scale") and float8(name.removesuffix("_scale")) for name in names):
        return Quantization("compressed-tensors", "compressed-tensors FP8 (from the tensor layout)")
    if any(name.endswith((".qweight", ".qzeros")) for name in names):
        raise _unsupported(source, "gptq or awq (packed qweight/qzeros tensors)")
    if any(name.endswith((".absmax", ".quant_map", ".SCB")) or ".quant_state." in name for name in names):
        raise _unsupported(source, "bitsandbytes")
    return None


def packed_tensors(source: ModelSource, quantization: Quantization) -> tuple[dict[str, Packed], set[str]]:
    """dense name -> how it is stored, and the stored names the dense model does not have (scales, activation
    scales). Every float8 weight must have its scale, every scale its weight."""
    names = set(source.names)
    if quantization.method == "mxfp4":
        packed = {
            name.removesuffix("_blocks"): _mxfp4(source, name, name.removesuffix("_blocks") + "_scales")
            for name in source.names
            if name.endswith("_blocks") and name.removesuffix("_blocks") + "_scales" in names
        }
        hidden = {item.scales for item in packed.values()} | set(item.codes for item in packed.values())
        return packed, hidden | _activation_scales(names)
    suffix = "_scale_inv" if quantization.method == "fp8" else "_scale"
    ignored = _ignored(source) if quantization.method == "compressed-tensors" else None
    packed = {}
    for name in source.names:
        scale = name + suffix
        if source.dtype(name) in FLOAT8 and scale not in names:
            raise InputError(f"{source.path}: tensor {name} is float8 but has no {scale} to dequantize it with")
        if scale in names:
            if ignored is not None and ignored(name.removesuffix(".weight")):
                raise InputError(
                    f"{source.path}: tensor {name} is stored quantized, but its module is on quantization_config's "
                    "ignore list"
                )
            packed[name] = _scaled(source, name, scale, quantization.block)
    orphans = sorted(n for n in names if n.endswith(".weight" + suffix) and n.removesuffix(suffix) not in names)
    if orphans:
        raise InputError(f"{source.path}: scale {orphans[0]} has no tensor {orphans[0].removesuffix(suffix)}")
    return packed, {item.scales for item in packed.values()} | _activation_scales(names)


def _activation_scales(names: set[str]) -> set[str]:
    return {name for name in names if name.endswith(ACTIVATION_SCALES) or name.endswith(".weight_zero_point")}


def _ignored(source: ModelSource):
    """compressed-tensors' `ignore`: module names, or `re:` patterns matched against them."""
    entries = (source.config or {}).get("quantization_config", {}).get("ignore") or []
    exact = {entry for entry in entries if isinstance(entry, str) and not entry.startswith("re:")}
    patterns = [re.compile(entry[3:]) for entry in entries if isinstance(entry, str) and entry.startswith("re:")]
    return lambda module: module in exact or any(pattern.match(module) for pattern in patterns)


def _scaled(source: ModelSource, name: str, scale: str, configured: tuple[int, int] | None) -> Packed:
    """A float8 weight and its scales: one per tensor, or a grid of blocks (per channel is a block of one row,
    a group one of one row and group columns). The block is the configured one (fp8's weight_block_size,
    compressed-tensors' block_structure) where the grid has several blocks, else read from the grid's shape."""
    shape, grid = source.shape(name), source.shape(scale)
    if source.dtype(name) not in FLOAT8:
        raise InputError(f"{source.path}: tensor {name} has scales {scale} but is {source.dtype(name)}, not float8")
    if len(shape) < 2:
        raise InputError(f"{source.path}: quantized tensor {name} has shape {list(shape)}; expected a matrix")
    rows, cols = shape[-2:]
    if math.prod(grid) == 1:
        return Packed(name, scale, shape, (rows, cols), (1,) * len(shape))
    grid_rows, grid_cols = (grid[-2], grid[-1]) if len(grid) >= 2 else (grid[0], 1)
    block = configured or (math.ceil(rows / grid_rows), math.ceil(cols / grid_cols))
    expected = (*shape[:-2], math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    if tuple(grid) != expected and not (len(grid) == 1 and (grid[0], 1) == expected[-2:]):
        raise InputError(
            f"{source.path}: scales {scale} have shape {list(grid)}; {block[0]}x{block[1]} blocks of {name} "
            f"{list(shape)} need {list(expected)}"
        )
    return Packed(name, scale, shape, block, expected)


def _mxfp4(source: ModelSource, blocks: str, scales: str) -> Packed:
    """gpt-oss's expert blocks [experts, rows, groups, 16] and scales [experts, rows, groups], both uint8."""
    shape, grid = source.shape(blocks), source.shape(scales)
    if source.dtype(blocks) != torch.uint8 or source.dtype(scales) != torch.uint8:
        raise InputError(f"{source.path}: MXFP4 tensors {blocks} and {scales} must be uint8")
    if len(shape) != 4 or shape[-1] * 2 != MX_BLOCK or tuple(grid) != tuple(shape[:-1]):
        raise InputError(
            f"{source.path}: MXFP4 tensor {blocks} {list(shape)} with scales {list(grid)}: expected gpt-oss's "
            f"[experts, rows, groups, {MX_BLOCK // 2}] and [experts, rows, groups]"
        )
    experts, rows, groups, _ = shape
    return Packed(blocks, scales, (experts, groups * MX_BLOCK, rows), None)


# --- opening -------------------------------------------------------------------------------------------------


def dequantized(source: ModelSource, refuse_unread: bool = True) -> ModelSource | QuantizedSource:
    """`source` as its dense model: a QuantizedSource where it is quantized, else itself. A scheme this module does
    not read is refused, or with `refuse_unread` False the source is given as stored (for a caller that reports
    such a model itself: the adapter audit's verdict on a quantised base)."""
    try:
        quantization = quantization_of(source)
    except InputError:
        if refuse_unread:
            raise
        return source
    if quantization is None:
        return source
    packed, hidden = packed_tensors(source, quantization)
    if not packed:
        raise InputError(f"{source.path}: config.json says {quantization.method}, but no tensor is stored quantized")
    return QuantizedSource(source, quantization, packed, hidden)


def open_dense(path, allow_pickle: bool = False, refuse_unread: bool = True) -> ModelSource | QuantizedSource:
    """A model folder or safetensors file opened as its dense model (see `dequantized`); GGUF files refused."""
    _refuse_gguf(Path(path))
    return dequantized(open_model(path, allow_pickle=allow_pickle), refuse_unread)


def _refuse_gguf(path: Path) -> None:
    folder_of_gguf = path.is_dir() and not any(path.glob("*.safetensors")) and any(path.glob("*.gguf"))
    if path.suffix == ".gguf" or folder_of_gguf:
        raise _unsupported(path, "gguf")


def _wrapped(source):
    """`source` and the sources it wraps (renamed, adapted, padded), outermost first."""
    seen = set()
    while source is not None and id(source) not in seen:
        seen.add(id(source))
        yield source
        source = getattr(source, "source", None) or getattr(source, "base", None)


def quantized_inputs(sources) -> list[QuantizedSource]:
    """The quantized models behind `sources`, through the wrappers that rename, adapt or pad them."""
    found = (next((link for link in _wrapped(source) if isinstance(link, QuantizedSource)), None) for source in sources)
    return [source for source in found if source is not None]


def dequantized_on_read(source, name: str) -> bool:
    """Whether `source` (through the wrappers that rename, adapt or pad it) reads tensor `name` dequantized:
    a float32 copy in new memory, outside the engine's ring."""
    for link in _wrapped(source):
        if isinstance(link, QuantizedSource):
            return name in link.packed
        name = getattr(link, "name_map", {}).get(name, name)
    return False
