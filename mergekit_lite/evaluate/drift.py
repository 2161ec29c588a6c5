"""Where post-training changed a model: relative Frobenius drift per tensor, decoder layer and module type, and,
on texts, how much each layer's representations moved (linear CKA).

Drift of a tensor W: ||W_post - W_pre||_F / ||W_pre||_F. A group of tensors (a layer, a module type) is measured
as one vector: sqrt(sum of squared differences) / sqrt(sum of squared pre weights), so a large tensor weighs by
its size, not by its count. Differences are taken in float32 (the precision merges compute in), squared and
summed in float64, so a model of billions of entries loses nothing to the sum's rounding.

Tensors stream one pair at a time, a plain safetensors tensor in row slabs of the merge engine's size
(`slabs.SLAB_BYTES`), so memory stays a slab whatever the model's size. A LoRA adapter as POST is read as the
model it makes (`sources.AdapterSource`: base + scaling * B @ A per tensor), without writing that model.

Representation similarity is linear CKA (Kornblith, Norouzi, Lee, Hinton, "Similarity of Neural Network
Representations Revisited", ICML 2019, §3 eq. (2) and the linear-kernel form of §4, "Linear CKA"): with X and Y
the centred [examples, features] matrices of the two models at one layer,
    CKA(X, Y) = ||Y^T X||_F^2 / (||X^T X||_F ||Y^T Y||_F),
1 for representations equal up to rotation and isotropic scale. Examples are tokens: every non-special token of
the texts under the shared tokenizer, at the output of each decoder layer (transformers' hidden_states[l + 1];
the last layer's is after the final norm, as transformers returns it).
"""

from __future__ import annotations

import gc
import math
from dataclasses import dataclass, field

import torch

from mergekit_lite import interrupts
from mergekit_lite.errors import InputError
from mergekit_lite.evaluate.settings import DriftSettings
from mergekit_lite.io.architecture import Layout, disk_names, layout
from mergekit_lite.io.lora import LoraAdapter
from mergekit_lite.io.safetensors import ModelSource
from mergekit_lite.io.sources import RenamedSource, TensorSource, open_inputs
from mergekit_lite.merge.config import is_embedding
from mergekit_lite.merge.finite import all_finite, nonfinite_message, tensor_file
from mergekit_lite.merge.plan import layer_index
from mergekit_lite.merge.recall import find_tokenizer_dir
from mergekit_lite.merge.slabs import SLAB_BYTES

# leaf module name (the component before .weight/.bias) -> module type; attention and MLP projections under the
# names of the common decoder families (Llama/Qwen/Mistral/Gemma/Phi, GPT-2, Mixtral's experts, NeoX, Falcon)
LEAF_MODULES = {
    "q_proj": "q",
    "wq": "q",
    "query": "q",
    "k_proj": "k",
    "wk": "k",
    "key": "k",
    "v_proj": "v",
    "wv": "v",
    "value": "v",
    "o_proj": "o",
    "wo": "o",
    "out_proj": "o",
    "c_attn": "qkv",
    "qkv_proj": "qkv",
    "query_key_value": "qkv",
    "wqkv": "qkv",
    "gate_proj": "gate",
    "w1": "gate",
    "up_proj": "up",
    "w3": "up",
    "c_fc": "up",
    "fc1": "up",
    "dense_h_to_4h": "up",
    "down_proj": "down",
    "w2": "down",
    "fc2": "down",
    "dense_4h_to_h": "down",
    "gate_up_proj": "gate_up",
}
MODULE_ORDER = (
    "q",
    "k",
    "v",
    "o",
    "qkv",
    "gate",
    "up",
    "down",
    "gate_up",
    "experts",
    "shared_expert",
    "router",
    "norm",
    "embed",
    "head",
    "tower",
    "other",
)
OUTSIDE = "outside layers"


def module_type(name: str, model_layout: Layout) -> str:
    """The module type a tensor belongs to, from its name (towers of a composite model: from transformers)."""
    if model_layout.in_tower(name):
        return "tower"
    parts = name.lower().split(".")
    leaf = parts[-2] if len(parts) > 1 and parts[-1] in ("weight", "bias") else parts[-1]
    parent = parts[-3] if len(parts) > 2 and parts[-1] in ("weight", "bias") else ""
    if "experts" in parts:
        return "experts"
    if any(part.startswith("shared_expert") for part in parts):
        return "shared_expert"
    if leaf in ("gate", "router") and parent in ("mlp", "block_sparse_moe", "moe", "feed_forward"):
        return "router"
    if "norm" in leaf or leaf.startswith("ln"):
        return "norm"
    if layer_index(name, model_layout) is None:
        if is_embedding(name):
            return "embed"
        if leaf in ("lm_head", "embed_out", "output", "head"):
            return "head"
    if leaf == "c_proj":  # GPT-2: the attention output under attn, the MLP's down projection under mlp
        return "o" if parent.startswith("attn") else "down"
    if leaf == "dense" and "attention" in parent:
        return "o"
    return LEAF_MODULES.get(leaf, "other")


@dataclass(frozen=True)
class TensorDrift:
    """One tensor's sums: squared differences and squared pre weights (float64)."""

    name: str
    layer: int | None
    module: str
    diff_sq: float
    pre_sq: float
    finite: bool = True  # False: pre or post holds NaN or Inf here (read with allow_nonfinite): no drift to give

    @property
    def relative_drift(self) -> float | None:
        return relative(self.diff_sq, self.pre_sq) if self.finite else None


def relative(diff_sq: float, pre_sq: float) -> float | None:
    """sqrt(diff_sq / pre_sq); None where pre is all zeros and post is not (no scale to measure against), 0 where
    both are."""
    if pre_sq == 0:
        return 0.0 if diff_sq == 0 else None
    return math.sqrt(diff_sq / pre_sq)


def group_drift(tensors: list[TensorDrift]) -> float | None:
    """A group's drift; None when a tensor of it holds NaN or Inf (its drift is no number)."""
    if not all(t.finite for t in tensors):
        return None
    return relative(math.fsum(t.diff_sq for t in tensors), math.fsum(t.pre_sq for t in tensors))


@dataclass(frozen=True)
class LayerDrift:
    layer: int
    relative_drift: float | None
    modules: dict[str, float | None]
    cka: float | None = None


@dataclass
class DriftReport:
    """Every tensor's drift, grouped per decoder layer and module type; CKA per layer when texts were given."""

    pre: str
    post: str
    tensors: list[TensorDrift]
    layers: list[LayerDrift] = field(default_factory=list)
    outside: dict[str, float | None] = field(default_factory=dict)
    modules: dict[str, float | None] = field(default_factory=dict)
    total: float | None = None

    def to_json(self) -> dict:
        return {
            "pre": self.pre,
            "post": self.post,
            "relative_drift": self.total,
            "tensors": {
                t.name: {"relative_drift": t.relative_drift, "layer": t.layer, "module": t.module} for t in self.tensors
            },
            "layers": [
                {
                    "layer": row.layer,
                    "relative_drift": row.relative_drift,
                    "modules": row.modules,
                    **({"cka": row.cka} if row.cka is not None else {}),
                }
                for row in self.layers
            ],
            "outside_layers": self.outside,
            "modules": self.modules,
        }

    @property
    def nonfinite(self) -> list[str]:
        """The tensors whose drift is null because pre or post holds NaN or Inf there."""
        return [t.name for t in self.tensors if not t.finite]

    def module_columns(self) -> list[str]:
        present = {module for row in self.layers for module in row.modules} | set(self.outside)
        return [module for module in MODULE_ORDER if module in present]


def summarise(pre: str, post: str, tensors: list[TensorDrift], cka: list[float | None] | None = None) -> DriftReport:
    """Group the tensors: per decoder layer (and its module types), outside the layers, per module type."""
    by_layer: dict[int, list[TensorDrift]] = {}
    for tensor in tensors:
        if tensor.layer is not None:
            by_layer.setdefault(tensor.layer, []).append(tensor)
    layers = []
    for index in sorted(by_layer):
        members = by_layer[index]
        modules = {
            module: group_drift([t for t in members if t.module == module])
            for module in MODULE_ORDER
            if any(t.module == module for t in members)
        }
        layers.append(
            LayerDrift(
                index, group_drift(members), modules, cka[index] if cka is not None and index < len(cka) else None
            )
        )
    outside_tensors = [t for t in tensors if t.layer is None]
    outside = {
        module: group_drift([t for t in outside_tensors if t.module == module])
        for module in MODULE_ORDER
        if any(t.module == module for t in outside_tensors)
    }
    modules = {
        module: group_drift([t for t in tensors if t.module == module])
        for module in MODULE_ORDER
        if any(t.module == module for t in tensors)
    }
    return DriftReport(pre, post, tensors, layers, outside, modules, group_drift(tensors))


# --- weights ---------------------------------------------------------------------------------------------


def open_pair(pre: str, post: str) -> tuple[TensorSource, TensorSource]:
    """PRE (a model) and POST (a model, or a LoRA adapter applied to PRE) with POST's names mapped onto PRE's."""
    if LoraAdapter.is_adapter_dir(pre):
        raise InputError(f"{pre}: PRE must be a model; a LoRA adapter can only be POST (applied to PRE)")
    reference, other = open_inputs([pre, post], base=pre, allow_pickle=False)
    for name in reference.names:
        if tuple(reference.shape(name)) != tuple(other.shape(name)):
            raise InputError(
                f"{post}: a model of another shape: tensor {name} is {list(other.shape(name))}, "
                f"{list(reference.shape(name))} in {pre}"
            )
    return reference, other


def _plain(source: TensorSource, name: str) -> tuple[ModelSource, str] | None:
    """The safetensors source and stored name behind `name` when its rows can be mapped a slab at a time."""
    if isinstance(source, RenamedSource) and type(source.source) is ModelSource:
        return source.source, source.name_map[name]
    if type(source) is ModelSource:
        return source, name
    return None


def _slabs(pre: TensorSource, post: TensorSource, name: str):
    """(pre, post) float32 pieces of one tensor: row slabs of SLAB_BYTES (both inputs together) where both are
    plain safetensors, else the whole tensors."""
    shape = tuple(pre.shape(name))
    plain_pre, plain_post = _plain(pre, name), _plain(post, name)
    if plain_pre is None or plain_post is None or len(shape) < 1 or shape[0] == 0:
        yield pre.load(name).to(torch.float32), post.load(name).to(torch.float32)
        return
    row_bytes = max(1, math.prod(shape[1:])) * (pre.dtype(name).itemsize + post.dtype(name).itemsize)
    rows = max(1, SLAB_BYTES // row_bytes)
    for begin in range(0, shape[0], rows):
        end = min(begin + rows, shape[0])
        yield (
            plain_pre[0].map_rows(plain_pre[1], begin, end).to(torch.float32),
            plain_post[0].map_rows(plain_post[1], begin, end).to(torch.float32),
        )


DRIFT_REMEDY = "pass --allow-nonfinite to report its drift as null"


def tensor_drift(
    pre: TensorSource,
    post: TensorSource,
    name: str,
    model_layout: Layout,
    allow_nonfinite: bool = False,
    remedy: str | None = DRIFT_REMEDY,
) -> TensorDrift:
    """Squared difference (float32, summed in float64) and squared pre norm of one tensor, slab by slab. NaN or Inf
    in either is refused (merge/finite.py), or with `allow_nonfinite` gives a tensor without a drift."""
    diff_sq = pre_sq = 0.0
    finite = True
    for before, after in _slabs(pre, post, name):
        for source, piece in ((pre, before), (post, after)):
            if not all_finite(piece):
                if not allow_nonfinite:
                    raise InputError(nonfinite_message(name, tensor_file(source, name), remedy))
                finite = False
        if not finite:  # no drift to report: the rest of the tensor need not be read
            break
        diff_sq += torch.sum(torch.square((after - before).to(torch.float64))).item()
        pre_sq += torch.sum(torch.square(before.to(torch.float64))).item()
    layer, module = layer_index(name, model_layout), module_type(name, model_layout)
    return TensorDrift(name, layer, module, diff_sq if finite else 0.0, pre_sq if finite else 0.0, finite)


def weight_drift(
    pre: str, post: str, allow_nonfinite: bool = False, remedy: str | None = DRIFT_REMEDY
) -> list[TensorDrift]:
    """Every tensor's drift, PRE's tensors in on-disk order (a pass reads each shard front to back)."""
    reference, other = open_pair(pre, post)
    try:
        model_layout = layout(reference.config)
        drifts = []
        for name in reference.names:
            interrupts.check()
            drifts.append(tensor_drift(reference, other, name, model_layout, allow_nonfinite, remedy))
        return drifts
    finally:
        reference.close()
        other.close()


def model_drift(
    pre: str, post: str, texts: list[str] | None = None, settings: DriftSettings | None = None, **options
) -> DriftReport:
    """The whole report: weight drift, and with `texts` each decoder layer's linear CKA (None where the
    representations are not finite). `settings` or `options` (its fields by name): DriftSettings."""
    chosen = DriftSettings.of(settings, **options)
    tensors = weight_drift(pre, post, chosen.allow_nonfinite)
    cka = layer_cka(pre, post, texts, chosen.max_length) if texts else None
    cka = None if cka is None else [value if value is None or math.isfinite(value) else None for value in cka]
    return summarise(pre, post, tensors, cka)


# --- representations -------------------------------------------------------------------------------------


def linear_cka(x: torch.Tensor, y: torch.Tensor) -> float | None:
    """Linear CKA of two [examples, features] matrices (Kornblith et al. 2019, "Linear CKA"), in float64;
    None where either has no variance (the index is 0/0)."""
    if x.shape[0] != y.shape[0]:
        raise InputError(f"CKA needs the same examples on both sides, got {x.shape[0]} and {y.shape[0]}")
    x = x.to(torch.float64) - x.to(torch.float64).mean(dim=0)
    y = y.to(torch.float64) - y.to(torch.float64).mean(dim=0)
    denominator = torch.linalg.matrix_norm(x.T @ x) * torch.linalg.matrix_norm(y.T @ y)
    if denominator == 0:
        return None
    return (torch.linalg.matrix_norm(y.T @ x) ** 2 / denominator).item()


def token_hidden_states(model, tokenizer, texts: list[str], max_length: int) -> list[torch.Tensor]:
    """Per decoder layer, the [tokens, hidden] float32 outputs at every non-special token of the texts, one text
    at a time (no padding)."""
    per_layer: list[list[torch.Tensor]] = []
    model.eval()
    with torch.inference_mode():
        for number, text in enumerate(texts, 1):
            interrupts.check()
            encoded = tokenizer(
                text, truncation=True, max_length=max_length, return_special_tokens_mask=True, return_tensors="pt"
            )
            keep = encoded["special_tokens_mask"][0] == 0
            if not bool(keep.any()):
                raise InputError(f"text {number} has no tokens besides special ones under the tokenizer")
            outputs = model.base_model(input_ids=encoded["input_ids"], output_hidden_states=True, use_cache=False)
            layers = outputs.hidden_states[1:]
            per_layer = per_layer or [[] for _ in layers]
            for rows, hidden in zip(per_layer, layers, strict=True):
                rows.append(hidden[0, keep].to(torch.float32))
    return [torch.cat(rows) for rows in per_layer]


def load_post_model(pre_model, pre: str, post: str):
    """POST in memory: its folder, or PRE's model with an adapter's tensors put in (base + scaling * B @ A)."""
    from transformers import AutoModelForCausalLM

    if not LoraAdapter.is_adapter_dir(post):
        with interrupts.deferred():
            return AutoModelForCausalLM.from_pretrained(post, dtype=torch.float32)
    reference, adapted = open_pair(pre, post)
    try:
        state = pre_model.state_dict()
        on_disk = disk_names(pre_model, list(state))
        memory_name = {disk: memory for memory, disk in on_disk.items()}
        with torch.no_grad():
            for name in adapted.names:
                target = state.get(memory_name.get(name, name))
                if target is None:
                    raise InputError(f"{post}: adapts {name}, which the model built from {pre} does not have")
                target.copy_(adapted.load(name).to(target.dtype))
    finally:
        reference.close()
    return pre_model


def layer_cka(pre: str, post: str, texts: list[str], max_length: int = 256) -> list[float | None]:
    """Linear CKA between PRE's and POST's token representations at each decoder layer's output. Models load one
    at a time in float32 (an adapter POST: PRE's model with its tensors changed in place)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(find_tokenizer_dir([pre, post], 0))
    with interrupts.deferred():
        model = AutoModelForCausalLM.from_pretrained(pre, dtype=torch.float32)
    before = token_hidden_states(model, tokenizer, texts, max_length)
    if not LoraAdapter.is_adapter_dir(post):
        del model
        gc.collect()
        model = None
    post_model = load_post_model(model, pre, post)
    after = token_hidden_states(post_model, tokenizer, texts, max_length)
    if len(before) != len(after):
        raise InputError(f"{post} has {len(after)} decoder layers, {pre} has {len(before)}")
    return [linear_cka(x, y) for x, y in zip(before, after, strict=True)]


# --- rendering --------------------------------------------------------------------------------------------


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def format_drift_table(report: DriftReport) -> str:
    """Layers (then the tensors outside them) by module type, relative drift; CKA as a last column when
    measured. A pipe table that also reads as plain text."""
    columns = report.module_columns()
    with_cka = any(row.cka is not None for row in report.layers)
    header = ["layer", "all", *columns, *(["cka"] if with_cka else [])]
    lines = [
        [
            str(row.layer),
            _number(row.relative_drift),
            *[_number(row.modules[c]) if c in row.modules else "" for c in columns],
            *([_number(row.cka)] if with_cka else []),
        ]
        for row in report.layers
    ]
    if report.outside:
        lines.append(
            [
                OUTSIDE,
                _number(group_drift([t for t in report.tensors if t.layer is None])),
                *[_number(report.outside[c]) if c in report.outside else "" for c in columns],
                *([""] if with_cka else []),
            ]
        )
    lines.append(
        [
            "model",
            _number(report.total),
            *[_number(report.modules.get(c)) for c in columns],
            *([""] if with_cka else []),
        ]
    )
    widths = [max(len(line[i]) for line in [header, *lines]) for i in range(len(header))]

    def render(cells):
        padded = (c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True)))
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join("-" * (w + 2) if i == 0 else "-" * (w + 1) + ":" for i, w in enumerate(widths)) + "|"
    return "\n".join([render(header), rule, *map(render, lines)])


def plot_drift_heatmap(report: DriftReport, path) -> None:
    """Relative drift, decoder layers (and the tensors outside them) by module type, each cell labelled; with CKA
    a second panel of 1 - CKA per layer. matplotlib's Agg canvas: no display needed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    columns = report.module_columns()
    rows = [(str(row.layer), row.modules) for row in report.layers]
    rows += [(OUTSIDE, report.outside)] if report.outside else []
    values = [[float("nan") if (v := cells.get(c)) is None else v for c in columns] for _, cells in rows]
    with_cka = any(row.cka is not None for row in report.layers)
    figure = Figure(figsize=(2.5 + 0.6 * len(columns) + 1.2 * with_cka, 1.8 + 0.3 * len(rows)))
    FigureCanvasAgg(figure)
    grid = figure.add_gridspec(1, 2 if with_cka else 1, width_ratios=[len(columns) + 2, 2] if with_cka else None)
    axes = figure.add_subplot(grid[0, 0])
    top = max((v for line in values for v in line if v == v), default=0.0) or 1.0
    image = axes.imshow(values, cmap="Reds", aspect="auto", vmin=0, vmax=top)
    for r, line in enumerate(values):
        for c, value in enumerate(line):
            axes.text(
                c,
                r,
                "" if value != value else f"{value:.3f}",
                ha="center",
                va="center",
                fontsize=6,
                color="white" if value > 0.6 * top else "black",
            )
    axes.set_xticks(range(len(columns)), columns, fontsize=7, rotation=45, ha="right")
    axes.set_yticks(range(len(rows)), [name for name, _ in rows], fontsize=7)
    axes.set_ylabel("decoder layer")
    axes.set_title("relative drift ||post - pre|| / ||pre||", fontsize=8)
    figure.colorbar(image, ax=axes, shrink=0.8)
    if with_cka:
        cka_axes = figure.add_subplot(grid[0, 1])
        dissimilarity = [[float("nan") if row.cka is None else 1 - row.cka] for row in report.layers]
        cka_axes.imshow(dissimilarity, cmap="Blues", aspect="auto", vmin=0, vmax=1)
        for r, (value,) in enumerate(dissimilarity):
            cka_axes.text(
                0,
                r,
                "" if value != value else f"{value:.3f}",
                ha="center",
                va="center",
                fontsize=6,
                color="white" if value > 0.6 else "black",
            )
        cka_axes.set_xticks([0], ["1 - CKA"], fontsize=7)
        cka_axes.set_yticks(range(len(report.layers)), [str(row.layer) for row in report.layers], fontsize=7)
        cka_axes.set_title("representations", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
