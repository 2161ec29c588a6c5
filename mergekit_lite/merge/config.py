"""What to merge: the merge configuration (from YAML or flags), validated before any tensor is read.

Two YAML schemas are read into one `MergeConfig`:
- mergekit-lite's own: `method`, `base`, `models` (with `weight` / `density` / `drop`), `dtype` (stored dtype), ...
- mergekit's, as it is: `merge_method`, `base_model`, `models` or `slices`, `dtype` (its compute dtype) and
  `out_dtype`, `tokenizer_source` or `tokenizer: {source: ...}`, `chat_template`, ... A file in this schema runs
  in `mergekit_compat` mode unless it says `mergekit_compat: false`: mergekit's defaults (MERGEKIT_DEFAULTS)
  and its rules where ours differ on purpose (see the README's "Coming from mergekit").
Strict pydantic models check the structure (a quoted "false" is not a boolean, `skip` must be a list);
errors name the file, the key and what was expected, and an unknown key gets a did-you-mean.

Parameter values take three forms, as in mergekit:
- a number: the same everywhere;
- a list of numbers: a gradient across layers, linearly interpolated from the first layer to the last
  (embeddings take the first value; the final norm and the head take the last one, or the first in
  mergekit_compat mode, where mergekit plans them at t=0 too);
- a list of `{filter: SUBSTRING, value: ...}` entries: the first entry whose filter occurs in the tensor
  name applies; an entry without a filter (or with `filter: "*"`) is the default.
"""

from __future__ import annotations

import difflib
import math
import typing
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
)

from mergekit_lite.errors import InputError
from mergekit_lite.io.hub import resolve_model
from mergekit_lite.io.safetensors import parse_size
from mergekit_lite.merge.methods import DARE_MASK_VERSION, TASK_VECTOR_METHODS

# The method registry: the parameters each method takes, and its main coefficient (what a sweep varies).
METHOD_PARAMETERS = {
    "linear": {"alpha", "weight", "normalize"},
    "slerp": {"t"},
    "nearswap": {"t"},
    "sce": {"select_topk", "int8_mask"},
    "task_arithmetic": {"lambda", "weight", "normalize", "int8_mask", "rescale"},
    "ties": {"lambda", "weight", "density", "normalize", "int8_mask", "rescale"},
    "dare_linear": {"lambda", "weight", "drop", "density", "normalize", "int8_mask", "rescale"},
    "dare_ties": {"lambda", "weight", "drop", "density", "normalize", "int8_mask", "rescale"},
    "della": {"lambda", "weight", "density", "epsilon", "normalize", "int8_mask", "rescale"},
    "della_linear": {"lambda", "weight", "density", "epsilon", "normalize", "int8_mask", "rescale"},
    "breadcrumbs": {"lambda", "weight", "density", "gamma", "normalize", "int8_mask", "rescale"},
    "breadcrumbs_ties": {"lambda", "weight", "density", "gamma", "normalize", "int8_mask", "rescale"},
    "model_stock": {"filter_wise"},
    "nuslerp": {"weight", "nuslerp_flatten", "nuslerp_row_wise"},
    "multislerp": {"weight", "normalize_weights", "eps"},
    "karcher": {"max_iter", "tol"},
    "passthrough": {"scale"},
    "recall": {"temperature"},
    "recall_lerp": {"alpha"},
}
METHODS = tuple(METHOD_PARAMETERS)
PER_MODEL_PARAMETERS = {"weight", "density", "drop", "epsilon", "gamma", "scale"}
BOOLEAN_PARAMETERS = {"normalize", "int8_mask", "rescale", "filter_wise", "nuslerp_flatten", "nuslerp_row_wise",
                      "normalize_weights"}
MAIN_COEFFICIENT = {
    "linear": "alpha", "slerp": "t", "task_arithmetic": "lambda", "ties": "lambda",
    "dare_linear": "lambda", "dare_ties": "lambda", "della": "lambda", "della_linear": "lambda",
    "breadcrumbs": "lambda", "breadcrumbs_ties": "lambda", "recall": "temperature", "recall_lerp": "alpha",
}
RECALL_METHODS = ("recall", "recall_lerp")
# epsilon, gamma and the Model Stock/NuSLERP/Multi-SLERP/Karcher/passthrough knobs: mergekit's names and defaults
DEFAULTS = {"weight": 1.0, "lambda": 1.0, "t": 0.5, "density": 0.5, "drop": 0.5, "temperature": 1.0,
            "int8_mask": False, "epsilon": 0.15, "gamma": 0.01, "filter_wise": False, "nuslerp_flatten": True,
            "nuslerp_row_wise": False, "normalize_weights": True, "eps": 1e-8, "max_iter": 10, "tol": 1e-5,
            "scale": 1.0, "select_topk": 1.0}
# mergekit's defaults where they differ (its generalized_task_arithmetic.py and merge_methods/registry.py):
# nothing is trimmed or dropped unless `density` is given, and DARE-TIES does not divide by the weights.
MERGEKIT_DEFAULTS = {"density": 1.0, "drop": 0.0}
MERGEKIT_NORMALIZE = {"dare_ties": False}
# (low, high, low inclusive, high inclusive); None = unbounded
RANGES = {
    "alpha": (0.0, 1.0, True, True),
    "t": (0.0, 1.0, True, True),
    "density": (0.0, 1.0, False, True),
    "drop": (0.0, 1.0, True, False),
    "temperature": (0.0, None, False, False),
    "epsilon": (0.0, 1.0, True, False),
    "gamma": (0.0, 1.0, True, True),
    "eps": (0.0, None, True, False),
    "max_iter": (1.0, None, True, False),
    "tol": (0.0, None, False, False),
    "select_topk": (0.0, 1.0, True, True),
}
DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
          "half": "float16", "fp32": "float32", "float32": "float32", "float": "float32"}
EMBED_RULES = ("nearest", "average", "base", "reference")
TOKENIZER_SOURCES = ("base", "union")


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

    def parameter(self, name: str, model_index: int | None = None) -> Any:
        """A parameter's raw value spec: the model's own, else the global one, else the default; a filter list
        that matches no tensor passes it on to the next of them (`fall_through`)."""
        own = self.models[model_index].parameters.get(name) if model_index is not None else None
        return fall_through(own, self.parameters.get(name), self.default(name))

    def default(self, name: str) -> Any:
        """A parameter's default for this method, mergekit's in mergekit_compat mode."""
        if name == "normalize":
            recipe = TASK_VECTOR_METHODS.get(self.method)
            if recipe is None:
                return True
            return MERGEKIT_NORMALIZE.get(self.method, recipe.normalize) if self.mergekit_compat else recipe.normalize
        if name == "rescale":
            recipe = TASK_VECTOR_METHODS.get(self.method)
            return bool(recipe and recipe.rescale)
        if self.mergekit_compat and name in MERGEKIT_DEFAULTS:
            return MERGEKIT_DEFAULTS[name]
        return DEFAULTS.get(name)

    def with_parameter(self, name: str, value: Any) -> "MergeConfig":
        """A copy with one global parameter set (what a sweep varies)."""
        data = self.to_dict()
        data["parameters"] = {**data["parameters"], name: value}
        return MergeConfig.from_dict(data)

    def validate(self) -> None:
        if self.method not in METHOD_PARAMETERS:
            raise InputError(f"unknown method {self.method!r}{_did_you_mean(self.method, METHODS)} "
                             f"(choose from {', '.join(METHODS)})")
        if bool(self.models) == bool(self.slices):
            raise InputError("no models to merge (give --model, or models: in the config)" if not self.slices
                             else "give models: or slices:, not both")
        allowed = METHOD_PARAMETERS[self.method]
        self._check_parameters(self.parameters, allowed, "parameter", per_model=False)
        for spec in self.models:
            self._check_parameters(spec.parameters, allowed, f"model {spec.path}: parameter", per_model=True)
        self._check_parameters(self.base_parameters, allowed, f"base {self.base}: parameter", per_model=True)
        for number, part in enumerate(self.slices):
            self._check_slice(number, part, allowed)
        if "drop" in allowed:
            self._density_to_drop()
        recipe = TASK_VECTOR_METHODS.get(self.method)
        if self.parameters.get("rescale") is True and recipe and recipe.sparsifier == "magnitude":
            raise InputError(f"rescale applies to DARE's random drop; {self.method} trims by magnitude without rescaling")
        if not self.slices:
            self._check_model_count()
        if self.method in RECALL_METHODS:
            from mergekit_lite.merge.recall import check_bandwidth

            check_bandwidth(self.recall.bandwidth)
        if self.method in RECALL_METHODS and self.recall.embed_rule not in EMBED_RULES:
            raise InputError(f"recall embed_rule must be one of {', '.join(EMBED_RULES)}, got {self.recall.embed_rule!r}")
        if self.dtype is not None:
            if str(self.dtype).lower() not in DTYPES:
                raise InputError(f"unknown dtype {self.dtype!r} (use bf16, fp16 or fp32)")
            self.dtype = DTYPES[str(self.dtype).lower()]
        if isinstance(self.out_shard_size, bool) or not isinstance(self.out_shard_size, (int, str)):
            raise InputError(f"out_shard_size: expected a size like 2GB or a byte count, got {self.out_shard_size!r}")
        self.out_shard_size = parse_size(self.out_shard_size)
        if self.device not in ("cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise InputError(f"unknown device {self.device!r} (use cpu or cuda)")
        if self.chat_template and self.chat_template not in ("auto", "chatml") and "{" not in self.chat_template:
            raise InputError(f"chat_template {self.chat_template!r}: give auto, chatml or a Jinja template "
                             "(mergekit's other bundled template names are not included)")
        if self.pad_to_multiple_of is not None and (self.pad_to_multiple_of < 1 or not self.tokenizer_source):
            raise InputError("tokenizer pad_to_multiple_of must be a positive integer, with a tokenizer source")

    def resolve_references(self) -> None:
        """Hub ids become snapshot folders in the Hugging Face cache (io/hub.py); local paths stay as they are.
        Called by the plan, so a config can be read and checked without fetching anything."""
        self.base = resolve_model(self.base) if self.base else None
        self.models = [ModelSpec(resolve_model(spec.path), spec.parameters) for spec in self.models]
        self.slices = [Slice([SliceSource(resolve_model(s.model), s.layer_range, s.parameters) for s in part.sources],
                             resolve_model(part.base) if part.base else None, part.parameters) for part in self.slices]
        if self.copy_files_from and self.copy_files_from != "base":
            self.copy_files_from = resolve_model(self.copy_files_from)
        if self.tokenizer_source and self.tokenizer_source not in TOKENIZER_SOURCES:
            self.tokenizer_source = resolve_model(self.tokenizer_source)

    def unused_settings(self) -> list[str]:
        """Per-model settings of a parameter mergekit reads only from `parameters:` (lambda, normalize, ...):
        mergekit accepts them and ignores them, so mergekit_compat mode does too, and the plan says so."""
        owners = [(f"model {spec.path}", spec.parameters) for spec in self.models] + \
            [(f"base {self.base}", self.base_parameters)] + \
            [(f"slices[{number}]: {source.model}", source.parameters)
             for number, part in enumerate(self.slices) for source in part.sources]
        return [f"{owner}: {name} has no effect per model (mergekit reads it from parameters: only)"
                for owner, parameters in owners for name in parameters if name not in PER_MODEL_PARAMETERS]

    def _check_parameters(self, parameters: dict, allowed: set[str], where: str, per_model: bool) -> None:
        for name, value in parameters.items():
            if name not in allowed:
                raise InputError(f"{where} {name!r} does not apply to method {self.method} "
                                 f"(it takes {', '.join(sorted(allowed))}){_did_you_mean(name, allowed)}"
                                 if not per_model else
                                 f"{where} {name!r} cannot be set per model for method {self.method}")
            if per_model and name not in PER_MODEL_PARAMETERS and not self.mergekit_compat:
                raise InputError(f"{where} {name!r} cannot be set per model for method {self.method}")
            _check_value(name, value)

    def _check_slice(self, number: int, part: Slice, allowed: set[str]) -> None:
        where = f"slices[{number}]"
        if not part.sources:
            raise InputError(f"{where}: no sources")
        self._check_parameters(part.parameters, allowed, f"{where}: parameter", per_model=False)
        for source in part.sources:
            start, end = source.layer_range
            if not 0 <= start < end:
                raise InputError(f"{where}: {source.model}: layer_range {[start, end]} must be [start, end) "
                                 "with 0 <= start < end")
            if end - start != part.n_layers:
                raise InputError(f"{where}: every source must give the same number of layers "
                                 f"({part.n_layers} and {end - start})")
            self._check_parameters(source.parameters, allowed, f"{where}: {source.model}: parameter", per_model=True)

    def _density_to_drop(self) -> None:
        """DARE's `density` is mergekit's keep share: stored as our `drop` = 1 - density (gradients and
        filters too, since interpolation commutes with 1 - x)."""
        for parameters in [self.parameters, self.base_parameters, *(spec.parameters for spec in self.models),
                           *(part.parameters for part in self.slices),
                           *(source.parameters for part in self.slices for source in part.sources)]:
            if "density" in parameters:
                if "drop" in parameters:
                    raise InputError(f"{self.method}: give density (the share kept, as in mergekit) or drop "
                                     "(the share dropped), not both")
                parameters["drop"] = _complement(parameters.pop("density"))

    def _check_model_count(self) -> None:
        count = len(self.inputs)
        if self.method == "slerp" and count != 2:
            raise InputError(f"slerp merges exactly two models (a base and one model), got {count}")
        if self.method == "nearswap" and (count != 2 or not self.base):
            raise InputError(f"nearswap merges exactly two models, a base and one model, got {count}")
        if self.method == "nearswap" and self.parameters.get("t") is None:
            raise InputError("nearswap needs t, the distance below which the model's entries are taken whole")
        if self.method == "linear" and "alpha" in self.parameters and count != 2:
            raise InputError(f"linear with alpha interpolates exactly two models, got {count}; use per-model weights for more")
        if self.method == "linear" and self.mergekit_compat and self.base and "alpha" not in self.parameters \
                and "weight" not in self.base_parameters and "weight" not in self.parameters:
            raise InputError(f"linear weights every input, the base too: give {self.base} a weight "
                             "(list it under models: with parameters: weight)")
        if (self.method in TASK_VECTOR_METHODS or self.method == "sce") and not self.base:
            raise InputError(f"{self.method} needs a base model (--base)")
        if self.method == "model_stock" and (not self.base or len(self.models) < 2):
            raise InputError(f"model_stock needs a base model and at least two fine-tunes, got {count} inputs")
        if self.method == "nuslerp" and len(self.models) != 2:
            raise InputError(f"nuslerp merges exactly two models (plus an optional base), got {len(self.models)}")
        if self.method == "karcher" and count < 2:
            raise InputError(f"karcher averages at least two models, got {count}")
        if self.method == "passthrough" and count != 1:
            raise InputError(f"passthrough copies one model per tensor, got {count} inputs (use slices to stack several)")
        if self.method == "recall" and count < 2:
            raise InputError(f"recall merges at least two models, got {count}")
        if self.method == "recall_lerp" and (count != 2 or not self.base):
            raise InputError(f"recall_lerp interpolates exactly two models, a base (pre) and one model (post), got {count}")
        if self.method == "recall_lerp" and not isinstance(self.parameters.get("alpha"), (int, float)):
            raise InputError("recall_lerp needs one number alpha (the global weight of post the layer profile centres on)")

    @classmethod
    def from_dict(cls, data: Any, where: str | None = None) -> "MergeConfig":
        """A config from parsed YAML in either schema (mergekit's when it has `merge_method`)."""
        prefix = f"{where}: " if where else ""
        if not isinstance(data, dict):
            raise InputError(f"{prefix}expected a mapping at the top level")
        schema = _MergekitConfig if "merge_method" in data else _LiteConfig
        if "merge_method" in data and "method" in data:
            raise InputError(f"{prefix}give method: (mergekit-lite's schema) or merge_method: (mergekit's), not both")
        data = _default_module(data) if "merge_method" in data else data
        if "modules" in data:
            raise InputError(f"{prefix}mergekit's modules: (multi-module architectures) is not supported; use slices:")
        try:
            parsed = schema.model_validate(data)
        except ValidationError as error:
            raise InputError(prefix + _describe(error, schema)) from None
        try:
            fields = parsed.to_fields()
            return cls(**fields)
        except InputError as error:
            raise InputError(f"{prefix}{error}") from None

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
        if uses_dare_masks(self.method):  # which masks this seed gives (README, "DARE's masks")
            data["dare_mask_version"] = DARE_MASK_VERSION
        return data


def uses_dare_masks(method: str) -> bool:
    recipe = TASK_VECTOR_METHODS.get(method)
    return recipe is not None and recipe.sparsifier == "random"


# ------------------------------------------------------------------------------------------- YAML schemas


class _Schema(BaseModel):
    model_config = ConfigDict(extra="forbid")


ParameterMap = Optional[dict[StrictStr, Any]]  # values: checked by _check_value (numbers, gradients, filters)


class _Tokenizer(_Schema):
    source: StrictStr = "union"
    pad_to_multiple_of: Optional[StrictInt] = None
    tokens: Optional[dict] = None


class _Recall(_Schema):
    texts: Optional[StrictStr] = None
    samples: Optional[StrictInt] = None
    embed_rule: Optional[StrictStr] = None
    reference: Optional[StrictInt] = None
    weights_file: Optional[StrictStr] = None
    max_length: Optional[StrictInt] = None
    bandwidth: Optional[Union[StrictStr, StrictFloat, StrictInt]] = None
    special_tokens: Optional[StrictBool] = None


class _SliceSource(_Schema):
    model: StrictStr
    layer_range: tuple[StrictInt, StrictInt]
    parameters: ParameterMap = None

    def to_source(self) -> SliceSource:
        return SliceSource(_reference(self.model), tuple(self.layer_range), dict(self.parameters or {}))


class _Options(_Schema):
    """Keys both schemas share: mergekit's output keys and mergekit-lite's run options."""

    dtype: Optional[StrictStr] = None
    seed: StrictInt = 0
    out_shard_size: Any = 5 * 10**9  # bytes, or "2GB": checked by parse_size
    copy_files_from: Optional[StrictStr] = None
    skip: list[StrictStr] = []
    recall: Optional[_Recall] = None
    allow_pickle: StrictBool = False
    allow_nonfinite: StrictBool = False
    force: StrictBool = False
    device: StrictStr = "cpu"
    tokenizer_source: Optional[StrictStr] = None
    tokenizer: Optional[_Tokenizer] = None
    chat_template: Optional[StrictStr] = None
    mergekit_compat: Optional[StrictBool] = None
    parameters: ParameterMap = None
    dare_mask_version: Optional[StrictInt] = None  # written by to_dict; only the version this code draws merges

    def common_fields(self) -> dict:
        if self.dare_mask_version not in (None, DARE_MASK_VERSION):
            raise InputError(f"dare_mask_version {self.dare_mask_version}: this mergekit-lite draws DARE masks of "
                             f"version {DARE_MASK_VERSION}, which give other masks for the same seed (remove the key "
                             f"to merge with version {DARE_MASK_VERSION})")
        if self.tokenizer_source and self.tokenizer:
            raise InputError("give tokenizer_source or tokenizer, not both")
        if self.tokenizer and self.tokenizer.tokens:
            raise InputError("tokenizer.tokens (per-token embedding sources) is not supported; "
                             "tokens a model lacks are filled from the models that have them")
        recall = {k: v for k, v in (self.recall.model_dump() if self.recall else {}).items() if v is not None}
        return {"seed": self.seed, "out_shard_size": self.out_shard_size, "copy_files_from": self.copy_files_from,
                "skip": list(self.skip), "recall": RecallSettings(**recall), "allow_pickle": self.allow_pickle,
                "allow_nonfinite": self.allow_nonfinite, "force": self.force, "device": self.device,
                "tokenizer_source": self.tokenizer.source if self.tokenizer else self.tokenizer_source,
                "pad_to_multiple_of": self.tokenizer.pad_to_multiple_of if self.tokenizer else None,
                "chat_template": self.chat_template, "parameters": dict(self.parameters or {})}


class _LiteModel(_Schema):
    model: StrictStr
    parameters: ParameterMap = None
    weight: Any = None
    density: Any = None
    drop: Any = None


class _LiteSlice(_Schema):
    sources: list[_SliceSource]
    base: Optional[StrictStr] = None
    parameters: ParameterMap = None


class _LiteConfig(_Options):
    """mergekit-lite's own schema."""

    method: StrictStr
    base: Optional[StrictStr] = None
    models: list[_LiteModel] = []
    slices: list[_LiteSlice] = []
    base_parameters: ParameterMap = None

    @field_validator("models", mode="before")
    @classmethod
    def _paths_as_entries(cls, value):
        return [{"model": entry} if isinstance(entry, str) else entry for entry in value] \
            if isinstance(value, list) else value

    def to_fields(self) -> dict:
        models = []
        for entry in self.models:
            parameters = dict(entry.parameters or {})
            parameters.update({name: getattr(entry, name) for name in ("weight", "density", "drop")
                               if getattr(entry, name) is not None})
            models.append(ModelSpec(entry.model, parameters))
        slices = [Slice([source.to_source() for source in part.sources], part.base, dict(part.parameters or {}))
                  for part in self.slices]
        return {**self.common_fields(), "method": self.method, "base": self.base, "models": models,
                "slices": slices, "dtype": self.dtype, "base_parameters": dict(self.base_parameters or {}),
                "mergekit_compat": bool(self.mergekit_compat)}


class _MergekitModel(_Schema):
    model: StrictStr
    parameters: ParameterMap = None


class _MergekitSlice(_Schema):
    sources: list[_SliceSource]
    base_model: Optional[StrictStr] = None
    residual_weight: Optional[float] = None
    parameters: ParameterMap = None


class _MergekitConfig(_Options):
    """mergekit's schema (its config.py MergeConfiguration), read with mergekit's meaning for each key."""

    merge_method: StrictStr
    base_model: Optional[StrictStr] = None
    models: Optional[list[_MergekitModel]] = None
    slices: Optional[list[_MergekitSlice]] = None
    out_dtype: Optional[StrictStr] = None
    name: Optional[StrictStr] = None  # mergekit-multi's name for a stage; mergekit-yaml ignores it, as we do

    def to_fields(self) -> dict:
        if bool(self.models) == bool(self.slices):
            raise InputError("give exactly one of models: or slices: (as mergekit requires)")
        base = _reference(self.base_model) if self.base_model else None
        models, base_parameters = [], {}
        for entry in self.models or []:
            if _reference(entry.model) == base:  # the base listed among the models is still the base
                base_parameters = _as_mergekit_reads(entry.parameters)
            else:
                models.append(ModelSpec(_reference(entry.model), _as_mergekit_reads(entry.parameters)))
        if self.models and not models:
            raise InputError(f"every entry under models: is the base ({base}): nothing to merge into it "
                             "(mergekit writes the base unchanged)")
        slices = []
        for part in self.slices or []:
            if part.residual_weight is not None:
                raise InputError("slices: residual_weight is not supported")
            sources = [replace(source.to_source(), parameters=_as_mergekit_reads(source.parameters))
                       for source in part.sources]
            slices.append(Slice(sources, _reference(part.base_model) if part.base_model else None,
                                _as_mergekit_reads(part.parameters)))
        # mergekit's dtype is the compute dtype, which also becomes the stored one unless out_dtype is given;
        # here the math is float32 always, so only the stored dtype is taken.
        return {**self.common_fields(), "parameters": _as_mergekit_reads(self.parameters), "method": self.merge_method,
                "base": base, "models": models, "slices": slices, "dtype": self.out_dtype or self.dtype,
                "base_parameters": base_parameters,
                "mergekit_compat": True if self.mergekit_compat is None else self.mergekit_compat}


def _default_module(data: dict) -> dict:
    """mergekit saves a plain decoder's merge as `modules: {default: {slices: ...}}` (model cards show that
    form): the one default module is the whole model, so its slices or models are read as top-level ones and
    its parameters override the top-level ones (mergekit's precedence: slice, module, global). Other modules
    (a multimodal model's towers) stay refused."""
    modules = data.get("modules")
    if not isinstance(modules, dict) or set(modules) != {"default"} or not isinstance(modules["default"], dict) \
            or data.get("models") or data.get("slices"):
        return data
    module = modules["default"]
    unwrapped = {**{key: value for key, value in data.items() if key != "modules"},
                 **{key: value for key, value in module.items() if key != "parameters"}}
    if module.get("parameters"):
        unwrapped["parameters"] = {**(data.get("parameters") or {}), **module["parameters"]}
    return unwrapped


def _as_mergekit_reads(parameters: dict | None) -> dict:
    """A parameter map with each value as mergekit's typed validation reads it: YAML takes `1e-5` (no dot) for
    a string, which mergekit reads as the number; a boolean parameter given as 1 or 0 is true or false. A
    string for a boolean (`'false'`) is still refused by _check_value: Python would read it as true."""
    return {name: _typed(name, value) for name, value in (parameters or {}).items()}


def _typed(name: str, value: Any) -> Any:
    if isinstance(value, list):
        return [_typed(name, entry) for entry in value]
    if isinstance(value, dict):
        return {**value, "value": _typed(name, value["value"])} if "value" in value else value
    if name in BOOLEAN_PARAMETERS:
        return bool(value) if type(value) in (int, float) and value in (0, 1) else value
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _reference(model: str) -> str:
    if "+" in model and not Path(model).exists():
        raise InputError(f"{model}: mergekit's model+lora references are not supported; give the adapter folder "
                         "as its own model (it is applied to the base)")
    return model


EXPECTED = {"bool_type": "true or false", "int_type": "an integer", "string_type": "a string", "list_type": "a list",
            "dict_type": "a mapping", "model_type": "a mapping", "tuple_type": "a list [start, end]",
            "float_type": "a number", "int_from_float": "an integer", "int_parsing": "an integer"}


def _describe(error: ValidationError, schema: type[BaseModel]) -> str:
    """The first schema error as one line: where (key path), what was expected, what was given."""
    first = error.errors()[0]
    loc = [part for part in first["loc"] if not (isinstance(part, str) and part[:1].islower() and "[" in part)]
    kind = first["type"]
    if kind == "extra_forbidden":
        key = loc[-1]
        return f"{_where(loc[:-1])}unknown key {key!r}{_did_you_mean(str(key), _keys_at(schema, loc[:-1]))}"
    if kind == "missing":
        return f"{_where(loc[:-1])}missing key {loc[-1]!r}"
    if kind in ("too_short", "too_long"):
        return f"{_where(loc)}{first['msg'].lower()}"
    expected = EXPECTED.get(kind, first["msg"])
    return f"{_where(loc)}expected {expected}, got {first['input']!r}"


def _where(loc: list) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return f"{text}: " if text else ""


def _keys_at(schema: type[BaseModel], loc: list) -> list[str]:
    """The keys the schema knows at a key path (for the did-you-mean)."""
    current = schema
    for part in loc:
        if isinstance(part, int):
            continue
        info = current.model_fields.get(part)
        current = _model_in(info.annotation) if info else None
        if current is None:
            return []
    return list(current.model_fields)


def _model_in(annotation) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for argument in typing.get_args(annotation):
        found = _model_in(argument)
        if found:
            return found
    return None


def _did_you_mean(word: str, choices) -> str:
    close = difflib.get_close_matches(word, sorted(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


# -------------------------------------------------------------------------------------------- value specs


def _check_value(name: str, value: Any) -> None:
    """Check every number a value spec can produce against the parameter's range."""
    if name in BOOLEAN_PARAMETERS:
        if not isinstance(value, bool):
            raise InputError(f"{name} must be true or false, got {value!r}")
        return
    for number in _numbers_in(name, value):
        if not math.isfinite(number):
            raise InputError(f"{name} must be a finite number, got {number}")
        if name in RANGES:
            low, high, low_in, high_in = RANGES[name]
            below = number < low or (number == low and not low_in)
            above = high is not None and (number > high or (number == high and not high_in))
            if below or above:
                left, right = "[" if low_in else "(", "]" if high_in else ")"
                raise InputError(f"{name} must be in {left}{low}, {'inf' if high is None else high}{right}, got {number}")


def _numbers_in(name: str, value: Any) -> list[float]:
    if isinstance(value, bool):
        raise InputError(f"{name} must be a number, got {value!r}")
    if isinstance(value, (int, float)):
        return [float(value)]
    if isinstance(value, dict):
        return _numbers_in(name, [value])
    if isinstance(value, list) and value and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        return [float(v) for v in value]
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        numbers = []
        for entry in value:
            unknown = set(entry) - {"filter", "value"}
            if unknown:
                key = sorted(unknown)[0]
                raise InputError(f"parameter {name}: unknown key {key!r}{_did_you_mean(key, ['filter', 'value'])}")
            if "value" not in entry:
                raise InputError(f"parameter {name}: filter entry {entry} has no value")
            if "filter" in entry and not isinstance(entry["filter"], str):
                raise InputError(f"parameter {name}: filter must be a string, got {entry['filter']!r}")
            numbers += _numbers_in(name, entry["value"])
        return numbers
    raise InputError(f"parameter {name}: expected a number, a list of numbers, or a list of {{filter, value}}, got {value!r}")


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


def resolve(name: str, value: Any, tensor_name: str, layer: int | None, n_layers: int,
            mergekit_compat: bool = False) -> float | bool:
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


def read_yaml(path: str | Path) -> Any:
    """A YAML file's content; unreadable or invalid files become a one-line error naming the file."""
    from mergekit_lite.io.validation import (
        read_yaml as read_limited_yaml,  # size, depth and alias limits
    )

    return read_limited_yaml(path)


def load_config(path: str | Path) -> MergeConfig:
    """Read a YAML merge config in either schema; unknown keys and bad values are named in a one-line error."""
    return MergeConfig.from_dict(read_yaml(path), where=str(path))
