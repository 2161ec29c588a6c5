"""NearSwap: the base, with the model's entries taken where the two are within t of each other (mergekit's
nearswap)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from mergekit_lite.merge.methods.registry import Calibration, Depth, Method, Position, T, require

if TYPE_CHECKING:
    import torch

# SLERP's t, read as a distance: no default, a nearswap config must give it
DISTANCE = replace(T, help="the distance within which the model's entries are taken whole", default=None)


def nearswap(base: torch.Tensor, model: torch.Tensor, t: float) -> torch.Tensor:
    """NearSwap (alchemonaut's QuartetAnemoi merges; mergekit's `nearswap`): the model's entries where they lie
    within `t` of the base's, and elsewhere a step of t/|model - base| from the base toward them, so entries
    that moved far in fine-tuning stay close to the base. The step is clamped to [0, 1], the distance at 1e-6."""
    import torch

    base32, model32 = base.to(torch.float32), model.to(torch.float32)
    step = (t / (base32 - model32).abs_().clamp_min_(1e-6)).clamp_(0.0, 1.0)
    return step * model32 + (1.0 - step) * base32


class Nearswap(Method):
    name = "nearswap"
    summary = "the base, with the model's entries where the two are within t"
    parameters = (DISTANCE,)
    elementwise = True
    calibration = Calibration({"t": 0.5}, 1, with_base=True)

    def check_inputs(self, config) -> None:
        count = len(config.inputs)
        require(count == 2 and config.base, f"nearswap merges exactly two models, a base and one model, got {count}")
        require(
            config.parameters.get("t") is not None,
            "nearswap needs t, the distance below which the model's entries are taken whole",
        )

    def step_parameters(self, config, value, depth: Depth):
        return Position(value("t"))

    def chunk_combiner(self, parameters, tensors, statistics, seed, tensor_name, first_element):
        return lambda chunk, out: nearswap(chunk[0], chunk[1], parameters.t)


METHODS = (Nearswap(),)
