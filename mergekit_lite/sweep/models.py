"""The models a sweep evaluates: the merge config of each alpha (RECALL's similarities computed once per run
folder), models built through transformers' own loading path, and the resident pair that merges each point
into one in-memory model without I/O."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from mergekit_lite import interrupts
from mergekit_lite.errors import InputError
from mergekit_lite.io.outputs import write_atomic
from mergekit_lite.merge import methods
from mergekit_lite.merge.config import MergeConfig
from mergekit_lite.sweep.settings import SweepSettings
from mergekit_lite.sweep.store import RECALL_DIR, SIMILARITY_FILE

MEMORY_COPIES = 4  # the model, pre, post (or its task vector) and one being converted, in the evaluation dtype


class MergeConfigs:
    """The merge config of each alpha. RECALL's similarities are computed once per run folder (running
    both models), kept in recall/similarity.json, and re-weighted per temperature (recall) or turned
    into per-layer alphas by the plan (recall_lerp)."""

    def __init__(self, settings: SweepSettings, folder: Path):
        self.settings, self.folder = settings, folder
        self.similarity = None

    def __call__(self, alpha: float) -> MergeConfig:
        method = methods.method(self.settings.method)
        if not method.reads_recall_weights:
            return self.settings.merge_config(alpha)
        if method.interpolates:
            return self.settings.merge_config(alpha, recall_weights_file=str(self.similarity_file()))
        path = self.folder / RECALL_DIR / f"temperature_{alpha!r}.json"
        write_atomic(path, json.dumps(self.weights().with_temperature(alpha).to_json(), indent=2) + "\n")
        return self.settings.merge_config(alpha, recall_weights_file=str(path))

    def similarity_file(self) -> Path:
        """recall/similarity.json, computed on first use; the run folder's identity check guards its settings."""
        from mergekit_lite.merge.recall import compute_recall_weights, read_texts

        path = self.folder / RECALL_DIR / SIMILARITY_FILE
        if not path.is_file():
            settings = self.settings
            config = settings.merge_config(settings.alphas[0])
            weights = compute_recall_weights(
                config.inputs,
                read_texts(settings.recall_texts),
                n_typical=settings.recall_samples,
                reference=config.recall.reference,
                device=config.device,
                seed=settings.seed,
                max_length=config.recall.max_length,
                bandwidth=config.recall.bandwidth,
                special_tokens=config.recall.special_tokens,
            )
            path.parent.mkdir(exist_ok=True)
            write_atomic(path, json.dumps(weights.to_json(), indent=2) + "\n")
        return path

    def weights(self):
        from mergekit_lite.merge.recall import RecallWeights

        if self.similarity is None:
            self.similarity = RecallWeights.from_json(json.loads(self.similarity_file().read_text()))
        return self.similarity


def fits_in_memory(source, dtype) -> bool:
    """MEMORY_COPIES copies of the model in the evaluation dtype must fit in the memory free now."""
    model_bytes = sum(math.prod(source.shape(name)) for name in source.names) * dtype.itemsize
    return model_bytes * MEMORY_COPIES < os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class ModelLoader:
    """Models built through transformers' own loading path (from_pretrained), so its key conversions apply:
    fused MoE experts in transformers 5, multimodal wrappers, tied heads."""

    def __init__(self, pre: str, dtype, device: str, loading_args: dict | None = None):
        import transformers

        self.loading_args = dict(loading_args or {})  # --model-args: attn_implementation, trust_remote_code
        self.config = transformers.AutoConfig.from_pretrained(
            pre, trust_remote_code=self.loading_args.get("trust_remote_code", False)
        )
        architecture = next(iter(self.config.architectures or []), None)
        self.model_class = getattr(transformers, architecture, None) if architecture else None
        if self.model_class is None:
            self.model_class = transformers.AutoModelForCausalLM._model_mapping[type(self.config)]
        self.dtype, self.device = dtype, device

    def from_folder(self, folder) -> object:
        with interrupts.deferred():  # transformers builds the model through torch's device modes: see interrupts
            loaded = self.model_class.from_pretrained(
                str(folder), dtype=self.dtype, output_loading_info=True, **self.loading_args
            )
        return self._checked(str(folder), loaded)

    def from_state(self, state: dict, what: str) -> object:
        """A model from on-disk tensor names (e.g. an adapter applied to pre, or a task vector)."""
        with interrupts.deferred():
            loaded = self.model_class.from_pretrained(
                None,
                config=self.config,
                state_dict=state,
                dtype=self.dtype,
                output_loading_info=True,
                **self.loading_args,
            )
        return self._checked(what, loaded)

    def _checked(self, what, loaded):
        model, info = loaded
        if info["missing_keys"]:
            raise InputError(
                f"{what}: lacks tensor {sorted(info['missing_keys'])[0]}, which the "
                f"{self.model_class.__name__} built from --pre's config.json needs"
            )
        return model.to(self.device).eval()


def converts_tensors(model) -> bool:
    """Whether transformers assembles some parameters from several on-disk tensors (e.g. fused experts)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    return any(isinstance(transform, WeightConverter) for transform in get_model_conversion_mapping(model))


class ResidentPair:
    """pre's model, loaded once, with pre and post (or post's task vector) held beside it in the evaluation
    dtype: each point writes its merged weights into the model's parameters in place, no I/O, no copy.

    What is held depends on the method. linear, slerp, task_arithmetic and recall combine pre and post
    tensor by tensor with coefficients that are elementwise-linear in the parameters, so they run on the
    model's own (converted) parameters. TIES and DARE sparsify the task vector with per-tensor statistics
    that fused tensors would change: the sparsified vector is computed once on the on-disk tensors, at
    lambda 1 (it does not depend on lambda), and mapped to the parameters through transformers'
    conversion; each point is then pre + lambda * vector, the engine's own formula. A 2-D grid over density
    or drop changes the vector: it is computed again when a point's other parameters differ from the held one's.

    Each merged tensor is rounded to the dtype the engine stores it in (pre's, e.g. bf16) before it is cast to the
    evaluation dtype, as a merge streamed to disk and loaded back is: the model scored is the one `--save-best`
    writes, not a float32 merge of it.
    """

    def __init__(self, loader: ModelLoader, settings: SweepSettings, sources, config: MergeConfig):
        import torch

        from mergekit_lite.io.architecture import layout
        from mergekit_lite.merge.plan import layer_count

        self.method = methods.method(settings.method)
        self.model = loader.from_folder(settings.pre)
        self.parameters = dict(self.model.named_parameters())
        self.pre = {name: parameter.detach().clone() for name, parameter in self.parameters.items()}
        self.sparsified = self.method.sparsifies
        self.loader, self.sources = loader, sources
        if self.sparsified:
            self._hold_task_vector(config)
        else:
            held = post_model(loader, settings, sources)
            self.held = {name: parameter.detach() for name, parameter in held.named_parameters()}
            del held
        self.identical = {
            name for name in self.parameters if not self.sparsified and torch.equal(self.pre[name], self.held[name])
        }
        self.layout = layout(sources[0].config)
        self.n_layers = layer_count(self.layout, sources[0].names)
        self.stored = stored_dtypes(self.parameters, sources[0])

    @property
    def exact(self) -> bool:
        """False for SLERP on a model whose parameters fuse on-disk tensors: its angle is per on-disk tensor,
        so such a sweep merges through a folder on disk instead."""
        return self.method.exact_on_fused_parameters or not converts_tensors(self.model)

    def _hold_task_vector(self, config: MergeConfig) -> None:
        """The sparsified task vector of `config` at lambda 1 (its density, drop and seed decide it)."""
        self.held_for = _sparsifier_key(config)
        self.held = {}  # the previous vector is freed before the next is built
        held = self.loader.from_state(task_vector_state(config, self.sources), "the task vector post - pre")
        self.held = {name: parameter.detach() for name, parameter in held.named_parameters()}

    def endpoint(self, index: int) -> bool:
        """Write pre (0) or post (1) into the model; False when post is not held (a task vector is)."""
        if index == 1 and self.sparsified:
            return False
        self._write(lambda name: (self.pre if index == 0 else self.held)[name])
        return True

    def write(self, config: MergeConfig) -> None:
        """Write one point's merge into the model's parameters."""
        import torch

        from mergekit_lite.merge.engine import merge_tensor
        from mergekit_lite.merge.plan import (
            TensorStep,
            load_recall_weights,
            tensor_parameters,
        )

        weights = load_recall_weights(config) if config.merge_method.reads_recall_weights else None
        if self.sparsified and _sparsifier_key(config) != self.held_for:
            self._hold_task_vector(config)

        def merged(name):
            pre, held = self.pre[name], self.held[name]
            parameters = tensor_parameters(config, name, self.layout, self.n_layers, weights)
            if self.sparsified:
                return held.to(torch.float32, copy=True).mul_(parameters.scale).add_(pre).to(self.stored[name])
            if name in self.identical:
                return pre
            step = TensorStep(name, tuple(pre.shape), self.stored[name], "merge", parameters)
            return merge_tensor(config, step, [pre, held])

        self._write(merged)

    def _write(self, tensor_for) -> None:
        import torch

        with torch.no_grad():
            for name, parameter in self.parameters.items():
                parameter.copy_(tensor_for(name))


def stored_dtypes(parameters: dict, source) -> dict:
    """Each parameter's on-disk dtype in pre, the dtype a merge stores it in: by its name, or, for a parameter
    transformers assembles from several tensors (fused experts), pre's floating dtype when it has one; else the
    parameter's own (nothing rounded)."""
    floating = {source.dtype(name) for name in source.names if source.dtype(name).is_floating_point}
    common = floating.pop() if len(floating) == 1 else None
    return {
        name: source.dtype(name) if name in source.names else common or parameter.dtype
        for name, parameter in parameters.items()
    }


def check_pair(settings: SweepSettings) -> None:
    """Headers only, before the run folder is made or any model read: pre and post hold the same tensors in the
    same shapes (a sweep merges them as they are, it aligns no vocabularies) and a merge of them plans."""
    from mergekit_lite.io.sources import open_inputs
    from mergekit_lite.merge.plan import plan_merge
    from mergekit_lite.merge.schema import config_from_dict

    sources = open_inputs([settings.pre, settings.post], settings.pre, allow_pickle=False)
    try:
        pre, post = sources
        for name in pre.names:
            if name in post.names and post.shape(name) != pre.shape(name):
                raise InputError(
                    f"tensor {name}: shape {list(post.shape(name))} in post ({settings.post}) but "
                    f"{list(pre.shape(name))} in pre ({settings.pre}); a sweep merges them tensor by tensor as they "
                    "are (for another vocabulary, re-index post onto pre's tokens first: mergekit-lite merge "
                    "--method linear --alpha 1 --base PRE --model POST --tokenizer-source base --out POST_ALIGNED)"
                )
        plan_merge(
            config_from_dict(
                {"method": "linear", "base": settings.pre, "models": [settings.post], "parameters": {"alpha": 0.5}},
                where="sweep",
            ),
            sources,
        )
    finally:
        for source in sources:
            source.close()


def _sparsifier_key(config: MergeConfig) -> str:
    """What a sparsified task vector depends on: the whole config but lambda."""
    return json.dumps(config.with_parameter("lambda", 1.0).to_dict(), sort_keys=True, default=str)


def post_model(loader: ModelLoader, settings: SweepSettings, sources):
    """post through from_pretrained, or, for a LoRA adapter, pre + its update by on-disk name; a quantized post
    as the dense tensors every command reads (io/quantized.py), by on-disk name too."""
    from mergekit_lite.io.lora import LoraAdapter
    from mergekit_lite.io.quantized import quantized_inputs

    if LoraAdapter.is_adapter_dir(settings.post) or quantized_inputs(sources[1:]):
        return loader.from_state({name: sources[1].load(name) for name in sources[1].names}, settings.post)
    return loader.from_folder(settings.post)


def task_vector_state(config: MergeConfig, sources) -> dict:
    """post - pre after the method's sparsifier (TIES trim, DARE drop and rescale), per on-disk tensor:
    the engine's merge at lambda 1 with pre taken as zero, so masks and thresholds are the engine's own."""
    import dataclasses

    import torch

    from mergekit_lite.merge.engine import merge_tensor
    from mergekit_lite.merge.plan import StepAction, plan_merge

    config = config.with_parameter("lambda", 1.0)
    state = {}
    for step in plan_merge(config, sources).steps:
        pre = sources[0].load(step.name)
        if not pre.is_floating_point():
            state[step.name] = pre
            continue
        if step.action is StepAction.COPY:
            state[step.name] = torch.zeros(step.shape, dtype=torch.float32)
            continue
        delta = sources[1].load(step.name).to(torch.float32).sub_(pre.to(torch.float32))
        step = dataclasses.replace(step, out_dtype=torch.float32)
        state[step.name] = merge_tensor(config, step, [torch.zeros_like(delta), delta])
    return state
