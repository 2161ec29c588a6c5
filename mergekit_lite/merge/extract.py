"""Extract a LoRA adapter from a fine-tune: the best rank-r approximation (truncated SVD) of each delta.

Ships a post-trained model as a small PEFT adapter (as mergekit-extract-lora does), and makes the demo's
real adapter without training one. Which weights are linear layers comes from the architecture itself
(the model built on the meta device, no memory); every linear layer gets factors, and the modules a
low-rank update cannot express (embeddings, the output head, norms, other non-linear modules) are stored
at full rank in `modules_to_save` when the fine-tune changed them, so at full rank PEFT's merge gives
back the fine-tune. Streams: one weight pair in memory at a time, factors written as they are computed.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import torch

from mergekit_lite.errors import InputError
from mergekit_lite.io.hub import hub_id_of, resolve_model
from mergekit_lite.io.model_card import ModelCard, input_name, licenses_of, write_card
from mergekit_lite.io.outputs import atomic_output_dir, check_output_folder
from mergekit_lite.io.safetensors import SINGLE_FILE, PlannedTensor, ShardedWriter
from mergekit_lite.io.sources import TensorSource, open_inputs
from mergekit_lite.io.validation import check_pattern

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def low_rank_factors(delta: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """B [out, r], A [r, in] with B @ A the best rank-r approximation (Eckart-Young); the singular values
    split evenly between the factors (their square roots on each side), as mergekit does by default."""
    u, s, vh = torch.linalg.svd(delta.to(torch.float32), full_matrices=False)
    root = s[:rank].sqrt()
    return (u[:, :rank] * root).contiguous(), (root[:, None] * vh[:rank]).contiguous()


@dataclass(frozen=True)
class ModuleKinds:
    """The tuned model's modules with weights, split by what an adapter can hold for them."""

    linear: list[str]  # low-rank factors (LoRA)
    full_rank: list[str]  # modules_to_save candidates, stored whole when they changed


def module_kinds(config_dir: Path, names: set[str], include: tuple[str, ...] = (), exclude: tuple[str, ...] = ()
                 ) -> ModuleKinds:
    """Classify modules by their class in the real architecture (built on the meta device from config.json).

    nn.Linear modules whose name matches `include` (all when empty) and no `exclude` regex get LoRA
    factors; embeddings and the output head (like mergekit without --embed-lora) and every other module
    that has a weight in the checkpoint are full-rank candidates. Excluded modules are left out entirely.
    """
    import transformers
    from torch import nn

    config = transformers.AutoConfig.from_pretrained(config_dir)
    architecture = (getattr(config, "architectures", None) or [None])[0]
    model_class = getattr(transformers, architecture or "", None)
    if model_class is None:
        raise InputError(f"{config_dir}: config.json names no transformers architecture ({architecture!r}); "
                         "extraction needs one to know which weights are linear layers")
    with torch.device("meta"):
        model = model_class(config)
    heads = {module for module in (model.get_input_embeddings(), model.get_output_embeddings()) if module is not None}
    linear, full_rank = [], []
    for name, module in model.named_modules():
        if f"{name}.weight" not in names or any(re.search(pattern, name) for pattern in exclude):
            continue
        if isinstance(module, nn.Linear) and module not in heads and (
                not include or any(re.search(pattern, name) for pattern in include)):
            linear.append(name)
        else:
            full_rank.append(name)
    return ModuleKinds(linear, full_rank)


def _changed(base: TensorSource, tuned: TensorSource, name: str) -> bool:
    return name in tuned.names and not torch.equal(base.load(name), tuned.load(name))


def peft_target_names(factored: list[str], all_modules: set[str]) -> list[str]:
    """target_modules for PEFT: short names (q_proj, ...) when they pick exactly the factored modules, else
    the full names (PEFT matches a name or a dotted suffix), so nothing else gets wrapped."""
    short = {module.rsplit(".", 1)[-1] for module in factored}
    picked = {module for module in all_modules if module.rsplit(".", 1)[-1] in short}
    return sorted(short) if picked == set(factored) else sorted(factored)


@dataclass(frozen=True)
class Extraction:
    """What went into the adapter: factored linear layers, modules stored whole, changes left out."""

    factored: list[str]
    saved: list[str]
    dropped: list[str]  # changed tensors the adapter does not carry (only with linear_only)


def _delta(base, tuned, name: str) -> torch.Tensor:
    """tuned - base in float32, refused in one line unless both are finite floating-point tensors (an SVD of
    NaN fails to converge; a bool or integer tensor is no weight to factor)."""
    first, second = base.load(name), tuned.load(name)
    for source, tensor in ((base, first), (tuned, second)):
        if not tensor.is_floating_point():
            raise InputError(f"tensor {name} in {source.path} is {str(tensor.dtype).replace('torch.', '')}; "
                             "extraction factors floating-point weights")
    delta = second.to(torch.float32) - first.to(torch.float32)
    if not torch.isfinite(delta).all():
        where = next((source.path for source, tensor in ((base, first), (tuned, second))
                      if not torch.isfinite(tensor).all()), f"{tuned.path} - {base.path} (overflow)")
        raise InputError(f"tensor {name} in {where} has NaN or Inf values; extraction needs finite weights")
    return delta


def _adapter_tensors(base: TensorSource, tuned: TensorSource, ranks: dict[str, int], lora_bias: bool,
                     saved: list[str]) -> list[tuple[PlannedTensor, Callable[[], torch.Tensor]]]:
    """The adapter's tensors in file order, each planned (PEFT's name, shape, the fine-tune's dtype) beside the
    function that computes it: a factored module's lora_A, lora_B (one SVD for both) and, with `lora_bias`, its
    bias delta as lora_B.bias; then the `saved` modules' weights and biases whole."""
    factors = functools.lru_cache(maxsize=1)(
        lambda module: low_rank_factors(_delta(base, tuned, f"{module}.weight"), ranks[module]))
    tensors = []
    for module, module_rank in ranks.items():
        out_features, in_features = tuned.shape(f"{module}.weight")
        dtype, prefix = tuned.dtype(f"{module}.weight"), f"base_model.model.{module}"
        tensors.append((PlannedTensor(f"{prefix}.lora_A.weight", (module_rank, in_features), dtype),
                        lambda module=module, dtype=dtype: factors(module)[1].to(dtype)))
        tensors.append((PlannedTensor(f"{prefix}.lora_B.weight", (out_features, module_rank), dtype),
                        lambda module=module, dtype=dtype: factors(module)[0].to(dtype)))
        if lora_bias:
            bias = f"{module}.bias"
            tensors.append((PlannedTensor(f"{prefix}.lora_B.bias", tuned.shape(bias), tuned.dtype(bias)),
                            lambda bias=bias: _delta(base, tuned, bias).to(tuned.dtype(bias))))
    for name in (f"{module}.{part}" for module in saved for part in ("weight", "bias")):
        if name in tuned.names:
            tensors.append((PlannedTensor(f"base_model.model.{name}", tuned.shape(name), tuned.dtype(name)),
                            lambda name=name: tuned.load(name)))
    return tensors


def extract_lora(base_dir: str, tuned_dir: str, out_dir: str, rank: int = 8, include: tuple[str, ...] = (),
                 exclude: tuple[str, ...] = (), linear_only: bool = False, overwrite: bool = False,
                 side_files: Callable[[Path, str], None] | None = None) -> Extraction:
    """Write a PEFT LoRA adapter (scaling 1) approximating tuned - base.

    Factors are stored in the fine-tune's dtype (math in float32). Ranks are min(rank, out, in) per
    layer, smaller ones listed in `rank_pattern`, so a `rank` at least every layer's size reproduces the
    fine-tune up to float rounding. Changed biases of factored layers ride as lora_B.bias (PEFT's
    `lora_bias`) when every factored layer has a bias; otherwise (PEFT cannot merge lora_bias into a
    layer without one) those layers are stored whole. `linear_only` stores nothing whole: a pure
    low-rank adapter (mergekit's --skip-undecomposable with embeddings excluded); what it leaves out
    is reported in `dropped`. The output rules are those of merge (`check_output_folder` before any work,
    and again by `atomic_output_dir`): never an input, a folder holding one, or the working folder.
    `side_files(folder, base_dir)` writes more files into the adapter folder before it appears (the audited API
    ships the base's fingerprint this way: mergekit_lite.audited.extract_lora).
    """
    if rank < 1:
        raise InputError(f"rank must be at least 1, got {rank}")
    for pattern in (*include, *exclude):
        check_pattern(pattern)
    base_dir, tuned_dir = resolve_model(str(base_dir)), resolve_model(str(tuned_dir))
    inputs = [base_dir, tuned_dir]
    check_output_folder(out_dir, inputs, overwrite)
    if not (Path(tuned_dir) / "config.json").is_file():
        raise InputError(f"{tuned_dir}: no config.json (extraction needs the architecture to find linear layers)")
    base, tuned = open_inputs(inputs, base_dir, allow_pickle=False)
    with closing(base), closing(tuned):  # the shards are closed when the adapter is written, or on an error
        kinds = module_kinds(Path(tuned_dir), set(tuned.names), include, exclude)
        changed_bias = [module for module in kinds.linear if _changed(base, tuned, f"{module}.bias")]
        lora_bias = bool(changed_bias) and all(f"{module}.bias" in tuned.names for module in kinds.linear)
        whole = [] if lora_bias else changed_bias
        factored = [module for module in kinds.linear if module not in whole]
        if not factored:
            raise InputError(f"{tuned_dir}: no linear layers to extract (check --include/--exclude)")
        candidates = [module for module in kinds.full_rank
                      if any(_changed(base, tuned, f"{module}.{part}") for part in ("weight", "bias"))] + whole
        saved, dropped = ([], candidates) if linear_only else (candidates, [])

        ranks = {module: min(rank, *tuned.shape(f"{module}.weight")) for module in factored}
        tensors = _adapter_tensors(base, tuned, ranks, lora_bias, saved)

        top_rank = max(ranks.values())
        smaller = {module: r for module, r in ranks.items() if r != top_rank}
        all_modules = {name.rsplit(".", 1)[0] for name in tuned.names}
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": top_rank, "lora_alpha": top_rank,
                  "rank_pattern": smaller, "alpha_pattern": smaller,
                  "target_modules": peft_target_names(factored, all_modules), "lora_dropout": 0.0, "bias": "none",
                  "lora_bias": lora_bias, "fan_in_fan_out": False, "use_rslora": False,
                  "modules_to_save": saved or None, "base_model_name_or_path": hub_id_of(base_dir) or str(base_dir)}
        with atomic_output_dir(out_dir, overwrite=overwrite, inputs=inputs) as folder:
            with ShardedWriter(folder, [planned for planned, _ in tensors], max_shard_bytes=2**63) as writer:
                for planned, make in tensors:
                    writer.write(planned.name, make())
                writer.close()
            (Path(folder) / SINGLE_FILE).rename(Path(folder) / ADAPTER_FILE)
            (Path(folder) / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
            parameters = {"model": input_name(tuned_dir), "rank": rank, "include": list(include),
                          "exclude": list(exclude), "linear_only": linear_only}
            write_card(folder, ModelCard(bases=[input_name(base_dir)], relation="adapter",
                                         method="extract (truncated SVD)", parameters=parameters,
                                         licenses=licenses_of([base_dir, tuned_dir])))
            if side_files is not None:
                side_files(Path(folder), base_dir)
        return Extraction(factored, saved, dropped)
