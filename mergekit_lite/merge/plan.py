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
from mergekit_lite.io.architecture import Layout, layout
from mergekit_lite.io.lora import LoraAdapter
from mergekit_lite.io.sources import TensorSource, open_inputs
from mergekit_lite.merge import methods
from mergekit_lite.merge.config import MergeConfig, is_embedding, resolve

LAYER_PATTERN = re.compile(r"(?:^|\.)(?:layers|h|blocks|block|layer)\.(\d+)\.")
RECALL_WEIGHTS_FILE = "recall_weights.json"
PROVENANCE_FILE = "mergekit_lite_config.yaml"
PLAIN = Layout(None)


def layer_index(tensor_name: str, model_layout: Layout = PLAIN) -> int | None:
    """The language model's decoder layer a tensor belongs to, or None (embeddings, head, towers).

    Towers (a multimodal model's vision or audio encoder and projector, an encoder-decoder's encoder)
    have layers of their own, but those are not decoder depths: a tower's tensors get no index and
    are resolved as the decoder's input (see `depth_position`).
    """
    if model_layout.in_tower(tensor_name):
        return None
    match = LAYER_PATTERN.search(tensor_name)
    return int(match.group(1)) if match else None


def depth_position(tensor_name: str, model_layout: Layout) -> tuple[int | None, str]:
    """(layer, part) that resolves a tensor's parameters: decoder layers by index; embeddings and towers,
    whose output enters the decoder at its input, as "embed" (a gradient's first value, RECALL's embed
    rule); the rest (final norm, head) as "head" (a gradient's last value)."""
    layer = layer_index(tensor_name, model_layout)
    if layer is not None:
        return layer, "layer"
    if is_embedding(tensor_name) or model_layout.in_tower(tensor_name):
        return None, "embed"
    return None, "head"


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
    model_layout = layout(reference.config)
    n_layers = layer_count(model_layout, names)
    recall_weights = load_recall_weights(config) if config.method == "recall" else None
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
        steps.append(_plan_step(config, name, shape, dtypes[0], model_layout, n_layers, recall_weights))
    for kinds in sorted(mixed):
        notes.append(f"inputs mix dtypes ({', '.join(kinds)}): upcast to float32 for the math")
    return MergePlan(config, sources, steps, n_layers, notes, recall_weights)


def layer_count(model_layout: Layout, names: list[str]) -> int:
    """The decoder's depth: the (text) config's num_hidden_layers, else counted from decoder tensor names."""
    if model_layout.n_layers:
        return model_layout.n_layers
    indices = [index for index in (layer_index(name, model_layout) for name in names) if index is not None]
    return max(indices) + 1 if indices else 1


def _plan_step(config: MergeConfig, name, shape, stored_dtype, model_layout, n_layers, recall_weights) -> TensorStep:
    if not stored_dtype.is_floating_point:
        return TensorStep(name, shape, stored_dtype, "copy", reason="not floating point: copied from input 0")
    out_dtype = getattr(torch, config.dtype) if config.dtype else stored_dtype
    skipped = next((pattern for pattern in config.skip if pattern in name), None)
    if skipped:
        return TensorStep(name, shape, out_dtype, "copy", reason=f"matches skip filter {skipped!r}: copied from input 0")
    return TensorStep(name, shape, out_dtype, "merge",
                      tensor_parameters(config, name, model_layout, n_layers, recall_weights))


def tensor_parameters(config: MergeConfig, name: str, model_layout: Layout, n_layers: int, recall_weights) -> dict:
    """Resolve the method's parameters for one tensor (gradients and filters applied), on-disk or in-memory name."""
    layer, part = depth_position(name, model_layout)
    # a tower resolves like the embeddings: position 0 of a gradient
    position = 0 if part == "embed" and layer is None and model_layout.in_tower(name) else layer

    def value(parameter, model_index=None):
        return resolve(parameter, config.parameter(parameter, model_index), name, position, n_layers)

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
        return {"weights": recall_weights.for_tensor(layer, part, config.recall.embed_rule)}
    recipe = methods.TASK_VECTOR_METHODS[method]
    parameters = {"lambda": value("lambda"), "weights": [value("weight", i) for i in models],
                  "normalize": config.parameters.get("normalize", recipe.normalize)}
    if recipe.sparsifier == "magnitude":
        parameters["densities"] = [value("density", i) for i in models]
    if recipe.sparsifier == "random":
        parameters["drops"] = [value("drop", i) for i in models]
    return parameters


def load_recall_weights(config: MergeConfig):
    """RECALL's per-layer weights: from the weights file, or computed by running the models on the texts."""
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
