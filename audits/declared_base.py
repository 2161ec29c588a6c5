"""The paper's first check: the base the adapter declares is the base it is about to be merged into.

Aharon et al., "Audit Before You Merge" (Table 2, App. F): `base_model_name_or_path` in adapter_config.json
is compared with the expected base and its aliases; in their random sample of public Llama-3.1 adapters
the failures were 4-bit quantised bases (`unsloth/...-bnb-4bit`), Llama-3 declared instead of 3.1, and
the non-Instruct base declared for an Instruct adapter.

Names are compared after normalising what does not change the weights (ours, wider than the paper's fixed
alias list): the hub organisation (meta-llama/, NousResearch/ and unsloth/ mirrors hold the same
weights), case, `_` vs `-`, and a leading `Meta-`. What does change the weights is named as the reason:
a quantised checkpoint, a different version, the base vs the Instruct variant, or another model.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

# Name parts that mark a quantised checkpoint: its weights are not the full-precision ones the merge adds to.
QUANTISED_MARKERS = (
    "bnb",
    "4bit",
    "8bit",
    "gptq",
    "awq",
    "gguf",
    "exl2",
    "nf4",
    "int4",
    "int8",
    "fp8",
    "hqq",
    "aqlm",
    "w4a16",
    "w8a8",
    "quantized",
)
# Name parts that mark the instruction/chat-tuned variant of a model.
TUNED_MARKERS = ("instruct", "chat", "it", "inst", "sft", "rlhf")
SIZE = re.compile(r"^\d+(\.\d+)?[bm]$|^\d+x\d+b$")  # 8b, 0.5b, 125m, 8x7b: model size, not a version
VERSION = re.compile(r"v?\d+(\.\d+)*")


@dataclass(frozen=True)
class ModelName:
    """A hub id taken apart: what identifies the weights, and the markers that change them."""

    raw: str
    core: tuple[str, ...]  # family, version and size parts, in order
    tuned: bool
    quantised: tuple[str, ...]


def is_local_path(name: str) -> bool:
    """A filesystem path, not a hub id (`org/name`): it cannot be compared by name."""
    return name.startswith(("/", ".", "~")) or "\\" in name or name.count("/") > 1 or ":" in name


def names_local_folder(name: str) -> bool:
    """A path by its form, or a name that is a folder here. transformers' from_pretrained loads an existing folder
    before it asks the hub, and PEFT records the string it was given, so an adapter trained from `models/pre`
    declares `models/pre`: one slash, the form of a hub id, but a local path (ours; the paper compares strings)."""
    return is_local_path(name) or os.path.isdir(os.path.expanduser(name))


def same_folder(declared: str, base_dir) -> bool:
    """The declared path is the given base's folder (symlinks, `~`, `./` and relative spellings resolved)."""
    declared = os.path.expanduser(declared)
    try:
        return os.path.samefile(declared, base_dir)
    except OSError:  # one of them does not exist here: compare the spellings
        return os.path.abspath(declared) == os.path.abspath(base_dir)


def parse(name: str) -> ModelName:
    model = name.strip().rstrip("/").split("/")[-1].lower().replace("_", "-")
    model = model.removeprefix("meta-")
    parts = [part for part in re.split(r"-+", model) if part]
    quantised = tuple(part for part in parts if any(marker in part for marker in QUANTISED_MARKERS))
    tuned = any(part in TUNED_MARKERS for part in parts)
    core = tuple(part for part in parts if part not in quantised and part not in TUNED_MARKERS and part != "hf")
    return ModelName(name, core, tuned, quantised)


def _skeleton(core: tuple[str, ...]) -> tuple[str, ...]:
    """The name with version numbers blanked (sizes kept): equal skeletons differ only by version."""
    return tuple(part if SIZE.match(part) else VERSION.sub("#", part) for part in core)


def _variant(tuned: bool) -> str:
    return "the Instruct/chat variant" if tuned else "the base (non-Instruct) variant"


def quantised_reason(declared: str) -> str | None:
    """Why a declared base that names a quantised checkpoint fails, whatever it is compared with (None if not)."""
    quantised = parse(declared).quantised
    return (
        (
            f"declares a quantised base ({'-'.join(quantised)}): the adapter was trained against quantisation "
            "error, not against these full-precision weights"
        )
        if quantised
        else None
    )


def compare(declared: str, given: str) -> list[str]:
    """Why the declared base is not the given one (empty: the same weights under another alias)."""
    a, b = parse(declared), parse(given)
    reasons = [reason] if (reason := quantised_reason(declared)) else []
    if a.core != b.core:
        if _skeleton(a.core) == _skeleton(b.core):
            reasons.append(f"version mismatch: declared {'-'.join(a.core)}, given {'-'.join(b.core)}")
        else:
            reasons.append(f"another model: declared {'-'.join(a.core)}, given {'-'.join(b.core)}")
    if a.tuned != b.tuned:
        reasons.append(f"declares {_variant(a.tuned)}, the given base is {_variant(b.tuned)}")
    return reasons


def given_base_id(
    base_dir, base_id: str | None, base_config: dict | None, hub_id: str | None = None
) -> tuple[str | None, str]:
    """The id to compare with: --base-id, else the hub id the base was given as (or its cache snapshot is of),
    else the base config's `_name_or_path` when it is a hub id."""
    if base_id:
        return base_id, "--base-id"
    if hub_id:
        return hub_id, "the base's hub id"
    recorded = (base_config or {}).get("_name_or_path")
    if isinstance(recorded, str) and recorded and not is_local_path(recorded):
        return recorded, f"{Path(base_dir).name}/config.json _name_or_path"
    return None, ""
