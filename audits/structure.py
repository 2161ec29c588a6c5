"""The structure check: every tensor an adapter holds maps onto a base tensor of the same shape, and when one
does not, the real cause (a vision-language layout, another architecture's module names, a tied head, another
vocabulary). PEFT names modules as they are in memory, the base as it is stored: names are mapped as the merge
maps them (mergekit_lite/io/sources.py)."""

from __future__ import annotations

import torch

from mergekit_lite.audits.fingerprint import is_weight_matrix
from mergekit_lite.audits.report import FAIL, PASS, SHOWN_NAMES, CheckResult
from mergekit_lite.io.architecture import checkpoint_names
from mergekit_lite.io.lora import LoraAdapter
from mergekit_lite.io.sources import replaces_tied_head, tied_head
from mergekit_lite.merge.plan import layer_index

BASE_COPY_TOLERANCE = 1e-2  # relative; a bf16 copy of the same tensor differs by ~4e-3, another base by ~1


def module_of(base_name: str) -> str:
    """The module a weight belongs to (its name without `.weight`)."""
    return base_name.removesuffix(".weight")


# Where vision-language checkpoints put the text model, and the text-only name each stands for.
VLM_LAYOUTS = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.", ""),
    ("model.text_model.", "model."),
    ("text_model.", ""),
)


def _text_model_name(name: str) -> str:
    for segment, text_only in VLM_LAYOUTS:
        if name.startswith(segment):
            return text_only + name[len(segment) :]
    return name


def stored_tied_head(base) -> tuple[str, str] | None:
    """(head, embeddings) on disk when the base ties its head to its embeddings (transformers' own tied keys
    for its architecture, e.g. GPT2's transformer.wte) and stores the embeddings only; else None."""
    pair = tied_head(base.config)
    return pair if pair is not None and pair[0] not in base and pair[1] in base else None


def base_names(adapter: LoraAdapter, base) -> dict[str, str]:
    """Each tensor the adapter holds -> the base's on-disk name for it. PEFT names modules as they are in memory
    (a multimodal Gemma3's model.language_model...), the base as it is stored: mapped as the merge maps them."""
    names = adapter.targets() + adapter.replaced() + adapter.copied_base()
    unknown = [name for name in names if name not in base]
    on_disk = checkpoint_names(base.config, unknown) if unknown else {}
    return {name: on_disk.get(name, name) for name in names}


def why_absent(name: str, base, adapter: LoraAdapter, adapter_name: str) -> str | None:
    """The real reason a base name the adapter adapts (as `adapter_name`) is not in the base (None: it is fine, a tied
    head replaced)."""
    tied = stored_tied_head(base)
    if tied and name == tied[0]:
        if adapter_name in adapter.replaced():
            return None
        if adapter.config.get("ensure_weight_tying") and tied[1] in adapter.targets():
            return (
                f"{name}: its LoRA is tied to the LoRA on {tied[1]} (ensure_weight_tying), and PEFT's merge_and_unload "
                "adds that update twice to the tied weight, unlike the PEFT model it ran; not merged"
            )
        return (
            f"{name}: the base ties {module_of(name)} to {tied[1]} (tie_word_embeddings) and stores no {name}; "
            "a LoRA on a tied head would change the input embeddings too"
        )
    if adapter_name in adapter.bias_targets():
        return (
            f"{name}: the adapter has a lora_B bias (lora_bias) for {name.removesuffix('.bias')}, whose base layer "
            "has no bias (PEFT cannot merge it either)"
        )
    bare = _text_model_name(name)
    if any(_text_model_name(other) == bare for other in base.names):
        return (
            f"{name}: the adapter and the base use different vision-language layouts (language_model. inside or "
            "outside model.): it was made for the VLM checkpoint, or for its text model, not this one"
        )
    leaf = module_of(name).rsplit(".", 1)[-1]
    base_leaves = sorted(
        {module_of(other).rsplit(".", 1)[-1] for other in base.names if layer_index(other) is not None}
    )
    if layer_index(name) is not None and leaf not in base_leaves:
        return (
            f"{name}: this base has no module named {leaf} (its layer modules: {', '.join(base_leaves[:8])}): "
            "module names of another architecture or of an older revision of this model's code"
        )
    return f"{name} is not in the base"


def replaced_tied_embeddings(adapter: LoraAdapter, base) -> str | None:
    """What to say when modules_to_save replaces the embeddings of a base that ties its head to them and stores no
    head, without ensure_weight_tying: PEFT trains a copy of the embeddings and leaves the head on the base's (its
    merge_and_unload keeps them apart). A note when the merge writes that untied head, a problem when it would tie the
    head to the trained copy (a model PEFT never ran); None when this is not the case."""
    tied = stored_tied_head(base)
    replaced = adapter.replaced()
    if not tied or tied[1] not in replaced or tied[0] in replaced or adapter.config.get("ensure_weight_tying"):
        return None
    if replaces_tied_head(adapter, base):
        return (
            f"{tied[1]} (modules_to_save) replaces the embeddings the base ties {tied[0]} to; PEFT keeps the base's "
            f"head: the merge writes an untied {tied[0]} (tie_word_embeddings false)"
        )
    return (
        f"{tied[1]} (modules_to_save) replaces the embeddings the base ties {tied[0]} to, without ensure_weight_tying: "
        f"PEFT runs it with the base's head (merge_and_unload unties them), but this merge would tie {tied[0]} to "
        "the trained embeddings, a different model"
    )


def why_shapes_differ(name: str, adapter_shape, base_shape, base) -> str:
    vocab = (base.config or {}).get("vocab_size")
    vocabulary_rows = name in (tied_head(base.config) or ()) or "embed" in name or "lm_head" in name
    if vocabulary_rows and adapter_shape[1:] == base_shape[1:]:
        return (
            f"{name}: vocabulary of {adapter_shape[0]} rows in the adapter, {base_shape[0]} in the base"
            f"{f' (vocab_size {vocab})' if vocab else ''}: made with another tokenizer or resized embeddings"
        )
    return f"{name} is {list(adapter_shape)} in the adapter, {list(base_shape)} in the base (another model size?)"


def check_structure(adapter: LoraAdapter, base) -> CheckResult:
    """Every adapted tensor maps onto a base tensor of the same shape; value = share of base matrices targeted."""
    problems, notes = [], []
    on_disk = base_names(adapter, base)
    for name, base_name in on_disk.items():
        if base_name not in base:
            problem = why_absent(base_name, base, adapter, name)
            if problem:
                problems.append(problem)
                continue
            head, base_name = stored_tied_head(base)
            notes.append(
                f"{name} (modules_to_save) replaces the head the base ties to {base_name}: "
                f"the merge writes an untied {head} (tie_word_embeddings false)"
            )
        if tuple(base.shape(base_name)) != tuple(adapter.shape(name)):
            problems.append(why_shapes_differ(base_name, adapter.shape(name), base.shape(base_name), base))
    embeddings = replaced_tied_embeddings(adapter, base)
    if embeddings:
        (notes if replaces_tied_head(adapter, base) else problems).append(embeddings)
    for name in adapter.copied_base():
        base_name = on_disk[name]
        if base_name in base and tuple(base.shape(base_name)) == tuple(adapter.shape(name)):
            weight = base.load(base_name).to(torch.float32)
            difference = float(
                (adapter.base_copy(name).to(torch.float32) - weight).norm() / weight.norm().clamp_min(1e-12)
            )
            if difference > BASE_COPY_TOLERANCE:
                problems.append(f"the adapter's copy of {name} differs from the base's (relative {difference:.2g})")
    matrices = [name for name in base.names if is_weight_matrix(base, name)]
    coverage = len({on_disk[name] for name in adapter.targets()} & set(matrices)) / len(matrices) if matrices else 0.0
    measurements = {
        "targeted": adapter.targets(),
        "replaced": adapter.replaced(),
        "base_matrices": len(matrices),
        "merge_notes": notes,
    }
    if problems:
        return CheckResult(
            "structure",
            FAIL,
            coverage,
            None,
            f"does not fit the base ({len(problems)} problems): {'; '.join(problems[:SHOWN_NAMES])}",
            measurements,
        )
    modules = len(adapter.weight_targets())
    detail = (
        f"all {modules} LoRA modules and {len(adapter.replaced())} replaced tensors match the base; "
        f"{modules} of {len(matrices)} base weight matrices targeted ({coverage:.0%})"
    )
    return CheckResult("structure", PASS, coverage, None, "; ".join(notes + [detail]), measurements)
