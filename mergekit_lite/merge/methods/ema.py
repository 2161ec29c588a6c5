"""EMA: an exponential moving average of checkpoints in training order (the base, if given, is the first)."""

from __future__ import annotations

from mergekit_lite.merge.methods.registry import (
    Calibration,
    Depth,
    Method,
    Parameter,
    WeightedSum,
    linear_combiner,
    require,
)

DECAY = Parameter(
    "decay",
    "the weight of the running average at each checkpoint (s_i = decay*s_(i-1) + (1-decay)*c_i, in training order)",
    low=0.0,
    high=1.0,
)


def ema_weights(count: int, decay: float) -> list[float]:
    """The weights of checkpoints c_0 .. c_n (training order) in their exponential moving average
    s_0 = c_0, s_i = decay * s_(i-1) + (1 - decay) * c_i: w_0 = decay^n, w_i = (1 - decay) * decay^(n - i).
    They sum to 1, so the EMA is `linear` with these weights, unnormalised (computed in float64)."""
    last = count - 1
    return [decay**last] + [(1.0 - decay) * decay ** (last - i) for i in range(1, count)]


class Ema(Method):
    name = "ema"
    summary = "exponential moving average of checkpoints in training order"
    parameters = (DECAY,)
    elementwise = True
    calibration = Calibration({"decay": 0.9}, 2, with_base=False)
    orders_checkpoints = True

    def check_inputs(self, config) -> None:
        count = len(config.inputs)
        require(count >= 2, f"ema averages at least two checkpoints (in training order), got {count}")
        require(
            config.parameters.get("decay") is not None,
            "ema needs decay (--decay), the weight of the running average at each checkpoint",
        )

    def step_parameters(self, config, value, depth: Depth):
        return WeightedSum(ema_weights(len(config.inputs), value("decay")), False)

    def chunk_combiner(self, parameters, tensors, statistics, seed, tensor_name, first_element):
        return linear_combiner(parameters.weights, parameters.normalize)


METHODS = (Ema(),)
