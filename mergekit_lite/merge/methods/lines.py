"""LiNeS: the task vector scaled linearly with depth, alpha in the first layer rising to alpha + beta in the last
(Wang et al., ICLR 2025, arXiv 2410.17146, Sec. 3)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from mergekit_lite.merge.methods.registry import (
    ALPHA,
    WEIGHT,
    Calibration,
    Depth,
    Method,
    Parameter,
    StepParameters,
    require,
)

if TYPE_CHECKING:
    import torch

BETA = Parameter("beta", "the scale's rise from the first layer to the last (default 1 - alpha)")


def lines_factor(alpha: float, beta: float, layer: int | None, n_layers: int) -> float:
    """LiNeS's scale of a tensor's task vector (Wang et al., ICLR 2025, arXiv 2410.17146, Sec. 3:
    lambda(l) = alpha + beta * (l - 1) / (L - 1) for blocks l = 1..L), written with decoder layers l = 0..L-1 as
    alpha + beta * l / (L - 1). A tensor outside the decoder layers (embeddings, final norm, head) takes alpha, as
    the authors' `LiNeS_scaling` (src/eval/eval.py) scales every key that names no residual block by alpha; one
    layer (L = 1) is the first layer, alpha (their code divides by zero there)."""
    if layer is None or n_layers < 2:
        return alpha
    return alpha + beta * (layer / (n_layers - 1))


def lines(
    base: torch.Tensor,
    models: Sequence[torch.Tensor],
    weights: Sequence[float],
    alpha: float,
    beta: float,
    layer: int | None,
    n_layers: int,
) -> torch.Tensor:
    """LiNeS: base + lines_factor(...) * sum_i w_i (model_i - base). With several models the factor scales the
    merged task vector, task arithmetic's weighted sum: the authors' multi-task form scales their merged vector
    (the "sum" method's plain sum for task arithmetic; src/eval/aggregation.py `create_task_vector`). They then fix
    alpha = (||sum tau||_1 / ||merged tau||_1) / T, which is 1/T for the plain sum, and sweep beta; here alpha is
    given (a streaming merge sees one tensor, not the whole model's norms): pass 1/T to follow them."""
    from mergekit_lite.merge.methods.tensor_math import task_vector_merge

    return task_vector_merge(base, models, weights, scale=lines_factor(alpha, beta, layer, n_layers))


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
    parameters = (
        replace(ALPHA, help="the scale of the task vector in the first layer and outside the layers"),
        BETA,
        WEIGHT,
    )
    main_coefficient = "alpha"
    alpha_meaning = "LiNeS: post's task vector scaled by alpha in the first layer, rising linearly to 1 in the last"
    post_at_one_without_beta = True
    needs_base = True
    takes_slices = False  # its scale follows the whole model's depth
    elementwise = True
    calibration = Calibration({"alpha": 0.5}, 1, with_base=True)

    def check_inputs(self, config) -> None:
        require(
            config.parameters.get("alpha") is not None,
            "lines needs alpha, the scale of the task vector in the first layer",
        )

    def step_parameters(self, config, value, depth: Depth):
        # beta defaults to 1 - alpha: the last layer keeps the whole task vector (the authors' single-task editing,
        # src/eval/eval.py `evaluate`)
        alpha = value("alpha")
        beta = value("beta") if config.parameter("beta") is not None else 1.0 - alpha
        return LayerScaled(
            alpha, beta, depth.layer, depth.n_layers, [value("weight", i) for i in range(len(config.models))]
        )

    def chunk_combiner(self, parameters, tensors, statistics, seed, tensor_name, first_element):
        return lambda chunk, out: lines(
            chunk[0],
            chunk[1:],
            parameters.weights,
            parameters.alpha,
            parameters.beta,
            parameters.layer,
            parameters.n_layers,
        )


METHODS = (Lines(),)
