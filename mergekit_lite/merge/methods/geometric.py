"""The geometric methods: Model Stock, NuSLERP, Multi-SLERP and the Karcher mean. Each returns a linear combination
of its inputs whose coefficients depend only on the inputs' inner products (`tensor_math.gram_matrix`, one chunked
pass in float64), so the merge itself is `tensor_math.linear` chunk by chunk; the row-wise variants take one Gram
matrix per row and need whole tensors."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mergekit_lite.merge.methods.registry import (
    WEIGHT,
    Calibration,
    Depth,
    Method,
    Parameter,
    StepParameters,
    linear_combiner,
    require,
    weight_total,
)

if TYPE_CHECKING:
    import torch

FILTER_WISE = Parameter("filter_wise", "Model Stock's ratio per row instead of per tensor", kind=bool, default=False)
NUSLERP_FLATTEN = Parameter(
    "nuslerp_flatten", "the angle of whole tensors (false: per row or column)", kind=bool, default=True
)
NUSLERP_ROW_WISE = Parameter(
    "nuslerp_row_wise", "without flattening, the angle per row (else per column)", kind=bool, default=False
)
NORMALIZE_WEIGHTS = Parameter("normalize_weights", "divide the weights by their sum", kind=bool, default=True)
EPS = Parameter("eps", "Multi-SLERP's tolerance for colinear inputs", default=1e-8, low=0.0, high_inclusive=False)
MAX_ITER = Parameter(
    "max_iter", "the Karcher mean's iterations at most", kind=int, default=10, low=1.0, high_inclusive=False
)
TOL = Parameter(
    "tol", "the Karcher mean's convergence tolerance", default=1e-5, low=0.0, low_inclusive=False, high_inclusive=False
)


def with_base(weights: list[float], has_base: bool) -> list[float]:
    """The base's coefficient (one minus the others') in front, where a base is given."""
    return [1.0 - math.fsum(weights), *weights] if has_base else weights


def model_stock_ratio(offset_gram: torch.Tensor) -> torch.Tensor:
    """Model Stock's interpolation ratio t = N·cosθ / (1 + (N-1)·cosθ) (Jang et al. 2024, eq. 3 and §3).

    cosθ is the mean pairwise cosine between the N fine-tunes' offsets from the base (from their Gram
    matrix, [..., N, N]). Where the denominator vanishes there is no finite estimate and t is 0 (the
    base is kept), as in mergekit.
    """
    import torch

    count = offset_gram.shape[-1]
    norms = offset_gram.diagonal(dim1=-2, dim2=-1).clamp(min=0).sqrt()
    cosines = [
        (offset_gram[..., i, j] / (norms[..., i] * norms[..., j]).clamp(min=1e-6)).clamp(-1, 1)
        for i in range(count)
        for j in range(i + 1, count)
    ]
    cosine = torch.stack(cosines).mean(dim=0)
    denominator = 1 + (count - 1) * cosine
    singular = denominator.abs() < 1e-6
    return torch.where(singular, torch.zeros_like(cosine), count * cosine / torch.where(singular, 1.0, denominator))


def model_stock_coefficients(offset_gram: torch.Tensor) -> torch.Tensor:
    """Coefficients on [base, model_1..model_N]: t·mean(models) + (1-t)·base ([..., N+1])."""
    import torch

    count = offset_gram.shape[-1]
    ratio = model_stock_ratio(offset_gram).unsqueeze(-1)
    return torch.cat([1 - ratio, (ratio / count).expand(*ratio.shape[:-1], count)], dim=-1)


def nuslerp_coefficients(gram: torch.Tensor, t: float) -> torch.Tensor:
    """NuSLERP's two coefficients ([..., 2]) for vectors with Gram matrix [..., 2, 2], as mergekit's nuslerp.

    The SLERP formula (`spherical_weights`) on the vectors' angle; only exactly colinear vectors
    (1 - cos² <= 1e-16) fall back to linear, unlike `slerp_weights`' wider band.
    """
    import torch

    norms = gram.diagonal(dim1=-2, dim2=-1).clamp(min=0).sqrt().clamp(min=1e-7)
    cosine = (gram[..., 0, 1] / (norms[..., 0] * norms[..., 1])).clamp(-1, 1)
    colinear = (1 - cosine.square()) <= 1e-16
    theta = torch.acos(torch.where(colinear, 0.0, cosine))
    sin_theta = torch.where(colinear, 1.0, torch.sin(theta))
    spherical = torch.stack([torch.sin((1 - t) * theta), torch.sin(t * theta)], dim=-1) / sin_theta.unsqueeze(-1)
    linear_pair = torch.tensor([1 - t, t], dtype=gram.dtype).expand_as(spherical)
    return torch.where(colinear.unsqueeze(-1), linear_pair, spherical)


def multislerp_coefficients(gram: torch.Tensor, weights: Sequence[float], eps: float = 1e-8) -> torch.Tensor:
    """Multi-SLERP's coefficients on its k vectors (Goddard 2024, "multislerp"), from their Gram matrix.

    The points are projected on the unit sphere, their weighted mean direction m taken, the points mapped
    to the tangent plane at m, averaged there with the weights, mapped back with the exponential map, and
    scaled by the weighted mean norm. Every step stays in the span of the inputs, so the result is a
    combination of them computed here from inner products alone. Weights are used as given (normalize
    them first for a barycentre).
    """
    import torch

    w = torch.tensor(list(weights), dtype=torch.float64)
    norms = gram.diagonal().clamp(min=0).sqrt()
    to_unit = 1.0 / (norms + eps)
    unit_gram = gram * to_unit[:, None] * to_unit[None, :]
    mean_norm = (w @ unit_gram @ w).clamp(min=0).sqrt()
    if mean_norm < eps:
        if len(w) == 2:
            return w
        raise ValueError("multislerp: the weighted mean direction is zero (antipodal inputs whose weights cancel)")
    mean = w / mean_norm
    dots = unit_gram @ mean
    tangent = w - (w * dots).sum() * mean
    tangent_norm = (tangent @ unit_gram @ tangent).clamp(min=0).sqrt() + eps
    on_sphere = mean * torch.cos(tangent_norm) + tangent * (torch.sin(tangent_norm) / tangent_norm)
    return on_sphere * (norms * w).sum() * to_unit


def karcher_coefficients(gram: torch.Tensor, max_iter: int = 10, tol: float = 1e-5) -> torch.Tensor:
    """The equal-weight Karcher (Riemannian, Fréchet) mean on the unit sphere, scaled by the mean norm.

    Karcher 1977; the fixed-point iteration of Buss & Fillmore 2001 (§3): map the points to the tangent
    plane at the current mean with the log map, average, step back with the exponential map, until the
    step is below `tol` or `max_iter` steps. As in mergekit, zero-norm inputs (<= tol) take no part in
    the direction but count in the norm. Coefficients on the inputs, from their Gram matrix.
    """
    import torch

    count = gram.shape[0]
    norms = gram.diagonal().clamp(min=0).sqrt()
    valid = [index for index in range(count) if norms[index] > tol]
    coefficients = torch.zeros(count, dtype=torch.float64)
    if not valid:
        return coefficients
    units = gram[valid][:, valid] / (norms[valid][:, None] * norms[valid][None, :])
    alphas = torch.full((len(valid),), 1.0 / len(valid), dtype=torch.float64)

    def length(vector):
        return (vector @ units @ vector).clamp(min=0).sqrt()

    mean = alphas.clone()
    mean_norm = length(mean)
    if mean_norm < tol:
        mean = torch.zeros_like(alphas)
        mean[0] = 1.0
    else:
        mean = mean / mean_norm
    for _ in range(max_iter):
        dots = (units @ mean).clamp(-1, 1)
        thetas = torch.arccos(dots)
        tangent = torch.zeros_like(mean)
        for index in range(len(valid)):
            if thetas[index] < tol:
                continue
            direction = -dots[index] * mean
            direction[index] += 1.0
            tangent += alphas[index] * (thetas[index] / torch.sin(thetas[index])) * direction
        tangent_norm = length(tangent)
        if tangent_norm < tol:
            break
        mean = torch.cos(tangent_norm) * mean + torch.sin(tangent_norm) * tangent / tangent_norm
        unit_norm = length(mean)
        if unit_norm > tol:
            mean = mean / unit_norm
    coefficients[valid] = mean * (norms.sum() / count) / norms[valid]
    return coefficients


@dataclass(frozen=True)
class ModelStockParameters(StepParameters):
    filter_wise: bool


class ModelStock(Method):
    name = "model_stock"
    summary = "Model Stock: the fine-tunes' average pulled toward the base by their angle"
    parameters = (FILTER_WISE,)

    def check_inputs(self, config) -> None:
        require(
            config.base and len(config.models) >= 2,
            f"model_stock needs a base model and at least two fine-tunes, got {len(config.inputs)} inputs",
        )

    def step_parameters(self, config, value, depth: Depth):
        return ModelStockParameters(value("filter_wise"))

    def holds_whole_tensors(self, parameters) -> bool:
        return parameters.filter_wise

    def whole_tensor_merge(self, parameters, tensors, seed, tensor_name):
        from mergekit_lite.merge.methods import tensor_math

        if not parameters.filter_wise:
            return None
        gram = tensor_math.row_gram_matrices(tensors[1:], -1, origin=tensors[0])
        return tensor_math.combine_rows(tensors, model_stock_coefficients(gram), -1)

    def chunk_combiner(self, parameters, tensors, statistics, seed, tensor_name, first_element):
        from mergekit_lite.merge.methods import tensor_math

        gram = tensor_math.gram_matrix(tensors[1:], origin=tensors[0])
        return linear_combiner(model_stock_coefficients(gram).tolist(), normalize=False)


@dataclass(frozen=True)
class NuslerpParameters(StepParameters):
    t: float
    base: bool
    flatten: bool
    row_wise: bool


class Nuslerp(Method):
    name = "nuslerp"
    summary = "NuSLERP: SLERP of two models by their weights, optionally around a base"
    parameters = (WEIGHT, NUSLERP_FLATTEN, NUSLERP_ROW_WISE)

    def check_inputs(self, config) -> None:
        require(
            len(config.models) == 2,
            f"nuslerp merges exactly two models (plus an optional base), got {len(config.models)}",
        )

    def step_parameters(self, config, value, depth: Depth):
        second = value("weight", 1)
        return NuslerpParameters(
            second / weight_total([value("weight", 0), second], depth.name, self.name),
            config.base is not None,
            value("nuslerp_flatten"),
            value("nuslerp_row_wise"),
        )

    def holds_whole_tensors(self, parameters) -> bool:
        return not parameters.flatten

    def whole_tensor_merge(self, parameters, tensors, seed, tensor_name):
        import torch

        from mergekit_lite.merge.methods import tensor_math

        if parameters.flatten:
            return None
        axis = 0 if parameters.row_wise else -1
        ends = tensors[-2:]
        origin = tensors[0] if parameters.base else None
        pair = nuslerp_coefficients(tensor_math.row_gram_matrices(ends, axis, origin=origin), parameters.t)
        if origin is None:
            return tensor_math.combine_rows(ends, pair, axis)
        return tensor_math.combine_rows(tensors, torch.cat([1 - pair.sum(-1, keepdim=True), pair], -1), axis)

    def chunk_combiner(self, parameters, tensors, statistics, seed, tensor_name, first_element):
        from mergekit_lite.merge.methods import tensor_math

        origin = tensors[0] if parameters.base else None
        ends = tensors[1:] if parameters.base else tensors
        weights = nuslerp_coefficients(tensor_math.gram_matrix(ends, origin=origin), parameters.t).tolist()
        return linear_combiner(with_base(weights, parameters.base), normalize=False)


@dataclass(frozen=True)
class MultislerpParameters(StepParameters):
    weights: list[float]
    eps: float
    base: bool


class Multislerp(Method):
    name = "multislerp"
    summary = "Multi-SLERP: a weighted spherical mean of several models, optionally around a base"
    parameters = (WEIGHT, NORMALIZE_WEIGHTS, EPS)

    def step_parameters(self, config, value, depth: Depth):
        weights = [value("weight", i) for i in range(len(config.models))]
        if value("normalize_weights"):
            total = weight_total(weights, depth.name, self.name)
            weights = [w / total for w in weights]
        return MultislerpParameters(weights, value("eps"), config.base is not None)

    def chunk_combiner(self, parameters, tensors, statistics, seed, tensor_name, first_element):
        from mergekit_lite.merge.methods import tensor_math

        has_base = parameters.base
        origin = tensors[0] if has_base else None
        ends = tensors[1:] if has_base else tensors
        if len(ends) == 1:
            return linear_combiner([0.0, 1.0] if has_base else [1.0], normalize=False)  # itself, as in mergekit
        gram = tensor_math.gram_matrix(ends, origin=origin)
        weights = multislerp_coefficients(gram, parameters.weights, parameters.eps).tolist()
        return linear_combiner(with_base(weights, has_base), normalize=False)


@dataclass(frozen=True)
class KarcherParameters(StepParameters):
    max_iter: int
    tol: float


class Karcher(Method):
    name = "karcher"
    summary = "the Karcher (Riemannian) mean of several models"
    parameters = (MAX_ITER, TOL)
    base_ignored = True
    calibration = Calibration({}, 2, with_base=False)

    def check_inputs(self, config) -> None:
        count = len(config.inputs)
        require(count >= 2, f"karcher averages at least two models, got {count}")

    def step_parameters(self, config, value, depth: Depth):
        return KarcherParameters(int(value("max_iter")), value("tol"))

    def chunk_combiner(self, parameters, tensors, statistics, seed, tensor_name, first_element):
        from mergekit_lite.merge.methods import tensor_math

        gram = tensor_math.gram_matrix(tensors)
        return linear_combiner(
            karcher_coefficients(gram, parameters.max_iter, parameters.tol).tolist(), normalize=False
        )


METHODS = (ModelStock(), Nuslerp(), Multislerp(), Karcher())
