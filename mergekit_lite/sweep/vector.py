"""A vector of coefficients instead of one: one per group of decoder layers (`--groups N`) and/or per module type
(`--modules attn,mlp,...`), written as the merge config's own per-tensor parameter forms (a layer gradient inside
`{filter, value}` entries, mergekit's), so the merge path is the engine's and a mergekit user can run it there.

The slots. N contiguous groups of decoder layers, layer l in group floor(l * N / n_layers) (the first groups take
the rounding); with --modules, each group has one slot per listed module type and one (`other`) for the rest of its
tensors (norms, unlisted projections). Outside the layers: the embeddings go with the first group (a gradient's
first value, where both we and mergekit put them), the final norm and the head with the last group (explicit
entries by tensor name, so mergekit, which plans them at the gradient's start, gives them the same value).

This module is the space, its configs, what a trial is worth against the scalar pick (a paired bootstrap on the
report split) and the report's account; the search itself is `vector_search`. [ours: the slots follow
mergekit-evolve's layer groups and filters; HMA (arXiv 2309.06256) and Layer Swapping (arXiv 2410.01335) motivate
per-layer coefficients]
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from mergekit_lite.errors import InputError
from mergekit_lite.io.report_page import Cell, Prose, Section, Table
from mergekit_lite.merge.config import MergeConfig
from mergekit_lite.sweep.settings import SweepSettings

VECTORS_DIR = "vectors"  # each trial's point: its label is a hash of its merge config
STUDY_FILE = "search.db"  # Optuna's SQLite storage: a killed search resumes its finished trials
MERGEKIT_FILE = "mergekit.yaml"  # the chosen merge as a mergekit config
OTHER, ALL = "other", "all"
KIND_TYPES = {  # --modules' names -> evaluate.drift.module_type's types
    "attn": ("q", "k", "v", "o", "qkv"),
    "mlp": ("gate", "up", "down", "gate_up", "experts", "shared_expert", "router"),
}
DEFAULT_TRIALS = 24


@dataclass(frozen=True)
class VectorSpace:
    """The slots of a vector and how each tensor finds its own: `entries` (filter, kind) for the tensors of a listed
    module type inside the layers, `head` (tensor name, kind) for the final norm and head, the rest `other`."""

    groups: int
    kinds: tuple[str, ...]  # the listed module types, then `other`; (`all`,) without --modules
    n_layers: int
    entries: tuple[tuple[str, str], ...]
    head: tuple[tuple[str, str], ...]

    @property
    def slots(self) -> list[str]:
        """Slot names: `g1` ... without --modules, `g1.attn`, `g1.other` ... with them (groups counted from 1)."""
        names = [f"g{group + 1}" for group in range(self.groups)]
        return names if self.kinds == (ALL,) else [f"{name}.{kind}" for name in names for kind in self.kinds]

    def group_of(self, layer: int) -> int:
        return layer * self.groups // self.n_layers

    def layers(self) -> list[list[int]]:
        """Each group's decoder layers."""
        return [
            [layer for layer in range(self.n_layers) if self.group_of(layer) == group] for group in range(self.groups)
        ]

    def spec(self, vector: list[float]):
        """The coefficient's value spec: per module type a gradient with one value per layer (its group's), the
        final norm and head by name, the rest the `other` gradient (the embeddings its first value)."""
        if len(vector) != len(self.slots):
            raise ValueError(f"a vector of {len(self.slots)} coefficients, got {len(vector)}")
        width = len(self.kinds)

        def value(group: int, kind: str) -> float:
            return float(vector[group * width + self.kinds.index(kind)])

        def gradient(kind: str):
            if self.groups == 1:
                return value(0, kind)
            return [value(self.group_of(layer), kind) for layer in range(self.n_layers)]

        default = OTHER if OTHER in self.kinds else ALL
        return [
            *({"filter": name, "value": gradient(kind)} for name, kind in self.entries),
            *({"filter": name, "value": value(self.groups - 1, kind)} for name, kind in self.head),
            {"value": gradient(default)},
        ]

    def to_json(self) -> dict:
        return {
            "groups": self.groups,
            "modules": [kind for kind in self.kinds if kind not in (OTHER, ALL)],
            "slots": self.slots,
            "layers": self.layers(),
            "outside_layers": "embeddings with the first group; the final norm and the head with the last",
        }


def kind_types(modules: list[str]) -> dict[str, str]:
    """module type -> the listed kind holding it; two listed kinds sharing a type (attn and q) are refused."""
    owner = {}
    for kind in modules:
        for module in KIND_TYPES.get(kind, (kind,)):
            if module in owner:
                raise InputError(f"modules: {owner[module]} and {kind} both hold {module}; list each type once")
            owner[module] = kind
    return owner


def vector_space(settings: SweepSettings) -> VectorSpace:
    """The space of `settings` from pre's headers: its decoder layers and, with --modules, which tensor is which
    module type (evaluate.drift's table); checked so that every tensor's first matching entry is its own slot's."""
    from mergekit_lite.evaluate.drift import module_type
    from mergekit_lite.io.architecture import layout
    from mergekit_lite.io.sources import open_inputs
    from mergekit_lite.merge.plan import LAYER_PATTERN, depth_position, layer_count

    [source] = open_inputs([settings.pre], settings.pre, allow_pickle=False)
    try:
        names, model_layout = list(source.names), layout(source.config)
    finally:
        source.close()
    n_layers = layer_count(model_layout, names)
    groups = settings.groups or 1
    if n_layers < groups:
        raise InputError(f"groups: {groups} groups of decoder layers, but pre has {n_layers} layers")
    owner = kind_types(settings.modules or [])
    kinds = (*dict.fromkeys(owner.values()), OTHER) if owner else (ALL,)
    entries, head, kind_of = {}, {}, {}
    for name in names:
        layer, part = depth_position(name, model_layout)
        kind_of[name] = owner.get(module_type(name, model_layout), OTHER if owner else ALL)
        if layer is not None and kind_of[name] not in (OTHER, ALL):
            entries.setdefault(name[LAYER_PATTERN.search(name).end() :], kind_of[name])
        elif layer is None and part == "head":
            head[name] = kind_of[name]
    space = VectorSpace(groups, kinds, n_layers, tuple(entries.items()), tuple(head.items()))
    filters = [*space.entries, *space.head]
    for name in names:
        first = next((kind for pattern, kind in filters if pattern in name), None)
        layer, part = depth_position(name, model_layout)
        own = kind_of[name] if layer is not None and kind_of[name] not in (OTHER, ALL) or part == "head" else None
        if first != own:
            raise InputError(
                f"--modules: tensor {name} cannot be told apart from a {first or own} tensor by its name; "
                "sweep fewer module types"
            )
    return space


def vector_config(base: MergeConfig, coefficient: str, spec) -> MergeConfig:
    """The merge `base` (the scalar pick's, its other parameters kept) with the coefficient `spec`, validated."""
    from mergekit_lite.merge.schema import config_from_dict

    data = base.to_dict()
    return config_from_dict({**data, "parameters": {**data["parameters"], coefficient: spec}}, where="sweep")


def vector_label(config: MergeConfig) -> str:
    """A trial's label: a hash of its whole merge config, so the same vector is the same point file."""
    text = json.dumps(config.to_dict(), sort_keys=True, default=str)
    return f"vector={hashlib.sha256(text.encode()).hexdigest()[:16]}"


def drift_start(space: VectorSpace, settings: SweepSettings, alpha: float, low: float, high: float) -> list[float]:
    """A start from post's drift profile: each slot's coefficient is the scalar pick scaled by the whole model's
    relative drift over the slot's own (clipped to the grid's range), so the slots post moved most start nearest
    pre. A heuristic start, never a pick: the search scores it like any vector. [ours]"""
    from mergekit_lite.evaluate.drift import weight_drift

    sums = [[0.0, 0.0] for _ in space.slots]
    total = [0.0, 0.0]
    for tensor in weight_drift(settings.pre, settings.post):
        index = slot_of(space, tensor.name, tensor.layer)
        sums[index][0] += tensor.diff_sq
        sums[index][1] += tensor.pre_sq
        total[0] += tensor.diff_sq
        total[1] += tensor.pre_sq
    whole = (total[0] / total[1]) ** 0.5 if total[1] else 0.0
    start = []
    for diff, pre in sums:
        own = (diff / pre) ** 0.5 if pre else 0.0
        start.append(min(high, max(low, alpha * whole / own if own > 0 else high)))
    return start


def slot_of(space: VectorSpace, name: str, layer: int | None) -> int:
    """The slot a tensor's coefficient comes from (as `VectorSpace.spec` resolves it)."""
    width = len(space.kinds)
    for pattern, kind in space.head:
        if pattern in name:
            return (space.groups - 1) * width + space.kinds.index(kind)
    group = 0 if layer is None else space.group_of(layer)
    kind = next((kind for pattern, kind in space.entries if pattern in name), OTHER if OTHER in space.kinds else ALL)
    return group * width + space.kinds.index(kind)


def mergekit_config(config: MergeConfig, settings: SweepSettings) -> dict:
    """The merge `config` in mergekit's schema, by what its coefficient is: `alpha` (linear's weight of post) as the
    weights of pre and post, 1 - spec and spec; `t` (slerp) as t; `lambda` (the task-vector methods) as lambda, with
    post's weight 1 and DARE's drop as mergekit's density (the share kept). Stored in pre's dtype."""
    method = config.merge_method
    coefficient = method.main_coefficient
    spec = config.parameters[coefficient]
    models: list[dict] = [{"model": settings.post, "parameters": {"weight": 1.0}}]
    data = {"merge_method": method.name, "base_model": settings.pre}
    if coefficient == "alpha":
        del data["base_model"]
        models = [
            {"model": settings.pre, "parameters": {"weight": complement(spec)}},
            {"model": settings.post, "parameters": {"weight": spec}},
        ]
    elif coefficient == "t":
        models, data["parameters"] = [{"model": settings.pre}, {"model": settings.post}], {"t": spec}
    else:
        data["parameters"] = {coefficient: spec}
        for name in ("density", "epsilon", "gamma"):
            if name in config.parameters:
                models[0]["parameters"][name] = config.parameters[name]
        if "drop" in config.parameters:
            models[0]["parameters"]["density"] = complement(config.parameters["drop"])
    data.update(models=models, dtype="float32")
    stored = stored_dtype(settings.pre)
    return {**data, **({"out_dtype": stored} if stored else {})}


def stored_dtype(model: str) -> str | None:
    """pre's dtype from its config.json (what our merge stores a floating tensor in), when it names one."""
    from mergekit_lite.io.validation import read_json

    data = read_json(Path(model) / "config.json")
    text = data.get("dtype") or data.get("torch_dtype") or (data.get("text_config") or {}).get("dtype")
    return text if text in ("float32", "bfloat16", "float16") else None


def complement(spec):
    """1 - x throughout a value spec (numbers, gradients, filter entries)."""
    if isinstance(spec, (int, float)):
        return 1.0 - spec
    if isinstance(spec, dict):
        return {**spec, "value": complement(spec["value"])}
    return [complement(item) for item in spec]


def vector_section(results: dict) -> Section | None:
    """The report's account of the vector search: the space, the cost, the pick's coefficients per slot, and the
    vector against the scalar pick on the report split, said plainly when it did not beat one coefficient."""
    vector = results.get("vector")
    if vector is None:
        return None
    search, space, pick = vector["search"], vector["space"], vector["pick"]
    modules = f", module types {', '.join(space['modules'])} (and `other`)" if space["modules"] else ""
    prune = search.get("prune")
    if prune is None:
        scored = f"each scored on every doc ({search['docs_per_trial']} docs a trial"
    else:
        scored = (
            f"each scored first on {prune['probe_docs']} probe docs of the selection split, then on every doc "
            f"({search['docs_per_trial']} docs a trial) unless Optuna's median pruner stopped it: "
            f"{prune['pruned']} pruned, {search['docs']} docs scored in all against "
            f"{search['docs_without_pruning']} for every trial on every doc ({search['evaluations']} evaluations"
        )
    batch = f", asked {search['batch']} at a time" + (" and scored in parallel on Ray" if search.get("ray") else "")
    cost = (
        f"Searched with {search['sampler']} from the {search['start']} start on the selection split only: "
        f"{search['trials']} trials{batch if search.get('batch', 1) > 1 or search.get('ray') else ''}, "
        f"{scored}; {search['evaluated']} scored on every doc by this run, the others resumed). Layers per group: "
        f"{'; '.join(f'g{index + 1}: {layer_range(layers)}' for index, layers in enumerate(space['layers']))}; "
        f"{space['outside_layers']}."
    )
    slots = Table(
        ["slot", *pick["coefficients"]],
        [[Cell("pick"), *(Cell(f"{value:.3f}", value) for value in pick["coefficients"].values())]],
        "l" + "r" * len(pick["coefficients"]),
    )
    rows = [
        [Cell(name), *(Cell(f"{row[key]:.4f}", row[key]) for key in ("old", "new", "harmonic_mean"))]
        for name, row in (("scalar pick", vector["scalar"]), ("vector", pick))
    ]
    intervals, difference = vector["intervals"], vector["difference"]
    shown = [
        f"{difference[name]:+.4f}" + (f" [{intervals[name][0]:+.4f}, {intervals[name][1]:+.4f}]" if intervals else "")
        for name in ("old", "new", "harmonic_mean")
    ]
    rows.append([Cell("vector - scalar"), *(Cell(text) for text in shown)])
    comparison = Table(["report split", "old", "new", "harmonic mean"], rows, "lrrr")
    verdict = Prose([f"**{vector['verdict'][0].upper()}{vector['verdict'][1:]}.**"])
    title = f"Vector of coefficients ({space['groups']} layer groups{modules})"
    return Section("vector", title, [Prose([cost]), slots, comparison, verdict, trial_table(vector["trials"])])


def trial_table(trials: list[dict]) -> Table:
    """Every trial: its estimate on probe docs (with --vector-prune), its selection harmonic mean on every doc (none
    when pruned), and the docs and evaluations it cost (none for a vector an earlier trial scored)."""

    def number(value) -> Cell:
        return Cell("-" if value is None else f"{value:.4f}", value)

    rows = [
        [
            Cell(str(trial["number"] + 1), trial["number"]),
            number(trial.get("probe_harmonic_mean")),
            number(trial["selection_harmonic_mean"]),
            Cell("pruned" if trial.get("pruned") else "every doc"),
            Cell(str(trial.get("docs", "")), trial.get("docs")),
            Cell(str(trial.get("evaluations", "")), trial.get("evaluations")),
        ]
        for trial in trials
    ]
    columns = ["trial", "probe estimate", "selection harmonic mean", "scored on", "docs", "evaluations"]
    return Table(columns, rows, "lrrlrr", key="vector-trials")


def layer_range(layers: list[int]) -> str:
    return str(layers[0]) if len(layers) == 1 else f"{layers[0]}-{layers[-1]}"


def vector_card(results: dict) -> tuple[str, str]:
    """The model card section of a vector pick: the coefficients per slot and the comparison with the scalar pick."""
    vector = results["vector"]
    coefficients = "\n".join(f"- {slot}: {value:.4f}" for slot, value in vector["pick"]["coefficients"].items())
    return (
        "Coefficients per layer group",
        f"{vector['coefficient']} per slot, chosen on the selection split:\n\n{coefficients}\n\n{vector['verdict']}.",
    )
