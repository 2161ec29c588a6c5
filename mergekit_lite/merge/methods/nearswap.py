"""NearSwap: the base, with the model's entries taken where the two are within t of each other (mergekit's
nearswap)."""

from __future__ import annotations

from mergekit_lite.merge.methods import tensor_math
from mergekit_lite.merge.methods.registry import T, Calibration, Depth, Method, Position, require


class Nearswap(Method):
    name = "nearswap"
    summary = "the base, with the model's entries where the two are within t"
    parameters = (T,)
    elementwise = True
    calibration = Calibration({"t": 0.5}, 1, with_base=True)

    def check_inputs(self, config) -> None:
        count = len(config.inputs)
        require(count == 2 and config.base, f"nearswap merges exactly two models, a base and one model, got {count}")
        require(config.parameters.get("t") is not None,
                "nearswap needs t, the distance below which the model's entries are taken whole")

    def step_parameters(self, config, value, depth: Depth):
        return Position(value("t"))

    def chunk_combiner(self, parameters, tensors, statistics, seed, tensor_name, first_element):
        return lambda chunk, out: tensor_math.nearswap(chunk[0], chunk[1], parameters.t)


METHODS = (Nearswap(),)
