"""How a plan runs: one pass that streams each tensor through the math into a sink (shards or memory)."""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from mergekit_lite import interrupts
from mergekit_lite.devices import usable_device
from mergekit_lite.errors import InputError
from mergekit_lite.io.buffers import BufferRing, reuse_freed_memory
from mergekit_lite.io.hub import lora_host, reference_paths, split_lora_reference
from mergekit_lite.io.lora import LoraAdapter
from mergekit_lite.io.model_card import ModelCard, input_name, licenses_of, write_card
from mergekit_lite.io.outputs import (
    atomic_output_dir,
    check_free_space,
    check_output_folder,
    copy_side_files,
    keep_post_trained_files,
)
from mergekit_lite.io.quantized import fp8_blocks, quantized_inputs
from mergekit_lite.io.safetensors import FLOAT8, PlannedTensor, ShardedWriter
from mergekit_lite.io.sources import TensorSource, UntiedHeadSource, adapter_of
from mergekit_lite.merge import slabs
from mergekit_lite.merge.config import MergeConfig
from mergekit_lite.merge.finite import all_finite, nonfinite_message, tensor_file
from mergekit_lite.merge.methods import tensor_math
from mergekit_lite.merge.methods.registry import Method
from mergekit_lite.merge.plan import (
    PROVENANCE_FILE,
    RECALL_WEIGHTS_FILE,
    MergePlan,
    StepAction,
    TensorStep,
    plan_merge,
)
from mergekit_lite.merge.vocab import write_tokenizer
from mergekit_lite.threads import torch_threads


def merge_tensor(
    config: MergeConfig,
    step: TensorStep,
    tensors: list[torch.Tensor],
    out: torch.Tensor | None = None,
    first_element: int = 0,
    statistics: list[float] | tuple[float, float] | None = None,
) -> torch.Tensor:
    """Apply the method to one tensor's inputs (input 0 is the base where the method has one), into `out`.
    The inputs may be a row slab of the step's tensors (merge/slabs.py) starting at flat index `first_element`,
    with the `statistics` computed over the whole tensors (TIES's thresholds, SLERP's weights).

    Per-tensor statistics (SLERP's angle, the Gram matrices of the geometric methods, TIES's trim
    thresholds, Breadcrumbs' bands) come from the whole tensors; the elementwise rest runs in cache-sized
    chunks: each chunk is converted to float32, combined, and cast straight into its slice of `out`, so no
    whole-tensor float32 temporary exists. `out` may overlay the first input when its dtype is no wider (a
    chunk is read before its slot is written), and may live on the host while the inputs are on a GPU: each
    chunk is cast there and copied back asynchronously. DARE's masks are drawn on the CPU chunk by chunk, each
    from the chunk's own Philox counters, so the bytes depend on neither the device nor the chunk size. Row-wise
    variants and DELLA (ranks within rows), and L1 rescaling (a norm of the sparsified delta), need whole tensors
    and get them.
    """
    method = config.merge_method
    whole = method.whole_tensor_merge(step.parameters, tensors, config.seed, step.name)
    if whole is not None:
        return whole.to(step.out_dtype) if out is None else out.copy_(whole)
    if statistics is None:
        statistics = method.tensor_statistics(step.parameters, tensors)
    combine = method.chunk_combiner(step.parameters, tensors, statistics, config.seed, step.name, first_element)
    if out is None:
        out = torch.empty(tensors[0].shape, dtype=step.out_dtype, device=tensors[0].device)
    size = chunk_size(method)
    # every chunk's views made in one call per tensor, not sliced one by one in the loop
    chunked = zip(out.view(-1).split(size), *(tensor.reshape(-1).split(size) for tensor in tensors), strict=True)
    with torch_threads(chunk_threads(method)):
        for target, *chunk in chunked:
            merged = combine(chunk, target)
            if merged is not target:  # a float32 result (LERP writes straight into the output where it can)
                target.copy_(merged, non_blocking=True)
    return out


def tensor_statistics(
    config: MergeConfig, step: TensorStep, tensors: list[torch.Tensor]
) -> list[float] | tuple[float, float] | None:
    """What a chunked merge needs from the whole tensors before its first chunk (merge/slabs.py computes the same
    from slabs): SLERP's two weights, TIES's trim threshold per model; None for the other methods."""
    return config.merge_method.tensor_statistics(step.parameters, tensors)


def execute(
    plan: MergePlan,
    sink: Callable[..., None],
    progress: bool = False,
    sink_keeps_tensors: bool = False,
    in_slabs: bool = False,
) -> None:
    """Stream every step: read its inputs, check them, merge (or copy), hand the result to `sink`.

    Three threads overlap: a reader fills the coming steps' inputs and checks them while step i is merged, and a
    writer checks and hands the finished steps to `sink`; a fourth computes, tensors ahead, the statistics of the
    steps in slabs that need a pass over every slab first (TIES's thresholds, SLERP's angle). Inputs are read
    into one reused ring of the largest step's size, and each result is cast chunk by chunk over its first
    input's bytes (every chunk is read before its slot is written), so memory stays bounded by that ring and no
    tensor pays for fresh pages; a step's block is free again once it is written, which is what holds a reader
    that runs ahead. Neither queue is waited on in between, so a slow disk and slow math overlap instead of
    taking turns. With
    `sink_keeps_tensors` (an in-memory merge) each result is given its own memory. With `in_slabs` the large
    tensors of elementwise methods go through in row slabs (merge/slabs.py; same bytes), handed to the sink as
    `sink(name, rows, first_row)`, so the ring holds a few slabs instead of the largest tensor's inputs.

    On a GPU the ring is pinned: inputs go up with non-blocking copies while the reader fills the next block,
    results come back cast to the output dtype, and the host waits for the device once per step.
    """
    from tqdm import tqdm

    config = plan.config
    device = usable_device(config.device)
    reuse_freed_memory()
    units = slabs.parts(plan, in_slabs)
    ring = BufferRing(slabs.ring_capacity(plan, units), pin=device.type == "cuda")
    decided: dict[str, bool] = {}  # a slabbed step's copy decision, from its first slab
    needs_statistics = config.merge_method.slab_statistics  # of the steps in slabs (a first slab: rows)
    with (
        interrupts.deferred(),
        tqdm(total=plan.total_bytes, unit="B", unit_scale=True, desc="merging", disable=not progress) as bar,
        ThreadPoolExecutor(max_workers=1) as reader,
        ThreadPoolExecutor(max_workers=1) as writer,
        ThreadPoolExecutor(max_workers=1) as statistician,
    ):
        # the statistics of the steps in slabs that need them, in step order, as far ahead as the statistician gets
        ahead = {
            part.step.name: statistician.submit(_decide_step, plan, part)
            for part in units
            if needs_statistics and part.rows is not None and part.rows[0] == 0
        }
        # both queues are in step order, and the ring's blocks bound how far the reader runs ahead of the writer
        reads: deque[Future] = deque(reader.submit(_read_step, plan, part, ring, decided, ahead) for part in units)
        writes: deque[Future] = deque()
        write_failed = threading.Event()
        try:
            for part in units:
                interrupts.check()  # signals are handled here, never inside the executors' locks
                block, tensors, copied, statistics = reads.popleft().result()
                step = part.step
                if copied:
                    merged = tensors[0].to(step.out_dtype)
                else:
                    merged = merge_tensor(
                        config,
                        step,
                        [t.to(device, non_blocking=True) for t in tensors],
                        _output_slot(part, tensors[0], block),
                        part.first_element,
                        statistics,
                    )
                _wait_for(device)
                del tensors
                if sink_keeps_tensors and _within(merged, block):
                    merged = merged.clone()
                while writes and writes[0].done():
                    writes.popleft().result()  # a failed write or check stops the merge here
                writes.append(writer.submit(_write_step, plan, part, sink, merged, ring, block, write_failed))
                bar.update(part.nbytes)
            while writes:
                writes.popleft().result()
        finally:
            for future in (*ahead.values(), *reads, *writes):
                future.cancel()  # a failed merge waits for none of the queued statistics, reads or writes
            ring.close()


def chunk_size(method: Method) -> int:
    """Elements per chunk of a method's loop: cache-sized for the memory-bound methods (`tensor_math.DENSE_CHUNK`),
    larger for the compute-bound ones, whose per-chunk work outweighs the calls (`tensor_math.ELEMENTWISE_CHUNK`).
    The bytes are the same at any size: the chunks are elementwise."""
    return tensor_math.ELEMENTWISE_CHUNK if method.compute_bound else tensor_math.DENSE_CHUNK


def chunk_threads(method: Method) -> int:
    """Intra-op threads for a method's chunk loop: one where the other cores draw DARE's masks (`KeepsAhead`) or count
    TIES's thresholds for the coming tensors (merge/slabs.py), else `math_threads`. A second math thread was no
    faster for DARE with version 2's cheaper draws, and slower for TIES, whose two math threads and threshold counts
    then contend for two cores (benchmarks/RESULTS.md)."""
    return 1 if method.one_chunk_thread else math_threads(method.compute_bound)


def math_threads(compute_bound: bool = False) -> int:
    """Intra-op threads for the chunk loop: the cores this process may use, minus one for reading and writing,
    or all of them for compute-bound methods, whose reader and writer mostly wait.

    Leaving a core free keeps an I/O-bound loop's thousands of parallel regions from waiting on a worker that
    another process has descheduled (much slower runs on a busy machine). Only the chunked
    loops change threads: elementwise ops give the same bytes with any thread count, while whole-tensor
    reductions such as SLERP's dot products round differently with another count and keep the default.
    """
    cores = len(os.sched_getaffinity(0))
    return max(1, min(torch.get_num_threads(), cores if compute_bound else cores - 1))


def input_bytes(plan: MergePlan, step: TensorStep) -> int:
    """The bytes a step reads: every input, page-aligned."""
    return sum(slabs.block_sizes(plan, slabs.Part(step)))


def _decide_step(plan: MergePlan, part: slabs.Part):
    """The statistician thread's job: `slabs.decide` for the step of `part` (its first slab), on one thread."""
    with torch_threads(1):
        return slabs.decide(plan, part)


def _read_step(plan: MergePlan, part: slabs.Part, ring: BufferRing, decided: dict[str, bool], ahead: dict[str, Future]):
    """The reader thread's job: one ring block holding every input of `part` (waits while the ring is full),
    whether its step is a plain copy (identical inputs), the inputs' finite check where the method needs it, and
    the step's statistics (TIES's thresholds, SLERP's weights; None for other methods): a step in slabs has them
    from the statistician's `ahead`, a whole step from its inputs just read (`tensor_statistics`), so the math
    thread only merges.

    The checks run here, on one thread, beside the math: torch.equal stops at the first difference only when
    it runs on one thread, and fine-tuned inputs differ in their first entries. A step in slabs is a copy when
    every slab is identical, decided at its first slab (`slabs.first_slab`) or with its statistics.
    """
    step = part.step
    sizes = slabs.block_sizes(plan, part)
    block = ring.take(sum(sizes))
    statistics = None
    with torch_threads(1):
        if part.rows is None:
            tensors = slabs.load_part(plan, part, block, sizes)
            copied = step.action is StepAction.COPY or slabs.all_identical(tensors)
        elif step.name in ahead:
            tensors = slabs.load_part(plan, part, block, sizes)
            copied, statistics = ahead[step.name].result()
        elif part.rows[0] == 0:
            tensors, copied = slabs.first_slab(plan, part, block, sizes)
            decided[step.name] = copied
        else:
            tensors, copied = slabs.load_part(plan, part, block, sizes), decided[step.name]
        if not (copied or plan.config.allow_nonfinite) and plan.config.merge_method.hides_nonfinite:
            _FiniteChecks(plan, step).of_inputs(tensors)
        if part.rows is None and not copied:
            statistics = tensor_statistics(plan.config, step, tensors)
    return block, tensors, copied, statistics


def _output_slot(part: slabs.Part, first: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """Where a merged result goes: over its first input's bytes when that input was read into the ring block
    and the output dtype is no wider, else new host memory (e.g. a float32 output of bf16 inputs)."""
    out_dtype = part.step.out_dtype
    if first.data_ptr() == block.data_ptr() and out_dtype.itemsize <= first.dtype.itemsize:
        return block[: part.nbytes].view(out_dtype).view(part.shape)
    return torch.empty(part.shape, dtype=out_dtype)


def _within(tensor: torch.Tensor, block: torch.Tensor) -> bool:
    return block.data_ptr() <= tensor.data_ptr() < block.data_ptr() + max(block.numel(), 1)


def _write_step(
    plan: MergePlan,
    part: slabs.Part,
    sink,
    merged: torch.Tensor,
    ring: BufferRing,
    block: torch.Tensor,
    failed: threading.Event,
) -> None:
    """The writer thread's job: check the result (on one thread, beside the math) and hand it to `sink`; the
    step's ring block is free again once that is done. After a failed write or check the queued steps are skipped,
    so nothing more goes to a sink that broke before the merge stops."""
    try:
        if failed.is_set():
            return
        step = part.step
        if not plan.config.allow_nonfinite:
            with torch_threads(1):
                _FiniteChecks(plan, step).of_result(merged)
        if part.rows is None:
            sink(step.name, merged)
        else:
            sink(step.name, merged, part.rows[0])
    except BaseException:
        failed.set()
        raise
    finally:
        ring.release(block)


def _wait_for(device: torch.device) -> None:
    """Asynchronous copies to and from a GPU must land before their ring blocks are reused."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _FiniteChecks:
    """Refuse NaN or Inf in a step's inputs or its result, naming the input that has them.

    The result is always checked: finite inputs can still overflow (a huge --lambda, a sum beyond float16's
    range). Most methods carry every non-finite input entry into the result, so a finite result proves the
    inputs finite and they need no pass of their own; only when the result is not finite are the inputs read
    again (the result may overlay the first one) to name the culprit. Methods that may select the bad entry
    away (`Method.hides_nonfinite`: the sparsifiers that select entries, TIES's trim, DELLA, Breadcrumbs) have
    their inputs checked before the merge. Every other method combines every input entry with a float32
    coefficient, and NaN or Inf survives that (Inf x 0 is NaN); DARE too, which drops by multiplying by its
    0-or-1 mask (tests/test_methods.py, every input and option).
    """

    def __init__(self, plan: MergePlan, step: TensorStep):
        self.step, self.inputs = step, plan.inputs_of(step)

    def of_inputs(self, tensors: list[torch.Tensor]) -> None:
        for (source, name), tensor in zip(self.inputs, tensors, strict=True):
            if not all_finite(tensor):
                where = tensor_file(source, name)
                raise InputError(nonfinite_message(name, where, "pass --allow-nonfinite to merge anyway"))

    def of_result(self, merged: torch.Tensor) -> None:
        if all_finite(merged):
            return
        self.of_inputs([source.load(name) for source, name in self.inputs])
        raise InputError(
            f"merged tensor {self.step.name} has NaN or Inf values (overflow in the merge or the "
            f"output dtype {str(merged.dtype).removeprefix('torch.')}; pass --allow-nonfinite to "
            f"write it anyway)"
        )


@dataclass
class MergeResult:
    out: Path
    plan: MergePlan
    seconds: float
    files: list[str]


# The audit of one adapter before it is merged (mergekit_lite.audited.audit_gate): raises when it may not be.
AdapterGate = Callable[[str, MergeConfig], Any]


def run_merge(
    config: MergeConfig,
    out: str | Path,
    overwrite: bool = False,
    progress: bool = False,
    gate: AdapterGate | None = None,
    card_sections: list[tuple[str, str]] = (),
    copy_tokenizer: bool = True,
    model_card: bool = True,
) -> MergeResult:
    """Plan and stream a merge into `out`, which appears only once complete, with its model card (README.md;
    `card_sections`: (title, markdown) a caller adds, e.g. a sweep's pick) unless not `model_card`, and the
    tokenizer files of the donor unless not `copy_tokenizer` (mergekit's flags). Adapters pass `gate` first
    (the Python API with the audits is mergekit_lite.audited.run_merge). Refused before anything is written when
    the output cannot fit where it goes."""
    started = time.perf_counter()
    inputs = config.read_paths
    check_output_folder(out, inputs, overwrite)
    usable_device(config.device)
    reports = _audit_adapters(config, gate)
    plan = plan_merge(config)
    plan.notes.extend(_audit_notes(reports))
    try:
        check_free_space(out, plan.total_bytes)
        requantized = requantization(plan) if config.out_quant else None
    except InputError:
        plan.close()
        raise
    with plan, atomic_output_dir(out, overwrite=overwrite, inputs=inputs) as folder:
        with ShardedWriter(folder, output_tensors(plan, requantized), config.out_shard_size) as writer:
            sink = writer.write if requantized is None else requantized.sink(writer.write)
            execute(plan, sink, progress=progress, in_slabs=True)
            writer.close()
        _write_side_files(plan, folder, copy_tokenizer, requantized)
        if model_card:
            sections = [*card_sections, *dequantized_section(plan, requantized)]
            write_card(folder, merge_card(config, reports, sections))
        files = sorted(p.name for p in folder.iterdir())
    return MergeResult(Path(out), plan, time.perf_counter() - started, files)


def merge_state_dict(
    config: MergeConfig, sources: list[TensorSource] | None = None, gate: AdapterGate | None = None
) -> dict[str, torch.Tensor]:
    """The same merge, kept in memory: for models that fit, e.g. each point of a sweep."""
    state = {}
    _audit_adapters(config, gate)
    with plan_merge(config, sources) as plan:
        execute(plan, state.__setitem__, sink_keeps_tensors=True)
    return state


def _audit_adapters(config: MergeConfig, gate: AdapterGate | None) -> list:
    """Adapters pass the gate (their audit against the model they apply to: the base, or the model of a model+lora
    reference) before anything else reads them, so a refusal names the real cause; without a gate none is merged.
    An adapter folder without a base is left to planning, which says it needs one. Hub ids are resolved first, so
    an adapter named by hub id is audited like a folder."""
    config.resolve_references()
    adapters = [reference for reference in config.inputs if adapter_of(reference)]
    if not adapters or (not config.base and any(LoraAdapter.is_adapter_dir(path) for path in adapters)):
        return []
    if gate is None:
        raise InputError(
            f"adapter {adapters[0]} is merged only after its audit: use mergekit_lite.audited.run_merge "
            "(or pass the engine a gate)"
        )
    # adapter folders (applied to the base) first: a base they cannot be audited against is refused before any
    # model+lora reference's verdict is printed
    return [gate(adapter, config) for adapter in sorted(adapters, key=lambda path: bool(split_lora_reference(path)))]


def merge_card(config: MergeConfig, reports: list, sections=()) -> ModelCard:
    """The output's model card: every input by hub id or folder name, their licenses, the method (with its
    declaration's summary) and its parameters, the configuration and each adapter's audit verdict."""
    inputs = list(dict.fromkeys(path for path in [config.base, *config.inputs] if path))
    # no local paths in a card meant for the Hub: every path read (side files, texts too) by hub id or name
    names = {str(path): input_name(path) for path in [*config.read_paths, *inputs] if path}
    shown = _renamed(config.to_dict(), names)
    return ModelCard(
        bases=[names[str(path)] for path in inputs],
        relation="merge",
        method=config.method,
        parameters=dict(config.parameters),
        config_yaml=yaml.safe_dump(shown, sort_keys=False),
        licenses=licenses_of(reference_paths(*inputs)),
        audits=[{"adapter": input_name(r.adapter), "verdict": r.verdict, "reasons": r.reasons} for r in reports],
        sections=[("Merge method", f"`{config.method}`: {config.merge_method.summary}."), *sections],
    )


def _renamed(data, names: dict[str, str]):
    """`data` with every string that is an input's path replaced by its name."""
    if isinstance(data, dict):
        return {key: _renamed(value, names) for key, value in data.items()}
    if isinstance(data, list):
        return [_renamed(value, names) for value in data]
    return names.get(data, data) if isinstance(data, str) else data


def _audit_notes(reports: list) -> list[str]:
    """What the audits say about how an adapter merges (a tied base's head written untied), so the user hears it
    from merge too."""
    return [
        f"{Path(report.adapter).name}: {note}"
        for report in reports
        for check in report.checks
        if check.name == "structure"
        for note in check.measurements.get("merge_notes", [])
    ]


def written_dtype(plan: MergePlan) -> str | None:
    """The dtype every floating tensor of the output is written in, for its config.json; None where they differ."""
    dtypes = {step.out_dtype for step in plan.steps if step.out_dtype.is_floating_point}
    return str(dtypes.pop()).removeprefix("torch.") if len(dtypes) == 1 else None


def dequantized_section(plan: MergePlan, requantized: Requantization | None = None) -> list[tuple[str, str]]:
    """The model card's word on quantized inputs: which were read dequantized, from what, and what was written."""
    quantized = quantized_inputs(plan.sources)
    if not quantized:
        return []
    written = written_dtype(plan) or "the dtypes of the inputs"
    output = (
        f"The output is dense ({written}), with no `quantization_config`."
        if requantized is None
        else f"The output is {requantized.describe()}; its other tensors are {written}."
    )
    lines = [f"- `{input_name(source.path)}`: {source.describe()}" for source in quantized]
    text = "\n".join(
        [
            "These inputs are quantized; their weights were dequantized to float32 before the merge, so the "
            f"merge is of weights, not of codes and scales. {output}",
            "",
            *lines,
        ]
    )
    return [("Dequantized inputs", text)]


@dataclass(frozen=True)
class Requantization:
    """`--out-quant fp8-block`: the tensors an FP8 block-scaled input stores quantized, written back in its scheme
    (codes in its float8 dtype, `_scale_inv` per block) from the merged tensor; everything else as merged."""

    names: frozenset[str]
    block: tuple[int, int]
    dtype: torch.dtype
    settings: dict  # the input's quantization_config, written into the output's config.json

    def describe(self) -> str:
        return f"FP8 ({len(self.names)} tensors re-quantized in {self.block[0]}x{self.block[1]} blocks)"

    def sink(self, write: Callable[..., None]) -> Callable[..., None]:
        """`write` for the merged tensors, each re-quantized one written as its codes, then its scales."""

        def requantizing(name, tensor, first_row=None):
            if name not in self.names:
                return write(name, tensor) if first_row is None else write(name, tensor, first_row)
            if first_row is not None:
                raise RuntimeError(f"{name}: a re-quantized tensor is merged whole, not in row slabs")
            codes, scales = fp8_blocks(tensor, self.block, self.dtype)
            write(name, codes)
            write(name + "_scale_inv", scales)

        return requantizing


def requantization(plan: MergePlan) -> Requantization:
    """What `--out-quant fp8-block` writes quantized: the tensors the first FP8 block-scaled input stores so
    (under the same names in the merge), in its block size and float8 dtype. They are merged whole (an input
    read dequantized is never read in row slabs), so each is quantized once, whole; a step the engine would cut
    into slabs (of other inputs only, in a slice) is written as merged."""
    fp8 = [
        source
        for source in quantized_inputs(plan.sources)
        if source.quantization.method == "fp8" and source.quantization.block is not None
    ]
    if not fp8:
        raise InputError(
            "--out-quant fp8-block re-quantizes to an FP8 block-scaled input's scheme, and no input is one"
        )
    source = fp8[0]
    merged = {
        step.name for step in plan.steps if step.out_dtype.is_floating_point and slabs.slab_rows(plan, step) is None
    }
    names = frozenset(name for name in source.packed if name in merged)
    dtypes = {source.source.dtype(source.packed[name].codes) for name in names}
    settings = dict((source.config or {}).get("quantization_config") or {})
    settings = settings or {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3"}
    settings["weight_block_size"] = list(source.quantization.block)
    return Requantization(names, source.quantization.block, dtypes.pop() if len(dtypes) == 1 else FLOAT8[0], settings)


def output_tensors(plan: MergePlan, requantized: Requantization | None) -> list[PlannedTensor]:
    """The output's tensors in plan order: each step's, a re-quantized one as its codes and its block scales."""
    planned = []
    for step in plan.steps:
        if requantized is None or step.name not in requantized.names:
            planned.append(PlannedTensor(step.name, step.shape, step.out_dtype))
            continue
        rows, cols = step.shape[-2:]
        grid = (*step.shape[:-2], -(-rows // requantized.block[0]), -(-cols // requantized.block[1]))
        planned.append(PlannedTensor(step.name, step.shape, requantized.dtype))
        planned.append(PlannedTensor(step.name + "_scale_inv", grid, torch.float32))
    return planned


def _restack_layers(model_config: dict, plan: MergePlan) -> None:
    """The output's layer count, and per-layer lists (Qwen2/Gemma's layer_types) taken from each layer's source."""
    model_config["num_hidden_layers"] = plan.n_layers
    if isinstance(model_config.get("layer_types"), list):
        model_config["layer_types"] = [
            (plan.sources[index].config or model_config)["layer_types"][layer] for index, layer in plan.layer_origins
        ]


def _write_side_files(
    plan: MergePlan, folder: Path, copy_tokenizer: bool = True, requantized: Requantization | None = None
) -> None:
    """config, tokenizer and generation files from --copy-files-from, by default from the base (or the
    first input), plus the chat template and generation config of a post-trained input when the base has
    none (a note says so). The weights written are dense, so a donor's quantization_config is dropped and its
    dtype set to the one written."""
    config = plan.config
    donor = config.copy_files_from or config.base or config.inputs[0]
    if donor == "base":
        donor = config.base or config.inputs[0]
    if LoraAdapter.is_adapter_dir(donor):
        donor = config.base
    donor = lora_host(donor)
    copy_side_files(Path(donor), folder, copy_tokenizer)
    if not config.copy_files_from and copy_tokenizer:
        others = [Path(lora_host(path)) for path in config.inputs if lora_host(path) != donor]
        plan.notes.extend(keep_post_trained_files(Path(donor), others, folder))
    config_file = folder / "config.json"
    own_head = any(isinstance(source, UntiedHeadSource) for source in plan.sources)
    model_config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    quantized = "quantization_config" in model_config or requantized is not None
    if config_file.is_file() and (config.dtype or own_head or plan.layer_origins is not None or quantized):
        written = config.dtype or (written_dtype(plan) if quantized else None)
        if written:
            key = "torch_dtype" if "torch_dtype" in model_config and "dtype" not in model_config else "dtype"
            model_config[key] = written
        model_config.pop("quantization_config", None)  # the weights written are dense (io/quantized.py)
        if requantized is not None:
            model_config["quantization_config"] = requantized.settings
        if own_head:
            model_config["tie_word_embeddings"] = False  # an adapter's own head (modules_to_save) on a tied base
        if plan.layer_origins is not None:
            _restack_layers(model_config, plan)
        config_file.write_text(json.dumps(model_config, indent=2) + "\n")
    write_tokenizer(folder, plan.vocabulary, config.chat_template, plan.sources)
    (folder / PROVENANCE_FILE).write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
    if plan.recall_weights is not None:
        (folder / RECALL_WEIGHTS_FILE).write_text(json.dumps(plan.recall_weights.to_json(), indent=2) + "\n")
