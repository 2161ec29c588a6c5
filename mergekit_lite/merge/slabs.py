"""Large tensors merged in row slabs, so the engine holds a few slabs at a time, not the largest tensor's inputs.

A method whose every output entry depends only on the same entry of each input (and, for DARE, on that entry's
own draw: `tensor_math.keep_indicator`; its declaration says `elementwise`) gives the same bytes whether a tensor is merged whole or a band of rows at a
time. Slabs start at multiples of `tensor_math.ELEMENTWISE_CHUNK` entries, so the chunks inside a slab, and the DARE
masks drawn per chunk, are exactly the whole tensor's. Methods that declare `slab_statistics` need a statistic of
the whole tensor first, which a thread of the engine computes in a pass over the slabs mapped from the shards (no
copy), tensors ahead of the reader (`decide`, handing the method a `SlabPass`): TIES's trim (and its mergekit
form) each model's magnitude threshold, from a sample of rows and one counting pass (`tensor_math.TrimThreshold`,
the same value), and SLERP its angle, whose reductions run chunk by chunk of `tensor_math.CHUNK` entries
(`tensor_math.SlerpAngle`): its slabs start at multiples of that chunk (its `slab_unit`), so the sums, the
weights and the bytes are the whole tensor's. This module also reads the parts into the engine's ring and
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
from mergekit_lite.merge.plan import MergePlan, StepAction, TensorStep

SLAB_BYTES = 32 << 20  # the inputs' bytes one slab reads, all inputs together
RING_SLABS = 3  # slabs in flight: one being read, one in the math, one being written


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
    method = plan.config.merge_method
    in_slabs = method.elementwise or method.slab_statistics
    if (
        step.action is not StepAction.MERGE
        or len(step.shape) < 2
        or not in_slabs
        or any(type(source) is not ModelSource for source, _ in inputs)
    ):
        return None
    row_elements = math.prod(step.shape[1:])
    row_bytes = sum(row_elements * source.dtype(name).itemsize for source, name in inputs)
    chunk = method.slab_unit
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
    inputs = plan.inputs_of(step)[:1] if step.action is StepAction.COPY else plan.inputs_of(step)
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
    # a copy step reads its first input only (block_sizes): the rest have no size
    for (source, name), size in zip(plan.inputs_of(part.step), sizes, strict=False):
        into = block[offset : offset + size]
        tensors.append(source.load(name, into) if part.rows is None else source.load_rows(name, *part.rows, into))
        offset += size
    return tensors


def map_slab(plan: MergePlan, part: Part) -> list[torch.Tensor]:
    """A slab's inputs mapped from their shards (`ModelSource.map_rows`), for a pass that only reads them: the
    statistics, and the check that a tensor is identical everywhere."""
    return [source.map_rows(name, *part.rows) for source, name in plan.inputs_of(part.step)]


class SlabPass:
    """A step's inputs for a method's statistics in slabs (`Method.statistics_in_slabs`): its slabs mapped one at a
    time, single rows read, or whole inputs loaded."""

    def __init__(self, plan: MergePlan, step: TensorStep, rows: int):
        self.plan, self.step, self.rows = plan, step, rows
        self.inputs = plan.inputs_of(step)
        self.shape = step.shape

    def for_each(self, action) -> None:
        """`action(*inputs)` on each slab in order, mapped (unmapped on return, before the next slab is mapped)."""
        for part in row_slabs(self.step, self.rows):
            action(*map_slab(self.plan, part))

    def row(self, row: int) -> list[torch.Tensor]:
        """One row of every input."""
        return [source.load_rows(name, row, row + 1) for source, name in self.inputs]

    def whole(self, index: int) -> torch.Tensor:
        """Input `index`, whole."""
        source, name = self.inputs[index]
        return source.load(name)


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
    if not plan.config.merge_method.slab_statistics:
        return 0
    return max(
        (sum(block_sizes(plan, part)) for part in found if part.rows is not None and part.rows[0] == 0), default=0
    )


def decide(plan: MergePlan, first: Part) -> tuple[bool, list[float] | tuple[float, float] | None]:
    """What a step in slabs, whose method needs statistics, has decided before its `first` slab is merged, looking
    at its slabs mapped one at a time (`statistics_slab_bytes`): whether it is a copy (`first_slab`'s rule)
    and else its statistics (`Method.statistics_in_slabs`: TIES's trim thresholds, one per model, SLERP's weights).
    The engine runs this on a thread of its own, tensors ahead of the reader, so the pass over every slab overlaps
    the merge of earlier tensors instead of holding the reader; mapped, it copies nothing the reader copies again."""
    if all_identical(map_slab(plan, first)) and later_slabs_identical(plan, first):
        return True, None
    step = first.step
    return False, plan.config.merge_method.statistics_in_slabs(step.parameters, SlabPass(plan, step, first.rows[1]))


def all_identical(tensors: list[torch.Tensor]) -> bool:
    """Identical inputs are copied through byte for byte (no rounding from the math)."""
    first = tensors[0]
    return len(tensors) > 1 and all(t.dtype == first.dtype and torch.equal(t, first) for t in tensors[1:])
