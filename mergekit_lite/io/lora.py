"""Read a PEFT LoRA adapter folder as dense weight updates in the base model's own layout.

A merge needs, per base tensor, what the adapter does to it: an update added to it (`targets()` / `delta()`:
`scaling * B @ A` on a weight, and with `lora_bias` `scaling * lora_B.bias` on that layer's bias), or a full
tensor that takes its place (`modules_to_save`, trained biases: `replaced()` / `replacement()`). The two sets
never overlap. A DoRA adapter (`use_dora`) also rescales each output row of `W + scaling * B @ A` to a trained
magnitude, so its merged weight depends on the base weight: `apply()` gives it as PEFT's merge_and_unload does.

When PEFT targets an embedding it also saves an untouched copy of the base embedding
(`<module>.base_layer.weight`). That copy is not an update: it is kept apart (`copied_base()` /
`base_copy()`) so an audit can compare it with the claimed base, and a merge adds the delta to the base.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, ValidationError

from mergekit_lite.errors import InputError
from mergekit_lite.io.safetensors import read_header
from mergekit_lite.io.validation import check_pattern, read_json, require_regular_inside

CONFIG_FILE = "adapter_config.json"
SAFETENSORS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"
PEFT_PREFIX = "base_model.model."
PEFT_DEFAULT_ALPHA = 8  # LoraConfig's default, which PEFT applies when a config omits lora_alpha

LINEAR_FACTOR = re.compile(r"^(?P<module>.+)\.lora_(?P<side>[AB])(?:\.[^.]+)?\.weight$")
LORA_BIAS = re.compile(
    r"^(?P<module>.+)\.lora_B(?:\.[^.]+)?\.bias$"
)  # lora_bias: B's own bias, merged into the layer's
MAGNITUDE = re.compile(r"^(?P<module>.+)\.lora_magnitude_vector(?:\.[^.]+)?$")  # DoRA's m, one per output feature
EMBEDDING_FACTOR = re.compile(r"^(?P<module>.+)\.lora_embedding_(?P<side>[AB])(?:\.[^.]+)?$")
SAVED_MODULE_INFIX = re.compile(r"\.modules_to_save(?:\.[^.]+)?\.")
BASE_LAYER_INFIX = ".base_layer."

# init_lora_weights values under which PEFT leaves the base untouched: the saved factors are the whole update.
PLAIN_INITS = {True, False, "gaussian", "orthogonal", "eva"}
# ...and those under which PEFT rewrites the base during init (peft/tuners/lora/layer.py *_init): the adapter belongs
# on that residual base, W - scaling*B0@A0 (LoftQ: a quantised W), which is not the base anyone merges into.
RESIDUAL_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")

# Options with a default under which the weights are `scaling * B @ A`; any other value is refused, with why.
REFUSED_OPTIONS = {
    "enable_lora": "enable_lora (PEFT 0.1-0.2's MergedLinear) stores grouped factors for parts of a fused layer",
    "target_parameters": "target_parameters adapts raw parameters (e.g. fused MoE experts), not module weights",
    "trainable_token_indices": "trainable_token_indices stores sparse token rows, not LoRA factors",
    "layer_replication": "layer_replication duplicates base layers, so the merged model has more layers than the base",
    "use_qalora": "QALoRA pools inputs in groups, so B@A does not have the base weight's shape",
    "alora_invocation_tokens": "aLoRA (alora_invocation_tokens) only acts after its invocation tokens appear; "
    "it cannot be merged into the weights (PEFT refuses to merge it too)",
    "megatron_config": "megatron_config builds tensor-parallel LoRA layers whose factors may be sharded",
    "use_bdlora": "BD-LoRA (use_bdlora) stores block-diagonal factors",
    "arrow_config": "Arrow (arrow_config) routes each token among several LoRA experts; there is no single update",
    "kasa_config": "KaSA (kasa_config) adds a trained singular-value vector between B and A",
    "monteclora_config": "MonteCLoRA (monteclora_config) samples its factors from a learned distribution",
    "velora_config": "VeLoRA (velora_config) is a variant this reader does not implement",
}


class AdapterConfigSchema(BaseModel):
    """adapter_config.json as PEFT's LoraConfig writes it, typed strictly (field names and defaults from PEFT 0.21).

    Options without a field here are kept (`extra="allow"`) and judged by `refusal_reason`. `merge_weights` and
    `enable_lora` are PEFT 0.1-0.2's (git history of peft/tuners/lora.py): the first only merged in eval mode.
    """

    model_config = ConfigDict(extra="allow", strict=True)

    peft_type: str = "LORA"
    task_type: str | None = None
    peft_version: str | None = None
    base_model_name_or_path: str | None = None
    revision: str | None = None
    inference_mode: bool = False
    auto_mapping: dict | None = None
    r: int
    lora_alpha: int | float = PEFT_DEFAULT_ALPHA
    lora_dropout: int | float = 0.0
    target_modules: list[str] | str | None = None
    exclude_modules: list[str] | str | None = None
    fan_in_fan_out: bool = False
    bias: Literal["none", "all", "lora_only"] = "none"
    use_rslora: bool = False
    modules_to_save: list[str] | None = None
    init_lora_weights: bool | str = True
    layers_to_transform: list[int] | int | None = None
    layers_pattern: list[str] | str | None = None
    rank_pattern: dict[str, int] | None = None
    alpha_pattern: dict[str, int | float] | None = None
    megatron_core: str | None = None
    runtime_config: dict | None = None
    ensure_weight_tying: bool = False
    qalora_group_size: int = 16
    loftq_config: dict | None = None
    eva_config: dict | None = None
    corda_config: dict | None = None
    lora_ga_config: dict | None = None
    use_dora: bool = False
    lora_bias: bool = False
    use_qalora: bool = False
    target_parameters: list[str] | None = None
    trainable_token_indices: list[int] | dict | None = None
    layer_replication: list | None = None
    alora_invocation_tokens: list[int] | None = None
    megatron_config: dict | None = None
    use_bdlora: dict | bool | None = None
    arrow_config: dict | None = None
    kasa_config: dict | None = None
    monteclora_config: dict | None = None
    velora_config: dict | None = None
    merge_weights: bool = False
    enable_lora: list[bool] | None = None


def _is_default_like(value) -> bool:
    """What an option that is not in use holds: null, false, zero, or empty."""
    return value is None or value is False or value == 0 or value in ("", [], {})


def refusal_reason(config: dict) -> str | None:
    """Why this config's weights are not plain `scaling * B @ A` on the given base, or None if they are."""
    init = config.get("init_lora_weights", True)
    if init not in PLAIN_INITS:
        if isinstance(init, str) and init.startswith(RESIDUAL_INITS):
            return (
                f"init_lora_weights={init!r} trains the adapter on a residual base (PEFT rewrites W to "
                "W - scaling*B0@A0 at init), so adding it to the original base is wrong; re-save it with "
                "save_pretrained(path_initial_model_for_weight_conversion=...) to get a plain LoRA"
            )
        return f"init_lora_weights={init!r} is not a plain LoRA initialisation this reader knows"
    for option, why in REFUSED_OPTIONS.items():
        if not _is_default_like(config.get(option)):
            return why
    for option in sorted(set(config) - set(AdapterConfigSchema.model_fields)):
        if not _is_default_like(config[option]):
            return (
                f"unknown option {option}={config[option]!r}: it is not one this reader knows, so how it changes "
                "the weights is unknown (an adapter from a newer PEFT?)"
            )
    return None


def _type_text(annotation) -> str:
    return str(annotation).replace("typing.", "").replace("NoneType", "null").replace("<class '", "").replace("'>", "")


def validate_config(config: dict, path: Path) -> AdapterConfigSchema:
    """Typed validation; a wrong type is one line naming the key and the type it must have."""
    try:
        return AdapterConfigSchema.model_validate(config)
    except ValidationError as error:
        first = error.errors()[0]
        key = str(first["loc"][0]) if first["loc"] else "?"
        if first["type"] == "missing":
            raise InputError(f"{path}: no {key} (required)") from None
        expected = _type_text(AdapterConfigSchema.model_fields[key].annotation)
        raise InputError(f"{path}: {key} must be {expected} (got {config.get(key)!r})") from None


@dataclass(frozen=True)
class _Factors:
    """Where one module's A and B live, and how their product maps onto the base weight."""

    a_key: str
    b_key: str
    embedding: bool
    bias_key: str | None = None  # lora_B's bias (lora_bias), added to the layer's bias
    magnitude_key: str | None = None  # DoRA's magnitude vector (use_dora)


class _TensorFile:
    """The adapter's tensors by key: safetensors read lazily, or an opted-in pickle held in memory."""

    def __init__(self, path: Path, tensors: dict[str, torch.Tensor] | None = None):
        self.path = path
        self._tensors = tensors
        if tensors is None:
            from safetensors import safe_open

            read_header(path)  # the strict header check models get: refused in one line that echoes nothing of it
            try:
                with safe_open(path, framework="pt") as handle:
                    self._shapes = {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}
            except Exception as error:  # safetensors raises its own error type for bad headers
                raise InputError(f"{path}: unreadable safetensors file ({error})") from None
        else:
            self._shapes = {key: tuple(tensor.shape) for key, tensor in tensors.items()}

    def keys(self) -> list[str]:
        return list(self._shapes)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._shapes[key]

    def load(self, key: str) -> torch.Tensor:
        if self._tensors is not None:
            return self._tensors[key].clone()
        from safetensors import safe_open

        with safe_open(self.path, framework="pt") as handle:
            return handle.get_tensor(key)


def _read_config(folder: Path) -> dict:
    path = require_regular_inside(folder / CONFIG_FILE, folder)
    config = read_json(path)  # size and depth limits, duplicate keys and NaN refused, as for every JSON input
    if not isinstance(config, dict):
        raise InputError(f"{path}: not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise InputError(f"{path}: peft_type {peft_type} is not LoRA")
    schema = validate_config(config, path)
    if schema.r <= 0:
        raise InputError(f"{path}: r must be a positive int (got {schema.r})")
    _check_patterns(config, path)
    why = refusal_reason(config)
    if why:
        raise InputError(f"{path}: unsupported: {why}")
    return config


def _check_patterns(config: dict, path: Path) -> None:
    """The options PEFT reads as regular expressions (rank/alpha_pattern keys, a target_modules or exclude_modules
    string, layers_pattern) must compile: a broken one is the adapter's fault, said in one line."""
    patterns = [(option, key) for option in ("rank_pattern", "alpha_pattern") for key in config.get(option) or {}]
    patterns += [
        (option, config[option])
        for option in ("target_modules", "exclude_modules")
        if isinstance(config.get(option), str)
    ]
    layers_pattern = config.get("layers_pattern")
    patterns += [
        ("layers_pattern", pattern)
        for pattern in ([layers_pattern] if isinstance(layers_pattern, str) else layers_pattern or [])
    ]
    for option, pattern in patterns:
        check_pattern(pattern, f"{path}: {option}: ")


def _open_weights(folder: Path, allow_pickle: bool) -> _TensorFile:
    """Safetensors by default; a pickle only when allowed, and then with weights_only=True."""
    if os.path.lexists(folder / SAFETENSORS_FILE):
        return _TensorFile(require_regular_inside(folder / SAFETENSORS_FILE, folder))
    pickle_path = folder / PICKLE_FILE
    if not os.path.lexists(pickle_path):
        raise InputError(f"{folder}: no {SAFETENSORS_FILE}")
    require_regular_inside(pickle_path, folder)
    if not allow_pickle:
        raise InputError(
            f"{pickle_path}: pickle weights can run code when loaded; refused "
            "(convert to safetensors, or pass --allow-pickle)"
        )
    try:
        tensors = torch.load(pickle_path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises many types for a bad or unsafe pickle
        raise InputError(f"{pickle_path}: cannot load pickle weights ({type(error).__name__})") from None
    if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise InputError(f"{pickle_path}: not a dict of tensors")
    return _TensorFile(pickle_path, tensors)


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern/alpha_pattern rule: the first key that matches the end of the module name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _scaling(config: dict, module: str) -> tuple[int, float]:
    """(rank, scaling) for one module: alpha/r, or alpha/sqrt(r) under rsLoRA."""
    rank = _pattern_value(config.get("rank_pattern") or {}, module, config["r"])
    alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", PEFT_DEFAULT_ALPHA))
    root = math.sqrt(rank) if config.get("use_rslora") else rank
    return rank, alpha / root


def _strip_prefix(key: str) -> str:
    return key[len(PEFT_PREFIX) :] if key.startswith(PEFT_PREFIX) else key


def _classify_keys(weights: _TensorFile) -> tuple[dict[str, dict[str, str]], set[str], dict[str, str]]:
    """Stored keys as: A/B keys per module (and "bias": lora_B's bias), the modules whose factors are
    embedding-style, full tensors by name."""
    sides: dict[str, dict[str, str]] = {}
    embeddings: set[str] = set()
    full_tensors: dict[str, str] = {}
    for key in weights.keys():
        name = _strip_prefix(key)
        match = LINEAR_FACTOR.match(name) or EMBEDDING_FACTOR.match(name) or LORA_BIAS.match(name)
        match = match or MAGNITUDE.match(name)
        if match:
            side = {LORA_BIAS: "bias", MAGNITUDE: "magnitude"}.get(match.re) or match["side"]
            module_sides = sides.setdefault(match["module"], {})
            if side in module_sides:
                raise InputError(
                    f"{weights.path}: two lora_{side} tensors for {match['module']} (several adapters in one file?)"
                )
            module_sides[side] = key
            if match.re is EMBEDDING_FACTOR:
                embeddings.add(match["module"])
        elif ".lora_" in name:
            raise InputError(f"{weights.path}: unsupported LoRA tensor {key}")
        else:
            full_tensors[SAVED_MODULE_INFIX.sub(".", name)] = key
    return sides, embeddings, full_tensors


def _module_factors(
    weights: _TensorFile, config: dict, sides: dict[str, dict[str, str]], embeddings: set[str]
) -> tuple[dict[str, _Factors], dict[str, float]]:
    """Factors and scaling per base weight name; every module needs both A and B at the config's rank, and a
    lora_B bias only where the config says lora_bias (PEFT's lora_B has no bias otherwise: it would drop it)."""
    factors, scaling = {}, {}
    for module, module_sides in sides.items():
        missing = {"A", "B"} - set(module_sides)
        if missing:
            raise InputError(f"{weights.path}: {module} has no lora_{missing.pop()} tensor")
        if "bias" in module_sides and not config.get("lora_bias"):
            raise InputError(
                f"{weights.path}: {module} has a lora_B bias but the config does not set lora_bias "
                "(PEFT would leave it out of the model)"
            )
        if ("magnitude" in module_sides) != bool(config.get("use_dora")):
            raise InputError(
                f"{weights.path}: {module} has a DoRA magnitude vector but the config does not set use_dora"
                if "magnitude" in module_sides
                else f"{weights.path}: {module} has no lora_magnitude_vector, which use_dora (DoRA) needs"
            )
        factor = _Factors(
            module_sides["A"],
            module_sides["B"],
            module in embeddings,
            module_sides.get("bias"),
            module_sides.get("magnitude"),
        )
        rank, scaling[f"{module}.weight"] = _scaling(config, module)
        _check_factor_shapes(weights, module, factor, rank)
        factors[f"{module}.weight"] = factor
    return factors, scaling


def _bias_name(weight_name: str) -> str:
    return weight_name.removesuffix(".weight") + ".bias"


def _full_tensor_roles(
    weights: _TensorFile, full_tensors: dict[str, str], factors: dict[str, _Factors]
) -> tuple[dict[str, str], dict[str, str]]:
    """Split full tensors into replacements and untouched copies of a targeted module's base weight."""
    replacements, base_copies = {}, {}
    for name, key in full_tensors.items():
        if BASE_LAYER_INFIX in name:
            name = name.replace(BASE_LAYER_INFIX, ".")
            (base_copies if name in factors else replacements)[name] = key
        else:
            replacements[name] = key
    overlap = sorted(set(factors) & set(replacements))
    if overlap:
        raise InputError(f"{weights.path}: {overlap[0]} has both LoRA factors and a full replacement")
    return replacements, base_copies


def peft_transforms(config: dict, weight_name: str) -> bool:
    """Whether PEFT puts a LoRA layer on this weight's module under `layers_to_transform` / `layers_pattern`
    (peft.tuners.tuners_utils.check_target_module_exists): the module's first numbered segment (after a
    `layers_pattern` name, when given) must be a listed layer. Factors of other modules are left out when
    PEFT loads the adapter; PEFT never saves them, so an adapter that holds them is refused (_check_layers)."""
    layers = config.get("layers_to_transform")
    if layers is None or layers == []:
        return True
    module = weight_name.rsplit(".", 1)[0]
    patterns = config.get("layers_pattern")
    patterns = [patterns] if isinstance(patterns, str) else patterns or []
    expressions = [rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\." for pattern in patterns] or [r".*?\.[^.]*\.(?P<idx>\d+)\."]
    match = next((found for expression in expressions if (found := re.match(expression, module))), None)
    if match is None:
        return False
    return int(match["idx"]) in (layers if isinstance(layers, list) else [layers])


def _check_layers(config: dict, names: list[str], path: Path) -> None:
    """Factors for a layer the config's layers_to_transform leaves out: PEFT would load the adapter without them, so
    the config and the tensors disagree about what the adapter is (as a rank that is not the config's r)."""
    left_out = sorted(name for name in names if not peft_transforms(config, name))
    if left_out:
        shown = ", ".join(left_out[:3]) + (f" (+{len(left_out) - 3} more)" if len(left_out) > 3 else "")
        raise InputError(
            f"{path}: LoRA tensors for {len(left_out)} modules in layers that layers_to_transform "
            f"{config.get('layers_to_transform')!r} leaves out (PEFT would not load them): {shown}"
        )


@dataclass
class LoraAdapter:
    """A PEFT LoRA adapter folder; every name it exposes is a base-model tensor name."""

    path: Path
    config: dict
    scaling: dict[str, float]
    weights_file: Path
    _file: _TensorFile = field(repr=False)
    _factors: dict[str, _Factors] = field(repr=False)
    _replacements: dict[str, str] = field(repr=False)
    _base_copies: dict[str, str] = field(repr=False)
    _biases: dict[str, str] = field(repr=False)  # bias updated by lora_B's bias -> the weight its factors update

    @staticmethod
    def is_adapter_dir(path) -> bool:
        return (Path(path) / CONFIG_FILE).is_file()

    @classmethod
    def open(cls, path, allow_pickle: bool = False) -> LoraAdapter:
        """Read config and tensor index (no factor data yet); refuse what would merge wrongly."""
        folder = Path(path)
        if not folder.is_dir():
            raise InputError(f"{folder}: no such adapter folder")
        if not cls.is_adapter_dir(folder):
            raise InputError(f"{folder}: no {CONFIG_FILE} (not a PEFT adapter folder)")
        config = _read_config(folder)
        weights = _open_weights(folder, allow_pickle)
        sides, embeddings, full_tensors = _classify_keys(weights)
        factors, scaling = _module_factors(weights, config, sides, embeddings)
        _check_layers(config, list(factors), weights.path)
        replacements, base_copies = _full_tensor_roles(weights, full_tensors, factors)
        biases = {_bias_name(name): name for name, factor in factors.items() if factor.bias_key}
        return cls(folder, config, scaling, weights.path, weights, factors, replacements, base_copies, biases)

    def targets(self) -> list[str]:
        """Base tensor names that get an update added: weights `scaling * B @ A` and, with lora_bias, the biases
        `scaling * lora_B.bias` of the same layers (a bias the adapter also saves whole is a replacement instead)."""
        return sorted([*self.weight_targets(), *self.bias_targets()])

    def weight_targets(self) -> list[str]:
        """The targets that are weights, updated by `scaling * B @ A` (what rank and spectral measures read)."""
        return sorted(self._factors)

    def bias_targets(self) -> list[str]:
        """The targets that are biases, updated by `scaling * lora_B.bias` (lora_bias)."""
        return sorted(name for name in self._biases if name not in self._replacements)

    def replaced(self) -> list[str]:
        """Base tensor names the adapter replaces outright (modules_to_save, trained biases)."""
        return sorted(self._replacements)

    def copied_base(self) -> list[str]:
        """Base weight names the adapter carries an untouched copy of (targeted embeddings)."""
        return sorted(self._base_copies)

    def rank(self, base_name: str) -> int:
        """The LoRA rank of a weight target."""
        return self._file.shape(self._factors[base_name].a_key)[0]

    def shape(self, base_name: str) -> tuple[int, ...]:
        """Shape of what the adapter holds for a base tensor (delta, replacement or copy), without reading it."""
        factor = self._factors.get(base_name)
        if factor is None and base_name in self._biases and base_name not in self._replacements:
            return self._file.shape(self._factors[self._biases[base_name]].bias_key)
        if factor is None:
            return self._file.shape(self._replacements.get(base_name) or self._base_copies[base_name])
        a_columns = self._file.shape(factor.a_key)[1]
        b_rows = self._file.shape(factor.b_key)[0]
        return (a_columns, b_rows) if self._transposed(factor) else (b_rows, a_columns)

    def factors(self, base_name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(left, right), float32, with left @ right == delta(base_name): rank-r work stays cheap. A bias target's
        are its update as one column and [1]."""
        if base_name in self._biases:
            return self._bias_update(base_name)[:, None], torch.ones(1)
        factor = self._factors[base_name]
        a = self._file.load(factor.a_key).to(torch.float32)
        b = self._file.load(factor.b_key).to(torch.float32)
        scale = self.scaling[base_name]
        if self._transposed(factor):
            return a.T, b.T * scale
        return b * scale, a

    def lora_factors(self, base_name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, A) as PEFT stores them, float32: `scaling * B @ A` is the update in the factor layout ([out, in] of
        the layer; an embedding's or a Conv1D's is its weight transposed, see `in_factor_layout`)."""
        factor = self._factors[base_name]
        return self._file.load(factor.b_key).to(torch.float32), self._file.load(factor.a_key).to(torch.float32)

    def in_factor_layout(self, base_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A base-layout weight in the factor layout (or back: the map is its own inverse)."""
        return tensor.T if self._transposed(self._factors[base_name]) else tensor

    def is_embedding(self, base_name: str) -> bool:
        """Whether a weight target's factors are embedding-style (lora_embedding_A/B)."""
        return self._factors[base_name].embedding

    def factor_dtype(self, base_name: str) -> torch.dtype:
        """The dtype a weight target's factors are stored in."""
        return self._file.load(self._factors[base_name].a_key).dtype

    def is_dora(self, base_name: str) -> bool:
        """Whether a weight target carries a DoRA magnitude vector."""
        factor = self._factors.get(base_name)
        return factor is not None and factor.magnitude_key is not None

    def magnitude(self, base_name: str) -> torch.Tensor:
        """DoRA's trained magnitude m, one value per row of the factor layout, float32."""
        return self._file.load(self._factors[base_name].magnitude_key).to(torch.float32)

    def apply(self, base_name: str, weight: torch.Tensor) -> torch.Tensor:
        """The merged tensor for a target, float32, from the base tensor: `weight + delta`, and under DoRA
        `m * (W + scaling*B@A) / ||W + scaling*B@A||` with the norm of each row of the factor layout (over the
        input features; DoRA paper, Liu et al. 2024, eq. 5), as PEFT's DoraLinearVariant.merge_unsafe computes it
        for linear, Conv1D (fan_in_fan_out) and embedding layers."""
        merged = weight.to(torch.float32) + self.delta(base_name)
        if not self.is_dora(base_name):
            return merged
        rows = self.in_factor_layout(base_name, merged)
        scale = self.magnitude(base_name) / torch.linalg.vector_norm(rows, dim=1)
        return self.in_factor_layout(base_name, rows * scale[:, None])

    def _transposed(self, factor: _Factors) -> bool:
        """Embeddings store (num_embeddings, dim) and Conv1D (fan_in_fan_out) stores (in, out): B@A is flipped."""
        return factor.embedding or bool(self.config.get("fan_in_fan_out"))

    def _bias_update(self, base_name: str) -> torch.Tensor:
        """`scaling * lora_B.bias`, what PEFT's merge adds to the layer's bias (peft/tuners/lora/layer.py merge)."""
        weight = self._biases[base_name]
        return self._file.load(self._factors[weight].bias_key).to(torch.float32) * self.scaling[weight]

    def delta(self, base_name: str) -> torch.Tensor:
        """The dense update `scaling * B @ A` for one base tensor, float32, in its shape. Under DoRA this is only
        the update's direction part: the merged weight is `apply()`."""
        left, right = self.factors(base_name)
        return left @ right

    def replacement(self, base_name: str) -> torch.Tensor:
        """The tensor that takes the base's place; a trained bias (bias="all") with a lora_B bias gets its update too,
        as PEFT loads the saved bias and then merges."""
        saved = self._file.load(self._replacements[base_name])
        return saved.to(torch.float32) + self._bias_update(base_name) if base_name in self._biases else saved

    def base_copy(self, base_name: str) -> torch.Tensor:
        return self._file.load(self._base_copies[base_name])

    def stored(self) -> list[tuple[str, str, str]]:
        """Every tensor key of the weights file with what it holds and for which base tensor: (key, role, base name),
        role one of "A", "B" (the factors, embeddings' too), "bias" (lora_B's bias: base name the layer's bias),
        "magnitude" (DoRA), "replacement" (modules_to_save, trained biases) and "base_copy"."""
        entries = []
        for name, factor in self._factors.items():
            entries += [(factor.a_key, "A", name), (factor.b_key, "B", name)]
            if factor.bias_key:
                entries.append((factor.bias_key, "bias", _bias_name(name)))
            if factor.magnitude_key:
                entries.append((factor.magnitude_key, "magnitude", name))
        entries += [(key, "replacement", name) for name, key in self._replacements.items()]
        entries += [(key, "base_copy", name) for name, key in self._base_copies.items()]
        return sorted(entries)

    def load_stored(self, key: str) -> torch.Tensor:
        """One tensor of the weights file by its key, as stored (dtype included)."""
        return self._file.load(key)


def _check_factor_shapes(weights: _TensorFile, module: str, factor: _Factors, rank: int) -> None:
    """A and B must be 2-D, agree on the rank, and that rank must be the config's (else scaling is wrong)."""
    a_shape, b_shape = weights.shape(factor.a_key), weights.shape(factor.b_key)
    if 0 in a_shape + b_shape:
        raise InputError(
            f"{weights.path}: {module} has empty LoRA factors A{list(a_shape)} and B{list(b_shape)}: saved "
            "under DeepSpeed ZeRO-3 without gathering the partitioned parameters (re-save with the "
            "gathered state dict, e.g. stage3_gather_16bit_weights_on_model_save)"
        )
    if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[0] != b_shape[1]:
        raise InputError(f"{weights.path}: {module} has mismatched LoRA factors A{list(a_shape)} and B{list(b_shape)}")
    if factor.bias_key and weights.shape(factor.bias_key) != (b_shape[0],):
        raise InputError(
            f"{weights.path}: {module} has a lora_B bias of shape {list(weights.shape(factor.bias_key))} "
            f"for B{list(b_shape)}"
        )
    if factor.magnitude_key and weights.shape(factor.magnitude_key) != (b_shape[0],):
        raise InputError(
            f"{weights.path}: {module} has a DoRA magnitude of shape {list(weights.shape(factor.magnitude_key))} "
            f"for B{list(b_shape)}"
        )
    if a_shape[0] != rank:
        raise InputError(
            f"{weights.path}: {module} has rank {a_shape[0]} but the config says r={rank} (rank_pattern missing?)"
        )
