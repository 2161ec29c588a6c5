"""What the commands that write LoRA adapters take, declared once for the Python API and the command line alike
(its options are made from these models: cli/options.py): an extraction (merge.extract.extract_lora, `mergekit-lite
extract`; the flag names beside ours are mergekit-extract-lora's, whose command lines run as they are) and a merge
of adapters (merge.adapters, `mergekit-lite merge-adapters`). Torch-free, so the command line's help needs no
torch."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import field_validator

from mergekit_lite.errors import InputError
from mergekit_lite.io.validation import check_pattern
from mergekit_lite.merge.adapter_combinations import COMBINATIONS, SPARSIFIED, is_svd
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


class AdapterMergeSettings(Settings):
    """What `merge-adapters` combines and how: PEFT's combination type, the output rank of the SVD types (None:
    the largest input rank, PEFT's default), the sparsifiers' density, DARE's seed, the SVDs' device."""

    combination: Literal[COMBINATIONS] = setting(
        "svd",
        "PEFT's add_weighted_adapter type: cat is exact; svd types give the rank-K optimum of the combined "
        "update; linear/ties/dare_*/magnitude_prune combine the factors themselves (approximate). See docs/methods.md.",
    )
    weights: tuple[float, ...] = setting(
        help="One weight per adapter, comma-separated (negative subtracts).", comma_list=True
    )
    rank: int | None = setting(None, "Output rank of the svd types (default: the largest input rank).")
    density: float | None = setting(
        None, "Share of entries kept by ties, dare_* and magnitude_prune types.", ge=0, le=1
    )
    seed: int = setting(0, "Seed of DARE's random drops.")
    device: str = setting("cpu", "Where the SVDs run: cpu (default), cuda, cuda:N or auto.")

    @field_validator("weights", mode="before")
    @classmethod
    def _comma_separated_finite(cls, weights):
        if isinstance(weights, str):
            try:
                weights = tuple(float(part) for part in weights.split(","))
            except ValueError:
                raise InputError(f"--weights {weights}: not a comma-separated list of numbers") from None
        if not all(isinstance(weight, (int, float)) and math.isfinite(weight) for weight in weights):
            raise InputError(f"--weights {','.join(map(str, weights))}: every weight must be a finite number")
        return tuple(weights)

    def check(self, count: int) -> None:
        """Refuse settings that do not fit the type or the number of adapters, in one line."""
        if len(self.weights) != count:
            raise InputError(f"{len(self.weights)} weights for {count} adapters; give one weight per adapter")
        if self.rank is not None and (not is_svd(self.combination) or self.rank < 1):
            raise InputError(
                f"--rank is the output rank of the svd types, at least 1 (got {self.rank} for {self.combination})"
            )
        sparsified = self.combination in SPARSIFIED
        if sparsified and (self.density is None or not 0 < self.density <= 1):
            raise InputError(f"--combination {self.combination} needs --density in (0, 1] (the share of entries kept)")
        if not sparsified and self.density is not None:
            raise InputError(f"--density applies to {', '.join(SPARSIFIED)}, not {self.combination}")
