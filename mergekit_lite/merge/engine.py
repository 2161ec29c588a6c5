"""How a plan runs: one pass that streams each tensor through the math into a sink (shards or memory)."""

from __future__ import annotations

import hashlib
import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import yaml

from mergekit_lite.errors import InputError
from mergekit_lite.io.lora import LoraAdapter
from mergekit_lite.io.outputs import atomic_output_dir, copy_side_files, keep_post_trained_files
from mergekit_lite.io.safetensors import ModelSource, PlannedTensor, ShardedWriter
from mergekit_lite.io.sources import TensorSource
from mergekit_lite.merge import methods
from mergekit_lite.merge.config import MergeConfig
from mergekit_lite.merge.plan import (
    PROVENANCE_FILE,
    RECALL_WEIGHTS_FILE,
    MergePlan,
    TensorStep,
    plan_merge,
)


def dare_generator(seed: int, tensor_name: str, model_index: int) -> torch.Generator:
    """A CPU generator per (seed, tensor, model): masks do not depend on tensor order or device."""
    digest = hashlib.sha256(f"{seed}\0{tensor_name}\0{model_index}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def merge_tensor(config: MergeConfig, step: TensorStep, tensors: list[torch.Tensor]) -> torch.Tensor:
    """Apply the method to one tensor's inputs (input 0 is the base where the method has one).

    Per-tensor statistics (SLERP's angle, TIES's trim thresholds) come from the whole tensors; the
    elementwise rest runs in cache-sized chunks written straight into the output, which is several
    times faster than whole-tensor float32 temporaries. DARE draws its masks chunk by chunk from one
    seeded generator per model, so the bytes do not depend on the device.
    """
    combine = _chunk_combiner(config, step, tensors)
    flats = [tensor.reshape(-1) for tensor in tensors]
    out = torch.empty(flats[0].numel(), dtype=step.out_dtype, device=flats[0].device)
    for begin in range(0, out.numel(), methods.CHUNK):
        chunk = slice(begin, begin + methods.CHUNK)
        out[chunk] = combine([flat[chunk] for flat in flats])
    return out.view(step.shape)


def _chunk_combiner(config: MergeConfig, step: TensorStep, tensors: list[torch.Tensor]):
    """The elementwise part of the method, with its per-tensor statistics bound in."""
    parameters = step.parameters
    method = config.method
    if method == "linear" and "alpha" in parameters:
        return lambda chunk: methods.lerp(chunk[0], chunk[1], parameters["alpha"])
    if method in ("linear", "recall"):
        return lambda chunk: methods.linear(chunk, parameters["weights"], normalize=parameters.get("normalize", True))
    if method == "slerp":
        weights = methods.slerp_weights(tensors[0], tensors[1], parameters["t"])
        return lambda chunk: methods.linear(chunk, weights, normalize=False)
    recipe = methods.TASK_VECTOR_METHODS[method]
    thresholds = generators = None
    if recipe.sparsifier == "magnitude":
        thresholds = [methods.trim_threshold(tensors[0], model, density)
                      for model, density in zip(tensors[1:], parameters["densities"])]
    if recipe.sparsifier == "random":
        generators = [dare_generator(config.seed, step.name, i) for i in range(len(tensors) - 1)]
    return lambda chunk: methods.task_vector_merge(
        chunk[0], chunk[1:], parameters["weights"], scale=parameters["lambda"], sparsifier=recipe.sparsifier,
        thresholds=thresholds, drops=parameters.get("drops"), generators=generators,
        consensus=recipe.consensus, normalize=parameters["normalize"])


def execute(plan: MergePlan, sink: Callable[[str, torch.Tensor], None], progress: bool = False) -> None:
    """Stream every step: read its inputs, check them, merge (or copy), hand the result to `sink`.

    `sink` runs on a background thread for one step at a time, so writing step i overlaps reading and
    merging step i+1 while at most one finished tensor waits in memory.
    """
    from tqdm import tqdm

    config = plan.config
    device = torch.device(config.device)
    with tqdm(total=plan.total_bytes, unit="B", unit_scale=True, desc="merging", disable=not progress) as bar, \
            ThreadPoolExecutor(max_workers=1) as writer:
        pending = None
        for step in plan.steps:
            if step.action == "copy":
                tensors = [plan.sources[0].load(step.name)]
            else:
                tensors = [source.load(step.name) for source in plan.sources]
            if not config.allow_nonfinite:
                _check_finite(step.name, tensors, plan.sources)
            if step.action == "copy" or _all_identical(tensors):
                merged = tensors[0]
            else:
                merged = merge_tensor(config, step, [t.to(device) for t in tensors])
            merged = merged.to(step.out_dtype).cpu()
            del tensors
            if pending is not None:
                pending.result()
            pending = writer.submit(sink, step.name, merged)
            bar.update(step.nbytes)
        if pending is not None:
            pending.result()


def _check_finite(name: str, tensors: list[torch.Tensor], sources: list[TensorSource]) -> None:
    """min and max propagate NaN and reach Inf, so one aminmax pass (much faster than isfinite) decides."""
    for tensor, source in zip(tensors, sources):
        if tensor.is_floating_point() and tensor.numel() and not all(map(math.isfinite, torch.aminmax(tensor))):
            where = source.entry(name).file if isinstance(source, ModelSource) else source.path
            raise InputError(f"tensor {name} in {where} has NaN or Inf values (pass --allow-nonfinite to merge anyway)")


def _all_identical(tensors: list[torch.Tensor]) -> bool:
    """Identical inputs are copied through byte for byte (no rounding from the math)."""
    first = tensors[0]
    return len(tensors) > 1 and all(t.dtype == first.dtype and torch.equal(t, first) for t in tensors[1:])


@dataclass
class MergeResult:
    out: Path
    plan: MergePlan
    seconds: float
    files: list[str]


def run_merge(config: MergeConfig, out: str | Path, overwrite: bool = False, progress: bool = False) -> MergeResult:
    """Plan and stream a merge into `out`, which appears only once complete."""
    started = time.perf_counter()
    plan = plan_merge(config)
    _audit_adapters(config)
    with atomic_output_dir(out, overwrite=overwrite) as folder:
        writer = ShardedWriter(folder, [PlannedTensor(s.name, s.shape, s.out_dtype) for s in plan.steps],
                               config.out_shard_size)
        execute(plan, writer.write, progress=progress)
        writer.close()
        _write_side_files(plan, folder)
        files = sorted(p.name for p in folder.iterdir())
    return MergeResult(Path(out), plan, time.perf_counter() - started, files)


def merge_state_dict(config: MergeConfig, sources: list[TensorSource] | None = None) -> dict[str, torch.Tensor]:
    """The same merge, kept in memory: for models that fit, e.g. each point of a sweep."""
    state = {}
    plan = plan_merge(config, sources)
    _audit_adapters(config)
    execute(plan, state.__setitem__)
    return state


def _audit_adapters(config: MergeConfig) -> None:
    """Adapters are audited against the base before they take part; REJECTED ones stop the merge."""
    adapters = [path for path in config.inputs if LoraAdapter.is_adapter_dir(path)]
    if adapters:
        from audits.adapter import require_verified

        for adapter in adapters:
            require_verified(adapter, config.base, force=config.force, allow_pickle=config.allow_pickle)


def _write_side_files(plan: MergePlan, folder: Path) -> None:
    """config, tokenizer and generation files from --copy-files-from, by default from the base (or the
    first input), plus the chat template and generation config of a post-trained input when the base has
    none (a note says so)."""
    config = plan.config
    donor = config.copy_files_from or config.base or config.inputs[0]
    if donor == "base":
        donor = config.base or config.inputs[0]
    if LoraAdapter.is_adapter_dir(donor):
        donor = config.base
    copy_side_files(Path(donor), folder)
    if not config.copy_files_from:
        others = [Path(path) for path in config.inputs if path != donor]
        plan.notes.extend(keep_post_trained_files(Path(donor), others, folder))
    config_file = folder / "config.json"
    if config_file.is_file() and config.dtype:
        model_config = json.loads(config_file.read_text())
        key = "torch_dtype" if "torch_dtype" in model_config and "dtype" not in model_config else "dtype"
        model_config[key] = config.dtype
        config_file.write_text(json.dumps(model_config, indent=2) + "\n")
    (folder / PROVENANCE_FILE).write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
    if plan.recall_weights is not None:
        (folder / RECALL_WEIGHTS_FILE).write_text(json.dumps(plan.recall_weights.to_json(), indent=2) + "\n")
