"""What a checkpoint's config.json says about its tensors, asked of transformers itself.

A model built from the config on the meta device (no memory, a fraction of a second) knows which
tensors are tied (`all_tied_weights_keys`), which module is the language model's decoder
(`get_decoder`) and which sibling modules are other towers (vision, audio, an encoder). Its names
are the in-memory ones; transformers' own `revert_weight_conversion` gives the names on disk.
Plain decoder-only configs never need this, so the merge path imports transformers only when a
checkpoint is composite or its names do not line up.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

from mergekit_lite import interrupts

SUB_CONFIG_KEYS = ("text_config", "vision_config", "audio_config", "encoder", "decoder")
# Far above any released model (Llama 3.1 405B: 126 layers; the largest MoE: a few hundred experts per layer), far
# below what a config.json of a few bytes can ask for: building a skeleton costs time and memory per module even on
# the meta device, so a config declaring millions of layers would take hours and all the memory. Such a config is treated like an unknown architecture: names alone.
MAX_SKELETON_LAYERS = 1024
MAX_SKELETON_EXPERTS = 4096


def is_composite(config: dict | None) -> bool:
    """A wrapper around a language model (multimodal, encoder-decoder): layer names alone are ambiguous."""
    config = config or {}
    return bool(config.get("is_encoder_decoder")) or any(isinstance(config.get(key), dict) for key in SUB_CONFIG_KEYS)


@lru_cache(maxsize=8)
def _skeleton(config_json: str):
    """The model class of config.json's architecture, built on the meta device; None if transformers cannot."""
    import torch
    import transformers

    data = json.loads(config_json)
    if not _buildable_size(data):
        return None
    try:
        config = transformers.AutoConfig.for_model(**data)
        architecture = next(iter(data.get("architectures") or []), None)
        model_class = getattr(transformers, architecture, None) if architecture else None
        with interrupts.deferred(), torch.device("meta"):  # Python called from C++: see interrupts
            if model_class is not None:
                return model_class(config)
            return transformers.AutoModelForCausalLM.from_config(config)
    except Exception:  # a custom or unknown architecture: callers fall back to names alone
        return None


def _buildable_size(config) -> bool:
    """No count of layers or experts anywhere in the config (sub-configs included) above the caps."""
    stack = [config]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            for key, value in item.items():
                if isinstance(value, int) and not isinstance(value, bool) and isinstance(key, str):
                    limit = (
                        MAX_SKELETON_EXPERTS
                        if "experts" in key
                        # counts, not sizes or capacities
                        else MAX_SKELETON_LAYERS
                        if key.endswith(("layers", "layer"))
                        else None
                    )
                    if limit is not None and value > limit:
                        return False
                stack.append(value)
    return True


def skeleton(config: dict | None):
    return _skeleton(json.dumps(config, sort_keys=True)) if config else None


def disk_names(model, names: list[str]) -> dict[str, str]:
    """In-memory parameter name -> the name transformers writes on disk (plain renames only)."""
    import torch
    from transformers.core_model_loading import revert_weight_conversion

    mapped = {}
    for name in names:
        reverted = revert_weight_conversion(model, {name: torch.empty(0, device="meta")})
        mapped[name] = next(iter(reverted)) if len(reverted) == 1 else name
    return mapped


def checkpoint_names(config: dict | None, names: list[str]) -> dict[str, str]:
    """In-memory names (as PEFT writes them) -> on-disk names, for the model config.json describes."""
    model = skeleton(config)
    return disk_names(model, names) if model is not None else {}


def tied_tensors(config: dict | None) -> dict[str, str]:
    """{tied name: the name it shares storage with} on disk, e.g. lm_head.weight -> transformer.wte.weight
    for GPT2; empty when the config does not tie (tie_word_embeddings false) or transformers cannot build it."""
    model = skeleton(config)
    if model is None:
        return {}
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
    on_disk = disk_names(model, list(tied) + list(tied.values()))
    return {on_disk[target]: on_disk[source] for target, source in tied.items()}


@dataclass(frozen=True)
class Layout:
    """Where the language model's decoder sits: its depth and the name components of the other towers.

    A tensor under a tower (any of its names' dot-separated components is a tower root) is not a
    decoder layer, whatever its own layer number.
    """

    n_layers: int | None
    towers: tuple[str, ...] = ()

    def in_tower(self, name: str) -> bool:
        return not set(name.split(".")).isdisjoint(self.towers)


def layout(config: dict | None) -> Layout:
    """The decoder's depth (text config's num_hidden_layers) and the tower roots of a composite model."""
    config = config or {}
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    depth = text.get("num_hidden_layers", text.get("num_layers", text.get("n_layer")))
    depth = depth if isinstance(depth, int) and depth > 0 else None
    if not is_composite(config):
        return Layout(depth)
    model = skeleton(config)
    if model is None:
        return Layout(depth)
    return Layout(depth, _tower_roots(model))


def _tower_roots(model) -> tuple[str, ...]:
    """Sibling modules of the decoder that hold parameters and are not the embeddings or the head."""
    decoder = model.get_decoder()
    names = {module: name for name, module in model.named_modules()}
    decoder_name = names.get(decoder, "")
    parent = model.get_submodule(decoder_name.rpartition(".")[0]) if decoder_name else model
    skip = {id(decoder), id(model.get_input_embeddings()), id(model.get_output_embeddings())}
    return tuple(
        sorted(
            name
            for name, child in parent.named_children()
            if id(child) not in skip and any(True for _ in child.parameters())
        )
    )
