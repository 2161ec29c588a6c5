"""The streaming engine's reused buffers and threads: bounded, aligned, never hanging, same bytes as plain tensors.

The `--device cuda` path is this same code (rings, reader thread, non-blocking copies into the output block);
only pinning and the per-step device wait differ, so running it on CPU tensors covers it here.
"""

import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from open_files import closes_what_it_opens, files_open_under
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tiny_models import save_tiny_llama

from mergekit_lite.errors import InputError
from mergekit_lite.io.buffers import ALIGNMENT, BufferRing, RingClosed
from mergekit_lite.io.safetensors import open_model, read_at
from mergekit_lite.io.sources import open_inputs
from mergekit_lite.io.validation import open_regular
from mergekit_lite.merge.engine import execute, math_threads, merge_state_dict, merge_tensor, run_merge
from mergekit_lite.merge.methods import tensor_math as methods
from mergekit_lite.merge.methods.task_vectors import KeepsAhead, dare_key
from mergekit_lite.merge.plan import plan_merge
from mergekit_lite.merge.schema import config_from_dict
from mergekit_lite.threads import torch_threads


@pytest.fixture(scope="module")
def trio(tmp_path_factory):
    root = tmp_path_factory.mktemp("trio")
    return [save_tiny_llama(seed, root / f"m{seed}", max_shard_size="30KB") for seed in range(3)]


def test_ring_blocks_are_aligned_reused_and_wrap():
    ring = BufferRing(3 * ALIGNMENT)
    first = ring.take(10)
    second = ring.take(ALIGNMENT + 1)
    assert first.data_ptr() % ALIGNMENT == 0 and second.data_ptr() - first.data_ptr() == ALIGNMENT
    ring.release(first)
    wrapped = ring.take(ALIGNMENT)  # no room after `second` (ends at 3 pages): goes to the freed start
    assert wrapped.data_ptr() == first.data_ptr()
    with pytest.raises(RuntimeError, match="oldest first"):
        ring.release(wrapped)
    ring.release(second)
    ring.release(wrapped)
    assert ring.take(3 * ALIGNMENT).data_ptr() == first.data_ptr()
    with pytest.raises(ValueError, match="exceeds"):
        ring.take(3 * ALIGNMENT + 1)


def test_a_full_ring_waits_for_a_release_and_close_wakes_waiters():
    ring = BufferRing(ALIGNMENT)
    held = ring.take(ALIGNMENT)
    got = []
    waiter = threading.Thread(target=lambda: got.append(ring.take(ALIGNMENT)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not got
    ring.release(held)
    waiter.join(5)
    assert got and got[0].data_ptr() == held.data_ptr()

    errors = []

    def blocked():
        try:
            ring.take(ALIGNMENT)
        except RingClosed as error:
            errors.append(error)

    waiter = threading.Thread(target=blocked)
    waiter.start()
    waiter.join(0.2)
    ring.close()
    waiter.join(5)
    assert not waiter.is_alive() and errors


@pytest.fixture(scope="module")
def trio_bf16(trio, tmp_path_factory):
    """The same models stored in bf16, in one file each."""
    root = tmp_path_factory.mktemp("trio_bf16")
    folders = []
    for folder in trio:
        target = root / folder.name
        target.mkdir()
        shutil.copy(folder / "config.json", target)
        tensors = {}
        for file in folder.glob("*.safetensors"):
            tensors.update(load_file(file))
        save_file({name: tensor.to(torch.bfloat16) for name, tensor in tensors.items()}, target / "model.safetensors")
        folders.append(target)
    return folders


@pytest.mark.parametrize(
    "method, parameters, stored, out_dtype",
    [
        ("linear", {"weight": 0.3}, "float32", "bfloat16"),
        ("slerp", {"t": 0.3}, "float32", "bfloat16"),
        ("task_arithmetic", {"lambda": 0.7}, "float32", "float32"),
        ("ties", {"density": 0.4}, "float32", "bfloat16"),
        ("dare_ties", {"drop": 0.3}, "float32", "float16"),
        ("ties", {"density": 0.4}, "bfloat16", "bfloat16"),
        ("linear", {"weight": 0.3}, "bfloat16", "float32"),
    ],
)
def test_streamed_outputs_equal_the_math_on_whole_tensors(trio, trio_bf16, method, parameters, stored, out_dtype):
    """Reader thread, reused ring, results cast chunk by chunk over their first input's bytes (narrower or
    equal output dtype) or into new memory (wider): the same bytes as merge_tensor on tensors read by the
    safetensors library into fresh memory, for every tensor."""
    models = trio_bf16 if stored == "bfloat16" else trio
    inputs = models[:2] if method in ("linear", "slerp") else models
    based = method != "linear"
    config = config_from_dict(
        {
            "method": method,
            "base": str(inputs[0]) if based else None,
            "models": [str(path) for path in (inputs[1:] if based else inputs)],
            "parameters": parameters,
            "dtype": out_dtype,
        }
    )
    plan = plan_merge(config)
    streamed = {}
    execute(plan, lambda name, tensor: streamed.__setitem__(name, tensor.clone()))

    assert [step.name for step in plan.steps] == list(streamed)
    merged_steps = 0
    for step in plan.steps:
        tensors = [_whole_tensor(folder, step.name) for folder in inputs]
        if step.action == "copy" or all(torch.equal(t, tensors[0]) for t in tensors[1:]):
            expected = tensors[0].to(step.out_dtype)
        else:
            expected = merge_tensor(config, step, tensors)
            merged_steps += 1
        assert streamed[step.name].dtype == getattr(torch, out_dtype)

        def as_bytes(tensor):
            return tensor.reshape(-1).view(torch.uint8)

        assert as_bytes(streamed[step.name]).equal(as_bytes(expected)), step.name
    assert merged_steps > 5


def _whole_tensor(folder, name):
    """A tensor as the safetensors library reads it, into fresh memory."""
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            if name in handle.keys():
                return handle.get_tensor(name)


def test_a_read_failure_in_the_reader_thread_surfaces_and_nothing_hangs(trio, tmp_path):
    """A shard truncated after planning: the reader's InputError reaches the caller, and the rings are closed so
    the reader and writer threads finish (the call returns)."""
    copy = tmp_path / "copy"
    shutil.copytree(trio[1], copy)
    config = config_from_dict({"method": "linear", "models": [str(trio[0]), str(copy)]})
    plan = plan_merge(config)
    last_shard = sorted(copy.glob("*.safetensors"))[-1]
    last_shard.write_bytes(last_shard.read_bytes()[:-64])
    with pytest.raises(InputError, match="truncated"):
        execute(plan, lambda name, tensor: None)


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
@pytest.mark.parametrize("method", ["linear", "ties"])
def test_a_merge_closes_the_inputs_it_opened_and_leaves_a_callers_open(trio, tmp_path, method):
    """run_merge and merge_state_dict close every shard they opened when they return, even while their result (which
    holds the plan) lives on; sources a caller opened and passed in stay open for its next merge."""
    config = config_from_dict(
        {
            "method": method,
            "base": str(trio[0]),
            "models": [str(trio[1]), str(trio[2])],
            "parameters": {"density": 0.5} if method == "ties" else {},
        }
    )
    result = run_merge(config, tmp_path / "out")
    assert result.plan.sources and files_open_under(*trio) == []
    state = merge_state_dict(config)
    assert files_open_under(*trio) == []
    sources = open_inputs(config.inputs, config.base, allow_pickle=False)
    assert merge_state_dict(config, sources).keys() == state.keys()
    assert len(files_open_under(*trio)) >= 3  # the caller's, still open
    name = sources[1].names[0]
    before = sources[1].load(name).clone()
    for source in sources:
        source.close()
    assert files_open_under(*trio) == []
    assert torch.equal(sources[1].load(name), before)  # a closed source opens its shard again when read
    sources[1].close()


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
def test_a_merge_stopped_by_a_bad_tensor_closes_every_shard_it_read(trio, tmp_path):
    """A NaN in the last shard of one input stops a TIES merge after the earlier shards were read: the error reaches
    the caller with every input file closed and no output left behind."""
    poisoned = Path(shutil.copytree(trio[1], tmp_path / "poisoned"))
    last = sorted(poisoned.glob("*.safetensors"))[-1]
    tensors = load_file(last)
    name = next(name for name, tensor in tensors.items() if tensor.dim() == 2)
    tensors[name][0, 0] = float("nan")
    save_file(tensors, last, metadata={"format": "pt"})
    config = config_from_dict(
        {
            "method": "ties",
            "base": str(trio[0]),
            "models": [str(poisoned), str(trio[2])],
            "parameters": {"density": 0.5},
        }
    )
    with closes_what_it_opens(trio[0], poisoned, trio[2]), pytest.raises(InputError, match="NaN"):
        run_merge(config, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_slow_write_does_not_hold_the_reading_and_the_math(trio, monkeypatch):
    """While the sink is stuck on one step (a slow disk), the engine goes on reading and merging the next ones, as
    far as the ring allows: the disk's time and the math's overlap instead of taking turns."""
    from mergekit_lite.merge import engine

    plan = plan_merge(config_from_dict({"method": "linear", "models": [str(path) for path in trio[:2]]}))
    sizes = [engine.input_bytes(plan, step) for step in plan.steps]
    stuck = next(i for i in range(1, len(sizes) - 3) if sum(sizes[i : i + 4]) <= max(sizes))  # four fit in the ring
    later_read = threading.Event()
    real_read_step = engine._read_step

    def read_step(plan, part, *rest):
        if part.step is plan.steps[stuck + 3]:
            later_read.set()
        return real_read_step(plan, part, *rest)

    def sink(name, tensor):
        if name == plan.steps[stuck].name:
            assert later_read.wait(30), "reading stopped while a write was stuck"

    monkeypatch.setattr(engine, "_read_step", read_step)
    execute(plan, sink)
    assert later_read.is_set()


def test_positioned_reads_share_one_handle_across_threads(tmp_path):
    """The reader thread and an error path may read one shard at once: reads carry their own offsets (no shared
    seek position), and a read past the end returns what is there."""
    data = torch.arange(1 << 20, dtype=torch.int32).numpy().tobytes()
    (tmp_path / "blob").write_bytes(data)
    handle = open_regular(tmp_path / "blob")
    size = 1 << 14

    def read_every_block(start):
        view = memoryview(bytearray(size))
        return all(
            read_at(handle, view, offset) == size and view == data[offset : offset + size]
            for offset in range(start, len(data), 2 * size)
        )

    with ThreadPoolExecutor(max_workers=2) as pool:
        assert all(pool.map(read_every_block, [0, size]))
    tail = memoryview(bytearray(100))
    assert read_at(handle, tail, len(data) - 40) == 40 and tail[:40] == data[-40:]


def test_math_leaves_a_core_for_reading_and_restores_the_thread_count(trio):
    before = torch.get_num_threads()
    assert 1 <= math_threads() <= max(before, 1)
    plan = plan_merge(config_from_dict({"method": "linear", "models": [str(path) for path in trio[:2]]}))
    execute(plan, lambda name, tensor: None)
    assert torch.get_num_threads() == before


@pytest.mark.slow
def test_reused_memory_keeps_one_arena_per_core():
    """The engine's threads share one glibc arena per usable core (each arena keeps its own freed temporaries),
    even when threads allocated before the call, as torch's and the progress bar's have in a merge. Counted from
    glibc's own malloc_info in a fresh interpreter, with eight allocating threads, with and without the call."""
    import os
    import subprocess
    import sys

    script = """
import ctypes, os, sys, tempfile, threading, torch
from mergekit_lite.io.buffers import reuse_freed_memory
torch.ones(1 << 22).sum()
if sys.argv[1] == "reuse":
    assert reuse_freed_memory()
def work():
    for _ in range(20):
        torch.empty(1 << 18).fill_(1.0)
threads = [threading.Thread(target=work) for _ in range(8)]
[thread.start() for thread in threads]
[thread.join() for thread in threads]
libc = ctypes.CDLL(None)
libc.fopen.restype = ctypes.c_void_p
handle, path = tempfile.mkstemp()
os.close(handle)
stream = ctypes.c_void_p(libc.fopen(path.encode(), b"w"))
libc.malloc_info(0, stream)
libc.fclose(stream)
print(open(path).read().count("<heap nr="))
os.unlink(path)
"""
    heaps = {
        mode: int(
            subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, check=True).stdout
        )
        for mode in ("default", "reuse")
    }
    cores = len(os.sched_getaffinity(0))
    assert heaps["reuse"] <= cores < heaps["default"], heaps


@pytest.mark.slow
def test_reused_memory_spares_a_page_fault_per_chunk_temporary():
    """A chunk's temporaries (several float32 chunks of 4 MB alive at once, freed together) come from memory glibc
    keeps, instead of pages handed back at every free and faulted in again (system time). Counted in a fresh
    interpreter, with and without `reuse_freed_memory`."""
    import os
    import subprocess
    import sys

    script = """
import resource, sys, torch
from mergekit_lite.io.buffers import reuse_freed_memory
if sys.argv[1] == "reuse":
    assert reuse_freed_memory()
torch.set_num_threads(1)
source = torch.ones(1 << 20, dtype=torch.bfloat16)
def chunk():
    temporaries = [source.to(torch.float32).mul_(i) for i in range(6)]
    return sum(float(t[0]) for t in temporaries)
for _ in range(3):
    chunk()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(100):
    chunk()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
    # glibc moves its mmap threshold at run time, so whether the default faults varies from run to run; pinning
    # it at its starting value (128 KiB) gives the default's slow path every time, as the control
    environment = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    faults = {
        mode: int(
            subprocess.run(
                [sys.executable, "-c", script, mode], capture_output=True, text=True, env=environment, check=True
            ).stdout
        )
        for mode in ("default", "reuse")
    }
    pages = 100 * 6 * (4 << 20) // 4096  # every temporary of every chunk faulted in again
    # with reuse, at most a round or two of a chunk's temporaries fault (seen: 0, once 7,168 pages, one round)
    assert faults["reuse"] < pages // 20, faults
    assert faults["default"] > pages // 2, faults


@pytest.mark.parametrize("second_drop", [0.6, 0.0])
def test_dare_chunks_give_the_masks_of_drawing_whole_tensors_at_any_chunk_size_and_thread_count(
    trio, monkeypatch, second_drop
):
    """The chunk loop draws each chunk's masks on other threads while the previous chunk's math runs: over many
    chunks of several sizes (a model with no drop drawing nothing), with one or two math threads, the bytes are
    those of one draw over the whole tensor."""
    config = config_from_dict(
        {
            "method": "dare_ties",
            "base": str(trio[0]),
            "parameters": {"drop": 0.3},
            "dtype": "float32",
            "models": [str(trio[1]), {"model": str(trio[2]), "parameters": {"drop": second_drop}}],
        }
    )
    plan = plan_merge(config)
    chunked = 0
    for step in plan.steps:
        if step.action == "copy":
            continue
        tensors = [_whole_tensor(folder, step.name) for folder in trio]
        parameters = step.parameters
        whole = methods.task_vector_merge(
            tensors[0],
            tensors[1:],
            parameters.weights,
            scale=parameters.scale,
            sparsifier="random",
            drops=parameters.drops,
            keys=[dare_key(config.seed, step.name, i) for i in (0, 1)],
            consensus=True,
            normalize=parameters.normalize,
            rescale=parameters.rescale,
        )
        for chunk, threads in ((100, 1), (37, 2), (4096, 2)):
            monkeypatch.setattr(methods, "ELEMENTWISE_CHUNK", chunk)
            with torch_threads(threads):
                merged = merge_tensor(config, step, tensors)
            assert torch.equal(merged.view(torch.int32), whole.view(torch.int32)), (step.name, chunk, threads)
        chunked += tensors[0].numel() > 3 * 100
    assert chunked > 5


@pytest.mark.parametrize("method", ["linear", "slerp", "task_arithmetic"])
def test_memory_bound_chunks_give_the_whole_tensors_bytes_at_any_size_and_thread_count(trio_bf16, monkeypatch, method):
    """The memory-bound methods' loop (`methods.DENSE_CHUNK`; LERP written straight into the output): chunks of
    several sizes, one or two math threads, give the bytes of one chunk over the whole tensor, in bf16 and fp32."""
    base, first, second = (str(folder) for folder in trio_bf16)
    models = {
        "linear": [{"model": base, "parameters": {"weight": 1}}, {"model": first, "parameters": {"weight": 3}}],
        "slerp": [first],
        "task_arithmetic": [first, second],
    }[method]
    for dtype in ("bfloat16", "float32"):
        parameters = {"linear": {}, "slerp": {"t": 0.3}, "task_arithmetic": {"lambda": 0.7}}[method]
        config = config_from_dict(
            {
                "method": method,
                "dtype": dtype,
                "parameters": parameters,
                **({} if method == "linear" else {"base": base}),
                "models": models,
            }
        )
        plan = plan_merge(config)
        for step in plan.steps:
            tensors = [source.load(name) for source, name in plan.inputs_of(step)]
            monkeypatch.setattr(methods, "DENSE_CHUNK", 1 << 30)
            whole = merge_tensor(config, step, tensors)
            for chunk, threads in ((100, 1), (37, 2), (4096, 2)):
                monkeypatch.setattr(methods, "DENSE_CHUNK", chunk)
                with torch_threads(threads):
                    merged = merge_tensor(config, step, tensors)
                assert merged.dtype == whole.dtype and torch.equal(
                    merged.view(-1).view(torch.uint8), whole.view(-1).view(torch.uint8)
                ), (method, step.name)


def test_keeps_ahead_give_each_chunks_mask_and_draw_at_most_the_window(monkeypatch):
    """More models than pool workers, a short last chunk, one model without a drop: every chunk equals drawing it
    alone, and a consumer that stops taking leaves exactly `depth` chunks drawn ahead, no more."""
    keys, drops, total, chunk, depth = [1, 2, 3, 4, 5], [0.5, 0.1, 0.0, 0.9, 0.3], 1050, 100, 3
    drawn = []
    draw = methods.keep_indicator

    def counted(key, begin, size, drop):
        drawn.append(begin)
        return draw(key, begin, size, drop)

    monkeypatch.setattr(methods, "keep_indicator", counted)
    keeps = KeepsAhead(keys, drops, total, chunk, depth=depth)
    for begin in range(0, total, chunk):
        expected = [draw(key, begin, min(chunk, total - begin), drop) for key, drop in zip(keys, drops, strict=True)]
        for got, want in zip(keeps.take(), expected, strict=True):
            assert (got is None and want is None) or torch.equal(got, want)
        if begin == 5 * chunk:  # stop taking for a while: only the window's chunks are drawn
            time.sleep(0.2)
            assert sorted(set(drawn)) == list(range(0, (6 + depth) * chunk, chunk))
            assert len(drawn) == (6 + depth) * len(keys)


def test_keeps_ahead_hand_a_failed_draw_to_the_taker():
    keeps = KeepsAhead([1, -1], [0.5, 0.5], 300, 100)  # a Philox key must be in [0, 2^128)
    with pytest.raises(ValueError):
        keeps.take()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "method, parameters",
    [
        ("linear", {}),
        ("task_arithmetic", {}),
        ("ties", {"density": 0.4}),
        ("dare_ties", {"drop": 0.3}),
        ("della", {"density": 0.5}),
    ],
)
def test_cuda_merges_what_the_cpu_merges(trio, method, parameters):
    """The same plan on the GPU (pinned ring, uploads, copy-back): DARE's and DELLA's masks are drawn on the CPU, so
    the same entries stay at the base; the values agree within one float32 rounding of the fused GPU kernels."""
    config = {
        "method": method,
        "base": None if method == "linear" else str(trio[0]),
        "dtype": "float32",
        "models": [str(folder) for folder in (trio if method == "linear" else trio[1:])],
        "parameters": parameters,
    }
    merged = {device: merge_state_dict(config_from_dict({**config, "device": device})) for device in ("cpu", "cuda")}
    base = {name: _whole_tensor(trio[0], name) for name in merged["cpu"]}
    assert merged["cpu"].keys() == merged["cuda"].keys()
    for name, cpu in merged["cpu"].items():
        cuda = merged["cuda"][name]
        assert cuda.device.type == "cpu" and cuda.dtype == cpu.dtype, name
        torch.testing.assert_close(cuda, cpu, rtol=2e-7, atol=1e-7, msg=name)
        if method != "linear":

            def kept_base(tensor, name=name):
                return tensor == base[name].to(torch.float32)

            assert torch.equal(kept_base(cuda), kept_base(cpu)), name


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
def test_threads_opening_a_shard_at_once_share_one_handle(tmp_path):
    """The engine's reader and statistician open a source's shards at the same moment: every thread reads through
    the one handle a shard gets, none of which closes under a reader (a handle that lost that race would, and a
    4 GB SLERP would stop with 'Bad file descriptor')."""
    save_file({"rows": torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64)}, tmp_path / "model.safetensors")
    for _ in range(30):
        source = open_model(tmp_path)
        start = threading.Barrier(8)

        def look(first_row: int) -> float:
            start.wait()
            return source.map_rows("rows", first_row, first_row + 8).sum().item()

        with ThreadPoolExecutor(8) as pool:
            sums = list(pool.map(look, range(0, 64, 8)))
        assert sums == [torch.arange(row * 64, (row + 8) * 64).sum().item() for row in range(0, 64, 8)]
        assert len(files_open_under(tmp_path)) == 1
        source.close()
