"""The two YAML schemas a merge config is written in, read into one `MergeConfig` (merge/config.py):
- mergekit-lite's own: `method`, `base`, `models` (with `weight` / `density` / `drop`), `dtype` (stored dtype), ...
- mergekit's, as it is: `merge_method`, `base_model`, `models` or `slices`, `dtype` (its compute dtype) and
  `out_dtype`, `tokenizer_source` or `tokenizer: {source: ...}`, `chat_template`, ... A file in this schema runs
  in `mergekit_compat` mode unless it says `mergekit_compat: false`: mergekit's defaults (`Parameter.mergekit_default`)
  and its rules where ours differ on purpose (see the README's "Coming from mergekit").
Strict pydantic models check the structure (a quoted "false" is not a boolean, `skip` must be a list);
errors name the file, the key and what was expected, and an unknown key gets a did-you-mean.
"""

from __future__ import annotations

import typing
from dataclasses import replace
from pathlib import Path
from typing import Any

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
from mergekit_lite.io.hub import split_lora_reference
from mergekit_lite.merge import methods
from mergekit_lite.merge.config import (
    MergeConfig,
    ModelSpec,
    RecallSettings,
    Slice,
    SliceSource,
    did_you_mean,
)
from mergekit_lite.merge.methods.task_vectors import DARE_MASK_VERSION


class _Schema(BaseModel):
    model_config = ConfigDict(extra="forbid")


ParameterMap = dict[StrictStr, Any] | None  # values: checked by config._check_value (numbers, gradients, filters)


class _Tokenizer(_Schema):
    source: StrictStr = "union"
    pad_to_multiple_of: StrictInt | None = None
    tokens: dict | None = None


class _Recall(_Schema):
    texts: StrictStr | None = None
    samples: StrictInt | None = None
    embed_rule: StrictStr | None = None
    reference: StrictInt | None = None
    weights_file: StrictStr | None = None
    max_length: StrictInt | None = None
    bandwidth: StrictStr | StrictFloat | StrictInt | None = None
    special_tokens: StrictBool | None = None


class _SliceSource(_Schema):
    model: StrictStr
    layer_range: tuple[StrictInt, StrictInt]
    parameters: ParameterMap = None

    def to_source(self) -> SliceSource:
        return SliceSource(_reference(self.model), tuple(self.layer_range), dict(self.parameters or {}))


class _Options(_Schema):
    """Keys both schemas share: mergekit's output keys and mergekit-lite's run options."""

    dtype: StrictStr | None = None
    out_quant: StrictStr | None = None
    seed: StrictInt = 0
    out_shard_size: Any = 5 * 10**9  # bytes, or "2GB": checked by parse_size
    copy_files_from: StrictStr | None = None
    skip: list[StrictStr] = []
    recall: _Recall | None = None
    allow_pickle: StrictBool = False
    allow_nonfinite: StrictBool = False
    force: StrictBool = False
    device: StrictStr = "cpu"
    tokenizer_source: StrictStr | None = None
    tokenizer: _Tokenizer | None = None
    chat_template: StrictStr | None = None
    mergekit_compat: StrictBool | None = None
    parameters: ParameterMap = None
    dare_mask_version: StrictInt | None = None  # written by to_dict; only the version this code draws merges

    def common_fields(self) -> dict:
        if self.dare_mask_version not in (None, DARE_MASK_VERSION):
            raise InputError(
                f"dare_mask_version {self.dare_mask_version}: this mergekit-lite draws DARE masks of "
                f"version {DARE_MASK_VERSION}, which give other masks for the same seed (remove the key "
                f"to merge with version {DARE_MASK_VERSION})"
            )
        if self.tokenizer_source and self.tokenizer:
            raise InputError("give tokenizer_source or tokenizer, not both")
        if self.tokenizer and self.tokenizer.tokens:
            raise InputError(
                "tokenizer.tokens (per-token embedding sources) is not supported; "
                "tokens a model lacks are filled from the models that have them"
            )
        recall = {k: v for k, v in (self.recall.model_dump() if self.recall else {}).items() if v is not None}
        return {
            "seed": self.seed,
            "out_quant": self.out_quant,
            "out_shard_size": self.out_shard_size,
            "copy_files_from": self.copy_files_from,
            "skip": list(self.skip),
            "recall": RecallSettings(**recall),
            "allow_pickle": self.allow_pickle,
            "allow_nonfinite": self.allow_nonfinite,
            "force": self.force,
            "device": self.device,
            "tokenizer_source": self.tokenizer.source if self.tokenizer else self.tokenizer_source,
            "pad_to_multiple_of": self.tokenizer.pad_to_multiple_of if self.tokenizer else None,
            "chat_template": self.chat_template,
            "parameters": dict(self.parameters or {}),
        }


class _LiteModel(_Schema):
    model: StrictStr
    parameters: ParameterMap = None
    weight: Any = None
    density: Any = None
    drop: Any = None


class _LiteSlice(_Schema):
    sources: list[_SliceSource]
    base: StrictStr | None = None
    parameters: ParameterMap = None


class _LiteConfig(_Options):
    """mergekit-lite's own schema."""

    method: StrictStr
    base: StrictStr | None = None
    models: list[_LiteModel] = []
    slices: list[_LiteSlice] = []
    base_parameters: ParameterMap = None

    @field_validator("models", mode="before")
    @classmethod
    def _paths_as_entries(cls, value):
        return (
            [{"model": entry} if isinstance(entry, str) else entry for entry in value]
            if isinstance(value, list)
            else value
        )

    def to_fields(self) -> dict:
        models = []
        for entry in self.models:
            parameters = dict(entry.parameters or {})
            parameters.update(
                {
                    name: getattr(entry, name)
                    for name in ("weight", "density", "drop")
                    if getattr(entry, name) is not None
                }
            )
            models.append(ModelSpec(entry.model, parameters))
        slices = [
            Slice([source.to_source() for source in part.sources], part.base, dict(part.parameters or {}))
            for part in self.slices
        ]
        return {
            **self.common_fields(),
            "method": self.method,
            "base": self.base,
            "models": models,
            "slices": slices,
            "dtype": self.dtype,
            "base_parameters": dict(self.base_parameters or {}),
            "mergekit_compat": bool(self.mergekit_compat),
        }


class _MergekitModel(_Schema):
    model: StrictStr
    parameters: ParameterMap = None


class _MergekitSlice(_Schema):
    sources: list[_SliceSource]
    base_model: StrictStr | None = None
    residual_weight: float | None = None
    parameters: ParameterMap = None


class _MergekitConfig(_Options):
    """mergekit's schema (its config.py MergeConfiguration), read with mergekit's meaning for each key."""

    merge_method: StrictStr
    base_model: StrictStr | None = None
    models: list[_MergekitModel] | None = None
    slices: list[_MergekitSlice] | None = None
    out_dtype: StrictStr | None = None
    name: StrictStr | None = None  # mergekit-multi's name for a stage; mergekit-yaml ignores it, as we do

    def to_fields(self) -> dict:
        if bool(self.models) == bool(self.slices):
            raise InputError("give exactly one of models: or slices: (as mergekit requires)")
        base = _reference(self.base_model) if self.base_model else None
        booleans = _boolean_parameters(self.merge_method)
        models, base_parameters = [], {}
        for entry in self.models or []:
            if _reference(entry.model) == base:  # the base listed among the models is still the base
                base_parameters = _as_mergekit_reads(entry.parameters, booleans)
            else:
                models.append(ModelSpec(_reference(entry.model), _as_mergekit_reads(entry.parameters, booleans)))
        if self.models and not models:
            raise InputError(
                f"every entry under models: is the base ({base}): nothing to merge into it "
                "(mergekit writes the base unchanged)"
            )
        slices = []
        for number, part in enumerate(self.slices or []):
            if part.residual_weight is not None:
                raise InputError("slices: residual_weight is not supported")
            _check_slice_base(number, self.merge_method, part.base_model or self.base_model, part.sources)
            sources = [
                replace(source.to_source(), parameters=_as_mergekit_reads(source.parameters, booleans))
                for source in part.sources
            ]
            slices.append(
                Slice(
                    sources,
                    _reference(part.base_model) if part.base_model else None,
                    _as_mergekit_reads(part.parameters, booleans),
                )
            )
        # mergekit's dtype is the compute dtype, which also becomes the stored one unless out_dtype is given;
        # here the math is float32 always, so only the stored dtype is taken.
        return {
            **self.common_fields(),
            "parameters": _as_mergekit_reads(self.parameters, booleans),
            "method": self.merge_method,
            "base": base,
            "models": models,
            "slices": slices,
            "dtype": self.out_dtype or self.dtype,
            "base_parameters": base_parameters,
            "mergekit_compat": True if self.mergekit_compat is None else self.mergekit_compat,
        }


def _check_slice_base(number: int, method: str, base: str | None, sources: list[_SliceSource]) -> None:
    """mergekit merges each slice against its base (the slice's, else the config's), which must be one of the
    slice's sources: it refuses a slice without it, where the slice's first source would otherwise stand in."""
    declared = methods.REGISTRY.get(method)  # an unknown method is refused with the config
    if base and not (declared and declared.base_ignored) and base not in [source.model for source in sources]:
        raise InputError(
            f"slices[{number}]: the base model {base} is not among this slice's sources; {method} merges "
            "each slice against its base, so list it there with a layer_range (mergekit refuses this too)"
        )


def _default_module(data: dict) -> dict:
    """mergekit saves a plain decoder's merge as `modules: {default: {slices: ...}}` (model cards show that
    form): the one default module is the whole model, so its slices or models are read as top-level ones and
    its parameters override the top-level ones (mergekit's precedence: slice, module, global). Other modules
    (a multimodal model's towers) stay refused."""
    modules = data.get("modules")
    if (
        not isinstance(modules, dict)
        or set(modules) != {"default"}
        or not isinstance(modules["default"], dict)
        or data.get("models")
        or data.get("slices")
    ):
        return data
    module = modules["default"]
    unwrapped = {
        **{key: value for key, value in data.items() if key != "modules"},
        **{key: value for key, value in module.items() if key != "parameters"},
    }
    if module.get("parameters"):
        unwrapped["parameters"] = {**(data.get("parameters") or {}), **module["parameters"]}
    return unwrapped


def _boolean_parameters(method: str) -> set[str]:
    """The boolean parameters `method` declares (none for an unknown method, refused with the config)."""
    declared = methods.REGISTRY.get(method)
    return {parameter.name for parameter in declared.parameters if parameter.kind is bool} if declared else set()


def _as_mergekit_reads(parameters: dict | None, booleans: set[str]) -> dict:
    """A parameter map with each value as mergekit's typed validation reads it: YAML takes `1e-5` (no dot) for
    a string, which mergekit reads as the number; a boolean parameter given as 1 or 0 is true or false. A
    string for a boolean (`'false'`) is still refused by _check_value: Python would read it as true."""
    return {name: _typed(value, name in booleans) for name, value in (parameters or {}).items()}


def _typed(value: Any, boolean: bool) -> Any:
    if isinstance(value, list):
        return [_typed(entry, boolean) for entry in value]
    if isinstance(value, dict):
        return {**value, "value": _typed(value["value"], boolean)} if "value" in value else value
    if boolean:
        return bool(value) if type(value) in (int, float) and value in (0, 1) else value
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _reference(model: str) -> str:
    """A model reference as mergekit writes it; a model+lora one (not a path on disk) must have its two parts."""
    split_lora_reference(model)
    return model


EXPECTED = {
    "bool_type": "true or false",
    "int_type": "an integer",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "tuple_type": "a list [start, end]",
    "float_type": "a number",
    "int_from_float": "an integer",
    "int_parsing": "an integer",
}


def _describe(error: ValidationError, schema: type[BaseModel]) -> str:
    """The first schema error as one line: where (key path), what was expected, what was given."""
    first = error.errors()[0]
    loc = [part for part in first["loc"] if not (isinstance(part, str) and part[:1].islower() and "[" in part)]
    kind = first["type"]
    if kind == "extra_forbidden":
        key = loc[-1]
        return f"{_where(loc[:-1])}unknown key {key!r}{did_you_mean(str(key), _keys_at(schema, loc[:-1]))}"
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


def config_from_dict(data: Any, where: str | None = None) -> MergeConfig:
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
        return MergeConfig(**fields)
    except InputError as error:
        raise InputError(f"{prefix}{error}") from None


def read_yaml(path: str | Path) -> Any:
    """A YAML file's content; unreadable or invalid files become a one-line error naming the file."""
    from mergekit_lite.io.validation import (
        read_yaml as read_limited_yaml,  # size, depth and alias limits
    )

    return read_limited_yaml(path)


def load_config(path: str | Path) -> MergeConfig:
    """Read a YAML merge config in either schema; unknown keys and bad values are named in a one-line error."""
    return config_from_dict(read_yaml(path), where=str(path))
