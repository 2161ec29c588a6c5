"""What a merge will do: a plan of per-tensor steps, resolved from headers alone before any data is read.

`plan_merge` checks that the inputs line up (names, shapes, architectures), resolves every parameter for
every tensor, and lays out the output; `engine` executes the plan.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

import torch

from mergekit_lite.errors import InputError
from mergekit_lite.io.architecture import Layout, layout
from mergekit_lite.io.lora import LoraAdapter
from mergekit_lite.io.quantized import quantized_inputs
from mergekit_lite.io.sources import TensorSource, check_architectures, open_inputs
from mergekit_lite.io.validation import read_json, require_regular
from mergekit_lite.merge.config import (
    MergeConfig,
    ModelSpec,
    Slice,
    fall_through,
    is_embedding,
    resolve,
)
from mergekit_lite.merge.methods.registry import Depth, StepParameters
from mergekit_lite.merge.methods.variants import Variant
from mergekit_lite.merge.vocab import align_vocabularies, limit_vocabulary_inputs

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


def with_layer(tensor_name: str, index: int) -> str:
    """The same tensor in another layer: model.layers.3.mlp.up_proj.weight -> model.layers.{index}.mlp..."""
    match = LAYER_PATTERN.search(tensor_name)
    return f"{tensor_name[: match.start(1)]}{index}{tensor_name[match.end(1) :]}"


class StepAction(Variant):
    """What a plan step does with its tensor."""

    MERGE = "merge"  # the method combines the inputs (the step's parameters say how)
    COPY = "copy"  # the first input is written unchanged (the step's reason says why)


@dataclass(frozen=True)
class TensorStep:
    """One output tensor: merge it with these resolved parameters (its method's own type), or copy it from the
    first input. `action` may be given by its value ("merge")."""

    name: str
    shape: tuple[int, ...]
    out_dtype: torch.dtype
    action: StepAction
    parameters: StepParameters | None = None
    reason: str = ""
    inputs: tuple[tuple[int, str], ...] = ()  # (source index, tensor name) per input; () = every source, this name

    def __post_init__(self):
        object.__setattr__(self, "action", StepAction(self.action))

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
    vocabulary: object | None = None  # vocab.Vocabulary when tokenizer_source is set
    layer_origins: list[tuple[int, int]] | None = None  # with slices: (source index, its layer) per output layer
    owns_sources: bool = False  # opened by plan_merge (not given by the caller), so closed with the plan

    def close(self) -> None:
        """Close the inputs' files when the plan opened them; sources a caller gave stay open for its next plan."""
        if self.owns_sources:
            for source in self.sources:
                source.close()

    def __enter__(self) -> MergePlan:
        return self

    def __exit__(self, *_) -> None:
        self.close()

    def inputs_of(self, step: TensorStep) -> list[tuple[TensorSource, str]]:
        """Where each input of a step comes from: (source, tensor name) in the method's input order."""
        if step.inputs:
            return [(self.sources[index], name) for index, name in step.inputs]
        return [(source, step.name) for source in self.sources]

    @property
    def total_bytes(self) -> int:
        return sum(step.nbytes for step in self.steps)

    def describe(self) -> str:
        """The dry-run view: every tensor, its shape, bytes and what will be done to it."""
        lines = [
            f"method: {self.config.method}   inputs: {len(self.sources)}   tensors: {len(self.steps)}   "
            f"output: {self.total_bytes / 1e6:.1f} MB   layers: {self.n_layers}"
        ]
        for position, source in enumerate(self.sources):
            lines.append(f"  input {position}: {source.path}")
        lines += [f"  note: {note}" for note in self.notes]
        width = max((len(step.name) for step in self.steps), default=10)
        for step in self.steps:
            what = step.reason if step.action is StepAction.COPY else _format_parameters(step.parameters.shown())
            if any(name != step.name for _, name in step.inputs):
                what += "  from " + ", ".join(f"{index}:{name}" for index, name in step.inputs)
            lines.append(
                f"{step.name:<{width}}  {str(list(step.shape)):<16} {str(step.out_dtype).replace('torch.', ''):<9} "
                f"{step.nbytes:>12,d}  {step.action:<5} {what}"
            )
        return "\n".join(lines)


def _format_parameters(parameters: dict) -> str:
    def show(value):
        if isinstance(value, list):
            return "[" + ", ".join(show(v) for v in value) + "]"
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    return " ".join(f"{key}={show(value)}" for key, value in parameters.items())


def plan_merge(config: MergeConfig, sources: list[TensorSource] | None = None) -> MergePlan:
    """Check the inputs against each other and resolve every tensor's step, reading headers only."""
    config.resolve_references()
    if config.slices:
        return _plan_slices(config, sources)
    owned = not sources
    sources = sources or open_inputs(config.inputs, config.base, config.allow_pickle)
    sources, vocabulary = align_vocabularies(sources, config.tokenizer_source, 0, config.pad_to_multiple_of)
    reference = sources[0]
    names = reference.names
    model_layout = layout(reference.config)
    n_layers = layer_count(model_layout, names)
    recall_weights = load_recall_weights(config) if config.merge_method.reads_recall_weights else None
    notes, mixed = config.unused_settings(), set()
    steps = []
    for name in names:
        shape = reference.shape(name)
        dtypes = [reference.dtype(name)]
        for source in sources[1:]:
            if source.shape(name) != shape:
                raise InputError(
                    f"tensor {name}: shape {list(source.shape(name))} in {source.path} "
                    f"but {list(shape)} in {reference.path}"
                )
            dtypes.append(source.dtype(name))
        _check_kinds(name, [(source.path, dtype) for source, dtype in zip(sources, dtypes, strict=True)])
        if len(set(dtypes)) > 1:
            mixed.add(tuple(sorted({str(d).replace("torch.", "") for d in dtypes})))
        steps.append(
            _plan_step(config, name, shape, dtypes[0], depth_position(name, model_layout), n_layers, recall_weights)
        )
    for kinds in sorted(mixed):
        notes.append(f"inputs mix dtypes ({', '.join(kinds)}): upcast to float32 for the math")
    notes.extend(f"{source.path}: {source.describe()} to float32 for the math" for source in quantized_inputs(sources))
    return MergePlan(config, sources, steps, n_layers, notes, recall_weights, vocabulary, owns_sources=owned)


def layer_count(model_layout: Layout, names: list[str]) -> int:
    """The decoder's depth: the (text) config's num_hidden_layers, else counted from decoder tensor names."""
    if model_layout.n_layers:
        return model_layout.n_layers
    indices = [index for index in (layer_index(name, model_layout) for name in names) if index is not None]
    return max(indices) + 1 if indices else 1


def _check_kinds(name: str, dtypes: list[tuple[str, torch.dtype]]) -> None:
    """Only floating-point tensors are merged; any other (a bool mask, integer ids) is copied from the first
    input, which is right only when every input stores it in the same dtype."""
    (reference, first), *others = dtypes
    for path, dtype in others:
        if dtype != first and not (dtype.is_floating_point and first.is_floating_point):
            raise InputError(
                f"tensor {name}: {str(dtype).replace('torch.', '')} in {path} but "
                f"{str(first).replace('torch.', '')} in {reference}; only floating-point tensors are "
                "merged (others are copied, so every input must store them alike)"
            )


def _plan_step(config: MergeConfig, name, shape, stored_dtype, depth, n_layers, recall_weights) -> TensorStep:
    if not stored_dtype.is_floating_point:
        return TensorStep(name, shape, stored_dtype, StepAction.COPY, reason="not floating point: copied from input 0")
    out_dtype = getattr(torch, config.dtype) if config.dtype else stored_dtype
    skipped = next((pattern for pattern in config.skip if pattern in name), None)
    if skipped:
        return TensorStep(
            name, shape, out_dtype, StepAction.COPY, reason=f"matches skip filter {skipped!r}: copied from input 0"
        )
    parameters = step_parameters(config, name, depth, n_layers, recall_weights)
    copied = config.merge_method.copies(parameters)
    if copied:
        return TensorStep(name, shape, out_dtype, StepAction.COPY, reason=copied)
    return TensorStep(name, shape, out_dtype, StepAction.MERGE, parameters)


def _plan_slices(config: MergeConfig, sources: list[TensorSource] | None) -> MergePlan:
    """Stack the slices' layers (mergekit's `slices`): output layer j is layer start+k of each source of the
    slice that holds j, merged by the slice's own plain merge (`slice_config`), renumbered to j.

    Parameters resolve per slice as in mergekit: a gradient runs across each slice's layers. Tensors
    outside the layers come from the first slice's sources (embeddings) or the last slice's (final norm,
    head).
    """
    if not config.merge_method.takes_slices:
        raise InputError(f"{config.method} does not take slices (it weighs whole models layer by layer)")
    for path in config.inputs:
        if LoraAdapter.is_adapter_dir(path):
            raise InputError(f"{path}: slices take model folders, not LoRA adapters")
    owned = not sources
    sources = sources or [open_inputs([path], None, config.allow_pickle)[0] for path in config.inputs]
    check_architectures(sources)
    base_index = config.inputs.index(config.base) if config.base else 0
    sources, vocabulary = align_vocabularies(sources, config.tokenizer_source, base_index, config.pad_to_multiple_of)
    position = {path: index for index, path in enumerate(config.inputs)}
    pieces = []
    for number, piece in enumerate(config.slices):
        merge, located = slice_config(config, piece, number)
        ranges = [layer_range for _, layer_range in located]
        for path, (start, end) in located:
            source = sources[position[path]]
            available = layer_count(layout(source.config), source.names)
            if not 0 <= start < end <= available:
                raise InputError(
                    f"slice {number}: layer_range [{start}, {end}] of {path} is outside its {available} layers"
                )
        pieces.append((merge, [position[path] for path, _ in located], ranges))
    steps, origins = [], []

    def add(merge, indices, tensor_names, out_name, depth, n_layers):
        template = sources[indices[0]]
        shape = template.shape(tensor_names[0])
        for index, name in zip(indices, tensor_names, strict=True):
            if name not in sources[index].names:
                raise InputError(f"{sources[index].path}: no tensor {name}")
            if sources[index].shape(name) != shape:
                raise InputError(
                    f"tensor {name}: shape {list(sources[index].shape(name))} in {sources[index].path} "
                    f"but {list(shape)} in {template.path}"
                )
        _check_kinds(
            tensor_names[0],
            [
                (sources[index].path, sources[index].dtype(name))
                for index, name in zip(indices, tensor_names, strict=True)
            ],
        )
        step = _plan_step(merge, out_name, shape, template.dtype(tensor_names[0]), depth, n_layers, None)
        steps.append(replace(step, inputs=tuple(zip(indices, tensor_names, strict=True))))

    outside = [name for name in sources[pieces[0][1][0]].names if layer_index(name) is None]
    for name in (n for n in outside if is_embedding(n)):
        merge, indices, ranges = pieces[0]
        add(merge, indices, [name] * len(indices), name, (None, "embed"), ranges[0][1] - ranges[0][0])
    for merge, indices, ranges in pieces:
        length = ranges[0][1] - ranges[0][0]
        for offset in range(length):
            first = sources[indices[0]]
            for name in (n for n in first.names if layer_index(n) == ranges[0][0] + offset):
                add(
                    merge,
                    indices,
                    [with_layer(name, start + offset) for start, _ in ranges],
                    with_layer(name, len(origins)),
                    (offset, "layer"),
                    length,
                )
            origins.append((indices[0], ranges[0][0] + offset))
    for name in (n for n in outside if not is_embedding(n)):
        merge, indices, ranges = pieces[-1]
        add(merge, indices, [name] * len(indices), name, (None, "head"), ranges[0][1] - ranges[0][0])
    limit_vocabulary_inputs(sources, {step.name: [index for index, _ in step.inputs] for step in steps})
    notes = [f"slices: {len(origins)} output layers from {len(pieces)} slices", *config.unused_settings()]
    return MergePlan(
        config, sources, steps, len(origins), notes, vocabulary=vocabulary, layer_origins=origins, owns_sources=owned
    )


def slice_config(
    config: MergeConfig, piece: Slice, number: int
) -> tuple[MergeConfig, list[tuple[str, tuple[int, int]]]]:
    """One slice as a plain merge, and (model, layer range) for each of its inputs in its input order.

    Its base is the slice's, else the config's, when the method uses one and it is among the sources
    (mergekit's rule); the other sources are its models, with their parameters; the slice's parameters
    override the config's, and where a slice's filter list matches no tensor the config's apply.
    """
    paths = [source.model for source in piece.sources]
    base = piece.base or config.base
    if config.merge_method.base_ignored or base not in paths:
        base = None
    base_source = next((source for source in piece.sources if source.model == base), None)
    others = [source for source in piece.sources if source is not base_source]
    ordered = ([base_source] if base_source else []) + others
    models = [ModelSpec(source.model, dict(source.parameters)) for source in others]
    try:
        parameters = {
            name: fall_through(piece.parameters.get(name), config.parameters.get(name))
            for name in {**config.parameters, **piece.parameters}
        }
        merge = replace(config, base=base, models=models, parameters=parameters, slices=[])
    except InputError as error:
        raise InputError(f"slice {number}: {error}") from None
    return merge, [(source.model, tuple(source.layer_range)) for source in ordered]


def tensor_parameters(config: MergeConfig, name: str, model_layout: Layout, n_layers: int, recall_weights) -> dict:
    """The method's parameters for one tensor of a model with this layout, on-disk or in-memory name."""
    return step_parameters(config, name, depth_position(name, model_layout), n_layers, recall_weights)


def step_parameters(
    config: MergeConfig, name: str, depth: tuple[int | None, str], n_layers: int, recall_weights
) -> StepParameters:
    """Resolve the method's parameters for one tensor at `depth` (layer, part), gradients and filters applied."""
    layer, part = depth
    return config.merge_method.step_parameters(
        config, TensorValues(config, name, depth, n_layers), Depth(name, layer, part, n_layers, recall_weights)
    )


class TensorValues:
    """A config's parameter values at one tensor: `values(name, model_index)` the model's own else the global one
    else the default, resolved there (gradients and filters applied)."""

    def __init__(self, config: MergeConfig, name: str, depth: tuple[int | None, str], n_layers: int):
        layer, part = depth
        self.config, self.name, self.n_layers = config, name, n_layers
        # a tower (an "embed" part that is not an embedding) resolves like the embeddings: position 0 of a gradient
        self.position = 0 if part == "embed" and layer is None and not is_embedding(name) else layer

    def __call__(self, parameter: str, model_index: int | None = None):
        return self.of_spec(parameter, self.config.parameter(parameter, model_index))

    def of_spec(self, parameter: str, spec):
        """A raw value spec resolved at this tensor."""
        return resolve(parameter, spec, self.name, self.position, self.n_layers, self.config.mergekit_compat)

    fall_through = staticmethod(fall_through)


def load_recall_weights(config: MergeConfig):
    """RECALL's per-layer weights: from the weights file, or computed by running the models on the texts."""
    from mergekit_lite.merge import recall

    settings = config.recall
    if settings.weights_file:
        return recall.RecallWeights.from_json(read_json(require_regular(settings.weights_file, "weights file")))
    if not settings.texts:
        raise InputError(
            "recall needs typical samples: recall.texts (a text file, one sample per line) or --recall-texts"
        )
    if any(LoraAdapter.is_adapter_dir(path) for path in config.inputs):
        raise InputError("recall runs the models to compare representations: give model folders, not adapters")
    return recall.compute_recall_weights(
        config.inputs,
        recall.read_texts(settings.texts),
        n_typical=settings.samples,
        temperature=float(config.parameter("temperature")),
        reference=settings.reference,
        device=config.device,
        seed=config.seed,
        max_length=settings.max_length,
        bandwidth=settings.bandwidth,
        special_tokens=settings.special_tokens,
    )
