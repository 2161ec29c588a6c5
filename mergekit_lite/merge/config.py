"""What to merge: the merge configuration (from YAML or flags), validated before any tensor is read.

Parameter values take three forms, as in mergekit:
- a number: the same everywhere;
- a list of numbers: a gradient across layers, linearly interpolated from the first layer to the last
  (embeddings take the first value, the final norm and the head take the last);
- a list of `{filter: SUBSTRING, value: ...}` entries: the first entry whose filter occurs in the tensor
  name applies, an entry without a filter is the default (e.g. `mlp` and `self_attn` set differently).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from mergekit_lite.errors import InputError
from mergekit_lite.io.safetensors import parse_size
from mergekit_lite.merge.methods import TASK_VECTOR_METHODS

METHOD_PARAMETERS = {
    "linear": {"alpha", "weight", "normalize"},
    "slerp": {"t"},
    "task_arithmetic": {"lambda", "weight", "normalize"},
    "ties": {"lambda", "weight", "density", "normalize"},
    "dare_linear": {"lambda", "weight", "drop", "normalize"},
    "dare_ties": {"lambda", "weight", "drop", "normalize"},
    "della": {"lambda", "weight", "density", "epsilon", "normalize", "rescale"},
    "della_linear": {"lambda", "weight", "density", "epsilon", "normalize", "rescale"},
    "breadcrumbs": {"lambda", "weight", "density", "gamma", "normalize", "rescale"},
    "breadcrumbs_ties": {"lambda", "weight", "density", "gamma", "normalize", "rescale"},
    "model_stock": {"filter_wise"},
    "nuslerp": {"weight", "nuslerp_flatten", "nuslerp_row_wise"},
    "multislerp": {"weight", "normalize_weights", "eps"},
    "karcher": {"max_iter", "tol"},
    "passthrough": {"scale"},
    "recall": {"temperature"},
}
METHODS = tuple(METHOD_PARAMETERS)
PER_MODEL_PARAMETERS = {"weight", "density", "drop", "epsilon", "gamma", "scale"}
BOOLEAN_PARAMETERS = {"normalize", "rescale", "filter_wise", "nuslerp_flatten", "nuslerp_row_wise", "normalize_weights"}
MAIN_COEFFICIENT = {
    "linear": "alpha", "slerp": "t", "task_arithmetic": "lambda", "ties": "lambda",
    "dare_linear": "lambda", "dare_ties": "lambda", "della": "lambda", "della_linear": "lambda",
    "breadcrumbs": "lambda", "breadcrumbs_ties": "lambda", "recall": "temperature",
}
# mergekit's defaults for the parameters it shares with us (epsilon, gamma, the NuSLERP/Multi-SLERP/Karcher knobs)
DEFAULTS = {"weight": 1.0, "lambda": 1.0, "t": 0.5, "density": 0.5, "drop": 0.5, "temperature": 0.5,
            "epsilon": 0.15, "gamma": 0.01, "filter_wise": False, "nuslerp_flatten": True, "nuslerp_row_wise": False,
            "normalize_weights": True, "eps": 1e-8, "max_iter": 10, "tol": 1e-5, "scale": 1.0}
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
}
DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
          "half": "float16", "fp32": "float32", "float32": "float32", "float": "float32"}
EMBED_RULES = ("nearest", "average", "base", "reference")
CONFIG_KEYS = {"method", "base", "models", "parameters", "dtype", "seed", "out_shard_size", "copy_files_from",
               "skip", "recall", "allow_pickle", "allow_nonfinite", "force", "device"}
MODEL_KEYS = {"model", "parameters", *PER_MODEL_PARAMETERS}
RECALL_KEYS = {"texts", "samples", "embed_rule", "reference", "weights_file", "max_length"}


@dataclass
class ModelSpec:
    """One input model (a folder, a .safetensors file, or a LoRA adapter folder) and its own parameters."""

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


@dataclass
class MergeConfig:
    method: str
    models: list[ModelSpec]
    base: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    dtype: str | None = None
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

    def __post_init__(self):
        self.validate()

    @property
    def inputs(self) -> list[str]:
        """Every input path in merge order: the base first (when given), then the models, or with slices
        every model the slices name, once each, in order of first mention."""
        paths = ([self.base] if self.base else []) + [spec.path for spec in self.models]
        if not self.slices:
            return paths
        for piece in self.slices:
            paths += ([piece.base] if piece.base else []) + [source.model for source in piece.sources]
        return list(dict.fromkeys(paths))

    def parameter(self, name: str, model_index: int | None = None) -> Any:
        """A parameter's raw value spec: the model's own, else the global one, else the default."""
        if model_index is not None and name in self.models[model_index].parameters:
            return self.models[model_index].parameters[name]
        return self.parameters.get(name, DEFAULTS.get(name))

    def with_parameter(self, name: str, value: Any) -> "MergeConfig":
        """A copy with one global parameter set (what a sweep varies)."""
        data = self.to_dict()
        data["parameters"] = {**data["parameters"], name: value}
        return MergeConfig.from_dict(data)

    def validate(self) -> None:
        if self.method not in METHOD_PARAMETERS:
            raise InputError(f"unknown method {self.method!r} (choose from {', '.join(METHODS)})")
        allowed = METHOD_PARAMETERS[self.method]
        for name, value in self.parameters.items():
            if name not in allowed:
                raise InputError(f"parameter {name!r} does not apply to method {self.method} (it takes {', '.join(sorted(allowed))})")
            _check_value(name, value)
        for spec in self.models:
            for name, value in spec.parameters.items():
                if name not in allowed or name not in PER_MODEL_PARAMETERS:
                    raise InputError(f"model {spec.path}: parameter {name!r} cannot be set per model for method {self.method}")
                _check_value(name, value)
        if self.slices and self.models:
            raise InputError("give models or slices, not both")
        if not self.slices:
            self.check_inputs()
        if self.method == "recall" and self.recall.embed_rule not in EMBED_RULES:
            raise InputError(f"recall embed_rule must be one of {', '.join(EMBED_RULES)}, got {self.recall.embed_rule!r}")
        if self.dtype is not None:
            if str(self.dtype).lower() not in DTYPES:
                raise InputError(f"unknown dtype {self.dtype!r} (use bf16, fp16 or fp32)")
            self.dtype = DTYPES[str(self.dtype).lower()]
        self.out_shard_size = parse_size(self.out_shard_size)
        if self.device not in ("cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise InputError(f"unknown device {self.device!r} (use cpu or cuda)")

    def check_inputs(self) -> None:
        """The number and roles of inputs the method needs (with slices: checked for each slice)."""
        count = len(self.inputs)
        if not self.models:
            raise InputError("no models to merge (give --model, or models: in the config)")
        if self.method == "slerp" and count != 2:
            raise InputError(f"slerp merges exactly two models (a base and one model), got {count}")
        if self.method == "linear" and "alpha" in self.parameters and count != 2:
            raise InputError(f"linear with alpha interpolates exactly two models, got {count}; use per-model weights for more")
        if self.method in TASK_VECTOR_METHODS and not self.base:
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

    @classmethod
    def from_dict(cls, data: dict, where: str = "config") -> "MergeConfig":
        if not isinstance(data, dict):
            raise InputError(f"{where}: expected a mapping at the top level")
        _reject_unknown(data, CONFIG_KEYS, where)
        models = []
        for position, entry in enumerate(data.get("models") or []):
            if isinstance(entry, str):
                entry = {"model": entry}
            if not isinstance(entry, dict) or "model" not in entry:
                raise InputError(f"{where}: models[{position}] needs a 'model' path")
            _reject_unknown(entry, MODEL_KEYS, f"{where}: models[{position}]")
            parameters = dict(entry.get("parameters") or {})
            parameters.update({k: v for k, v in entry.items() if k in PER_MODEL_PARAMETERS})
            models.append(ModelSpec(str(entry["model"]), parameters))
        recall = data.get("recall") or {}
        if not isinstance(recall, dict):
            raise InputError(f"{where}: recall must be a mapping")
        _reject_unknown(recall, RECALL_KEYS, f"{where}: recall")
        fields = {k: v for k, v in data.items() if k not in ("models", "recall")}
        try:
            return cls(models=models, recall=RecallSettings(**recall), **fields)
        except TypeError as error:
            raise InputError(f"{where}: {error}") from None

    def to_dict(self) -> dict:
        data = asdict(self)
        data["models"] = [{"model": spec.path, **spec.parameters} for spec in self.models]
        if not self.slices:
            del data["slices"]  # reads back with from_dict, which does not parse slices yet (mkconfig's schema)
        return data


def _reject_unknown(data: dict, known: set[str], where: str) -> None:
    for key in data:
        if key not in known:
            raise InputError(f"{where}: unknown key {key!r} (known: {', '.join(sorted(known))})")


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
    if isinstance(value, list) and value and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        return [float(v) for v in value]
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        numbers = []
        for entry in value:
            _reject_unknown(entry, {"filter", "value"}, f"parameter {name}")
            if "value" not in entry:
                raise InputError(f"parameter {name}: filter entry {entry} has no value")
            numbers += _numbers_in(name, entry["value"])
        return numbers
    raise InputError(f"parameter {name}: expected a number, a list of numbers, or a list of {{filter, value}}, got {value!r}")


def resolve(name: str, value: Any, tensor_name: str, layer: int | None, n_layers: int) -> float | bool:
    """The number a value spec gives for one tensor (see the module docstring for the forms)."""
    if isinstance(value, (bool, int, float)):
        return value if isinstance(value, bool) else float(value)
    if all(isinstance(v, dict) for v in value):
        for entry in value:
            if "filter" not in entry or entry["filter"] in tensor_name:
                return resolve(name, entry["value"], tensor_name, layer, n_layers)
        raise InputError(f"parameter {name}: no filter matches tensor {tensor_name} and no default entry is given")
    if len(value) == 1:
        return float(value[0])
    if layer is None:
        position = 0.0 if is_embedding(tensor_name) else 1.0
    else:
        position = layer / max(n_layers - 1, 1)
    return float(np.interp(position * (len(value) - 1), np.arange(len(value)), value))


def is_embedding(tensor_name: str) -> bool:
    """Tensors that sit before the first layer (token/position embeddings)."""
    return any(part in tensor_name for part in ("embed", "wte", "wpe"))


def read_yaml(path: str | Path) -> Any:
    """A YAML file's content; unreadable or invalid files become a one-line error naming the file."""
    path = Path(path)
    try:
        return yaml.safe_load(path.read_text())
    except OSError as error:
        raise InputError(f"{path}: cannot read ({error.strerror})") from None
    except yaml.YAMLError as error:
        raise InputError(f"{path}: invalid YAML ({str(error).splitlines()[0]})") from None


def load_config(path: str | Path) -> MergeConfig:
    """Read a YAML merge config; unknown keys and bad values are named in a one-line error."""
    return MergeConfig.from_dict(read_yaml(path), where=str(path))
