"""The task-vector family (task arithmetic, TIES, DARE, DELLA, Model Breadcrumbs) and SCE: task vectors
(model - base), an optional sparsifier, an optional sign consensus, and a weighted sum added back to the base
(`tensor_math.task_vector_merge`). Each member names one combination, as mergekit's generalized task
arithmetic does. DARE's and DELLA's draws are seeded per (seed, tensor, model), so they depend on neither tensor
order, chunk size, thread count nor device."""

from __future__ import annotations

import hashlib
import math
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mergekit_lite.errors import InputError
from mergekit_lite.merge.methods.registry import (
    DENSITY,
    INT8_MASK,
    LAMBDA,
    NORMALIZE,
    RESCALE,
    WEIGHT,
    Depth,
    Method,
    Parameter,
    StepParameters,
)
from mergekit_lite.merge.methods.variants import Sparsifier
from mergekit_lite.threads import start_on_other_cores

if TYPE_CHECKING:
    import torch

    from mergekit_lite.merge.methods import tensor_math

DROP = Parameter(
    "drop",
    "DARE's share of each task vector's entries dropped",
    default=0.5,
    low=0.0,
    high=1.0,
    high_inclusive=False,
    per_model=True,
    mergekit_default=0.0,
)
EPSILON = Parameter(
    "epsilon",
    "DELLA's spread of drop probabilities around 1 - density",
    default=0.15,
    low=0.0,
    high=1.0,
    high_inclusive=False,
    per_model=True,
)
GAMMA = Parameter(
    "gamma", "Breadcrumbs' share of the largest entries left out", default=0.01, low=0.0, high=1.0, per_model=True
)
SELECT_TOPK = Parameter(
    "select_topk", "SCE's share of entries kept, by their variance across models", default=1.0, low=0.0, high=1.0
)
# 1: torch's Mersenne Twister, float uniforms, one sequential stream per tensor; 2: Philox4x64-10, 16 bits per entry
# at the entry's own counter (`tensor_math.keep_indicator`)
DARE_MASK_VERSION = 2
# the knobs of each sparsifier beyond lambda, weight, normalize, int8_mask and rescale (DARE's density is mergekit's
# name for 1 - drop)
SPARSIFIER_PARAMETERS = {
    None: (),
    Sparsifier.MAGNITUDE: (DENSITY,),
    Sparsifier.RANDOM: (DROP, DENSITY),
    Sparsifier.MAGPRUNE: (DENSITY, EPSILON),
    Sparsifier.OUTLIERS: (DENSITY, GAMMA),
}


def _draw_digest(seed: int, tensor_name: str, model_index: int) -> bytes:
    return hashlib.sha256(f"{seed}\0{tensor_name}\0{model_index}".encode()).digest()


def dare_key(seed: int, tensor_name: str, model_index: int) -> int:
    """DARE's 128-bit Philox key per (seed, tensor, model) (`tensor_math.keep_indicator`)."""
    return int.from_bytes(_draw_digest(seed, tensor_name, model_index)[:16], "little")


def magprune_generator(seed: int, tensor_name: str, model_index: int) -> torch.Generator:
    """DELLA's seeded CPU generator per (seed, tensor, model)."""
    import torch

    return torch.Generator().manual_seed(
        int.from_bytes(_draw_digest(seed, tensor_name, model_index)[:8], "little") & (2**63 - 1)
    )


class KeepsAhead:
    """DARE's keep masks for a tensor's chunks, in order, drawn on the other cores up to `depth` chunks ahead of the
    math. Each chunk's mask depends only on its model's key and its offset (`tensor_math.keep_indicator`), so every
    (chunk, model) is a job of its own, run in any order; a merge that stops taking leaves at most `depth` chunks
    drawn."""

    def __init__(self, keys: list[int], drops: list[float], total: int, chunk: int, first: int = 0, depth: int = 4):
        """`total` entries from flat index `first` of the models' tensors (a row slab's), in chunks of `chunk`."""
        self._models = list(zip(keys, drops, strict=True))
        self._chunks = iter([(first + begin, min(chunk, total - begin)) for begin in range(0, total, chunk)])
        self._ahead: deque[list[Future]] = deque()
        for _ in range(depth):
            self._start_next()

    def take(self) -> list[torch.Tensor | None]:
        """The next chunk's keep masks per model (None where a model drops nothing)."""
        jobs = self._ahead.popleft()
        self._start_next()
        return [job.result() for job in jobs]

    def _start_next(self) -> None:
        from mergekit_lite.merge.methods import tensor_math

        begin, size = next(self._chunks, (None, 0))
        if begin is not None:
            self._ahead.append(
                start_on_other_cores(
                    lambda model: tensor_math.keep_indicator(model[0], begin, size, model[1]), self._models
                )
            )


@dataclass(frozen=True)
class TaskVectorParameters(StepParameters):
    """A task-vector merge's parameters for one tensor: per-model lists where the sparsifier takes them."""

    scale: float  # lambda
    weights: list[float]
    normalize: bool
    densities: list[float] | None = None
    drops: list[float] | None = None
    epsilons: list[float] | None = None
    gammas: list[float] | None = None
    rescale: bool | None = None
    mergekit_rules: bool = False  # mergekit's trim count and sign vote (`tensor_math.trim_threshold`)

    def shown(self) -> dict:
        shown = {"lambda": self.scale, "weights": self.weights, "normalize": self.normalize}
        for name in ("densities", "drops", "epsilons", "gammas", "rescale"):
            if getattr(self, name) is not None:
                shown[name] = getattr(self, name)
        return {**shown, **({"mergekit_rules": True} if self.mergekit_rules else {})}


class TaskVectorMethod(Method):
    """One member of the family: which `Sparsifier` (None: none), whether signs must agree, and its defaults for
    normalize and rescale (mergekit's)."""

    main_coefficient = "lambda"
    needs_base = True

    def __init__(
        self,
        name: str,
        sparsifier: Sparsifier | None,
        consensus: bool,
        normalize: bool,
        rescale: bool,
        summary: str,
        alpha_meaning: str,
        mergekit_normalize: bool | None = None,
    ):
        self.name, self.sparsifier, self.consensus, self.summary = name, sparsifier, consensus, summary
        self.normalize, self.rescale, self.alpha_meaning = normalize, rescale, alpha_meaning
        self.mergekit_normalize = normalize if mergekit_normalize is None else mergekit_normalize
        self.parameters = (LAMBDA, WEIGHT, *SPARSIFIER_PARAMETERS[sparsifier], NORMALIZE, INT8_MASK, RESCALE)
        self.draws_dare_masks = sparsifier is Sparsifier.RANDOM
        self.pre_at_zero = True  # lambda 0: no task vector
        self.post_at_one = sparsifier is None  # lambda 1, nothing sparsified: post itself
        self.sparsifies = sparsifier is not None
        self.scales_task_vector = sparsifier is None and not consensus  # pre + lambda * (post - pre), one model
        self.elementwise = sparsifier in (None, Sparsifier.RANDOM)
        # TIES's trim: elementwise once each threshold is known
        self.slab_statistics = sparsifier is Sparsifier.MAGNITUDE
        self.hides_nonfinite = sparsifier is not None and sparsifier.by_magnitude
        # ~15 float32 ops per element and model: several times the reading and writing
        self.compute_bound = sparsifier is not None
        # DARE's masks are drawn, and TIES's coming thresholds counted, on the other cores (benchmarks/RESULTS.md)
        self.one_chunk_thread = sparsifier in (Sparsifier.RANDOM, Sparsifier.MAGNITUDE)

    def default(self, name: str, mergekit_compat: bool):
        if name == "normalize":
            return self.mergekit_normalize if mergekit_compat else self.normalize
        if name == "rescale":
            return self.rescale
        return super().default(name, mergekit_compat)

    def check(self, config) -> None:
        if config.parameters.get("rescale") is True and self.sparsifier is Sparsifier.MAGNITUDE:
            raise InputError(f"rescale applies to DARE's random drop; {self.name} trims by magnitude without rescaling")

    def step_parameters(self, config, value, depth: Depth) -> TaskVectorParameters:
        models = range(len(config.models))
        per_model = {}
        sparsifier = self.sparsifier
        if sparsifier is not None and sparsifier.by_magnitude:
            per_model["densities"] = [value("density", i) for i in models]
        if sparsifier is Sparsifier.RANDOM:
            per_model["drops"] = [value("drop", i) for i in models]
        if sparsifier is Sparsifier.MAGPRUNE:
            per_model["epsilons"] = [value("epsilon", i) for i in models]
            for density, epsilon in zip(per_model["densities"], per_model["epsilons"], strict=True):
                if density < 1.0 and not (density - epsilon > 0.0 and density + epsilon < 1.0):
                    raise InputError(
                        f"tensor {depth.name}: della needs 0 < density - epsilon and density + epsilon "
                        f"< 1, got density {density:g}, epsilon {epsilon:g}"
                    )
        if sparsifier is Sparsifier.OUTLIERS:
            per_model["gammas"] = [value("gamma", i) for i in models]
        if sparsifier is Sparsifier.RANDOM or (sparsifier is not None and sparsifier.l1_rescaled):
            per_model["rescale"] = config.parameter("rescale")
        rules = config.mergekit_compat and (sparsifier is Sparsifier.MAGNITUDE or self.consensus)
        return TaskVectorParameters(
            value("lambda"),
            [value("weight", i) for i in models],
            config.parameter("normalize"),
            mergekit_rules=rules,
            **per_model,
        )

    def holds_whole_tensors(self, parameters) -> bool:
        """DELLA's ranks and Breadcrumbs' band are selections over every magnitude of the tensor."""
        return self.sparsifier is not None and self.sparsifier.over_whole_tensors

    def recipe(self, parameters: TaskVectorParameters, **inputs) -> tensor_math.TaskVectorRecipe:
        """The combination of a tensor's task vectors (`tensor_math.task_vector_merge`): this member's, with the
        step's parameters and the sparsifier's `inputs` (thresholds, generators, ...)."""
        from mergekit_lite.merge.methods import tensor_math

        return tensor_math.TaskVectorRecipe(
            scale=parameters.scale,
            sparsifier=self.sparsifier,
            consensus=self.consensus,
            normalize=parameters.normalize,
            mergekit_rules=parameters.mergekit_rules,
            densities=parameters.densities,
            drops=parameters.drops,
            epsilons=parameters.epsilons,
            gammas=parameters.gammas,
            **inputs,
        )

    def whole_tensor_merge(self, parameters, tensors, seed, tensor_name):
        """DELLA (ranks within rows) and the L1 rescales (a norm of the sparsified delta) need whole tensors."""
        from mergekit_lite.merge.methods import tensor_math

        sparsifier = self.sparsifier
        l1_rescaled = sparsifier is not None and sparsifier.l1_rescaled and parameters.rescale
        if not (sparsifier is Sparsifier.MAGPRUNE or l1_rescaled):
            return None
        generators = [magprune_generator(seed, tensor_name, i) for i in range(len(tensors) - 1)]
        recipe = self.recipe(parameters, generators=generators, rescale=parameters.rescale)
        return tensor_math.task_vector_merge(tensors[0], tensors[1:], parameters.weights, recipe)

    def tensor_statistics(self, parameters, tensors):
        """TIES's trim threshold per model (one model per core: exact selections, in any order)."""
        from mergekit_lite.merge.methods import tensor_math

        if self.sparsifier is not Sparsifier.MAGNITUDE:
            return None
        return [
            future.result()
            for future in start_on_other_cores(
                lambda pair: tensor_math.trim_threshold(tensors[0], *pair, parameters.mergekit_rules),
                zip(tensors[1:], parameters.densities, strict=True),
            )
        ]

    def statistics_in_slabs(self, parameters, slabs):
        """Each model's TIES trim threshold (`tensor_math.TrimThreshold`, the value `trim_threshold` gives on whole
        tensors): sampled from rows spread over the tensor (a few hundred small reads), then counted in one pass
        over the mapped slabs, the models on other cores."""
        from mergekit_lite.merge.methods import tensor_math

        shape = slabs.shape
        trims = [
            tensor_math.TrimThreshold(math.prod(shape), density, parameters.mergekit_rules)
            for density in parameters.densities
        ]
        sampled_rows = max(tensor_math.THRESHOLD_SAMPLE // math.prod(shape[1:]), 1)
        for row in range(0, shape[0], max(shape[0] // sampled_rows, 1)):
            base, *models = slabs.row(row)
            for trim, model in zip(trims, models, strict=True):
                trim.sample(base, model)

        def count(base, *models):  # one slab's counts for every model's threshold, the models on other cores
            for job in start_on_other_cores(lambda pair: pair[0].count(base, pair[1]), zip(trims, models, strict=True)):
                job.result()

        slabs.for_each(count)
        return [trim.select(lambda i=i: (slabs.whole(0), slabs.whole(i))) for i, trim in enumerate(trims, start=1)]

    def chunk_combiner(self, parameters, tensors, statistics, seed, tensor_name, first_element):
        from mergekit_lite.merge.methods import tensor_math

        thresholds = statistics
        if self.sparsifier is Sparsifier.OUTLIERS:
            thresholds = [
                tensor_math.outlier_band(tensors[0], model, density, gamma)
                for model, density, gamma in zip(tensors[1:], parameters.densities, parameters.gammas, strict=True)
            ]
        keeps = None
        if self.sparsifier is Sparsifier.RANDOM:
            keys = [dare_key(seed, tensor_name, i) for i in range(len(tensors) - 1)]
            keeps = KeepsAhead(keys, parameters.drops, tensors[0].numel(), tensor_math.ELEMENTWISE_CHUNK, first_element)
        rescale = True if parameters.rescale is None else parameters.rescale
        recipe = self.recipe(parameters, thresholds=thresholds, rescale=rescale)
        return lambda chunk, out: tensor_math.task_vector_merge(
            chunk[0], chunk[1:], parameters.weights, recipe, keeps=None if keeps is None else keeps.take(), out=out
        )


def sce(base: torch.Tensor, models: Sequence[torch.Tensor], select_topk: float = 1.0) -> torch.Tensor:
    """SCE (Wan et al. 2024, FuseChat-2.0, arXiv 2408.07990, §3.3 "Select, Calculate, Erase"), as mergekit's `sce`:

    Select keeps the entries whose variance across the task vectors is among the top `select_topk` share of the
    non-zero variances (`variance_keep`); Calculate weighs each model by the mean square of its selected task
    vector, as a share of their sum (`sce_weights`); Erase keeps, entry by entry, the deltas whose sign agrees
    with the sign of their sum (+ on a zero sum, as in mergekit). The merge is the weighted mean of what is
    kept, added to the base. Whole tensors: the selection ranks and the weights are per tensor.
    """
    import torch

    from mergekit_lite.merge.methods.tensor_math import sign_consensus, task_vector

    base32 = base.to(torch.float32)
    deltas = torch.stack([task_vector(model, base32) for model in models])
    if select_topk < 1.0:
        deltas.mul_(variance_keep(deltas, select_topk))
    agree = sign_consensus(deltas, zero_sum_positive=True).to(torch.float32)
    weighted = agree * sce_weights(deltas).view(-1, *[1] * base32.dim())
    return base32 + (deltas * weighted).sum(dim=0) / weighted.sum(dim=0).clamp_min(1e-6)  # mergekit's floor


def variance_keep(deltas: torch.Tensor, share: float) -> torch.Tensor:
    """1.0 where the variance across the models (population variance, dim 0) is among the top `share` of the
    non-zero variances, else 0.0. Variances tied at the threshold are kept alike (mergekit's topk keeps exactly k,
    breaking ties by position)."""
    import torch

    from mergekit_lite.merge.methods.tensor_math import at_least, magnitude_threshold

    variance = deltas.var(dim=0, unbiased=False)
    keep = int(torch.count_nonzero(variance).item() * share)
    if keep == 0:
        return torch.zeros_like(variance)
    return at_least(variance.clone(), magnitude_threshold(variance, keep))


def sce_weights(deltas: torch.Tensor) -> torch.Tensor:
    """Each model's mean squared (selected) task vector as a share of their sum; equal shares where the sum is
    below 1e-6, when the models barely moved (SCE's Calculate step, mergekit's threshold)."""
    import torch

    weights = deltas.square().reshape(deltas.shape[0], -1).mean(dim=1)
    total = weights.sum().item()
    return torch.full_like(weights, 1.0 / len(weights)) if abs(total) < 1e-6 else weights / total


@dataclass(frozen=True)
class SceParameters(StepParameters):
    select_topk: float


class Sce(Method):
    """SCE (Wan et al. 2024, FuseChat-2.0, sec. 3.3): select entries by their variance across models, weigh each task
    vector by its mean square, erase minority signs; its ranks and mean squares need whole tensors."""

    name = "sce"
    summary = "SCE: select by variance, calculate weights, erase minority signs"
    parameters = (SELECT_TOPK, INT8_MASK)
    needs_base = True

    def step_parameters(self, config, value, depth: Depth):
        return SceParameters(value("select_topk"))

    def holds_whole_tensors(self, parameters) -> bool:
        return True

    def whole_tensor_merge(self, parameters, tensors, seed, tensor_name):
        return sce(tensors[0], tensors[1:], parameters.select_topk)


def _member(name, sparsifier, consensus, normalize, rescale, summary, meaning, **mergekit) -> TaskVectorMethod:
    return TaskVectorMethod(
        name,
        sparsifier,
        consensus,
        normalize,
        rescale,
        summary,
        f"lambda, the scale of post's {meaning} added to pre",
        **mergekit,
    )


METHODS = (
    Sce(),
    _member(
        "task_arithmetic",
        None,
        False,
        False,
        False,
        "task arithmetic: the base plus scaled task vectors",
        "task vector (post - pre)",
    ),
    _member(
        "ties",
        Sparsifier.MAGNITUDE,
        True,
        True,
        False,
        "TIES: trimmed task vectors, elected signs, disjoint mean",
        "TIES-trimmed task vector",
    ),
    _member(
        "dare_linear",
        Sparsifier.RANDOM,
        False,
        False,
        True,
        "DARE: randomly dropped, rescaled task vectors",
        "DARE-dropped task vector",
    ),
    _member(
        "dare_ties",
        Sparsifier.RANDOM,
        True,
        True,
        True,
        "DARE with TIES's sign election",
        "DARE-dropped, sign-elected task vector",
        mergekit_normalize=False,
    ),  # mergekit's does not divide
    _member(
        "della",
        Sparsifier.MAGPRUNE,
        True,
        True,
        True,
        "DELLA: magnitude-ranked random drop, elected signs",
        "DELLA-pruned (magnitude-ranked drop), sign-elected task vector",
    ),
    _member(
        "della_linear",
        Sparsifier.MAGPRUNE,
        False,
        False,
        True,
        "DELLA without sign election",
        "DELLA-pruned (magnitude-ranked drop) task vector",
    ),
    _member(
        "breadcrumbs",
        Sparsifier.OUTLIERS,
        False,
        False,
        False,
        "Model Breadcrumbs: task vectors without their outliers",
        "task vector without its largest and smallest entries,",
    ),
    _member(
        "breadcrumbs_ties",
        Sparsifier.OUTLIERS,
        True,
        False,
        False,
        "Model Breadcrumbs with TIES's sign election",
        "Breadcrumbs-trimmed, sign-elected task vector",
    ),
)
