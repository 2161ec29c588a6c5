"""Large tensors merged in row slabs, so the engine holds a few slabs at a time, not the largest tensor's inputs.

A method whose every output entry depends only on the same entry of each input (and, for DARE, on that entry's
own draw: `methods.keep_indicator`) gives the same bytes whether a tensor is merged whole or a band of rows at a
time. Slabs start at multiples of `methods.ELEMENTWISE_CHUNK` entries, so the chunks inside a slab, and the DARE
masks drawn per chunk, are exactly the whole tensor's. Two methods need a statistic of the whole tensor first,
which a thread of the engine computes in a pass over the slabs mapped from the shards (no copy), tensors ahead
of the reader (`decide`): TIES's trim (and its mergekit form) each model's magnitude threshold, from a sample of
rows and one counting pass (`methods.TrimThreshold`, the same value), and SLERP its angle, whose reductions run
chunk by chunk of `methods.CHUNK` entries (`methods.SlerpAngle`): its slabs start at multiples of that chunk, so
the sums, the weights and the bytes are the whole tensor's. This module also reads the parts into the engine's ring and
decides, slab by slab, whether a tensor is the same in every input. Methods with other per-tensor statistics
(the Gram matrices of the geometric methods, the L1 rescales, row-wise variants) read whole tensors as before;
so do inputs that are not plain safetensors (adapters, pickles, untied heads).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mergekit_lite.io.buffers import aligned
from mergekit_lite.io.safetensors import ModelSource
from mergekit_lite.merge import methods, recipes
from mergekit_lite.merge.plan import MergePlan, TensorStep
from mergekit_lite.threads import start_on_other_cores

SLAB_BYTES = 32 << 20  # the inputs' bytes one slab reads, all inputs together
RING_SLABS = 3  # slabs in flight: one being read, one in the math, one being written
ELEMENTWISE_METHODS = ("linear", "recall", "recall_lerp", "ema", "passthrough", "lines", "nearswap")


def merges_elementwise(method: str) -> bool:
    """Whether each output entry of `method` depends on the same entry of the inputs alone (see the module)."""
    if method in ELEMENTWISE_METHODS:
        return True
    recipe = recipes.TASK_VECTOR_METHODS.get(method)
    return recipe is not None and recipe.sparsifier in (None, "random")


def trims_by_magnitude(method: str) -> bool:
    """TIES's trim: elementwise once each model's magnitude threshold is known."""
    recipe = recipes.TASK_VECTOR_METHODS.get(method)
    return recipe is not None and recipe.sparsifier == "magnitude"


def needs_statistics(method: str) -> bool:
    """Methods whose steps in slabs first read every slab for a statistic of the whole tensor (TIES's trim
    thresholds, SLERP's angle), and so go over their inputs twice (the first time mapped: `map_slab`)."""
    return trims_by_magnitude(method) or method == "slerp"


def slab_unit(method: str) -> int:
    """The entries a slab's first entry is a multiple of: the chunk of the method's reductions (SLERP's angle) or of
    its elementwise passes and DARE's draws."""
    return methods.CHUNK if method == "slerp" else methods.ELEMENTWISE_CHUNK


@dataclass(frozen=True)
class Part:
    """A step of the plan, whole (`rows` None) or one band of its rows [begin, end)."""

    step: TensorStep
    rows: tuple[int, int] | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.step.shape if self.rows is None else (self.rows[1] - self.rows[0], *self.step.shape[1:])

    @property
    def first_element(self) -> int:
        """The flat index, in the step's tensor, of the part's first entry."""
        return 0 if self.rows is None else self.rows[0] * math.prod(self.step.shape[1:])

    @property
    def nbytes(self) -> int:
        """The part's bytes in the output."""
        return math.prod(self.shape) * self.step.out_dtype.itemsize


def slab_rows(plan: MergePlan, step: TensorStep) -> int | None:
    """Rows per slab when `step` is merged in slabs, else None: a merged (not copied) tensor of plain safetensors
    inputs whose method merges elementwise (or does once TIES's thresholds or SLERP's angle are known) and whose
    inputs exceed SLAB_BYTES."""
    inputs = plan.inputs_of(step)
    method = plan.config.method
    in_slabs = merges_elementwise(method) or needs_statistics(method)
    if step.action != "merge" or len(step.shape) < 2 or not in_slabs \
            or any(type(source) is not ModelSource for source, _ in inputs):
        return None
    row_elements = math.prod(step.shape[1:])
    row_bytes = sum(row_elements * source.dtype(name).itemsize for source, name in inputs)
    chunk = slab_unit(method)
    unit = chunk // math.gcd(row_elements, chunk)  # rows per whole chunk
    rows = SLAB_BYTES // max(row_bytes, 1) // unit * unit
    return rows if 0 < rows < step.shape[0] else None


def parts(plan: MergePlan, slabs: bool = True) -> list[Part]:
    """The plan's steps in order, each whole or (with `slabs`) cut into row slabs where `slab_rows` allows."""
    found = []
    for step in plan.steps:
        rows = slab_rows(plan, step) if slabs else None
        found.extend([Part(step)] if rows is None else row_slabs(step, rows))
    return found


def row_slabs(step: TensorStep, rows: int) -> list[Part]:
    """The step's tensor as consecutive slabs of `rows` rows (the last one shorter)."""
    return [Part(step, (begin, min(begin + rows, step.shape[0]))) for begin in range(0, step.shape[0], rows)]


def block_sizes(plan: MergePlan, part: Part) -> list[int]:
    """Each input's share of the part's ring block, page-aligned so every tensor view is aligned."""
    step = part.step
    inputs = plan.inputs_of(step)[:1] if step.action == "copy" else plan.inputs_of(step)
    return [aligned(math.prod(part.shape) * source.dtype(name).itemsize) for source, name in inputs]


def ring_capacity(plan: MergePlan, found: list[Part]) -> int:
    """The engine's ring for the plan cut into `found` (`parts`): the largest part's inputs, with room for
    RING_SLABS slabs where the plan has slabs, and never more than the largest whole step's inputs."""
    largest = max((sum(block_sizes(plan, part)) for part in found), default=0)
    slab = max((sum(block_sizes(plan, part)) for part in found if part.rows is not None), default=0)
    whole = max((sum(block_sizes(plan, Part(step))) for step in plan.steps), default=0)
    return min(max(largest, RING_SLABS * slab), whole)


def load_part(plan: MergePlan, part: Part, block: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """The part's inputs read into `block`, each at its offset in `sizes` (`block_sizes`)."""
    tensors, offset = [], 0
    for (source, name), size in zip(plan.inputs_of(part.step), sizes):
        into = block[offset:offset + size]
        tensors.append(source.load(name, into) if part.rows is None else source.load_rows(name, *part.rows, into))
        offset += size
    return tensors


def map_slab(plan: MergePlan, part: Part) -> list[torch.Tensor]:
    """A slab's inputs mapped from their shards (`ModelSource.map_rows`), for a pass that only reads them: the
    statistics, and the check that a tensor is identical everywhere."""
    return [source.map_rows(name, *part.rows) for source, name in plan.inputs_of(part.step)]


def trim_thresholds_in_slabs(plan: MergePlan, step: TensorStep, rows: int) -> list[float]:
    """Each model's TIES trim threshold (`methods.TrimThreshold`, the value `trim_threshold` gives on whole
    tensors): sampled from rows spread over the tensor (a few hundred small reads), then counted in one pass
    over the mapped slabs, the models on other cores."""
    inputs = plan.inputs_of(step)
    trims = [methods.TrimThreshold(math.prod(step.shape), density, step.parameters.get("mergekit_rules", False))
             for density in step.parameters["densities"]]
    sampled_rows = max(methods.THRESHOLD_SAMPLE // math.prod(step.shape[1:]), 1)
    for row in range(0, step.shape[0], max(step.shape[0] // sampled_rows, 1)):
        base, *models = [source.load_rows(name, row, row + 1) for source, name in inputs]
        for trim, model in zip(trims, models):
            trim.sample(base, model)
    for part in row_slabs(step, rows):
        _count_slab(trims, *map_slab(plan, part))  # unmapped on return, before the next slab is mapped
    return [trim.select(lambda i=i: (inputs[0][0].load(inputs[0][1]), inputs[i][0].load(inputs[i][1])))
            for i, trim in enumerate(trims, start=1)]


def _count_slab(trims: list[methods.TrimThreshold], base: torch.Tensor, *models: torch.Tensor) -> None:
    """One slab's counts for every model's threshold, the models on other cores."""
    for job in start_on_other_cores(lambda pair: pair[0].count(base, pair[1]), zip(trims, models)):
        job.result()


def slerp_weights_in_slabs(plan: MergePlan, step: TensorStep, rows: int) -> tuple[float, float]:
    """SLERP's two weights from the mapped slabs in order: `methods.SlerpAngle`'s sums over blocks that are the
    whole tensor's."""
    angle = methods.SlerpAngle()
    for part in row_slabs(step, rows):
        angle.add(*map_slab(plan, part))
    return angle.weights(step.parameters["t"])


def first_slab(plan: MergePlan, part: Part, block: torch.Tensor, sizes: list[int]) -> tuple[list[torch.Tensor], bool]:
    """The first slab of a step in slabs read into `block`, and whether the step is a copy: every slab identical in
    every input, as for a whole tensor. Later slabs are looked at (mapped) only when the first is identical in
    every input; fine-tuned inputs differ in their first slab."""
    tensors = load_part(plan, part, block, sizes)
    return tensors, all_identical(tensors) and later_slabs_identical(plan, part)


def later_slabs_identical(plan: MergePlan, first: Part) -> bool:
    """Whether every slab after the `first` is identical in every input, each mapped in turn."""
    return all(all_identical(map_slab(plan, later)) for later in row_slabs(first.step, first.rows[1])[1:])


def statistics_slab_bytes(plan: MergePlan, found: list[Part]) -> int:
    """The most bytes `decide` maps at once for the plan cut into `found` (`parts`), resident while they are
    mapped: the largest first slab of a step whose statistics need a pass of their own (0 where none does)."""
    if not needs_statistics(plan.config.method):
        return 0
    return max((sum(block_sizes(plan, part)) for part in found if part.rows is not None and part.rows[0] == 0),
               default=0)


def decide(plan: MergePlan, first: Part) -> tuple[bool, list[float] | tuple[float, float] | None]:
    """What a step in slabs, whose method needs statistics, has decided before its `first` slab is merged, looking
    at its slabs mapped one at a time (`statistics_slab_bytes`): whether it is a copy (`first_slab`'s rule)
    and else its statistics: TIES's trim thresholds, one per model, or SLERP's weights.
    The engine runs this on a thread of its own, tensors ahead of the reader, so the pass over every slab overlaps
    the merge of earlier tensors instead of holding the reader; mapped, it copies nothing the reader copies again."""
    if all_identical(map_slab(plan, first)) and later_slabs_identical(plan, first):
        return True, None
    step, rows = first.step, first.rows[1]
    if plan.config.method == "slerp":
        return False, slerp_weights_in_slabs(plan, step, rows)
    return False, trim_thresholds_in_slabs(plan, step, rows)


def all_identical(tensors: list[torch.Tensor]) -> bool:
    """Identical inputs are copied through byte for byte (no rounding from the math)."""
    first = tensors[0]
    return len(tensors) > 1 and all(t.dtype == first.dtype and torch.equal(t, first) for t in tensors[1:])
