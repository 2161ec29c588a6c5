"""What an extraction takes (merge.extract.extract_lora), declared once for the Python API and `mergekit-lite
extract` alike; torch-free, so the command line's help needs no torch. The flag names beside ours are those of
mergekit-extract-lora, whose command lines run as they are."""

from __future__ import annotations

from pydantic import field_validator

from mergekit_lite.io.validation import check_pattern
from mergekit_lite.settings import Settings, setting


class ExtractSettings(Settings):
    rank: int = setting(
        128, "Largest LoRA rank; layers smaller than it are factored exactly.", flags=("--rank", "--max-rank"), ge=1
    )
    include: tuple[str, ...] = setting(
        (),
        "Only factor linear layers whose name matches this regex (repeatable).",
        flags=("--include", "--include-regex", "-i"),
    )
    exclude: tuple[str, ...] = setting(
        (),
        "Leave out modules whose name matches this regex (repeatable).",
        flags=("--exclude", "--exclude-regex", "-e"),
    )
    linear_only: bool = setting(
        False, "Only low-rank factors: do not store changed embeddings, head or norms at full rank."
    )
    distribute_scale: bool = setting(
        True,
        "Split the singular values evenly between A and B (default), or put them all in A.",
        negatable=True,
    )
    embed_lora: bool = setting(
        False,
        "Factor the embeddings and output head too (PEFT's lora_embedding_A/B), instead of storing them "
        "whole in modules_to_save.",
        negatable=True,
    )
    save_modules: tuple[str, ...] = setting(
        (),
        "Store this module whole (modules_to_save), changed or not: a full name or its last part "
        "(lm_head); repeatable.",
        flags=("--save-module",),
    )
    sv_epsilon: float = setting(
        0.0,
        "Drop singular values at or below this: a module's rank is how many are above (at most the rank).",
        ge=0,
        allow_inf_nan=False,
    )
    skip_undecomposable: bool = setting(
        False,
        "Leave out changed modules that are neither linear nor embeddings (norms) instead of storing them whole.",
    )

    @field_validator("include", "exclude")
    @classmethod
    def _patterns_compile(cls, patterns):
        for pattern in patterns:
            check_pattern(pattern)
        return patterns
