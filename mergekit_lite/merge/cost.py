"""What a planned merge will cost on this machine: wall time and peak RSS from the plan's sizes and rates measured
once (`calibrate`) and cached per machine in the user's cache folder (`--dry-run`, `--calibrate`).

The model follows the engine's structure: a merge run as a process is start-up, then reading every input once
(reads are memory copies from the page cache, on the cores the math needs; the steps in slabs whose statistics
need a pass of their own, TIES's and SLERP's, map their inputs for that pass, which copies nothing, so it costs
the statistics' share of the math) and the math, which add up, side by side with the writing (shards go to the
device past the page cache, `io/direct.py`, while the next steps are read and merged), so whichever of the two is
longer; `benchmarks/predict_vs_measured.py` checks the predictions against
measured runs. Peak memory is start-up, the engine's ring (the largest step's inputs or three row slabs, exact
from the plan, and one more slab for TIES's and SLERP's statistics, mapped on a thread of their own), the
writer's two direct-write stages, and the method's working memory: a few chunks' temporaries, or for the
methods that hold whole tensors (`Method.holds_whole_tensors`) bytes per element of the step; for TIES and SLERP
also their statistics' own, which the reader's and the statistician's threads compute while the math thread
merges; and for quantized inputs the float32 copies they are read into (io/quantized.py). The time of that
dequantization is not modelled.
"""

from __future__ import annotations

import ctypes
import errno
import json
import math
import os
import platform
import stat
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated

import torch
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from safetensors.torch import save_file

import mergekit_lite
from mergekit_lite.io.direct import STAGE_BYTES
from mergekit_lite.io.outputs import write_atomic
from mergekit_lite.io.quantized import dequantized_on_read
from mergekit_lite.io.safetensors import SINGLE_FILE, PlannedTensor, ShardedWriter, read_at
from mergekit_lite.merge import engine, slabs
from mergekit_lite.merge.methods import NAMES, REGISTRY, tensor_math
from mergekit_lite.merge.plan import MergePlan, StepAction, plan_merge
from mergekit_lite.merge.schema import config_from_dict

RATES_FORMAT = 7  # bump when what calibrate measures changes: older entries are measured again
# Elements of the calibration tensors: two sizes split fixed from per-element costs (both at least a reduction
# chunk, tensor_math.CHUNK, whose float64 stacks are a fixed cost). Small, so that a dry run answers in seconds: the
# per-tensor start-up (threads, DARE's first draws) then shows in the per-entry rates, and walls are predicted
# long rather than short (benchmarks/RESULTS.md, the dry run's predictions, were made at 1 and 8 M entries)
CALIBRATION_SIZES = (1 << 20, 1 << 21)
IO_BYTES = 32 << 20  # enough that a shard's final sync is not most of the write
REPEATS = 2  # the best of two timings: one is at times far off on a busy machine
TENSOR = "model.layers.0.mlp.up_proj.weight"
WRITER_BYTES = 2 * STAGE_BYTES  # the writer's two direct-write stages (none where a filesystem refuses O_DIRECT)


@dataclass
class Rates:
    startup_s: float
    startup_rss: int
    read_bytes_per_s: float
    write_bytes_per_s: float
    math_ns_per_element: dict[str, float]
    math_s_per_step: dict[str, float]
    memory_bytes_per_element: dict[str, float]
    memory_peak_bytes: dict[str, float]  # working memory at the larger calibration size
    statistics_peak_bytes: dict[str, float]  # the whole-tensor statistics' working memory there (TIES, SLERP)
    measured_at: str
    load: float  # the 1-minute load average then: other jobs' threads slow the multi-threaded methods' rates


# What a cache entry may hold: the values a measurement gives (finite, positive where a rate divides, below bounds
# no machine reaches), so a hand-edited or foreign file cannot divide by zero or print a negative wall time.
Rate = Annotated[float, Field(gt=0, lt=1e13, allow_inf_nan=False)]  # bytes/s, ns per element, seconds
Amount = Annotated[float, Field(ge=0, lt=1e15, allow_inf_nan=False)]  # bytes, seconds per step, load


class _CachedRates(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    startup_s: Rate
    startup_rss: Annotated[int, Field(gt=0, lt=10**15)]
    read_bytes_per_s: Rate
    write_bytes_per_s: Rate
    math_ns_per_element: dict[str, Rate]
    math_s_per_step: dict[str, Amount]
    memory_bytes_per_element: dict[str, Amount]
    memory_peak_bytes: dict[str, Amount]
    statistics_peak_bytes: dict[str, Amount]
    measured_at: Annotated[str, Field(max_length=40)]
    load: Amount


_CACHE_SCHEMA = TypeAdapter(dict[str, _CachedRates])
CACHE_BYTES = 1 << 20  # a machine's entry is about 3 KB


@dataclass
class Estimate:
    method: str
    wall_s: float
    startup_s: float
    read_s: float
    math_s: float
    write_s: float
    peak_rss: int
    ring_bytes: int
    writer_bytes: int
    device: str = "cpu"

    def describe(self, source: str) -> str:
        note = (
            "  (excludes RECALL's forward passes over the texts)" if REGISTRY[self.method].reads_recall_weights else ""
        )
        if self.device != "cpu":
            note += f"  (math at this CPU's rates, not {self.device}'s)"
        return (
            f"estimate on this machine: wall {self.wall_s:.1f} s (start-up {self.startup_s:.1f} + the longer of "
            f"read {self.read_s:.1f} + math {self.math_s:.1f} and write {self.write_s:.1f}), peak RSS "
            f"{self.peak_rss / 1e6:.0f} MB (ring {self.ring_bytes / 1e6:.0f} MB, writer "
            f"{self.writer_bytes / 1e6:.0f} MB){note}\n"
            f"  rates: {source} (--calibrate measures them again, best on an idle machine)"
        )


def cache_file() -> Path:
    """rates.json in $MERGEKIT_LITE_CACHE, else ~/.cache/mergekit-lite (or under $XDG_CACHE_HOME)."""
    folder = os.environ.get("MERGEKIT_LITE_CACHE")
    if not folder:
        folder = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mergekit-lite"
    return Path(folder) / "rates.json"


def machine_key() -> str:
    """Rates hold for one machine, its usable cores and torch threads, one torch and one mergekit-lite, with or
    without its compiled kernels (SLERP's math is several times faster with them)."""
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [
            line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")
        ]
        cpu = names[0] if names else cpu
    return (
        f"{platform.node()}|{cpu}|{len(os.sched_getaffinity(0))} cores|{torch.get_num_threads()} threads|"
        f"torch {torch.__version__}|mergekit-lite {mergekit_lite.__version__}|rates {RATES_FORMAT}|"
        f"kernels {'compiled' if tensor_math._kernels is not None else 'torch'}"
    )


def load_rates(
    refresh: bool = False, say: Callable[[str], None] = lambda line: None, methods: Iterable[str] = ()
) -> tuple[Rates, str]:
    """This machine's rates for `methods` (default: all) from the cache, measured (and cached) when missing,
    unusable or when `refresh`; `say` gets a line before a measurement, and one saying why a cache that is there
    cannot be used. A dry run asks for its plan's method only, so it measures that one (seconds, not minutes)."""
    path, key = cache_file(), machine_key()
    cached, problem = read_cache(path)
    if problem:
        say(f"note: rates cache {path}: {problem}; measuring this machine again")
    wanted = set(methods or NAMES)
    rates = None if refresh else cached.get(key)
    if rates is not None and wanted <= set(rates.math_ns_per_element):
        return rates, f"{path}, {_when(rates)}"
    missing = sorted(wanted - set(rates.math_ns_per_element) if rates else wanted)
    say(
        f"measuring this machine's rates for {', '.join(missing) if methods else 'every method'} (a few seconds, "
        "once; cached for the next dry runs)"
    )
    rates = calibrate(missing, rates)
    entries = {**{machine: asdict(value) for machine, value in cached.items()}, key: asdict(rates)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(entries, indent=1) + "\n")  # a rename: a link there is replaced, not followed
    except OSError as error:  # a cache that cannot be written costs a calibration per dry run, nothing else
        return rates, f"{_when(rates)}, not cached ({error.strerror or error}: {error.filename or path})"
    return rates, f"{path}, {_when(rates)}"


def read_cache(path: Path) -> tuple[dict[str, Rates], str | None]:
    """The cached rates by machine, and why the file there cannot be used (None when it can, or is absent).

    The cache is ours only as a regular file of this user, at most CACHE_BYTES, whose every entry the schema
    accepts; anything else (a link, a folder, a device, another user's file, a value no measurement gives:
    zero, negative, NaN, inf, huge, a string, null) is not read further and is measured again and replaced."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except (FileNotFoundError, NotADirectoryError):  # none yet (or no folder for one): measured, nothing to say
        return {}, None
    except OSError as error:  # a symbolic link (ELOOP), unreadable, ...
        return {}, "not a file of ours" if error.errno == errno.ELOOP else f"unreadable ({error.strerror})"
    try:
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode) or status.st_uid != os.getuid():
            return {}, "not a file of ours"
        data = b""
        while len(data) <= CACHE_BYTES and (chunk := os.read(descriptor, CACHE_BYTES + 1 - len(data))):
            data += chunk
    finally:
        os.close(descriptor)
    if len(data) > CACHE_BYTES:
        return {}, f"larger than {CACHE_BYTES // 1024} KiB"
    try:
        entries = _CACHE_SCHEMA.validate_json(data)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"][1:]) or "the file"
        return {}, f"{where}: {first['msg'].lower()}" if first["type"] != "json_invalid" else "not JSON"
    return {machine: Rates(**entry.model_dump()) for machine, entry in entries.items()}, None


def _when(rates: Rates) -> str:
    return f"measured {rates.measured_at} at load {rates.load:.1f} on {len(os.sched_getaffinity(0))} cores"


def estimate(plan: MergePlan, rates: Rates) -> Estimate:
    """Wall time and peak RSS of running `plan` as a process on the machine `rates` were measured on."""
    method = plan.config.merge_method.same_math_as or plan.config.method
    merged = [step for step in plan.steps if step.action is not StepAction.COPY]
    input_bytes = sum(engine.input_bytes(plan, step) for step in plan.steps)
    math_s = sum(
        rates.math_s_per_step[method] + math.prod(step.shape) * rates.math_ns_per_element[method] * 1e-9
        for step in merged
    )
    units = slabs.parts(plan)
    ring = slabs.ring_capacity(plan, units) + slabs.statistics_slab_bytes(plan, units)  # blocks read into, slab mapped
    working = max((_working_memory(rates, method, step) for step in merged), default=0)
    working += sum(sorted((_dequantized_bytes(plan, step) for step in plan.steps), reverse=True)[:2])
    read_s, write_s = input_bytes / rates.read_bytes_per_s, plan.total_bytes / rates.write_bytes_per_s
    return Estimate(
        plan.config.method,
        rates.startup_s + max(read_s + math_s, write_s),
        rates.startup_s,
        read_s,
        math_s,
        write_s,
        int(rates.startup_rss + ring + WRITER_BYTES + working),
        ring,
        WRITER_BYTES,
        plan.config.device,
    )


def _dequantized_bytes(plan: MergePlan, step) -> int:
    """What a step's quantized inputs cost beyond the ring (io/quantized.py): their float32 dequantized copies,
    and the result's own memory, which then cannot overlay its first input's bytes in the ring. Two steps hold
    them at once: the one being merged and the one the reader has ready."""
    copies = sum(
        4 * math.prod(step.shape) for source, name in plan.inputs_of(step) if dequantized_on_read(source, name)
    )
    return copies + step.nbytes if copies else 0


def _working_memory(rates: Rates, method: str, step) -> float:
    """A step's memory beyond its inputs: the calibrated peak, and for the methods that hold whole tensors the
    bytes per element measured between the two calibration sizes, for this step's size."""
    peak = rates.memory_peak_bytes[method] + rates.statistics_peak_bytes.get(method, 0.0)
    if not REGISTRY[method].holds_whole_tensors(step.parameters):
        return peak
    per_element = rates.memory_bytes_per_element[method]
    return max(peak - per_element * CALIBRATION_SIZES[1], 0.0) + per_element * math.prod(step.shape)


def calibrate(methods: Iterable[str] = NAMES, known: Rates | None = None) -> Rates:
    """Measure this machine in a few seconds: start-up (a fresh interpreter importing the merge path), reading from
    the page cache and writing a synced shard (32 MB, the engine's own reader and writer), and `methods`' math
    and working memory (the engine's merge_tensor on bf16 tensors of two sizes); other methods' rates come from
    `known` (an earlier measurement of this machine), whose start-up and I/O rates are measured again."""
    measured = {REGISTRY[method].same_math_as or method for method in methods}
    tables = (
        (
            known.math_ns_per_element,
            known.math_s_per_step,
            known.memory_bytes_per_element,
            known.memory_peak_bytes,
            known.statistics_peak_bytes,
        )
        if known
        else ({}, {}, {}, {}, {})
    )
    per_element, per_step, memory_per_element, memory_peak, statistics_peak = (
        {name: value for name, value in table.items() if name not in measured} for table in tables
    )
    with tempfile.TemporaryDirectory(prefix="mergekit-lite-calibrate-") as scratch:
        folder = Path(scratch)
        startup_s, startup_rss = _startup()
        read_rate, write_rate = _io_rates(folder)
        for method in sorted(measured):
            timings, peaks = [], []
            for size in CALIBRATION_SIZES:
                seconds, peak, statistics_bytes = _merge_rates(method, size, folder / f"{method}-{size}")
                timings.append(seconds)
                peaks.append(peak)
            if REGISTRY[method].slab_statistics:
                statistics_peak[method] = statistics_bytes
            (small, large), (low, high) = timings, peaks
            # the larger merge's time per element (a difference of two noisy timings is noisier), the rest per step
            per_element[method] = large / CALIBRATION_SIZES[1] * 1e9
            per_step[method] = max(small - per_element[method] * CALIBRATION_SIZES[0] * 1e-9, 0.0)
            memory_per_element[method] = max(high - low, 0) / (CALIBRATION_SIZES[1] - CALIBRATION_SIZES[0])
            memory_peak[method] = high
        for alias, declared in REGISTRY.items():
            for table in (per_element, per_step, memory_per_element, memory_peak):
                if declared.same_math_as in table:  # RECALL's math is linear's; its forward passes are not timed
                    table[alias] = table[declared.same_math_as]
    return Rates(
        startup_s,
        startup_rss,
        read_rate,
        write_rate,
        per_element,
        per_step,
        memory_per_element,
        memory_peak,
        statistics_peak,
        time.strftime("%Y-%m-%d %H:%M:%S"),
        os.getloadavg()[0],
    )


def _startup() -> tuple[float, int]:
    """Wall time and RSS of a fresh interpreter that imports what a merge imports."""
    script = (
        "import resource, mergekit_lite.merge.engine, mergekit_lite.cli.main; "
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"
    )
    root = Path(mergekit_lite.__file__).resolve().parent.parent
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=environment, check=True)
    return time.perf_counter() - started, int(result.stdout.split()[-1])


def _timed(action) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def _io_rates(folder: Path) -> tuple[float, float]:
    """Bytes per second written through the merge's ShardedWriter (synced, past the page cache where it can; the
    median of three writes, which on these VMs vary from one to the next) and read back with the
    engine's positioned reads (the page cache, as a merge of files just written reads them; the fastest of three
    reads: one read once took five times the others on a busy machine)."""
    data = torch.randint(0, 256, (IO_BYTES,), dtype=torch.uint8)
    planned = [PlannedTensor("calibration", (IO_BYTES,), torch.uint8)]

    def write(into: Path) -> None:
        into.mkdir()
        with ShardedWriter(into, planned, IO_BYTES * 2) as writer:
            writer.write("calibration", data)
            writer.close()

    write_rate = IO_BYTES / statistics.median(_timed(lambda i=i: write(folder / f"write-{i}")) for i in range(3))
    target = torch.empty(IO_BYTES, dtype=torch.uint8)
    with open(folder / "write-0" / SINGLE_FILE, "rb") as handle:
        read_at(handle, memoryview(target.numpy()), 0)  # once into the page cache, then timed
        read_rate = IO_BYTES / min(_timed(lambda: read_at(handle, memoryview(target.numpy()), 0)) for _ in range(3))
    return read_rate, write_rate


def _merge_rates(method: str, size: int, folder: Path) -> tuple[float, int, int]:
    """Seconds (best of REPEATS) and working memory (bytes above the resident set before it) of merging one
    bf16 tensor of `size` elements with `method`'s default parameters, and the working memory of its whole-tensor
    statistics alone (`engine.tensor_statistics`; 0 for the methods without)."""
    calibration = REGISTRY[method].calibration
    parameters, count, with_base = calibration.parameters, calibration.models, calibration.with_base
    folder.mkdir()
    generator = torch.Generator().manual_seed(0)
    shape = (size // 1024, 1024)
    base = torch.randn(shape, generator=generator) * 0.02
    paths = []
    for index in range(count + 1):
        tensor = base if index == 0 else base + torch.randn(shape, generator=generator) * 0.002
        paths.append(folder / f"m{index}.safetensors")
        save_file({TENSOR: tensor.to(torch.bfloat16)}, paths[-1])
    models = [str(path) for path in (paths[1:] if with_base else paths[:count])]
    config = config_from_dict(
        {"method": method, "base": str(paths[0]) if with_base else None, "models": models, "parameters": parameters}
    )
    with plan_merge(config) as plan:
        [step] = plan.steps
        tensors = [source.load(name) for source, name in plan.inputs_of(step)]
    out = torch.empty(step.shape, dtype=step.out_dtype)
    runs = [_measured(lambda: engine.merge_tensor(config, step, tensors, out)) for _ in range(REPEATS)]
    statistics_peak = (
        _measured(lambda: engine.tensor_statistics(config, step, tensors))[1] if REGISTRY[method].slab_statistics else 0
    )
    return min(seconds for seconds, _ in runs), runs[-1][1], statistics_peak


def _measured(action) -> tuple[float, int]:
    """Wall seconds of `action` and the bytes its peak resident set rose above the resident set before it."""
    _release_freed_memory()
    resident = _resident_bytes()
    _reset_peak()
    seconds = _timed(action)
    return seconds, max(_peak_bytes() - resident, 0)


def _release_freed_memory() -> None:
    """glibc hands freed heap back to the system, so the peak that follows is this merge's own."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


def _status(field: str) -> int:
    """A size from /proc/self/status in bytes; 0 where there is none (not Linux): no working memory is measured."""
    status = Path("/proc/self/status")
    for line in status.read_text().splitlines() if status.is_file() else []:
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _resident_bytes() -> int:
    return _status("VmRSS")


def _peak_bytes() -> int:
    return _status("VmHWM")


def _reset_peak() -> None:
    """Linux resets the process's peak RSS (VmHWM) to its current RSS on a 5 written to clear_refs."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
