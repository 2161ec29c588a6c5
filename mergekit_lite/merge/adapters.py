"""Write the merge of several LoRA adapters as one PEFT adapter folder (the math: merge/adapter_merge.py).

Streams: per module, each adapter's factors are read, combined and measured against the dense truth, then dropped;
only the output factors (adapter-sized) stay until the folder is written. The base is read only for DoRA adapters
(their update depends on the base weight) and for the names of its modules (target_modules)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mergekit_lite.errors import InputError
from mergekit_lite.io.architecture import checkpoint_names
from mergekit_lite.io.lora import PEFT_PREFIX, LoraAdapter
from mergekit_lite.io.model_card import ModelCard, input_name, write_card
from mergekit_lite.io.outputs import atomic_output_dir, check_output_folder
from mergekit_lite.io.sources import TensorSource
from mergekit_lite.merge import adapter_merge as math_
from mergekit_lite.merge.adapter_combinations import dense_rule, is_svd
from mergekit_lite.merge.extract import ADAPTER_CONFIG, ADAPTER_FILE, peft_target_names
from mergekit_lite.merge.lora_settings import AdapterMergeSettings


@dataclass(frozen=True)
class AdapterMergeResult:
    """What was written and how close it is to the dense truth sum_i w_i dW_i (relative Frobenius error over every
    weight target; `best_error`: the Eckart-Young floor at the same ranks, for the SVD types)."""

    combination: str
    exact: bool
    modules: int
    rank: int
    error: float
    best_error: float | None = None
    dora: list[str] = field(default_factory=list)  # the DoRA adapters, folded against the base


def _on_disk(adapter: LoraAdapter, base: TensorSource, names: list[str]) -> dict[str, str]:
    """Adapter (in-memory) names -> the base's on-disk names, as AdapterSource maps them."""
    unknown = [name for name in names if name not in base.names]
    mapped = checkpoint_names(base.config, unknown) if unknown else {}
    return {name: mapped.get(name, name) for name in names}


def _check_inputs(adapters: Sequence[LoraAdapter], settings: AdapterMergeSettings) -> None:
    for adapter in adapters:
        if adapter.replaced():
            raise InputError(
                f"{adapter.path}: holds full tensors ({', '.join(adapter.replaced()[:3])}: modules_to_save or a "
                "trained bias), which an adapter merge of LoRA factors cannot combine; merge into dense weights with "
                "`mergekit-lite merge` instead"
            )
        dora = [name for name in adapter.weight_targets() if adapter.is_dora(name)]
        if dora and not is_svd(settings.combination):
            raise InputError(
                f"{adapter.path} is a DoRA adapter: its update m*(W+sBA)/||W+sBA|| - W is no sum of LoRA factors, so "
                f"--combination {settings.combination} cannot hold it; use an svd type (svd, ties_svd, ...), which "
                "folds it against the base first, or `mergekit-lite merge` for dense weights"
            )
    layouts = {bool(adapter.config.get("fan_in_fan_out")) for adapter in adapters}
    if len(layouts) > 1:
        raise InputError("the adapters disagree on fan_in_fan_out (Conv1D layers): they are not for one model")


def _module_inputs(
    name: str, adapters: Sequence[LoraAdapter], weights: Sequence[float], base: TensorSource, on_disk: list[dict]
) -> list[math_.ModuleInput]:
    inputs = []
    for adapter, weight, names in zip(adapters, weights, on_disk, strict=True):
        if name not in adapter.weight_targets():
            continue
        b, a = adapter.lora_factors(name)
        scaling = adapter.scaling[name]
        if adapter.is_dora(name):
            stored = base.load(names[name]).to(torch.float32)
            delta = adapter.in_factor_layout(name, adapter.apply(name, stored) - stored)
        else:
            delta = (b * scaling) @ a
        inputs.append(math_.ModuleInput(b, a, scaling, weight, delta))
    return inputs


def _merged_factors(
    name: str, inputs: list[math_.ModuleInput], settings: AdapterMergeSettings, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    kind, density = settings.combination, settings.density or 1.0
    if kind == "cat":
        return math_.concatenated(inputs)
    if is_svd(kind):
        return math_.svd_combined(dense_rule(kind), inputs, density, settings.seed, name, rank, settings.device)
    return math_.factor_combined(kind, inputs, density, settings.seed, name)


def _tensor_names(module: str, embedding: bool) -> tuple[str, str]:
    prefix = f"{PEFT_PREFIX}{module}"
    if embedding:
        return f"{prefix}.lora_embedding_A", f"{prefix}.lora_embedding_B"
    return f"{prefix}.lora_A.weight", f"{prefix}.lora_B.weight"


def merge_adapters(
    adapters: Sequence[LoraAdapter],
    base: TensorSource,
    out: str | Path,
    settings: AdapterMergeSettings,
    *,
    declared_base: str,
    overwrite: bool = False,
    inputs: Sequence[str | Path] = (),
    audits: Sequence[dict] = (),
) -> AdapterMergeResult:
    """Combine `adapters` (opened, audited by the caller) into one PEFT adapter folder at `out`, written atomically;
    `declared_base` is its base_model_name_or_path and card base."""
    from safetensors.torch import save_file

    settings.check(len(adapters))
    _check_inputs(adapters, settings)
    check_output_folder(out, [*inputs, base.path], overwrite)
    weight_names = sorted({name for adapter in adapters for name in adapter.weight_targets()})
    on_disk = [_on_disk(adapter, base, adapter.weight_targets()) for adapter in adapters]
    svd_rank = settings.rank or max(adapter.rank(name) for adapter in adapters for name in adapter.weight_targets())
    tensors, ranks = {}, {}
    error = truth_norm = floor = 0.0
    for name in weight_names:
        module_inputs = _module_inputs(name, adapters, settings.weights, base, on_disk)
        b, a = _merged_factors(name, module_inputs, settings, svd_rank)
        truth = math_.dense_truth(module_inputs)
        error += float((b @ a - truth).square().sum())
        truth_norm += float(truth.square().sum())
        if is_svd(settings.combination):
            floor += math_.best_rank_error(truth, a.shape[0], settings.device)
        module = name.removesuffix(".weight")
        owner = next(adapter for adapter in adapters if name in adapter.weight_targets())
        dtype = owner.factor_dtype(name)
        a_name, b_name = _tensor_names(module, owner.is_embedding(name))
        tensors[a_name], tensors[b_name] = a.to(dtype).contiguous(), b.to(dtype).contiguous()
        ranks[module] = a.shape[0]
    bias_names = sorted({name for adapter in adapters for name in adapter.bias_targets()})
    for name in bias_names:  # lora_bias: the weighted sum, exact for every type (PEFT's merge leaves it out)
        parts = [
            w * adapter.delta(name)
            for adapter, w in zip(adapters, settings.weights, strict=True)
            if name in adapter.bias_targets()
        ]
        tensors[f"{PEFT_PREFIX}{name.removesuffix('.bias')}.lora_B.bias"] = sum(parts[1:], parts[0])
    top = max(ranks.values())
    smaller = {module: rank for module, rank in ranks.items() if rank != top}
    all_modules = {name.rsplit(".", 1)[0] for names in (base.names, weight_names) for name in names}
    config = {
        "peft_type": "LORA",
        "task_type": adapters[0].config.get("task_type"),
        "base_model_name_or_path": declared_base,
        "r": top,
        "lora_alpha": top,
        "rank_pattern": smaller,
        "alpha_pattern": smaller,
        "target_modules": peft_target_names(list(ranks), all_modules),
        "lora_dropout": 0.0,
        "bias": "none",
        "lora_bias": bool(bias_names),
        "fan_in_fan_out": bool(adapters[0].config.get("fan_in_fan_out")),
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
    }
    result = AdapterMergeResult(
        settings.combination,
        settings.combination in math_.EXACT,
        len(ranks),
        top,
        (error / truth_norm) ** 0.5 if truth_norm else 0.0,
        (floor / truth_norm) ** 0.5 if is_svd(settings.combination) and truth_norm else None,
        [str(adapter.path) for adapter in adapters if any(map(adapter.is_dora, adapter.weight_targets()))],
    )
    with atomic_output_dir(out, overwrite=overwrite, inputs=[*inputs, base.path]) as folder:
        save_file(tensors, str(Path(folder) / ADAPTER_FILE), metadata={"format": "pt"})
        (Path(folder) / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        parameters = {
            "adapters": [input_name(adapter.path) for adapter in adapters],
            "weights": list(settings.weights),
            "combination": settings.combination,
            "rank": settings.rank,
            "density": settings.density,
            "seed": settings.seed,
            "relative_error": round(result.error, 6),
        }
        write_card(
            folder,
            ModelCard(
                bases=[declared_base],
                relation="adapter",
                method=f"merge-adapters ({settings.combination})",
                parameters=parameters,
                audits=list(audits),
            ),
        )
    return result
