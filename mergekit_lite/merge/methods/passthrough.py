"""Passthrough: one model's tensors copied (scaled by `scale` where given); with slices, a model stacked from
layer ranges."""

from __future__ import annotations

from dataclasses import dataclass

from mergekit_lite.merge.methods.registry import Calibration, Depth, Method, Parameter, StepParameters, require

SCALE = Parameter("scale", "a factor on the copied tensor", default=1.0, per_model=True)


@dataclass(frozen=True)
class Scale(StepParameters):
    scale: float


class Passthrough(Method):
    name = "passthrough"
    summary = "one model's tensors copied (or scaled); with slices, layers stacked"
    parameters = (SCALE,)
    base_ignored = True
    elementwise = True
    calibration = Calibration({"scale": 0.5}, 1, with_base=False)

    def check_inputs(self, config) -> None:
        count = len(config.inputs)
        require(
            count == 1, f"passthrough copies one model per tensor, got {count} inputs (use slices to stack several)"
        )

    def step_parameters(self, config, value, depth: Depth):
        return Scale(value("scale", 0))

    def copies(self, parameters) -> str | None:
        return "passthrough: copied from its one input" if parameters.scale == 1.0 else None

    def chunk_combiner(self, parameters, tensors, statistics, seed, tensor_name, first_element):
        import torch

        return lambda chunk, out: chunk[0].to(torch.float32) * parameters.scale


METHODS = (Passthrough(),)
