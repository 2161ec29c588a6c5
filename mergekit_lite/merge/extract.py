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
from mergekit_lite.merge.lora_settings import ExtractSettings

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def low_rank_factors(
    delta: torch.Tensor, rank: int, distribute_scale: bool = True, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """B [out, r], A [r, in] on the CPU with B @ A the best rank-r approximation (Eckart-Young); the singular
    values split evenly between the factors (their square roots on each side), as mergekit does by default, or
    all in A (mergekit's --no-distribute-scale). The SVD runs on `device`."""
    u, s, vh = torch.linalg.svd(delta.to(device, torch.float32), full_matrices=False)
    if distribute_scale:
        left = right = s[:rank].sqrt()
    else:
        left, right = torch.ones_like(s[:rank]), s[:rank]
    return (u[:, :rank] * left).contiguous().cpu(), (right[:, None] * vh[:rank]).contiguous().cpu()


@dataclass(frozen=True)
class ModuleKinds:
    """The tuned model's modules with weights, split by what an adapter can hold for them."""

    linear: list[str]  # low-rank factors (LoRA)
    full_rank: list[str]  # modules_to_save candidates, stored whole when they changed
    embeddings: list[str]  # the embedding tables among them (nn.Embedding)
    heads: list[str]  # the linear output head among them (not factored unless asked: mergekit's embed_out)


def module_kinds(
    config_dir: Path, names: set[str], include: tuple[str, ...] = (), exclude: tuple[str, ...] = ()
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
        raise InputError(
            f"{config_dir}: config.json names no transformers architecture ({architecture!r}); "
            "extraction needs one to know which weights are linear layers"
        )
    with torch.device("meta"):
        model = model_class(config)
    heads = {module for module in (model.get_input_embeddings(), model.get_output_embeddings()) if module is not None}
    linear, full_rank, embeddings, output_heads = [], [], [], []
    for name, module in model.named_modules():
        if f"{name}.weight" not in names or any(re.search(pattern, name) for pattern in exclude):
            continue
        if (
            isinstance(module, nn.Linear)
            and module not in heads
            and (not include or any(re.search(pattern, name) for pattern in include))
        ):
            linear.append(name)
        else:
            full_rank.append(name)
            if isinstance(module, nn.Embedding):
                embeddings.append(name)
            elif module in heads and isinstance(module, nn.Linear):
                output_heads.append(name)
    return ModuleKinds(linear, full_rank, embeddings, output_heads)


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
            raise InputError(
                f"tensor {name} in {source.path} is {str(tensor.dtype).replace('torch.', '')}; "
                "extraction factors floating-point weights"
            )
    delta = second.to(torch.float32) - first.to(torch.float32)
    if not torch.isfinite(delta).all():
        where = next(
            (source.path for source, tensor in ((base, first), (tuned, second)) if not torch.isfinite(tensor).all()),
            f"{tuned.path} - {base.path} (overflow)",
        )
        raise InputError(f"tensor {name} in {where} has NaN or Inf values; extraction needs finite weights")
    return delta


@dataclass(frozen=True)
class FactorSettings:
    """How deltas become factors: mergekit-extract-lora's --max-rank, --sv-epsilon, --distribute-scale, and the
    device the SVDs run on."""

    rank: int
    sv_epsilon: float = 0.0
    distribute_scale: bool = True
    device: str = "cpu"


def _module_delta(base, tuned, module: str, transposed: bool) -> torch.Tensor:
    """A module's weight delta as it is factored: an embedding table's transposed ([dim, vocab]), as PEFT's
    lora_embedding_B @ lora_embedding_A holds it."""
    delta = _delta(base, tuned, f"{module}.weight")
    return delta.T if transposed else delta


def _ranks(base, tuned, modules: list[str], embeddings: set[str], settings: FactorSettings) -> dict[str, int]:
    """Each factored module's rank: --max-rank within its size, and with an --sv-epsilon only as many as it has
    singular values above it (an SVD pass of its own: the shapes are fixed before anything is written); a module
    with none is left out."""
    ranks = {}
    for module in modules:
        rank = min(settings.rank, *tuned.shape(f"{module}.weight"))
        if settings.sv_epsilon > 0:
            values = torch.linalg.svdvals(_module_delta(base, tuned, module, module in embeddings).to(settings.device))
            rank = min(rank, int((values > settings.sv_epsilon).sum()))
        if rank:
            ranks[module] = rank
    return ranks


def _adapter_tensors(
    base: TensorSource,
    tuned: TensorSource,
    ranks: dict[str, int],
    lora_bias: bool,
    saved: list[str],
    embeddings: set[str],
    settings: FactorSettings,
) -> list[tuple[PlannedTensor, Callable[[], torch.Tensor]]]:
    """The adapter's tensors in file order, each planned (PEFT's name, shape, the fine-tune's dtype) beside the
    function that computes it: a factored module's lora_A, lora_B (one SVD for both; an embedding table's
    lora_embedding_A, lora_embedding_B) and, with `lora_bias`, its bias delta as lora_B.bias; then the `saved`
    modules' weights and biases whole."""
    factors = functools.lru_cache(maxsize=1)(
        lambda module: low_rank_factors(
            _module_delta(base, tuned, module, module in embeddings),
            ranks[module],
            settings.distribute_scale,
            settings.device,
        )
    )
    tensors = []
    for module, module_rank in ranks.items():
        rows, columns = tuned.shape(f"{module}.weight")
        dtype, prefix = tuned.dtype(f"{module}.weight"), f"base_model.model.{module}"
        if module in embeddings:  # [vocab, dim] factored as its transpose: A [r, vocab], B [dim, r]
            names, (out_features, in_features) = (
                (f"{prefix}.lora_embedding_A", f"{prefix}.lora_embedding_B"),
                (columns, rows),
            )
        else:
            names, (out_features, in_features) = (f"{prefix}.lora_A.weight", f"{prefix}.lora_B.weight"), (rows, columns)
        tensors.append(
            (
                PlannedTensor(names[0], (module_rank, in_features), dtype),
                lambda module=module, dtype=dtype: factors(module)[1].to(dtype),
            )
        )
        tensors.append(
            (
                PlannedTensor(names[1], (out_features, module_rank), dtype),
                lambda module=module, dtype=dtype: factors(module)[0].to(dtype),
            )
        )
        if lora_bias and module not in embeddings:
            bias = f"{module}.bias"
            tensors.append(
                (
                    PlannedTensor(f"{prefix}.lora_B.bias", tuned.shape(bias), tuned.dtype(bias)),
                    lambda bias=bias: _delta(base, tuned, bias).to(tuned.dtype(bias)),
                )
            )
    for name in (f"{module}.{part}" for module in saved for part in ("weight", "bias")):
        if name in tuned.names:
            tensors.append(
                (
                    PlannedTensor(f"base_model.model.{name}", tuned.shape(name), tuned.dtype(name)),
                    lambda name=name: tuned.load(name),
                )
            )
    return tensors


def _named(module: str, names: tuple[str, ...]) -> bool:
    """mergekit's --save-module match: the module's full name or its last part (lm_head, embed_tokens)."""
    return module in names or module.rsplit(".", 1)[-1] in names


def extract_lora(
    base_dir: str,
    tuned_dir: str,
    out_dir: str,
    settings: ExtractSettings | None = None,
    *,
    device: str = "cpu",
    overwrite: bool = False,
    model_card: bool = True,
    side_files: Callable[[Path, str], None] | None = None,
    **options,
) -> Extraction:
    """Write a PEFT LoRA adapter (scaling 1) approximating tuned - base.

    `settings` (or `options`, its fields by name: `rank=16`) say what is factored and how (ExtractSettings).
    Factors are stored in the fine-tune's dtype (math in float32). Ranks are min(rank, out, in) per
    layer, smaller ones listed in `rank_pattern`, so a `rank` at least every layer's size reproduces the
    fine-tune up to float rounding. Changed biases of factored layers ride as lora_B.bias (PEFT's
    `lora_bias`) when every factored layer has a bias; otherwise (PEFT cannot merge lora_bias into a
    layer without one) those layers are stored whole. `linear_only` stores nothing whole: a pure
    low-rank adapter; what it leaves out is reported in `dropped`. mergekit-extract-lora's options:
    `save_modules` are stored whole, changed or not (--save-module); `skip_undecomposable` leaves out the changed
    modules that are neither linear nor embeddings (norms); `embed_lora` factors the embeddings and the output
    head too (PEFT's lora_embedding_A/B); `sv_epsilon` drops singular values at or below it; `distribute_scale`
    False puts the singular values in A only. The output rules are those of merge (`check_output_folder` before
    any work, and again by `atomic_output_dir`): never an input, a folder holding one, or the working folder.
    `side_files(folder, base_dir)` writes more files into the adapter folder before it appears (the audited API
    ships the base's fingerprint this way: mergekit_lite.audited.extract_lora).
    """
    chosen = ExtractSettings.of(settings, **options)
    rank, include, exclude = chosen.rank, chosen.include, chosen.exclude
    settings = FactorSettings(rank, chosen.sv_epsilon, chosen.distribute_scale, device)
    base_dir, tuned_dir = resolve_model(str(base_dir)), resolve_model(str(tuned_dir))
    inputs = [base_dir, tuned_dir]
    check_output_folder(out_dir, inputs, overwrite)
    if not (Path(tuned_dir) / "config.json").is_file():
        raise InputError(f"{tuned_dir}: no config.json (extraction needs the architecture to find linear layers)")
    base, tuned = open_inputs(inputs, base_dir, allow_pickle=False)
    with closing(base), closing(tuned):  # the shards are closed when the adapter is written, or on an error
        kinds = module_kinds(Path(tuned_dir), set(tuned.names), include, exclude)
        factored, saved, dropped, lora_bias = _chosen_modules(base, tuned, kinds, chosen, tuned_dir)
        ranks = _ranks(base, tuned, factored, set(kinds.embeddings), settings)
        dropped += [module for module in factored if module not in ranks]
        if not ranks:
            raise InputError(
                f"{tuned_dir}: no singular value above --sv-epsilon {chosen.sv_epsilon}: nothing to extract"
            )
        tensors = _adapter_tensors(base, tuned, ranks, lora_bias, saved, set(kinds.embeddings), settings)
        config = _peft_config(ranks, lora_bias, saved, {name.rsplit(".", 1)[0] for name in tuned.names}, base_dir)
        card = ModelCard(
            bases=[input_name(base_dir)],
            relation="adapter",
            method="extract (truncated SVD)",
            parameters={
                "model": input_name(tuned_dir),
                "rank": rank,
                "include": list(include),
                "exclude": list(exclude),
                "linear_only": chosen.linear_only,
            },
            licenses=licenses_of([base_dir, tuned_dir]),
        )
        with atomic_output_dir(out_dir, overwrite=overwrite, inputs=inputs) as folder:
            with ShardedWriter(folder, [planned for planned, _ in tensors], max_shard_bytes=2**63) as writer:
                for planned, make in tensors:
                    writer.write(planned.name, make())
                writer.close()
            (Path(folder) / SINGLE_FILE).rename(Path(folder) / ADAPTER_FILE)
            (Path(folder) / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
            if model_card:
                write_card(folder, card)
            if side_files is not None:
                side_files(Path(folder), base_dir)
        return Extraction(list(ranks), saved, dropped)


def _chosen_modules(base, tuned, kinds, chosen: ExtractSettings, tuned_dir: str) -> tuple[list, list, list, bool]:
    """Which modules are factored, stored whole (modules_to_save) and left out, and whether changed biases ride as
    PEFT's lora_bias: --save-module first, then the linear layers (and with --embed-lora embeddings and head), then
    the changed modules a low-rank update cannot express."""
    forced = [module for module in kinds.linear + kinds.full_rank if _named(module, chosen.save_modules)]
    unknown = [name for name in chosen.save_modules if not any(_named(module, (name,)) for module in forced)]
    if unknown:
        raise InputError(f"--save-module {unknown[0]}: no module of {tuned_dir} has that name")
    embedding_lora = [module for module in kinds.embeddings + kinds.heads if chosen.embed_lora and module not in forced]
    linear = [
        module
        for module in kinds.linear + kinds.heads
        if module not in forced and (module not in kinds.heads or module in embedding_lora)
    ]
    changed_bias = [module for module in linear if _changed(base, tuned, f"{module}.bias")]
    lora_bias = bool(changed_bias) and all(f"{module}.bias" in tuned.names for module in linear)
    whole = [] if lora_bias else changed_bias
    factored = [module for module in linear if module not in whole] + [
        module for module in embedding_lora if module in kinds.embeddings
    ]
    if not factored:
        raise InputError(f"{tuned_dir}: no linear layers to extract (check --include/--exclude)")
    candidates = [
        module
        for module in kinds.full_rank
        if module not in forced + embedding_lora
        and any(_changed(base, tuned, f"{module}.{part}") for part in ("weight", "bias"))
    ] + whole
    undecomposable = (
        []
        if not chosen.skip_undecomposable
        else [module for module in candidates if module not in kinds.embeddings + kinds.heads + whole]
    )
    if chosen.linear_only:
        return factored, forced, candidates, lora_bias
    return (
        factored,
        forced + [module for module in candidates if module not in undecomposable],
        undecomposable,
        lora_bias,
    )


def _peft_config(ranks: dict[str, int], lora_bias: bool, saved: list[str], all_modules: set[str], base_dir) -> dict:
    """adapter_config.json at scaling 1 (lora_alpha = r, per module in the patterns), as PEFT loads it."""
    top_rank = max(ranks.values())
    smaller = {module: r for module, r in ranks.items() if r != top_rank}
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": top_rank,
        "lora_alpha": top_rank,
        "rank_pattern": smaller,
        "alpha_pattern": smaller,
        "target_modules": peft_target_names(list(ranks), all_modules),
        "lora_dropout": 0.0,
        "bias": "none",
        "lora_bias": lora_bias,
        "fan_in_fan_out": False,
        "use_rslora": False,
        "modules_to_save": saved or None,
        "base_model_name_or_path": hub_id_of(base_dir) or str(base_dir),
    }
