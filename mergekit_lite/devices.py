"""The one check of a --device value (merge, sweep, audit --behaviour): refused in one line, before any work, when
torch cannot parse it or this machine lacks it (CUDA asked of a CPU-only torch, cuda:N past the last GPU)."""

from __future__ import annotations

from mergekit_lite.errors import InputError


def usable_device(name: str):
    """`name` as a torch.device that this machine has; only cpu and cuda are supported."""
    import torch  # the callers are about to run models or math: torch is needed anyway

    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise InputError(f"device {name!r} is not a torch device (use cpu, cuda or cuda:N)") from None
    if device.type not in ("cpu", "cuda"):
        raise InputError(f"device {name!r} is not supported (use cpu, cuda or cuda:N)")
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        raise InputError(
            f"device {name!r} is not available here (torch sees {torch.cuda.device_count()} CUDA devices"
            f"{'' if torch.backends.cuda.is_built() else '; this torch is built without CUDA'})"
        )
    return device
