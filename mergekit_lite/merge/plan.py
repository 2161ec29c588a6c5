"""What a merge will do: a plan of per-tensor steps, resolved from headers alone before any data is read.

`plan_merge` checks that the inputs line up (names, shapes, architectures), resolves every parameter for
every tensor, and lays out the output; `engine` executes the plan.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

import torch

from mergekit_lite.errors import InputError
from mergekit_lite.io.lora import LoraAdapter
from mergekit_lite.io.sources import TensorSource, open_inputs
from mergekit_lite.merge import methods
from mergekit_lite.merge.config import MergeConfig, is_embedding, resolve

LAYER_PATTERN = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")
RECALL_WEIGHTS_FILE = "recall_weights.json"
PROVENANCE_FILE = "mergekit_lite_config.yaml"


def layer_index(tensor_name: str) -> int | None:
    match = LAYER_PATTERN.search(tensor_name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class TensorStep:
    """One output tensor: merge it with these resolved parameters, or copy it from the first input."""

    name: str
    shape: tuple[int, ...]
    out_dtype: torch.dtype
    action: str  # "merge" or "copy"
    parameters: dict = field(default_factory=dict)
    reason: str = ""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.out_dtype.itemsize


@dataclass
class MergePlan:
    config: MergeConfig
    sources: list[TensorSource]
    steps: list[TensorStep]
    n_layers: int
    notes: list[str]
    recall_weights: object | None = None

    @property
    def total_bytes(self) -> int:
        return sum(step.nbytes for step in self.steps)

    def describe(self) -> str:
        """The dry-run view: every tensor, its shape, bytes and what will be done to it."""
        lines = [f"method: {self.config.method}   inputs: {len(self.sources)}   tensors: {len(self.steps)}   "
                 f"output: {self.total_bytes / 1e6:.1f} MB   layers: {self.n_layers}"]
        for position, source in enumerate(self.sources):
            lines.append(f"  input {position}: {source.path}")
        lines += [f"  note: {note}" for note in self.notes]
        width = max((len(step.name) for step in self.steps), default=10)
        for step in self.steps:
            what = step.reason if step.action == "copy" else _format_parameters(step.parameters)
            lines.append(f"{step.name:<{width}}  {str(list(step.shape)):<16} {str(step.out_dtype).replace('torch.', ''):<9} "
                         f"{step.nbytes:>12,d}  {step.action:<5} {what}")
        return "\n".join(lines)


def _format_parameters(parameters: dict) -> str:
    def show(value):
        if isinstance(value, list):
            return "[" + ", ".join(show(v) for v in value) + "]"
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    return " ".join(f"{key}={show(value)}" for key, value in parameters.items())


def plan_merge(config: MergeConfig, sources: list[TensorSource] | None = None) -> MergePlan:
    """Check the inputs against each other and resolve every tensor's step, reading headers only."""
    sources = sources or open_inputs(config.inputs, config.base, config.allow_pickle)
    reference = sources[0]
    names = reference.names
    n_layers = _layer_count(reference, names)
    recall_weights = _recall_weights(config) if config.method == "recall" else None
    notes, mixed = [], set()
    steps = []
    for name in names:
        shape = reference.shape(name)
        dtypes = [reference.dtype(name)]
        for source in sources[1:]:
            if source.shape(name) != shape:
                raise InputError(f"tensor {name}: shape {list(source.shape(name))} in {source.path} "
                                 f"but {list(shape)} in {reference.path}")
            dtypes.append(source.dtype(name))
        if len(set(dtypes)) > 1:
            mixed.add(tuple(sorted({str(d).replace("torch.", "") for d in dtypes})))
        steps.append(_plan_step(config, name, shape, dtypes[0], n_layers, recall_weights))
    for kinds in sorted(mixed):
        notes.append(f"inputs mix dtypes ({', '.join(kinds)}): upcast to float32 for the math")
    return MergePlan(config, sources, steps, n_layers, notes, recall_weights)


def _layer_count(reference: TensorSource, names: list[str]) -> int:
    configured = (reference.config or {}).get("num_hidden_layers")
    if isinstance(configured, int) and configured > 0:
        return configured
    indices = [index for index in map(layer_index, names) if index is not None]
    return max(indices) + 1 if indices else 1


def _plan_step(config: MergeConfig, name, shape, stored_dtype, n_layers, recall_weights) -> TensorStep:
    if not stored_dtype.is_floating_point:
        return TensorStep(name, shape, stored_dtype, "copy", reason="not floating point: copied from input 0")
    out_dtype = getattr(torch, config.dtype) if config.dtype else stored_dtype
    skipped = next((pattern for pattern in config.skip if pattern in name), None)
    if skipped:
        return TensorStep(name, shape, out_dtype, "copy", reason=f"matches skip filter {skipped!r}: copied from input 0")
    layer = layer_index(name)
    return TensorStep(name, shape, out_dtype, "merge", _step_parameters(config, name, layer, n_layers, recall_weights))


def _step_parameters(config: MergeConfig, name: str, layer: int | None, n_layers: int, recall_weights) -> dict:
    """Resolve the method's parameters for one tensor (gradients and filters applied)."""

    def value(parameter, model_index=None):
        return resolve(parameter, config.parameter(parameter, model_index), name, layer, n_layers)

    models = range(len(config.models))
    method = config.method
    if method == "linear":
        if "alpha" in config.parameters:
            return {"alpha": value("alpha")}
        weights = ([1.0] if config.base else []) + [value("weight", i) for i in models]
        return {"weights": weights, "normalize": config.parameters.get("normalize", True)}
    if method == "slerp":
        return {"t": value("t")}
    if method == "recall":
        part = "layer" if layer is not None else ("embed" if is_embedding(name) else "head")
        return {"weights": recall_weights.for_tensor(layer, part, config.recall.embed_rule)}
    if method == "model_stock":
        return {"filter_wise": value("filter_wise")}
    if method == "nuslerp":
        first, second = value("weight", 0), value("weight", 1)
        total = first + second
        return {"t": 0.5 if abs(total) < 1e-6 else second / total,
                "flatten": value("nuslerp_flatten"), "row_wise": value("nuslerp_row_wise")}
    if method == "multislerp":
        weights = [value("weight", i) for i in models]
        if value("normalize_weights"):
            total = math.fsum(weights)
            if total == 0:
                raise InputError(f"tensor {name}: multislerp weights sum to zero; cannot normalize")
            weights = [w / total for w in weights]
        return {"weights": weights, "eps": value("eps")}
    if method == "karcher":
        return {"max_iter": int(value("max_iter")), "tol": value("tol")}
    if method == "passthrough":
        return {"scale": value("scale", 0)}
    recipe = methods.TASK_VECTOR_METHODS[method]
    parameters = {"lambda": value("lambda"), "weights": [value("weight", i) for i in models],
                  "normalize": config.parameters.get("normalize", recipe.normalize)}
    if recipe.sparsifier in ("magnitude", "magprune", "outliers"):
        parameters["densities"] = [value("density", i) for i in models]
    if recipe.sparsifier == "random":
        parameters["drops"] = [value("drop", i) for i in models]
    if recipe.sparsifier == "magprune":
        parameters["epsilons"] = [value("epsilon", i) for i in models]
        for density, epsilon in zip(parameters["densities"], parameters["epsilons"]):
            if density < 1.0 and not (density - epsilon > 0.0 and density + epsilon < 1.0):
                raise InputError(f"tensor {name}: della needs 0 < density - epsilon and density + epsilon < 1, "
                                 f"got density {density:g}, epsilon {epsilon:g}")
    if recipe.sparsifier == "outliers":
        parameters["gammas"] = [value("gamma", i) for i in models]
    if recipe.sparsifier in methods.RESCALE_DEFAULT:
        parameters["rescale"] = config.parameters.get("rescale", methods.RESCALE_DEFAULT[recipe.sparsifier])
    return parameters


def _recall_weights(config: MergeConfig):
    from mergekit_lite.merge import recall

    settings = config.recall
    if settings.weights_file:
        with open(settings.weights_file) as handle:
            return recall.RecallWeights.from_json(json.load(handle))
    if not settings.texts:
        raise InputError("recall needs typical samples: recall.texts (a text file, one sample per line) or --recall-texts")
    if any(LoraAdapter.is_adapter_dir(path) for path in config.inputs):
        raise InputError("recall runs the models to compare representations: give model folders, not adapters")
    return recall.compute_recall_weights(
        config.inputs, recall.read_texts(settings.texts), n_typical=settings.samples,
        temperature=float(config.parameter("temperature")), reference=settings.reference,
        device=config.device, seed=config.seed, max_length=settings.max_length)
