"""Linear: a weighted average of the inputs (Wortsman et al. 2022, model soups), or with `alpha` the interpolation
of two models (what a sweep varies between pre and post)."""

from __future__ import annotations

from mergekit_lite.merge.methods.registry import (
    ALPHA,
    NORMALIZE,
    WEIGHT,
    Calibration,
    Depth,
    Lerp,
    Method,
    WeightedSum,
    lerp_combiner,
    linear_combiner,
    require,
    weight_total,
)


class Linear(Method):
    name = "linear"
    summary = "weighted average of the inputs, or with alpha the interpolation of two"
    parameters = (ALPHA, WEIGHT, NORMALIZE)
    main_coefficient = "alpha"
    alpha_meaning = "weight of post (0 = pre, 1 = post)"
    pre_at_zero = post_at_one = True
    scales_task_vector = True  # with alpha: (1 - alpha) pre + alpha post = pre + alpha (post - pre)
    base_ignored = True
    elementwise = True
    calibration = Calibration({}, 2, with_base=False)

    def check_inputs(self, config) -> None:
        count = len(config.inputs)
        require(
            "alpha" not in config.parameters or count == 2,
            f"linear with alpha interpolates exactly two models, got {count}; use per-model weights for more",
        )
        require(
            not (
                config.mergekit_compat
                and config.base
                and "alpha" not in config.parameters
                and "weight" not in config.base_parameters
                and "weight" not in config.parameters
            ),
            f"linear weights every input, the base too: give {config.base} a weight "
            "(list it under models: with parameters: weight)",
        )

    def step_parameters(self, config, value, depth: Depth):
        if "alpha" in config.parameters:
            return Lerp(value("alpha"))
        base_weight = value.fall_through(
            config.base_parameters.get("weight"), config.parameter("weight") if config.mergekit_compat else 1.0
        )
        weights = ([value.of_spec("weight", base_weight)] if config.base else []) + [
            value("weight", i) for i in range(len(config.models))
        ]
        if config.parameter("normalize"):
            weight_total(weights, depth.name, self.name)
        return WeightedSum(weights, config.parameter("normalize"))

    def chunk_combiner(self, parameters, tensors, statistics, seed, tensor_name, first_element):
        if isinstance(parameters, Lerp):
            return lerp_combiner(parameters.alpha)
        return linear_combiner(parameters.weights, parameters.normalize)


METHODS = (Linear(),)
