"""A LoRA adapter's update scaled by a coefficient c, written as a PEFT adapter folder: the merge pre + c * (post - pre)
of a method that `scales_task_vector`, where post is pre with the adapter applied (`sweep --save-best-adapter`).

Tensor by tensor, with s the module's scaling (alpha/r, alpha/sqrt(r) under rsLoRA, rank/alpha patterns alike):

- a plain LoRA factor pair: c * s * B @ A is the update of the same adapter with B scaled by c (embeddings and
  Conv1D layers too); A, the config and every scaling stay as they are. lora_bias's c * s * b likewise.
- a full tensor R the adapter puts in place of the base's (modules_to_save, trained biases): pre + c * (R - pre),
  stored whole. An untouched copy of a targeted embedding stays as it is.
- DoRA (Liu et al. 2024, eq. 5): post's row is m * V / ||V|| with V = W + s * B @ A (rows of the factor layout, as
  PEFT's DoraLinearVariant normalises them). The merge's row, (1 - c) W + c m / ||V|| * V, is
  k * (W + g * s * B @ A) with k = 1 - c + c m / ||V|| and g = c m / (||V|| k): a DoRA row whose B row is scaled by
  g and whose magnitude is k * ||W + g * s * B @ A||. Interpolating the magnitude vector alone is not this merge: the
  direction moves with c as well. A row with k = 0 (c > 1 or a negative magnitude) has no such form and is refused.

The written folder is the adapter's own config (PEFT loads it as it is), the tensors under their own keys and
dtypes, and a model card.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mergekit_lite.errors import InputError
from mergekit_lite.io.lora import CONFIG_FILE, SAFETENSORS_FILE, LoraAdapter
from mergekit_lite.io.model_card import ModelCard, write_card
from mergekit_lite.io.outputs import atomic_output_dir

SINGULAR_DORA_ROW = 1e-6  # |k| below this: the merged row is (nearly) no row of the form k * (W + g s B A)


def scaled_dora(
    weight: torch.Tensor, b: torch.Tensor, a: torch.Tensor, scaling: float, magnitude: torch.Tensor, c: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B', m'): the DoRA factors whose merged weight is (1 - c) W + c * DoRA(W), all in the factor layout, float32
    (`weight` [out, in], `b` [out, r], `a` [r, in], `magnitude` [out])."""
    update = scaling * (b @ a)
    norm = torch.linalg.vector_norm(weight + update, dim=1)
    k = 1 - c + c * magnitude / norm
    if bool((k.abs() < SINGULAR_DORA_ROW).any()):
        raise InputError(
            f"DoRA at coefficient {c:g}: a row of the merge is no DoRA row (its base part cancels); write the "
            "merge as a model folder (--save-best) instead"
        )
    g = c * magnitude / (norm * k)
    scaled_b = b * g[:, None]
    return scaled_b, k * torch.linalg.vector_norm(weight + scaling * (scaled_b @ a), dim=1)


def scaled_tensors(adapter: LoraAdapter, c: float, base_tensor) -> dict[str, torch.Tensor]:
    """Every stored tensor of `adapter` for the merge pre + c * (post - pre), under its own key and dtype;
    `base_tensor(name)`: pre's tensor where the adapter puts its tensor `name` (AdapterSource.base_tensor)."""
    tensors = {}
    stored_keys = adapter.stored()
    magnitude_keys = {name: key for key, role, name in stored_keys if role == "magnitude"}
    for key, role, name in stored_keys:
        stored = adapter.load_stored(key)
        if role == "magnitude":  # a DoRA module's B sets it, before or after this key
            tensors.setdefault(key, stored)
        elif role in ("A", "base_copy"):
            tensors[key] = stored
        elif role == "B" and adapter.is_dora(name):
            b, a = adapter.lora_factors(name)
            weight = adapter.in_factor_layout(name, base_tensor(name).to(torch.float32))
            scaled_b, magnitude = scaled_dora(weight, b, a, adapter.scaling[name], adapter.magnitude(name), c)
            tensors[key] = scaled_b.to(stored.dtype)
            tensors[magnitude_keys[name]] = magnitude.to(adapter.load_stored(magnitude_keys[name]).dtype)
        elif role in ("B", "bias"):
            tensors[key] = (stored.to(torch.float32) * c).to(stored.dtype)
        else:  # a replacement R: pre + c * (R - pre)
            pre = base_tensor(name).to(torch.float32)
            tensors[key] = torch.lerp(pre, stored.to(torch.float32), c).to(stored.dtype)
    return {key: tensor.contiguous() for key, tensor in tensors.items()}


@dataclass(frozen=True)
class ScaledAdapter:
    """What `write_scaled_adapter` wrote: the coefficient, the modules whose B was scaled (DoRA ones among them) and
    the full tensors interpolated."""

    coefficient: float
    modules: int
    dora: int
    replaced: list[str] = field(default_factory=list)


def write_scaled_adapter(
    adapter: LoraAdapter,
    c: float,
    base_tensor,
    out: str | Path,
    card: ModelCard,
    *,
    overwrite: bool = False,
    inputs=(),
) -> ScaledAdapter:
    """The adapter scaled by `c` (scaled_tensors) written atomically as a PEFT adapter folder at `out`, with `card`."""
    from safetensors.torch import save_file

    tensors = scaled_tensors(adapter, c, base_tensor)
    with atomic_output_dir(out, overwrite=overwrite, inputs=inputs) as folder:
        save_file(tensors, str(Path(folder) / SAFETENSORS_FILE), metadata={"format": "pt"})
        (Path(folder) / CONFIG_FILE).write_text(json.dumps(adapter.config, indent=2) + "\n")
        write_card(folder, card)
    weights = adapter.weight_targets()
    return ScaledAdapter(c, len(weights), sum(map(adapter.is_dora, weights)), adapter.replaced())
