"""LiNeS: the task vector scaled linearly with depth, alpha in the first layer rising to alpha + beta in the last
(Wang et al., ICLR 2025, arXiv 2410.17146, Sec. 3)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from mergekit_lite.merge.methods import tensor_math
from mergekit_lite.merge.methods.registry import ALPHA, WEIGHT, Calibration, Depth, Method, Parameter, StepParameters, require

BETA = Parameter("beta", "the scale's rise from the first layer to the last (default 1 - alpha)")


@dataclass(frozen=True)
class LayerScaled(StepParameters):
    alpha: float
    beta: float
    layer: int | None
    n_layers: int
    weights: list[float]


class Lines(Method):
    name = "lines"
    summary = "task vectors scaled linearly with depth (LiNeS)"
    parameters = (replace(ALPHA, help="the scale of the task vector in the first layer"), BETA, WEIGHT)
    main_coefficient = "alpha"
    alpha_meaning = "LiNeS: post's task vector scaled by alpha in the first layer, rising linearly to 1 in the last"
    needs_base = True
    takes_slices = False  # its scale follows the whole model's depth
    elementwise = True
    calibration = Calibration({"alpha": 0.5}, 1, with_base=True)

    def check_inputs(self, config) -> None:
        require(config.parameters.get("alpha") is not None, "lines needs alpha, the scale of the task vector in the first layer")

    def step_parameters(self, config, value, depth: Depth):
        # beta defaults to 1 - alpha: the last layer keeps the whole task vector (the authors' single-task editing,
        # src/eval/eval.py `evaluate`)
        alpha = value("alpha")
        beta = value("beta") if config.parameter("beta") is not None else 1.0 - alpha
        return LayerScaled(alpha, beta, depth.layer, depth.n_layers, [value("weight", i) for i in range(len(config.models))])

    def chunk_combiner(self, parameters, tensors, statistics, seed, tensor_name, first_element):
        return lambda chunk, out: tensor_math.lines(chunk[0], chunk[1:], parameters.weights, parameters.alpha,
                                                    parameters.beta, parameters.layer, parameters.n_layers)


METHODS = (Lines(),)
