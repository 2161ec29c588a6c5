"""What to merge: the merge configuration, validated before any tensor is read against its method's declaration
(merge/methods/), and how a parameter's value spec resolves per tensor.

A `MergeConfig` is built from either YAML schema (ours or mergekit's) by `merge/schema.py`, which reads
files and flags into it; this module knows nothing of the schemas.

Parameter values take three forms, as in mergekit:
- a number: the same everywhere;
- a list of numbers: a gradient across layers, linearly interpolated from the first layer to the last
  (embeddings take the first value; the final norm and the head take the last one, or the first in
  mergekit_compat mode, where mergekit plans them at t=0 too);
- a list of `{filter: SUBSTRING, value: ...}` entries: the first entry whose filter occurs in the tensor
  name applies; an entry without a filter (or with `filter: "*"`) is the default.
"""

from __future__ import annotations

import copy
import math
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from mergekit_lite.errors import InputError
from mergekit_lite.io.hub import reference_paths, resolve_model
from mergekit_lite.io.validation import parse_size, require_regular
from mergekit_lite.merge import methods
from mergekit_lite.merge.methods.registry import Method, did_you_mean
from mergekit_lite.merge.methods.task_vectors import DARE_MASK_VERSION

DTYPES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float32": "float32",
    "float": "float32",
}
TOKENIZER_SOURCES = ("base", "union")
OUT_QUANTS = ("fp8-block",)  # the merge re-quantized to its fp8 input's block scheme (io/quantized.py)


@dataclass
class ModelSpec:
    """One input model (a folder, a .safetensors file, a LoRA adapter folder or a hub id) and its own parameters."""

    path: str
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SliceSource:
    """Layers [start, end) of one model (mergekit's `layer_range`: end exclusive), with parameters for this slice."""

    model: str
    layer_range: tuple[int, int]
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Slice:
    """A run of output layers (mergekit's `slices:` entry). Every source gives the same number of layers;
    layer k of the slice merges layer start+k of each source with the config's method (`passthrough`:
    one source, copied). Output layers are the slices stacked in order. `base` is this slice's base
    model where it differs from the config's; `parameters` override the config's for this slice.
    """

    sources: list[SliceSource]
    base: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)

    @property
    def n_layers(self) -> int:
        start, end = self.sources[0].layer_range
        return end - start


@dataclass
class RecallSettings:
    """Where RECALL gets its typical samples and how it turns similarities into weights."""

    texts: str | None = None
    samples: int = 8
    embed_rule: str = "nearest"
    reference: int = -1
    weights_file: str | None = None
    max_length: int = 256
    bandwidth: str | float = "median"  # RBF sigma: "median" heuristic per layer, or a fixed number
    special_tokens: bool = False  # include BOS/EOS in the token mean


@dataclass
class MergeConfig:
    method: str
    models: list[ModelSpec]
    base: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    dtype: str | None = None  # the stored dtype (mergekit's out_dtype); the math is always float32
    out_quant: str | None = None  # "fp8-block": the merge re-quantized to its fp8 input's block scheme
    seed: int = 0
    out_shard_size: int = 5 * 10**9
    copy_files_from: str | None = None
    skip: list[str] = field(default_factory=list)
    recall: RecallSettings = field(default_factory=RecallSettings)
    allow_pickle: bool = False
    allow_nonfinite: bool = False
    force: bool = False
    device: str = "cpu"
    slices: list[Slice] = field(default_factory=list)  # mergekit's slices: set instead of models
    base_parameters: dict[str, Any] = field(default_factory=dict)  # the base's own entry under models:
    tokenizer_source: str | None = None  # "base", "union" or a model: the output vocabulary (merge/vocab.py)
    pad_to_multiple_of: int | None = None
    chat_template: str | None = None
    mergekit_compat: bool = False

    def __post_init__(self):
        self.validate()

    @property
    def inputs(self) -> list[str]:
        """Every input model once, in merge order: the base first (when given), then the models (or the
        slices' sources in order of appearance)."""
        references = ([self.base] if self.base else []) + [spec.path for spec in self.models]
        for part in self.slices:
            for reference in [part.base] + [source.model for source in part.sources]:
                if reference and reference not in references:
                    references.append(reference)
        return references

    @property
    def read_paths(self) -> list[str | None]:
        """Everything the merge reads (both parts of a model+lora): an output may not be, hold or sit inside one."""
        return [*reference_paths(*self.inputs), self.copy_files_from, self.recall.texts, self.recall.weights_file]

    def parameter(self, name: str, model_index: int | None = None) -> Any:
        """A parameter's raw value spec: the model's own, else the global one, else the default; a filter list
        that matches no tensor passes it on to the next of them (`fall_through`)."""
        own = self.models[model_index].parameters.get(name) if model_index is not None else None
        return fall_through(own, self.parameters.get(name), self.default(name))

    def default(self, name: str) -> Any:
        """A parameter's default for this method, mergekit's in mergekit_compat mode (for a parameter the method
        does not take, the default of the methods that do)."""
        if name in self.merge_method.parameter_names:
            return self.merge_method.default(name, self.mergekit_compat)
        parameter = methods.PARAMETERS.get(name)
        return None if parameter is None else parameter.default

    @property
    def merge_method(self) -> Method:
        """The registered method this config merges with."""
        return methods.method(self.method)

    def with_parameter(self, name: str, value: Any) -> MergeConfig:
        """A copy with one global parameter set (what a sweep varies)."""
        copied = copy.deepcopy(self)
        return replace(copied, parameters={**copied.parameters, name: value})

    def validate(self) -> None:
        method = self.merge_method
        if bool(self.models) == bool(self.slices):
            raise InputError(
                "no models to merge (give --model, or models: in the config)"
                if not self.slices
                else "give models: or slices:, not both"
            )
        allowed = method.parameter_names
        self._check_parameters(self.parameters, allowed, "parameter", per_model=False)
        for spec in self.models:
            self._check_parameters(spec.parameters, allowed, f"model {spec.path}: parameter", per_model=True)
        self._check_parameters(self.base_parameters, allowed, f"base {self.base}: parameter", per_model=True)
        for number, part in enumerate(self.slices):
            self._check_slice(number, part, allowed)
        if "drop" in allowed:
            self._density_to_drop()
        method.check(self)
        if not self.slices:
            if method.needs_base and not self.base:
                raise InputError(f"{self.method} needs a base model (--base)")
            method.check_inputs(self)
        if self.dtype is not None:
            if str(self.dtype).lower() not in DTYPES:
                raise InputError(f"unknown dtype {self.dtype!r} (use bf16, fp16 or fp32)")
            self.dtype = DTYPES[str(self.dtype).lower()]
        if self.out_quant is not None and self.out_quant not in OUT_QUANTS:
            raise InputError(f"unknown out_quant {self.out_quant!r} (use {', '.join(OUT_QUANTS)})")
        if isinstance(self.out_shard_size, bool) or not isinstance(self.out_shard_size, (int, str)):
            raise InputError(f"out_shard_size: expected a size like 2GB or a byte count, got {self.out_shard_size!r}")
        self.out_shard_size = parse_size(self.out_shard_size)
        if self.device not in ("cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise InputError(f"unknown device {self.device!r} (use cpu or cuda)")
        if self.chat_template and self.chat_template not in ("auto", "chatml") and "{" not in self.chat_template:
            raise InputError(
                f"chat_template {self.chat_template!r}: give auto, chatml or a Jinja template "
                "(mergekit's other bundled template names are not included)"
            )
        if self.pad_to_multiple_of is not None and (self.pad_to_multiple_of < 1 or not self.tokenizer_source):
            raise InputError("tokenizer pad_to_multiple_of must be a positive integer, with a tokenizer source")

    def resolve_references(self) -> None:
        """Hub ids become snapshot folders in the Hugging Face cache (io/hub.py); local paths stay as they are.
        Called by the plan, so a config can be read and checked without fetching anything."""
        self.base = resolve_model(self.base) if self.base else None
        self.models = [ModelSpec(resolve_model(spec.path), spec.parameters) for spec in self.models]
        self.slices = [
            Slice(
                [SliceSource(resolve_model(s.model), s.layer_range, s.parameters) for s in part.sources],
                resolve_model(part.base) if part.base else None,
                part.parameters,
            )
            for part in self.slices
        ]
        if self.copy_files_from and self.copy_files_from != "base":
            self.copy_files_from = resolve_model(self.copy_files_from)
            if os.path.exists(self.copy_files_from) and not os.path.isdir(self.copy_files_from):
                raise InputError(
                    f"{self.copy_files_from}: --copy-files-from takes a model folder (its config and "
                    "tokenizer files are copied), not a file"
                )
        if self.tokenizer_source and self.tokenizer_source not in TOKENIZER_SOURCES:
            self.tokenizer_source = resolve_model(self.tokenizer_source)
        for path in reference_paths(*self.inputs):
            if not os.path.lexists(path):
                raise InputError(f"{path}: no such file or folder")
        for path, what in ((self.recall.texts, "text file"), (self.recall.weights_file, "weights file")):
            if path and self.merge_method.reads_recall_weights:
                require_regular(path, what)

    def unused_settings(self) -> list[str]:
        """Per-model settings of a parameter mergekit reads only from `parameters:` (lambda, normalize, ...):
        mergekit accepts them and ignores them, so mergekit_compat mode does too, and the plan says so."""
        owners = (
            [(f"model {spec.path}", spec.parameters) for spec in self.models]
            + [(f"base {self.base}", self.base_parameters)]
            + [
                (f"slices[{number}]: {source.model}", source.parameters)
                for number, part in enumerate(self.slices)
                for source in part.sources
            ]
        )
        return [
            f"{owner}: {name} has no effect per model (mergekit reads it from parameters: only)"
            for owner, parameters in owners
            for name in parameters
            if not self._per_model(name)
        ]

    def _per_model(self, name: str) -> bool:
        """Whether this config's method declares `name` settable per model."""
        declared = self.merge_method.parameter(name)
        return declared is not None and declared.per_model

    def _check_parameters(self, parameters: dict, allowed: set[str], where: str, per_model: bool) -> None:
        for name, value in parameters.items():
            if name not in allowed:
                raise InputError(
                    f"{where} {name!r} does not apply to method {self.method} "
                    f"(it takes {', '.join(sorted(allowed))}){did_you_mean(name, allowed)}"
                    if not per_model
                    else f"{where} {name!r} cannot be set per model for method {self.method}"
                )
            if per_model and not self._per_model(name) and not self.mergekit_compat:
                raise InputError(f"{where} {name!r} cannot be set per model for method {self.method}")
            _check_value(self.merge_method.parameter(name), value)

    def _check_slice(self, number: int, part: Slice, allowed: set[str]) -> None:
        where = f"slices[{number}]"
        if not part.sources:
            raise InputError(f"{where}: no sources")
        self._check_parameters(part.parameters, allowed, f"{where}: parameter", per_model=False)
        for source in part.sources:
            start, end = source.layer_range
            if not 0 <= start < end:
                raise InputError(
                    f"{where}: {source.model}: layer_range {[start, end]} must be [start, end) with 0 <= start < end"
                )
            if end - start != part.n_layers:
                raise InputError(
                    f"{where}: every source must give the same number of layers ({part.n_layers} and {end - start})"
                )
            self._check_parameters(source.parameters, allowed, f"{where}: {source.model}: parameter", per_model=True)

    def _density_to_drop(self) -> None:
        """DARE's `density` is mergekit's keep share: stored as our `drop` = 1 - density (gradients and
        filters too, since interpolation commutes with 1 - x)."""
        for parameters in [
            self.parameters,
            self.base_parameters,
            *(spec.parameters for spec in self.models),
            *(part.parameters for part in self.slices),
            *(source.parameters for part in self.slices for source in part.sources),
        ]:
            if "density" in parameters:
                if "drop" in parameters:
                    raise InputError(
                        f"{self.method}: give density (the share kept, as in mergekit) or drop "
                        "(the share dropped), not both"
                    )
                parameters["drop"] = _complement(parameters.pop("density"))

    def to_dict(self) -> dict:
        """mergekit-lite's own schema (what --dry-run's provenance file and flag overrides use)."""
        data = asdict(self)
        # under parameters:, where the own schema takes any per-model parameter (epsilon, gamma, scale too)
        data["models"] = [{"model": spec.path, "parameters": dict(spec.parameters)} for spec in self.models]
        for part in data["slices"]:
            for source in part["sources"]:
                source["layer_range"] = list(source["layer_range"])
        source, pad = data.pop("tokenizer_source"), data.pop("pad_to_multiple_of")
        data["tokenizer"] = {"source": source, "pad_to_multiple_of": pad} if source else None
        if self.merge_method.draws_dare_masks:  # which masks this seed gives (README, "DARE's masks")
            data["dare_mask_version"] = DARE_MASK_VERSION
        return data


# -------------------------------------------------------------------------------------------- value specs


def _check_value(parameter: methods.Parameter, value: Any) -> None:
    """Check every number a value spec can produce against the parameter's type and range (counts such as
    max_iter refuse 2.5 rather than truncate it)."""
    name = parameter.name
    if parameter.kind is bool:
        if not isinstance(value, bool):
            raise InputError(f"{name} must be true or false, got {value!r}")
        return
    for number in _numbers_in(name, value):
        if parameter.kind is int and not isinstance(number, int):
            raise InputError(f"{name} must be an integer, got {number!r}")
        if not math.isfinite(number):
            raise InputError(f"{name} must be a finite number, got {number}")
        if parameter.out_of_bounds(number):
            raise InputError(f"{name} must be in {parameter.bounds_text()}, got {number}")


def _numbers_in(name: str, value: Any) -> list[float]:
    if isinstance(value, bool):
        raise InputError(f"{name} must be a number, got {value!r}")
    if isinstance(value, (int, float)):
        return [value]
    if isinstance(value, dict):
        return _numbers_in(name, [value])
    if (
        isinstance(value, list)
        and value
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
    ):
        return list(value)
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        numbers = []
        for entry in value:
            unknown = set(entry) - {"filter", "value"}
            if unknown:
                key = sorted(unknown)[0]
                raise InputError(f"parameter {name}: unknown key {key!r}{did_you_mean(key, ['filter', 'value'])}")
            if "value" not in entry:
                raise InputError(f"parameter {name}: filter entry {entry} has no value")
            if "filter" in entry and not isinstance(entry["filter"], str):
                raise InputError(f"parameter {name}: filter must be a string, got {entry['filter']!r}")
            numbers += _numbers_in(name, entry["value"])
        return numbers
    raise InputError(
        f"parameter {name}: expected a number, a list of numbers, or a list of {{filter, value}}, got {value!r}"
    )


def _complement(value: Any) -> Any:
    """1 - x for every number of a value spec (density -> drop)."""
    if isinstance(value, dict):
        return {**value, "value": _complement(value["value"])}
    if isinstance(value, list):
        return [_complement(entry) for entry in value]
    return 1.0 - float(value)


def fall_through(*specs: Any) -> Any:
    """Value specs from the highest precedence down (a model's own, a slice's, the global one, the default) as
    one spec, with mergekit's precedence: a level whose filter list matches no tensor name passes that tensor
    on to the next level. Filter lists are chained into one; the first number or gradient ends the chain, as
    it gives every tensor a value. None when no level sets the parameter."""
    entries: list[dict] = []
    for spec in specs:
        if spec is None:
            continue
        if isinstance(spec, dict) or (isinstance(spec, list) and spec and all(isinstance(e, dict) for e in spec)):
            entries.extend([spec] if isinstance(spec, dict) else spec)
            continue
        return [*entries, {"value": spec}] if entries else spec
    return entries or None


def resolve(
    name: str, value: Any, tensor_name: str, layer: int | None, n_layers: int, mergekit_compat: bool = False
) -> float | bool:
    """The number a value spec gives for one tensor (see the module docstring for the forms).

    Layers sit at t = layer / (n_layers - 1) along a gradient. Embeddings take t = 0; the final norm and
    the head take t = 1, or t = 0 with `mergekit_compat` (mergekit plans tensors outside the layers at t=0,
    and a single layer at t=1).
    """
    if isinstance(value, (bool, int, float)):
        return value if isinstance(value, bool) else float(value)
    if isinstance(value, dict):
        value = [value]
    if all(isinstance(v, dict) for v in value):
        for entry in value:
            if entry.get("filter") in (None, "*") or entry["filter"] in tensor_name:
                return resolve(name, entry["value"], tensor_name, layer, n_layers, mergekit_compat)
        raise InputError(f"parameter {name}: no filter matches tensor {tensor_name} and no default entry is given")
    if len(value) == 1:
        return float(value[0])
    if layer is None:
        position = 0.0 if is_embedding(tensor_name) or mergekit_compat else 1.0
    elif n_layers > 1:
        position = layer / (n_layers - 1)
    else:
        position = 1.0 if mergekit_compat else 0.0
    return float(np.interp(position * (len(value) - 1), np.arange(len(value)), value))


def is_embedding(tensor_name: str) -> bool:
    """Tensors that sit before the first layer (token/position embeddings)."""
    return any(part in tensor_name for part in ("embed", "wte", "wpe"))
