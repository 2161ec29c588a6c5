"""Large tensors merged in row slabs (merge/slabs.py) give the bytes of whole-tensor merges, for every method that
merges elementwise, including DARE's masks, a tensor every input holds alike (copied through, not merged) and
one alike only in its first rows (merged, as whole: no slab of it is copied on its own); and the ring shrinks."""

from __future__ import annotations

import itertools
import os
import shutil
from pathlib import Path

import pytest
import torch
from open_files import mapped_files
from safetensors.torch import load_file, save_file

from mergekit_lite.audited import run_merge
from mergekit_lite.errors import InputError
from mergekit_lite.io.safetensors import PlannedTensor, ShardedWriter, open_model
from mergekit_lite.merge import slabs
from mergekit_lite.merge.engine import execute
from mergekit_lite.merge.methods import tensor_math as methods
from mergekit_lite.merge.plan import plan_merge
from mergekit_lite.merge.schema import config_from_dict

ROWS, WIDTH = 2600, 512  # 1.3 M entries: slabs of whole chunks (512 rows each) and a short last one
SMALL_SLABS = 4 << 20  # 2 to 6 slabs of each large tensor


def save_models(root, dtype) -> list[str]:
    """Three models: a tensor that differs, one alike in its first 1200 rows only, one alike everywhere, one of odd
    width (its slabs could not start at whole chunks: merged whole), and a vector."""
    generator = torch.Generator().manual_seed(7)
    shared = {name: torch.randn(ROWS, WIDTH, generator=generator) for name in ("frozen", "same")}
    folders = []
    for index in range(3):
        frozen = shared["frozen"].clone()
        frozen[1200:] = torch.randn(ROWS - 1200, WIDTH, generator=generator)
        tensors = {
            "model.layers.0.mlp.up_proj.weight": torch.randn(ROWS, WIDTH, generator=generator),
            "model.layers.1.mlp.up_proj.weight": frozen,
            "model.layers.1.mlp.down_proj.weight": shared["same"],
            "model.layers.0.self_attn.o_proj.weight": torch.randn(700, 999, generator=generator),
            "model.norm.weight": torch.randn(WIDTH, generator=generator),
        }
        folder = root / f"m{index}"
        folder.mkdir()
        save_file(
            {name: tensor.to(dtype).contiguous() for name, tensor in tensors.items()},
            folder / "model.safetensors",
            metadata={"format": "pt"},
        )
        folders.append(str(folder))
    return folders


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def models(request, tmp_path_factory):
    return save_models(tmp_path_factory.mktemp(f"slab-models-{str(request.param)[6:]}"), request.param)


CONFIGS = {
    "linear": lambda m: {"method": "linear", "base": m[0], "models": [m[1]], "parameters": {"alpha": 0.3}},
    "linear_weights": lambda m: {
        "method": "linear",
        "models": [{"model": m[0], "weight": 0.2}, {"model": m[1], "weight": 0.5}, {"model": m[2], "weight": 0.3}],
    },
    "ema": lambda m: {"method": "ema", "models": m, "parameters": {"decay": 0.6}},
    "task_arithmetic": lambda m: {
        "method": "task_arithmetic",
        "base": m[0],
        "models": m[1:],
        "parameters": {"lambda": 0.8},
    },
    "lines": lambda m: {"method": "lines", "base": m[0], "models": [m[1]], "parameters": {"alpha": 0.2, "beta": 0.6}},
    "nearswap": lambda m: {"method": "nearswap", "base": m[0], "models": [m[1]], "parameters": {"t": 0.01}},
    "dare_linear": lambda m: {
        "method": "dare_linear",
        "base": m[0],
        "models": m[1:],
        "seed": 3,
        "parameters": {"density": 0.4},
    },
    "dare_ties": lambda m: {
        "method": "dare_ties",
        "base": m[0],
        "models": m[1:],
        "seed": 3,
        "parameters": {"density": 0.6},
    },
    "ties": lambda m: {
        "method": "ties",
        "base": m[0],
        "models": [{"model": m[1], "density": 0.3}, {"model": m[2], "density": 0.7}],
    },
    "ties_mergekit": lambda m: {
        "merge_method": "ties",
        "base_model": m[0],
        "parameters": {"normalize": True},
        "models": [
            {"model": m[1], "parameters": {"weight": 0.6, "density": 0.5}},
            {"model": m[2], "parameters": {"weight": 0.4, "density": 1.0}},
        ],
    },
}


@pytest.mark.parametrize("method", CONFIGS)
def test_slabs_give_the_bytes_of_whole_tensors(models, method, tmp_path, monkeypatch):
    config = config_from_dict(CONFIGS[method](models))
    monkeypatch.setattr(slabs, "SLAB_BYTES", 1 << 40)
    plan = plan_merge(config)
    assert len(slabs.parts(plan)) == len(plan.steps)
    run_merge(config, tmp_path / "whole")
    monkeypatch.setattr(slabs, "SLAB_BYTES", SMALL_SLABS)
    cut = {part.step.name for part in slabs.parts(plan) if part.rows is not None}
    assert cut == {
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.1.mlp.up_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
    }, "the odd-width tensor and the vector stay whole"
    run_merge(config, tmp_path / "slabs")
    assert (tmp_path / "slabs" / "model.safetensors").read_bytes() == (
        tmp_path / "whole" / "model.safetensors"
    ).read_bytes()


def test_the_ring_holds_three_slabs_instead_of_the_largest_tensors_inputs(models, monkeypatch):
    plan = plan_merge(config_from_dict(CONFIGS["task_arithmetic"](models)))
    itemsize = plan.steps[0].out_dtype.itemsize
    monkeypatch.setattr(slabs, "SLAB_BYTES", 3 * (1 << 18) * itemsize)  # one chunk of each of the three inputs
    whole = 3 * ROWS * WIDTH * itemsize
    assert slabs.ring_capacity(plan, slabs.parts(plan, slabs=False)) == whole
    assert slabs.ring_capacity(plan, slabs.parts(plan)) == slabs.RING_SLABS * slabs.SLAB_BYTES < whole


def test_slerp_in_slabs_of_whole_reduction_chunks_gives_the_bytes_of_whole_tensors(models, tmp_path, monkeypatch):
    """SLERP's angle is summed over chunks of methods.CHUNK entries: its slabs start at multiples of that chunk
    (2048 rows of 512 here: two slabs, the second short), the reader sums the angle over them before the first is
    merged, and the output is the whole tensors' byte for byte, with a per-layer t; a tensor alike in every input
    is still copied."""
    config = config_from_dict(
        {"method": "slerp", "base": models[0], "models": [models[1]], "parameters": {"t": [0.2, 0.7]}}
    )
    plan = plan_merge(config)
    monkeypatch.setattr(slabs, "SLAB_BYTES", 1 << 40)
    run_merge(config, tmp_path / "whole")
    monkeypatch.setattr(slabs, "SLAB_BYTES", methods.CHUNK * 2 * plan.steps[0].out_dtype.itemsize)
    cut = {part.step.name: part.rows for part in slabs.parts(plan) if part.rows is not None}
    assert set(cut) == {
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.1.mlp.up_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
    }  # the last alike everywhere: copied
    assert all(part.first_element % methods.CHUNK == 0 for part in slabs.parts(plan) if part.rows is not None)
    run_merge(config, tmp_path / "slabs")
    assert (tmp_path / "slabs" / "model.safetensors").read_bytes() == (
        tmp_path / "whole" / "model.safetensors"
    ).read_bytes()


def test_the_slerp_angle_from_slabs_is_the_whole_tensors():
    generator = torch.Generator().manual_seed(5)
    start = torch.randn(3 * 1024 + 77, 1024, generator=generator)
    end = start + torch.randn(start.shape, generator=generator)
    angle = methods.SlerpAngle()
    for begin, stop in ((0, 1024), (1024, 3072), (3072, start.shape[0])):  # 1024 rows of 1024: one CHUNK
        angle.add(start[begin:stop], end[begin:stop])
    assert angle.weights(0.3) == methods.slerp_weights(start, end, 0.3) != (0.7, 0.3)


def test_the_slerp_angle_is_the_same_on_any_thread_count():
    """The angle's additions have a fixed order (compiled or in torch, tests/test_kernels.py), so the weights (and a
    merge's bytes) do not depend on the thread count; the 2^16-entry blocks include partial ones."""
    generator = torch.Generator().manual_seed(6)
    start = torch.randn(5 * 65536 + 123, generator=generator).to(torch.bfloat16)
    end = (start.float() + 0.1 * torch.randn(start.shape, generator=generator)).to(torch.bfloat16)
    previous = torch.get_num_threads()
    try:
        weights = set()
        for threads in (1, 2, 4, 8):
            torch.set_num_threads(threads)
            weights.add(methods.slerp_weights(start, end, 0.3))
    finally:
        torch.set_num_threads(previous)
    assert len(weights) == 1 and weights != {(0.7, 0.3)}, weights


def test_statistics_are_read_through_one_slab_of_their_own(models, monkeypatch):
    """TIES and SLERP decide each tensor in slabs on the statistician thread, through a block of the largest
    first slab (counted in the dry run's ring); the methods without statistics need none."""
    monkeypatch.setattr(slabs, "SLAB_BYTES", SMALL_SLABS)
    for method in ("ties", "linear", "dare_ties"):
        plan = plan_merge(config_from_dict(CONFIGS[method](models)))
        firsts = [sum(slabs.block_sizes(plan, part)) for part in slabs.parts(plan) if part.rows and not part.rows[0]]
        expected = max(firsts) if method == "ties" else 0
        assert len(firsts) == 3 and slabs.statistics_slab_bytes(plan, slabs.parts(plan)) == expected, method
        assert slabs.statistics_slab_bytes(plan, slabs.parts(plan, slabs=False)) == 0
        assert expected <= SMALL_SLABS and (expected > 0) == (method == "ties")


def test_a_failed_statistics_pass_stops_the_merge_and_leaves_no_output(models, tmp_path, monkeypatch):
    """An error on the statistician thread (here: the second tensor's) reaches the caller as itself and no output
    folder is left behind."""
    monkeypatch.setattr(slabs, "SLAB_BYTES", SMALL_SLABS)
    decide, decided = slabs.decide, []

    def failing(plan, first, *args):
        decided.append(first.step.name)
        if len(decided) == 2:
            raise InputError(f"{first.step.name}: unreadable")
        return decide(plan, first, *args)

    monkeypatch.setattr(slabs, "decide", failing)
    with pytest.raises(InputError, match="unreadable") as raised:
        run_merge(config_from_dict(CONFIGS["ties"](models)), tmp_path / "out")
    assert str(raised.value).startswith(decided[1]) and not (tmp_path / "out").exists()


def test_methods_with_other_per_tensor_statistics_stay_whole(models):
    for method, parameters, count in (
        ("nuslerp", {"weight": 0.5}, 2),
        ("breadcrumbs", {"density": 0.5}, 2),
        ("model_stock", {}, 2),
    ):
        plan = plan_merge(
            config_from_dict(
                {"method": method, "base": models[0], "models": models[1 : 1 + count], "parameters": parameters}
            )
        )
        assert all(part.rows is None for part in slabs.parts(plan)), method


@pytest.mark.parametrize("density", [0.01, 0.3, 0.5, 0.97])
def test_the_trim_threshold_from_slabs_is_the_whole_tensors(density):
    """Sampled from a few rows, then counted as uneven slabs (starting at whole chunks): the value of the whole
    tensors, on magnitudes with many ties (a quarter of the entries share one value) as on distinct ones; a
    sample from the first rows only, which brackets the wrong values, still gives it."""
    generator = torch.Generator().manual_seed(11)
    base = torch.randn(3001, 256, generator=generator)
    model = base + torch.randn(3001, 256, generator=generator)
    model[::4] = base[::4] + 0.5
    expected = methods.trim_threshold(base, model, density)
    bounds = [0, 1024, 2048, 3001]  # rows: 1024 rows of 256 entries are one chunk
    for sampled in (slice(None, None, 12), slice(0, 40)):
        trim = methods.TrimThreshold(base.numel(), density)
        trim.sample(base[sampled], model[sampled])
        for begin, end in itertools.pairwise(bounds):
            trim.count(base[begin:end], model[begin:end])
        assert trim.select(lambda: (base, model)) == expected


def test_slab_rows_start_at_whole_chunks(models):
    plan = plan_merge(config_from_dict(CONFIGS["task_arithmetic"](models)))
    for part in slabs.parts(plan):
        if part.rows is not None:
            assert part.first_element % (1 << 18) == 0 and part.shape[1:] == part.step.shape[1:]


def test_the_writer_takes_slabs_only_in_order(tmp_path):
    planned = [PlannedTensor("a", (4, 2), torch.float32), PlannedTensor("b", (3,), torch.float32)]
    rows = torch.arange(8, dtype=torch.float32).reshape(4, 2)
    with ShardedWriter(tmp_path, planned, 1 << 30) as writer:
        writer.write("a", rows[:2], 0)
        with pytest.raises(RuntimeError, match="from row 2"):
            writer.write("a", rows[3:], 3)
        with pytest.raises(RuntimeError, match="expected"):
            writer.write("b", torch.zeros(3))
        writer.write("a", rows[2:], 2)
        writer.write("b", torch.zeros(3))
        writer.close()
    assert load_file(tmp_path / "model.safetensors")["a"].equal(rows)


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="needs /proc")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.int8])
def test_mapped_rows_are_the_rows_read_and_are_unmapped_with_their_view(tmp_path, dtype):
    """`ModelSource.map_rows` (the statistics pass) gives the bytes `load_rows` reads, at offsets off the page
    boundary (a 3-byte tensor first); the shard is mapped while the view lives and no longer once it is dropped.
    float8 is upcast as a read is, into memory of its own: nothing stays mapped."""
    generator = torch.Generator().manual_seed(3)
    rows = (
        torch.randn(300, 77, generator=generator).to(dtype)
        if dtype.is_floating_point
        else torch.randint(-100, 100, (300, 77), generator=generator, dtype=dtype)
    )
    file = tmp_path / "model.safetensors"
    save_file({"a.odd": torch.ones(3, dtype=torch.uint8), "b.rows": rows}, file)
    source = open_model(tmp_path)
    for begin, end in ((0, 1), (5, 130), (17, 300), (299, 300)):
        mapped = source.map_rows("b.rows", begin, end)
        assert (str(file.resolve()) in mapped_files()) == (dtype != torch.float8_e4m3fn)
        assert torch.equal(mapped, source.load_rows("b.rows", begin, end)), (begin, end)
        del mapped
        assert str(file.resolve()) not in mapped_files()
    source.close()


def test_a_shard_cut_short_before_its_rows_are_mapped_is_an_input_error(tmp_path):
    file = tmp_path / "model.safetensors"
    save_file({"rows": torch.randn(400, 256)}, file)
    source = open_model(tmp_path)
    os.truncate(file, file.stat().st_size - 4096)
    assert source.map_rows("rows", 0, 10).shape == (10, 256)  # rows still in the file
    with pytest.raises(InputError, match=r"model\.safetensors: truncated file \(tensor rows\)"):
        source.map_rows("rows", 300, 400)
    source.close()


@pytest.mark.parametrize("method", ["ties", "slerp"])
def test_a_shard_cut_short_after_planning_stops_a_merge_with_statistics(models, tmp_path, monkeypatch, method):
    """The statistician maps the slabs of a shard cut short after the plan was made: an InputError reaches the
    caller (not the bus error of a read past a mapped file's end)."""
    copies = []
    for index, folder in enumerate(models):
        copies.append(tmp_path / f"m{index}")
        shutil.copytree(folder, copies[-1])
    configs = {
        **CONFIGS,
        "slerp": lambda m: {"method": "slerp", "base": m[0], "models": [m[1]], "parameters": {"t": 0.3}},
    }
    config = config_from_dict(configs[method]([str(copy) for copy in copies]))
    with plan_merge(config) as plan:
        monkeypatch.setattr(slabs, "SLAB_BYTES", SMALL_SLABS * plan.steps[0].out_dtype.itemsize // 2)
        assert slabs.statistics_slab_bytes(plan, slabs.parts(plan))
        shard = sorted(copies[1].glob("*.safetensors"))[0]
        os.truncate(shard, 4096 + 8)
        with pytest.raises(InputError, match="truncated"):
            execute(plan, lambda *args: None, in_slabs=True)
