"""mergekit's shared command-line flags (mergekit 0.1.5's MergeOptions, taken by mergekit-yaml and
mergekit-extract-lora), so a mergekit command line runs with only the program name changed.

Each flag does what it does in mergekit where mergekit-lite has the same thing; where it has nothing to do here it
is accepted with a one-line note saying why; where it cannot apply it is refused in one line with the reason.
Nothing is ignored in silence. docs/mergekit.md lists them all.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import click

from mergekit_lite.cli.types import ShardSize, flag_name
from mergekit_lite.errors import InputError

GPU_FLAGS = ("cuda", "read_to_gpu", "low_cpu_memory", "multi_gpu", "gpu_rich")


def _flag(name: str, help_text: str):
    """mergekit declares every boolean as --name/--no-name, off by default."""
    return click.option(f"--{name}/--no-{name}", default=False, show_default=False, help=help_text)


OPTIONS = (
    click.option(
        "--out-shard-size",
        type=ShardSize(),
        help="Largest output shard: mergekit's count with K/M/B (1B = 10^9; mergekit compares it with "
        "each tensor's bytes, so 1B gives mergekit's ~1 GB shards), or bytes: 500MB, 2GB, 5GiB "
        "(default 5B = 5GB).",
    ),
    click.option(
        "--copy-tokenizer/--no-copy-tokenizer",
        default=True,
        help="Copy the tokenizer files to the output (default: copy). A config's tokenizer_source "
        "writes its own tokenizer either way.",
    ),
    click.option(
        "--write-model-card/--no-write-model-card",
        default=True,
        help="Write README.md describing the output (default: write).",
    ),
    click.option(
        "--random-seed",
        type=int,
        help="mergekit's name for --seed: the seed of the random methods' draws "
        "(DARE, DELLA); same seed, same bytes (not mergekit's draws).",
    ),
    _flag(
        "allow-crimes",
        "mergekit: allow mixing architectures. Here tensors merge by name and shape, and "
        "models whose config.json names another architecture are still refused: it lets nothing more through.",
    ),
    _flag(
        "lazy-unpickle",
        "Nothing to do: mergekit-lite never unpickles lazily (it reads safetensors; pickle "
        ".bin weights only with --allow-pickle, torch's weights-only loader).",
    ),
    _flag(
        "clone-tensors",
        "Nothing to do: every output tensor is written as a copy of its own, so a layer used "
        "twice (passthrough slices) is stored twice already.",
    ),
    _flag(
        "trust-remote-code",
        "Nothing to trust: no model code from a repository is ever run (architectures "
        "come from transformers itself); a warning says so.",
    ),
    click.option(
        "--transformers-cache",
        type=click.Path(file_okay=False),
        help="Hugging Face hub cache that hub ids are resolved in (instead of HF_HUB_CACHE).",
    ),
    click.option(
        "--lora-merge-cache",
        type=click.Path(file_okay=False),
        help="Nothing to store: a model+lora reference's adapter is applied as its tensors are read.",
    ),
    click.option(
        "--lora-merge-dtype",
        help="Nothing to choose: adapters are applied in float32, like all the "
        "math; the stored dtype is --dtype / out_dtype.",
    ),
    click.option("-v", "verbosity", count=True, help="Log more (-v info, -vv debug), as mergekit."),
    click.option(
        "--safe-serialization/--no-safe-serialization",
        default=True,
        help="Write safetensors: always (--no-safe-serialization is refused: no pickled weights are ever written).",
    ),
    _flag(
        "unsafe-truncate-embeddings",
        "Refused: embedding rows are matched by token here; set "
        "tokenizer_source: base in the config to keep the base's vocabulary.",
    ),
    click.option(
        "--num-threads",
        "-j",
        type=click.IntRange(min=1),
        help="Use at most this many CPU cores (the merge's math, reading and writing threads).",
    ),
    _flag(
        "async-write", "Nothing to do: shards are always written on a thread of their own while the next tensors merge."
    ),
    click.option(
        "--write-threads",
        type=click.IntRange(min=1),
        help="Nothing to do: one writer thread streams each shard to disk (see --async-write).",
    ),
    _flag("cuda", "The math on the GPU (--device cuda); refused where there is none."),
    _flag(
        "read-to-gpu",
        "With a GPU: inputs go to it from pinned buffers as they are read (always so with "
        "--cuda); refused where there is none.",
    ),
    _flag(
        "low-cpu-memory",
        "With a GPU: nothing more to save, no whole model is ever held in memory; refused where there is none.",
    ),
    _flag("multi-gpu", "With a GPU: the merge runs on one GPU (cuda:0); refused where there is none."),
    click.option(
        "--gpu-rich", is_flag=True, default=False, help="mergekit's --cuda --low-cpu-memory --read-to-gpu --multi-gpu."
    ),
)


def mergekit_options(command):
    """Add mergekit's shared flags to a click command; they arrive as the keyword arguments of MergekitFlags."""
    for option in reversed(OPTIONS):
        command = option(command)
    return command


@dataclass(frozen=True)
class MergekitFlags:
    """The values of mergekit's shared flags, as given."""

    out_shard_size: int | None
    copy_tokenizer: bool
    write_model_card: bool
    random_seed: int | None
    allow_crimes: bool
    lazy_unpickle: bool
    clone_tensors: bool
    trust_remote_code: bool
    transformers_cache: str | None
    lora_merge_cache: str | None
    lora_merge_dtype: str | None
    verbosity: int
    safe_serialization: bool
    unsafe_truncate_embeddings: bool
    num_threads: int | None
    async_write: bool
    write_threads: int | None
    cuda: bool
    read_to_gpu: bool
    low_cpu_memory: bool
    multi_gpu: bool
    gpu_rich: bool

    def refusals(self) -> None:
        """The flags that cannot apply, refused in one line before any work."""
        if not self.safe_serialization:
            raise InputError(
                "--no-safe-serialization: refused, mergekit-lite writes safetensors only (pickled "
                "weights can run code when loaded)"
            )
        if self.unsafe_truncate_embeddings:
            raise InputError(
                "--unsafe-truncate-embeddings: refused, embedding rows are matched by token here; set "
                "tokenizer_source: base in the config to keep the base's vocabulary"
            )

    def gpu_flags(self) -> list[str]:
        return [flag_name(name) for name in GPU_FLAGS if getattr(self, name)]

    def device(self, device: str | None) -> str | None:
        """The math's device: --device as given (mergekit's `auto`: cuda where there is one), else cuda with
        --cuda or --gpu-rich; a GPU flag where torch sees no GPU is refused in one line."""
        wanted = self.gpu_flags()
        if device == "auto" or wanted:
            import torch

            available = torch.cuda.is_available()
            if wanted and not available:
                raise InputError(
                    f"{wanted[0]}: no CUDA GPU here (torch sees {torch.cuda.device_count()}); "
                    "leave it out to merge on the CPU"
                )
            if device == "auto":
                return "cuda" if available else "cpu"
        if wanted and device is None:
            return "cuda"
        return device

    def notes(self) -> list[str]:
        """One line per flag given that has nothing to do here, saying why (`note: ...`, `warning: ...`)."""
        said = {
            "allow_crimes": "--allow-crimes: lets nothing more through here (tensors merge by name and shape; "
            "models whose config.json names another architecture are refused)",
            "lazy_unpickle": "--lazy-unpickle: nothing to do, mergekit-lite never unpickles lazily (safetensors; "
            ".bin only with --allow-pickle)",
            "clone_tensors": "--clone-tensors: nothing to do, every output tensor is written as a copy of its own",
            "trust_remote_code": "warning: --trust-remote-code: no repository code is ever run here (architectures come "
            "from transformers itself); nothing was trusted",
            "lora_merge_cache": "--lora-merge-cache: nothing to store, adapters are applied as tensors are read",
            "lora_merge_dtype": "--lora-merge-dtype: adapters are applied in float32 like all the math; the stored "
            "dtype is --dtype",
            "async_write": "--async-write: shards are always written on a thread of their own",
            "write_threads": "--write-threads: one writer thread streams each shard (always asynchronous)",
            "read_to_gpu": "--read-to-gpu: inputs go to the GPU from pinned buffers as they are read (always)",
            "low_cpu_memory": "--low-cpu-memory: no whole model is ever held in memory (always)",
            "multi_gpu": "--multi-gpu: the merge runs on one GPU",
        }
        notes = [
            line for name, line in said.items() if getattr(self, name) and not (self.gpu_rich and name in GPU_FLAGS)
        ]
        if self.gpu_rich:
            notes.append(
                "--gpu-rich: the math on cuda (reading to the GPU and low CPU memory are always so here), on one GPU"
            )
        if self.num_threads is not None and self.num_threads > len(os.sched_getaffinity(0)):
            notes.append(f"-j {self.num_threads}: this process may use {len(os.sched_getaffinity(0))} cores")
        return [line if line.startswith("warning: ") else f"note: {line}" for line in notes]

    def apply(self) -> None:
        """The process-wide settings: log level, cores, the hub cache."""
        if self.verbosity:
            logging.basicConfig(level=logging.DEBUG if self.verbosity > 1 else logging.INFO)
        if self.num_threads is not None:
            cores = sorted(os.sched_getaffinity(0))
            os.sched_setaffinity(0, cores[: self.num_threads])  # the engine sizes its threads by the usable cores
        if self.transformers_cache is not None:
            from huggingface_hub import constants

            constants.HF_HUB_CACHE = os.path.abspath(self.transformers_cache)
