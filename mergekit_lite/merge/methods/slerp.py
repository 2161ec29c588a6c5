"""SLERP: spherical interpolation of two models, tensor by tensor (Shoemake 1985), the angle from the whole
tensors seen as flat vectors."""

from __future__ import annotations

from mergekit_lite.merge.methods.chunks import CHUNK
from mergekit_lite.merge.methods.registry import Calibration, Depth, Method, Position, T, linear_combiner, require


class Slerp(Method):
    name = "slerp"
    summary = "spherical interpolation of two models"
    parameters = (T,)
    main_coefficient = "t"
    alpha_meaning = "t, spherical interpolation from pre (0) to post (1)"
    pre_at_zero = post_at_one = True
    slab_statistics = True
    slab_unit = CHUNK  # the angle's sums run chunk by chunk: slabs start at a chunk
    exact_on_fused_parameters = False  # the angle is per on-disk tensor
    calibration = Calibration({"t": 0.5}, 1, with_base=True)

    def check_inputs(self, config) -> None:
        count = len(config.inputs)
        require(count == 2, f"slerp merges exactly two models (a base and one model), got {count}")

    def step_parameters(self, config, value, depth: Depth):
        return Position(value("t"))

    def tensor_statistics(self, parameters, tensors):
        from mergekit_lite.merge.methods import tensor_math

        return tensor_math.slerp_weights(tensors[0], tensors[1], parameters.t)

    def statistics_in_slabs(self, parameters, slabs):
        """SLERP's two weights from the mapped slabs in order: `tensor_math.SlerpAngle`'s sums over blocks that are
        the whole tensor's."""
        from mergekit_lite.merge.methods import tensor_math

        angle = tensor_math.SlerpAngle()
        slabs.for_each(angle.add)
        return angle.weights(parameters.t)

    def chunk_combiner(self, parameters, tensors, statistics, seed, tensor_name, first_element):
        return linear_combiner(statistics, normalize=False)


METHODS = (Slerp(),)
