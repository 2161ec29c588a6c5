"""RECALL (Wang et al., EMNLP 2025): per-layer weights from how close each model's hidden representations are to
the reference's on typical samples (computed by merge/recall.py), then a linear combination per layer; and
`recall_lerp`, the interpolation of pre and post whose alpha follows each layer's drift."""

from __future__ import annotations

from dataclasses import dataclass

from mergekit_lite.errors import InputError
from mergekit_lite.merge.methods.registry import (
    ALPHA,
    Calibration,
    Depth,
    Lerp,
    Method,
    Parameter,
    StepParameters,
    lerp_combiner,
    linear_combiner,
    require,
)

TEMPERATURE = Parameter(
    "temperature",
    "the softmax temperature of the per-layer weights",
    default=1.0,
    low=0.0,
    low_inclusive=False,
    high_inclusive=False,
)
EMBED_RULES = ("nearest", "average", "base", "reference")
MEDIAN_BANDWIDTH = "median"  # RECALL's sigma from the reference's own samples at each layer


def check_bandwidth(bandwidth) -> None:
    """`median` or a positive number (a fixed sigma for every layer)."""
    if bandwidth == MEDIAN_BANDWIDTH:
        return
    if isinstance(bandwidth, bool) or not isinstance(bandwidth, (int, float)) or not bandwidth > 0:
        raise InputError(
            f"recall bandwidth must be {MEDIAN_BANDWIDTH!r} or a number > 0 (a fixed sigma), got {bandwidth!r}"
        )


@dataclass(frozen=True)
class LayerWeights(StepParameters):
    """Each input's weight at this tensor's depth."""

    weights: list[float]


class RecallMethod(Method):
    reads_recall_weights = True
    elementwise = True
    same_math_as = "linear"  # a linear combination per layer; the forward passes are not estimated
    interpolates = False  # recall_lerp: a LERP of pre and post, alpha per layer

    def check(self, config) -> None:
        check_bandwidth(config.recall.bandwidth)
        if config.recall.embed_rule not in EMBED_RULES:
            raise InputError(
                f"recall embed_rule must be one of {', '.join(EMBED_RULES)}, got {config.recall.embed_rule!r}"
            )


class Recall(RecallMethod):
    name = "recall"
    summary = "RECALL: per-layer weights from representation similarity on typical samples"
    parameters = (TEMPERATURE,)
    main_coefficient = "temperature"
    alpha_meaning = "softmax temperature of RECALL's per-layer weights (low = each layer follows the closer model)"
    takes_slices = False  # it weighs whole models layer by layer

    def check_inputs(self, config) -> None:
        count = len(config.inputs)
        require(count >= 2, f"recall merges at least two models, got {count}")

    def step_parameters(self, config, value, depth: Depth):
        return LayerWeights(depth.recall_weights.for_tensor(depth.layer, depth.part, config.recall.embed_rule))

    def chunk_combiner(self, parameters, tensors, statistics, seed, tensor_name, first_element):
        return linear_combiner(parameters.weights, True)


class RecallLerp(RecallMethod):
    name = "recall_lerp"
    summary = "RECALL-guided interpolation of pre and post: alpha per layer from its drift"
    parameters = (ALPHA,)
    main_coefficient = "alpha"
    alpha_meaning = "global weight of post; layer l takes alpha ** (its drift / mean drift), flat drift = linear"
    pre_at_zero = post_at_one = True
    calibration = Calibration({"alpha": 0.5}, 1, with_base=True)
    interpolates = True

    def check_inputs(self, config) -> None:
        count = len(config.inputs)
        require(
            count == 2 and config.base,
            f"recall_lerp interpolates exactly two models, a base (pre) and one model (post), got {count}",
        )
        require(
            isinstance(config.parameters.get("alpha"), (int, float)),
            "recall_lerp needs one number alpha (the global weight of post the layer profile centres on)",
        )

    def step_parameters(self, config, value, depth: Depth):
        return Lerp(depth.recall_weights.lerp_alpha(value("alpha"), depth.layer, depth.part, config.recall.embed_rule))

    def chunk_combiner(self, parameters, tensors, statistics, seed, tensor_name, first_element):
        return lerp_combiner(parameters.alpha)


METHODS = (Recall(), RecallLerp())
