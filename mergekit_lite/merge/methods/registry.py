"""What a merge method declares: `Parameter` (a knob: type, default, bounds, help) and `Method` (a method's name,
parameters, needs from the plan, combination, dry-run cost and report text). Each module of this package
declares its methods with these; the package's `__init__` collects them into the registry.

The rest of mergekit-lite asks a `Method` what to do (config validation, the plan, the engine's reader and
math, slabs, the dry run's cost, CLI help, the sweep) and never compares method names.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from mergekit_lite.errors import InputError
from mergekit_lite.merge.methods.chunks import ELEMENTWISE_CHUNK

if TYPE_CHECKING:
    import torch

NOT_SET = object()


@dataclass(frozen=True)
class Parameter:
    """One knob a method takes: `kind` float, bool or int; `low`/`high` bounds (None: unbounded) and whether each
    is included; `per_model`: settable per input model (under models:), else only globally; `per_model_only`: a
    setting of each model that the command line takes with its model (`merge --model PATH:WEIGHT`), so it has no
    flag of its own (a config may still give it under parameters: or a slice). `merge`'s flags, their help and
    the YAML configs' keys all come from these declarations (cli/method_flags.py, merge/config.py)."""

    name: str
    help: str
    kind: type = float
    default: Any = None
    low: float | None = None
    high: float | None = None
    low_inclusive: bool = True
    high_inclusive: bool = True
    per_model: bool = False
    per_model_only: bool = False
    mergekit_default: Any = NOT_SET  # mergekit's default where it differs (used in mergekit_compat mode)

    def bounds_text(self) -> str:
        left, right = "[" if self.low_inclusive else "(", "]" if self.high_inclusive else ")"
        return f"{left}{self.low}, {'inf' if self.high is None else self.high}{right}"

    def out_of_bounds(self, number: float) -> bool:
        if self.low is None:
            return False
        below = number < self.low or (number == self.low and not self.low_inclusive)
        above = self.high is not None and (number > self.high or (number == self.high and not self.high_inclusive))
        return below or above


# The knobs several methods share (a method's own knobs sit in its module). Their defaults and those of the methods'
# own knobs are mergekit's; where mergekit's differ (its generalized_task_arithmetic.py and merge_methods/registry.py),
# `mergekit_default` holds them for mergekit_compat mode: nothing is trimmed or dropped unless `density` is given.
WEIGHT = Parameter("weight", "a model's weight in the combination", default=1.0, per_model=True, per_model_only=True)
NORMALIZE = Parameter("normalize", "divide by the sum of the weights", kind=bool, default=True)
ALPHA = Parameter("alpha", "the weight of the second model (post), 1 - alpha on the first", low=0.0, high=1.0)
LAMBDA = Parameter(
    "lambda", "the scale of the combined task vectors added to the base (negative subtracts)", default=1.0
)
T = Parameter("t", "the interpolation position from the base (0) to the model (1)", default=0.5, low=0.0, high=1.0)
DENSITY = Parameter(
    "density",
    "the share of each task vector's entries kept",
    default=0.5,
    low=0.0,
    high=1.0,
    low_inclusive=False,
    per_model=True,
    mergekit_default=1.0,
)
INT8_MASK = Parameter(
    "int8_mask", "mergekit's int8 masks (accepted; masks here are exact either way)", kind=bool, default=False
)
RESCALE = Parameter("rescale", "the sparsifier's rescaling of the entries kept", kind=bool, default=False)


@dataclass(frozen=True)
class StepParameters:
    """A method's parameters resolved for one tensor (the plan's `TensorStep.parameters`); `shown` is the dry run's
    view, name=value in order."""

    def shown(self) -> dict[str, Any]:
        return {field.name: getattr(self, field.name) for field in fields(self)}


@dataclass(frozen=True)
class Calibration:
    """The merge the dry run's calibration times for a method: parameters beyond the defaults, the number of models
    besides the base, and whether a base is given."""

    parameters: dict
    models: int = 2
    with_base: bool = True


# A tensor combination of one chunk: (the inputs' chunks, the output's chunk) -> the result (or the output itself)
Combiner = Callable[[list["torch.Tensor"], "torch.Tensor"], "torch.Tensor"]
# A function (parameter name, model index or None) -> the parameter's value for the tensor being planned
ValueOf = Callable[..., Any]


@dataclass(frozen=True)
class Depth:
    """Where the tensor being planned sits: its decoder layer (None outside them), its part ("layer", "embed" or
    "head"), the layer count, and RECALL's weights where the method reads them."""

    name: str
    layer: int | None
    part: str
    n_layers: int
    recall_weights: Any = None


class Method:
    """A merge method. Subclasses set the class attributes and implement `step_parameters` and the combination
    (`chunk_combiner`, and `whole_tensor_merge` where the combination needs whole tensors)."""

    name: str = ""
    summary: str = ""  # one line for the CLI's help and the docs' table
    parameters: tuple[Parameter, ...] = ()
    main_coefficient: str | None = None  # what a sweep varies between pre and post (alpha)
    alpha_meaning: str | None = None  # what alpha is in a sweep's report
    pre_at_zero: bool = False  # the merge at coefficient 0 is pre itself (post's contribution scaled to nothing)
    post_at_one: bool = False  # at 1 it is post itself (nothing of post's task vector trimmed, dropped or reweighted)
    post_at_one_without_beta: bool = False  # at 1 with beta 0 it is post itself (LiNeS: scale 1 in every layer)
    # the merge at coefficient c is pre + c * (post - pre) in every tensor, nothing trimmed, dropped, rotated or
    # scheduled by depth: for a LoRA post, c times its update (sweep --save-best-adapter writes it as an adapter)
    scales_task_vector: bool = False
    needs_base: bool = False
    base_ignored: bool = False  # mergekit's BasePolicy.IGNORED: in a slice the base is just another source
    takes_slices: bool = True
    reads_recall_weights: bool = False  # RECALL's statistics pass: forward passes over typical samples
    draws_dare_masks: bool = False  # DARE's seeded Philox masks (the provenance file names their version)
    sparsifies: bool = False  # selects or drops task-vector entries (a sweep holds the sparsified vector)
    elementwise: bool = False  # each output entry from the same entry of the inputs only (merged in slabs)
    slab_statistics: bool = False  # elementwise once a whole-tensor statistic is known (slabs make a pass first)
    slab_unit: int = ELEMENTWISE_CHUNK  # slabs start at multiples of this many entries
    hides_nonfinite: bool = False  # may select a NaN/Inf input entry away: inputs are checked before the merge
    compute_bound: bool = False  # chunk math costs several times the reading and writing
    one_chunk_thread: bool = False  # the other cores draw masks or count thresholds beside the chunk loop
    exact_on_fused_parameters: bool = True  # a sweep may merge a model's in-memory (possibly fused) parameters
    orders_checkpoints: bool = False  # inputs are checkpoints in training order (merge --order sorts them)
    calibration: Calibration = Calibration({})
    same_math_as: str | None = None  # the dry run times this method's math as another's

    def __repr__(self) -> str:
        return f"<merge method {self.name}>"

    # ------------------------------------------------------------------------------------------ configuration

    def parameter(self, name: str) -> Parameter | None:
        return next((parameter for parameter in self.parameters if parameter.name == name), None)

    @property
    def parameter_names(self) -> set[str]:
        return {parameter.name for parameter in self.parameters}

    def default(self, name: str, mergekit_compat: bool) -> Any:
        """A parameter's default for this method, mergekit's in mergekit_compat mode."""
        parameter = self.parameter(name)
        if parameter is None:
            return None
        if mergekit_compat and parameter.mergekit_default is not NOT_SET:
            return parameter.mergekit_default
        return parameter.default

    def check_inputs(self, config) -> None:
        """Refuse a config whose inputs or required parameters this method cannot merge (without slices)."""

    def check(self, config) -> None:
        """Method-specific checks of a config's settings, slices or not."""

    # ------------------------------------------------------------------------------------------------ planning

    def step_parameters(self, config, value: ValueOf, depth: Depth) -> StepParameters:
        raise NotImplementedError

    def copies(self, parameters: StepParameters) -> str | None:
        """Why a step with these parameters is a plain copy of its one input, else None."""
        return None

    def holds_whole_tensors(self, parameters: StepParameters) -> bool:
        """Whether a step's working memory grows with its tensor (whole-tensor merges, Breadcrumbs' band)."""
        return False

    # ------------------------------------------------------------------------------------------------ the math

    def whole_tensor_merge(
        self, parameters: StepParameters, tensors: list[torch.Tensor], seed: int, tensor_name: str
    ) -> torch.Tensor | None:
        """The merge of a step whose combination needs whole rows or whole-tensor statistics; None where the
        combination runs chunk by chunk (`chunk_combiner`)."""
        return None

    def tensor_statistics(self, parameters: StepParameters, tensors: list[torch.Tensor]):
        """What the chunks need from the whole tensors before the first one (computed by the engine's reader);
        None for most methods."""
        return None

    def statistics_in_slabs(self, parameters: StepParameters, slabs):
        """`tensor_statistics` from a pass over a step's slabs, for `slab_statistics` methods: `slabs` is
        merge/slabs.py's `SlabPass` (the slabs mapped one at a time, single rows, whole inputs)."""
        raise NotImplementedError

    def chunk_combiner(
        self,
        parameters: StepParameters,
        tensors: list[torch.Tensor],
        statistics,
        seed: int,
        tensor_name: str,
        first_element: int,
    ) -> Combiner:
        """The elementwise part of the method, with its per-tensor statistics bound in."""
        raise NotImplementedError


def did_you_mean(word: str, choices) -> str:
    """` (did you mean 'x'?)` for the known name closest to an unknown one (the configs' and schemas' checks)."""
    close = difflib.get_close_matches(word, sorted(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def require(condition: bool, message: str) -> None:
    """An InputError with `message` unless `condition` holds (the methods' input checks)."""
    if not condition:
        raise InputError(message)


def weight_total(weights: list[float], name: str, method: str) -> float:
    """The sum the weights are divided by, refused where it is (nearly) zero: the weights would then be no
    proportions at all (a division by zero, or mergekit's silent fallback to an even mix for nuslerp)."""
    total = math.fsum(weights)
    if abs(total) < 1e-6:
        raise InputError(
            f"tensor {name}: {method} weights {', '.join(f'{w:g}' for w in weights)} sum to zero; "
            "they are divided by their sum (give weights with a non-zero sum)"
        )
    return total


def linear_combiner(weights, normalize: bool) -> Combiner:
    """The chunks combined with fixed coefficients (`tensor_math.linear`)."""
    from mergekit_lite.merge.methods import tensor_math

    return lambda chunk, out: tensor_math.linear(chunk, weights, normalize, out)


@dataclass(frozen=True)
class Lerp(StepParameters):
    """Two inputs interpolated: alpha of the second."""

    alpha: float


@dataclass(frozen=True)
class WeightedSum(StepParameters):
    """Every input times its weight, summed (divided by the weights' sum with `normalize`)."""

    weights: list[float]
    normalize: bool


def lerp_combiner(alpha: float) -> Combiner:
    from mergekit_lite.merge.methods import tensor_math

    return lambda chunk, out: tensor_math.lerp(chunk[0], chunk[1], alpha, out)


@dataclass(frozen=True)
class Position(StepParameters):
    """A position t between the base (0) and the model (1)."""

    t: float
