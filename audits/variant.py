"""Which LoRA variant an adapter is, and what that means for combining it with others: whether PEFT's
`add_weighted_adapter` of it is right, and what `mergekit-lite merge-adapters` does with it.

The variant is read from adapter_config.json (and, when the adapter opens, its tensors): rsLoRA (`use_rslora`:
scaling alpha/sqrt(r), Kalajdzievski 2023), DoRA (`use_dora`: a trained magnitude per output row, Liu et al. 2024),
`lora_bias` (a trained bias on lora_B), the initialisation (`init_lora_weights`: PiSSA, OLoRA, CorDA, LoftQ and
LoRA-GA rewrite the base during init, so their factors belong on that residual base), per-module ranks and alphas
(`rank_pattern`, `alpha_pattern`), full tensors (`modules_to_save`, trained biases: `bias` "all" or "lora_only").

PEFT's `add_weighted_adapter` (peft/tuners/lora/model.py) folds each adapter's scaling into the combined factors
and gives the combined adapter the first one's config with `r = lora_alpha = ` the new rank. That is right for plain
LoRA, rank and alpha patterns, embeddings and Conv1D layers; it is wrong where the config or the tensors carry more
(huggingface/peft#3761; combining one adapter with weight 1 must give it back, and the tests check each case below
against PEFT itself): `use_rslora` stays on, so the combined adapter is scaled by sqrt(r); lora_B's bias is left
out; DoRA's magnitudes are the base's norms, not the trained ones; a `modules_to_save` copy is the base's module
again. PEFT refuses trained biases outright (one adapter with a bias per model).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mergekit_lite.errors import InputError
from mergekit_lite.io.lora import CONFIG_FILE, PLAIN_INITS, RESIDUAL_INITS, LoraAdapter
from mergekit_lite.io.validation import read_json, require_regular_inside

RIGHT, WRONG, REFUSED = "right", "wrong", "refused"  # PEFT's add_weighted_adapter of the adapter
HANDLED, SVD_ONLY = "yes", "svd types only"  # merge-adapters (and REFUSED)
INIT_NAMES = {"pissa": "PiSSA", "olora": "OLoRA", "corda": "CorDA", "loftq": "LoftQ", "lora_ga": "LoRA-GA"}


@dataclass
class AdapterVariant:
    """What kind of LoRA an adapter is (`label`, e.g. "rsLoRA+DoRA"; "plain LoRA" for none of the options), the
    options themselves, and what combining it gives: `peft_weighted` (right, wrong or refused) and `merge_adapters`
    (yes, svd types only, refused), each with why. Tensor counts are None when the adapter did not open."""

    label: str
    use_rslora: bool
    use_dora: bool
    lora_bias: bool
    init_lora_weights: bool | str
    residual_init: bool  # the init rewrote the base: the factors belong on that residual base
    ranks: list[int]
    rank_pattern: dict
    alpha_pattern: dict
    modules_to_save: list[str]
    bias: str
    peft_weighted: str
    peft_weighted_why: str
    merge_adapters: str
    merge_adapters_why: str
    magnitude_vectors: int | None = None
    lora_bias_tensors: int | None = None
    replaced_tensors: list[str] | None = None


def _init_name(init) -> str | None:
    """The variant an init_lora_weights value names (None for the plain ones)."""
    if init in PLAIN_INITS:
        return None if init in (True, False, "gaussian", "orthogonal") else str(init).upper()  # eva: EVA
    text = str(init)
    return next((name for prefix, name in INIT_NAMES.items() if text.startswith(prefix)), f"init {text}")


def _ranks(config: dict, adapter: LoraAdapter | None) -> list[int]:
    if adapter is not None:
        return sorted({adapter.rank(name) for name in adapter.weight_targets()})
    return sorted({config.get("r"), *(config.get("rank_pattern") or {}).values()} - {None})


def peft_weighted(config: dict, replaced: bool) -> tuple[str, str]:
    """Whether PEFT's add_weighted_adapter of this adapter (with others, or alone at weight 1) is the weighted sum of
    the updates, and why not."""
    init = config.get("init_lora_weights", True)
    if init not in PLAIN_INITS:
        return WRONG, f"init_lora_weights={init!r}: the factors belong on PEFT's residual base, not the base"
    if config.get("bias", "none") != "none":
        return REFUSED, f'bias="{config["bias"]}": PEFT allows one adapter with trained biases per model'
    why = []
    if config.get("use_rslora"):
        why.append(
            "it keeps use_rslora with lora_alpha = r, so the result is scaled by sqrt(r) of its rank (right only at rank 1)"
        )
    if config.get("use_dora"):
        why.append("its DoRA magnitudes are the base's row norms, not the trained ones")
    if config.get("lora_bias"):
        why.append("it leaves lora_B's bias out")
    if replaced or config.get("modules_to_save"):
        why.append("its modules_to_save copies are the base's modules, not the trained ones")
    return (WRONG, "; ".join(why)) if why else (RIGHT, "scaling folded into the factors, the result's scaling 1")


def merge_adapters_handling(config: dict, replaced: bool, opened: bool) -> tuple[str, str]:
    """What `mergekit-lite merge-adapters` does with this adapter (mergekit_lite/merge/adapters.py)."""
    if not opened:
        return REFUSED, "the adapter does not open (see the format check)"
    if replaced:
        return REFUSED, "full tensors (modules_to_save, trained biases): `merge` combines them into dense weights"
    if config.get("use_dora"):
        return SVD_ONLY, "DoRA is folded against the base into a plain LoRA; cat and the factor types refuse it"
    parts = ["each scaling carried into the factors"]
    parts += ["lora_B's biases summed with the weights"] if config.get("lora_bias") else []
    return HANDLED, ", ".join(parts) + "; the result has scaling 1 (cat exact, svd types the rank-K optimum)"


def describe_variant(config: dict, adapter: LoraAdapter | None = None) -> AdapterVariant:
    """The variant of an adapter from its config and, when it opened, its tensors."""
    init = config.get("init_lora_weights", True)
    replaced = adapter.replaced() if adapter is not None else None
    weights = adapter.weight_targets() if adapter is not None else []
    names = [
        name
        for name, present in (
            ("rsLoRA", config.get("use_rslora")),
            ("DoRA", config.get("use_dora")),
            ("lora_bias", config.get("lora_bias")),
            (_init_name(init), _init_name(init)),
            ("rank_pattern", config.get("rank_pattern")),
            ("alpha_pattern", config.get("alpha_pattern")),
            ("modules_to_save", config.get("modules_to_save")),
            (f"bias={config.get('bias')}", config.get("bias", "none") != "none"),
        )
        if present
    ]
    peft, peft_why = peft_weighted(config, bool(replaced))
    ours, ours_why = merge_adapters_handling(config, bool(replaced), adapter is not None)
    return AdapterVariant(
        label="+".join(names) or "plain LoRA",
        use_rslora=bool(config.get("use_rslora")),
        use_dora=bool(config.get("use_dora")),
        lora_bias=bool(config.get("lora_bias")),
        init_lora_weights=init,
        residual_init=isinstance(init, str) and init.startswith(RESIDUAL_INITS),
        ranks=_ranks(config, adapter),
        rank_pattern=dict(config.get("rank_pattern") or {}),
        alpha_pattern=dict(config.get("alpha_pattern") or {}),
        modules_to_save=list(config.get("modules_to_save") or []),
        bias=str(config.get("bias", "none")),
        peft_weighted=peft,
        peft_weighted_why=peft_why,
        merge_adapters=ours,
        merge_adapters_why=ours_why,
        magnitude_vectors=sum(map(adapter.is_dora, weights)) if adapter is not None else None,
        lora_bias_tensors=len(adapter.bias_targets()) if adapter is not None else None,
        replaced_tensors=replaced,
    )


def variant_of(folder: Path, adapter: LoraAdapter | None) -> AdapterVariant | None:
    """The variant of the adapter in `folder`: from the opened adapter, else from its config alone (an adapter the
    reader refuses, e.g. PiSSA, still says what it is); None when the config cannot be read as a JSON object."""
    if adapter is not None:
        return describe_variant(adapter.config, adapter)
    try:
        config = read_json(require_regular_inside(Path(folder) / CONFIG_FILE, Path(folder)))
    except InputError:
        return None
    return describe_variant(config) if isinstance(config, dict) else None
