"""The geometric methods: Model Stock, NuSLERP, Multi-SLERP and the Karcher mean. Each returns a linear combination
of its inputs whose coefficients depend only on the inputs' inner products (`tensor_math.gram_matrix`, one chunked
pass in float64), so the merge itself is `tensor_math.linear` chunk by chunk; the row-wise variants take one Gram
matrix per row and need whole tensors."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mergekit_lite.merge.methods import tensor_math
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

FILTER_WISE = Parameter("filter_wise", "Model Stock's ratio per row instead of per tensor", kind=bool, default=False)
NUSLERP_FLATTEN = Parameter("nuslerp_flatten", "the angle of whole tensors (false: per row or column)", kind=bool,
                            default=True)
NUSLERP_ROW_WISE = Parameter("nuslerp_row_wise", "without flattening, the angle per row (else per column)", kind=bool,
                             default=False)
NORMALIZE_WEIGHTS = Parameter("normalize_weights", "divide the weights by their sum", kind=bool, default=True)
EPS = Parameter("eps", "Multi-SLERP's tolerance for colinear inputs", default=1e-8, low=0.0, high_inclusive=False)
MAX_ITER = Parameter("max_iter", "the Karcher mean's iterations at most", kind=int, default=10, low=1.0,
                     high_inclusive=False)
TOL = Parameter("tol", "the Karcher mean's convergence tolerance", default=1e-5, low=0.0, low_inclusive=False,
                high_inclusive=False)


def with_base(weights: list[float], has_base: bool) -> list[float]:
    """The base's coefficient (one minus the others') in front, where a base is given."""
    return [1.0 - math.fsum(weights), *weights] if has_base else weights


@dataclass(frozen=True)
class ModelStockParameters(StepParameters):
    filter_wise: bool


class ModelStock(Method):
    name = "model_stock"
    summary = "Model Stock: the fine-tunes' average pulled toward the base by their angle"
    parameters = (FILTER_WISE,)

    def check_inputs(self, config) -> None:
        require(config.base and len(config.models) >= 2,
                f"model_stock needs a base model and at least two fine-tunes, got {len(config.inputs)} inputs")

    def step_parameters(self, config, value, depth: Depth):
        return ModelStockParameters(value("filter_wise"))

    def holds_whole_tensors(self, parameters) -> bool:
        return parameters.filter_wise

    def whole_tensor_merge(self, parameters, tensors, seed, tensor_name):
        if not parameters.filter_wise:
            return None
        gram = tensor_math.row_gram_matrices(tensors[1:], -1, origin=tensors[0])
        return tensor_math.combine_rows(tensors, tensor_math.model_stock_coefficients(gram), -1)

    def chunk_combiner(self, parameters, tensors, statistics, seed, tensor_name, first_element):
        gram = tensor_math.gram_matrix(tensors[1:], origin=tensors[0])
        return linear_combiner(tensor_math.model_stock_coefficients(gram).tolist(), normalize=False)


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
        require(len(config.models) == 2,
                f"nuslerp merges exactly two models (plus an optional base), got {len(config.models)}")

    def step_parameters(self, config, value, depth: Depth):
        second = value("weight", 1)
        return NuslerpParameters(second / weight_total([value("weight", 0), second], depth.name, self.name),
                                 config.base is not None, value("nuslerp_flatten"), value("nuslerp_row_wise"))

    def holds_whole_tensors(self, parameters) -> bool:
        return not parameters.flatten

    def whole_tensor_merge(self, parameters, tensors, seed, tensor_name):
        if parameters.flatten:
            return None
        axis = 0 if parameters.row_wise else -1
        ends = tensors[-2:]
        origin = tensors[0] if parameters.base else None
        pair = tensor_math.nuslerp_coefficients(tensor_math.row_gram_matrices(ends, axis, origin=origin), parameters.t)
        if origin is None:
            return tensor_math.combine_rows(ends, pair, axis)
        return tensor_math.combine_rows(tensors, torch.cat([1 - pair.sum(-1, keepdim=True), pair], -1), axis)

    def chunk_combiner(self, parameters, tensors, statistics, seed, tensor_name, first_element):
        origin = tensors[0] if parameters.base else None
        ends = tensors[1:] if parameters.base else tensors
        weights = tensor_math.nuslerp_coefficients(tensor_math.gram_matrix(ends, origin=origin), parameters.t).tolist()
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
        has_base = parameters.base
        origin = tensors[0] if has_base else None
        ends = tensors[1:] if has_base else tensors
        if len(ends) == 1:
            return linear_combiner([0.0, 1.0] if has_base else [1.0], normalize=False)  # itself, as in mergekit
        gram = tensor_math.gram_matrix(ends, origin=origin)
        weights = tensor_math.multislerp_coefficients(gram, parameters.weights, parameters.eps).tolist()
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
        gram = tensor_math.gram_matrix(tensors)
        return linear_combiner(tensor_math.karcher_coefficients(gram, parameters.max_iter, parameters.tol).tolist(),
                               normalize=False)


METHODS = (ModelStock(), Nuslerp(), Multislerp(), Karcher())
