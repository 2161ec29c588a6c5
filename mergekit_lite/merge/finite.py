"""One policy for NaN and Inf in the weights a command reads: refused in one line naming the tensor and its file,
unless the command's --allow-nonfinite says what it does with them instead (`merge`: merges them as they are;
`drift`: reports their drift as null, with a warning). A sweep's pre and post are held to it before any point is
scored: a merge of a model with NaN weights scores as noise, not as a model."""

from __future__ import annotations

import math

import numpy
import torch


def nonfinite_message(name: str, where, remedy: str | None) -> str:
    """The one line for a tensor with NaN or Inf values; `remedy`, the opt-in that accepts them, if there is one."""
    return f"tensor {name} in {where} has NaN or Inf values" + (f" ({remedy})" if remedy else "")


def tensor_file(source, name: str):
    """The file a tensor of `source` is stored in (a renamed or adapted source: the folder it reads)."""
    from mergekit_lite.io.safetensors import ModelSource

    inner = getattr(source, "source", None)
    if isinstance(inner, ModelSource) and hasattr(source, "name_map"):
        return inner.entry(source.name_map[name]).file
    return source.entry(name).file if isinstance(source, ModelSource) else source.path


# The integer views of IEEE floats: signed, and its unsigned twin in numpy (torch has few unsigned kernels)
INTEGER_VIEWS = {2: (torch.int16, numpy.uint16), 4: (torch.int32, numpy.uint32), 8: (torch.int64, numpy.uint64)}


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether a tensor has no NaN or Inf, from two integer maxima of its bits (IEEE 754 §3.4's encoding).

    Every non-finite float has all exponent bits set, so without its sign its bits reach +Inf's. Read as signed
    integers, the positive ones are then the largest, at least +Inf's bits; read as unsigned, the negative ones,
    at least -Inf's: integer maxima, which numpy vectorizes, instead of torch's aminmax over the floats (the checks
    read every input and result of a merge). Tensors off the CPU, and float8 (whose
    encodings have no Inf), go through aminmax, which propagates NaN and reaches Inf (upcast for float8: exact).
    """
    if not (tensor.is_floating_point() and tensor.numel()):
        return True
    if tensor.device.type != "cpu" or tensor.element_size() not in INTEGER_VIEWS:
        low_high = torch.aminmax(tensor.float() if tensor.element_size() == 1 else tensor)
        return all(math.isfinite(value) for value in low_high)
    signed, unsigned = INTEGER_VIEWS[tensor.element_size()]
    infinities = torch.tensor([math.inf, -math.inf], dtype=tensor.dtype).view(signed).numpy()
    bits = tensor.reshape(-1).view(signed).numpy()
    return bits.max() < infinities[0] and bits.view(unsigned).max() < infinities[1:].view(unsigned)[0]
