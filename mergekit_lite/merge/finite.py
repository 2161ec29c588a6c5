"""One policy for NaN and Inf in the weights a command reads: refused in one line naming the tensor and its file,
unless the command's --allow-nonfinite says what it does with them instead (`merge`: merges them as they are;
`drift`: reports their drift as null, with a warning). A sweep's pre and post are held to it before any point is
scored: a merge of a model with NaN weights scores as noise, not as a model."""

from __future__ import annotations

from mergekit_lite.errors import InputError


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


def is_finite(tensor) -> bool:
    from mergekit_lite.merge.engine import all_finite

    return all_finite(tensor)


def require_finite(tensor, name: str, where, remedy: str | None = None) -> None:
    if not is_finite(tensor):
        raise InputError(nonfinite_message(name, where, remedy))
