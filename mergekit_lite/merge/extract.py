"""Extract a LoRA adapter from a fine-tune: the best rank-r approximation (truncated SVD) of each delta.

Useful to ship a post-trained model as a small adapter, and in the demo to make a real PEFT-format
adapter without training one. Streams one weight at a time.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from mergekit_lite.errors import InputError
from mergekit_lite.io.outputs import atomic_output_dir
from mergekit_lite.io.sources import open_inputs
from mergekit_lite.merge.plan import layer_index

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def low_rank_factors(delta: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """B [out, r], A [r, in] with B @ A the best rank-r approximation; the singular values split evenly."""
    u, s, vh = torch.linalg.svd(delta.to(torch.float32), full_matrices=False)
    root = s[:rank].sqrt()
    return (u[:, :rank] * root).contiguous(), (root[:, None] * vh[:rank]).contiguous()


def extract_lora(base_dir: str, tuned_dir: str, out_dir: str, rank: int = 8,
                 targets: tuple[str, ...] = DEFAULT_TARGETS, overwrite: bool = False) -> list[str]:
    """Write a PEFT LoRA adapter (scaling 1) approximating tuned - base on the target linear layers."""
    if rank < 1:
        raise InputError(f"rank must be at least 1, got {rank}")
    base, tuned = open_inputs([base_dir, tuned_dir], base_dir, allow_pickle=False)
    tensors, modules = {}, []
    for name in base.names:
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or layer_index(name) is None or module.rsplit(".", 1)[-1] not in targets:
            continue
        if len(base.shape(name)) != 2:
            continue
        delta = tuned.load(name).to(torch.float32) - base.load(name).to(torch.float32)
        lora_b, lora_a = low_rank_factors(delta, rank)
        tensors[f"base_model.model.{module}.lora_A.weight"] = lora_a
        tensors[f"base_model.model.{module}.lora_B.weight"] = lora_b
        modules.append(module)
    if not modules:
        raise InputError(f"{base_dir}: no 2-D weights named like {', '.join(targets)} inside layers")
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank,
              "target_modules": sorted({m.rsplit(".", 1)[-1] for m in modules}), "lora_dropout": 0.0,
              "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "modules_to_save": None,
              "base_model_name_or_path": str(base_dir)}
    with atomic_output_dir(out_dir, overwrite=overwrite) as folder:
        save_file(tensors, str(Path(folder) / "adapter_model.safetensors"), metadata={"format": "pt"})
        (Path(folder) / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return modules
