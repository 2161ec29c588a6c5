"""SLERP's compiled passes (mergekit_lite/merge/kernels.c) against torch's arithmetic: the same bytes.

The kernel is an optional extension; where it was not built, the merge runs `methods.angle_sums` and torch's
float32 combination instead. Each test here checks that the two agree bit for bit, on random and hostile values
(overflow, subnormals, signed zeros, short last blocks), and that a whole SLERP merge writes the same file
either way."""

import math

import pytest
import torch
from safetensors.torch import save_file

from mergekit_lite.audited import run_merge
from mergekit_lite.merge import methods, slabs
from mergekit_lite.merge.schema import config_from_dict

compiled = pytest.mark.skipif(methods._kernels is None, reason="the optional extension was not built here")
SIZES = (0, 1, 5, methods.ANGLE_LANES - 1, methods.ANGLE_LANES + 3, methods.ANGLE_BLOCK, methods.ANGLE_BLOCK + 1,
         3 * methods.ANGLE_BLOCK + 17, methods.CHUNK + 5)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int16 if tensor.element_size() == 2 else torch.int32)


def hostile(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Finite random entries over many magnitudes, with zeros of both signs, the dtype's extremes and subnormals."""
    generator = torch.Generator().manual_seed(seed)
    info = torch.finfo(dtype)
    spread = min(20, int(math.log2(info.max)) - 4)
    values = torch.randn(n, generator=generator, dtype=torch.float64) * \
        torch.exp2(torch.randint(-spread, spread, (n,), generator=generator).double())
    specials = torch.tensor([0.0, -0.0, info.max, -info.max, info.tiny, info.tiny / 4, -info.smallest_normal / 8],
                            dtype=torch.float64)
    count = min(n, len(specials))
    values[torch.randperm(n, generator=generator)[:count]] = specials[:count]
    return values.to(dtype)


@compiled
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_compiled_angle_adds_what_the_torch_angle_adds(dtype):
    if dtype not in methods.ANGLE_DTYPES:
        pytest.skip(f"this compiler has no {dtype} type")
    for n in SIZES:
        start, end = hostile(n, dtype, seed=n), hostile(n, dtype, seed=n + 1)
        code = methods.ANGLE_DTYPES[dtype]
        compiled_sums = methods._kernels.angle_sums(start.data_ptr(), end.data_ptr(), n, code, methods.ANGLE_BLOCK,
                                                    (1.5, -2.0, 0.25))
        assert compiled_sums == methods.angle_sums(start, end, (1.5, -2.0, 0.25)), (dtype, n)
        a, b = start.double().tolist(), end.double().tolist()
        exact = (1.5 + math.fsum(x * x for x in a), -2.0 + math.fsum(x * y for x, y in zip(a, b)),
                 0.25 + math.fsum(y * y for y in b))
        for got, want, scale in zip(compiled_sums, exact, (exact[0], math.sqrt(exact[0] * exact[2]), exact[2])):
            assert abs(got - want) <= 1e-12 * scale, (dtype, n, got, want)  # float64 sums, no float32 overflow


@compiled
def test_the_angle_fed_in_slabs_is_the_angle_of_the_whole_tensor():
    """Slabs start at multiples of CHUNK, so each block's additions are the whole tensor's and the totals go on."""
    start, end = hostile(3 * methods.CHUNK + 999, torch.bfloat16, 1), hostile(3 * methods.CHUNK + 999, torch.bfloat16, 2)
    whole, in_slabs = methods.SlerpAngle(), methods.SlerpAngle()
    whole.add(start, end)
    for begin in range(0, start.numel(), 2 * methods.CHUNK):
        in_slabs.add(start[begin:begin + 2 * methods.CHUNK], end[begin:begin + 2 * methods.CHUNK])
    assert whole.weights(0.3) == in_slabs.weights(0.3) != (0.7, 0.3)
    assert whole._totals == in_slabs._totals == methods.angle_sums(start, end, (0.0, 0.0, 0.0))


@compiled
@pytest.mark.parametrize("n", [1, 7, 15, 16, 17, 1000, methods.DENSE_CHUNK + 3])
def test_the_compiled_weighted_sum_is_torchs_float32_sum_rounded_once(n):
    """start*w0 + end*w1 straight into a bfloat16 output: torch's `mul_`, `add_(alpha=)` in float32 and one
    rounding, to the bit, including sums that overflow to infinity and subnormal results; the output may be
    either input itself."""
    start, end = hostile(n, torch.bfloat16, 3), hostile(n, torch.bfloat16, 4)
    for weights in ((0.8, 0.7), (1.7, -0.9), (1e-30, 3.0), (-2.5, 2.5)):
        expected = methods.linear([start, end], list(weights), normalize=False)  # float32, torch's arithmetic
        assert expected.dtype == torch.float32
        out = torch.empty_like(start)
        assert methods.linear([start, end], list(weights), normalize=False, out=out) is out
        assert torch.equal(bits(out), bits(expected.to(torch.bfloat16))), weights
        over_start, over_end = start.clone(), end.clone()
        methods.linear([over_start, end], list(weights), normalize=False, out=over_start)
        methods.linear([start, over_end], list(weights), normalize=False, out=over_end)
        assert torch.equal(bits(over_start), bits(out)) and torch.equal(bits(over_end), bits(out))
    overflow = torch.full((n,), torch.finfo(torch.bfloat16).max, dtype=torch.bfloat16)
    out = torch.empty_like(overflow)
    methods.linear([overflow, overflow], [0.9, 0.9], normalize=False, out=out)
    assert torch.isinf(out).all() and (out > 0).all()


def test_inputs_the_kernel_cannot_take_go_to_torch():
    """Not built, another dtype or device layout, mixed dtypes, or an output overlapping an input only in part."""
    a = torch.zeros(64, dtype=torch.bfloat16)
    built = methods._kernels is not None
    assert methods.fused(a[:32], a[32:], dtypes=(torch.bfloat16,)) == built
    assert not methods.fused(a[:32], a[16:48], dtypes=(torch.bfloat16,))
    assert methods.fused(a[:32], a[:32], a[32:], dtypes=(torch.bfloat16,)) == built
    assert not methods.fused(a[::2], a[1::2], dtypes=(torch.bfloat16,))
    assert not methods.fused(a, a.float(), dtypes=(torch.bfloat16, torch.float32))
    assert not methods.fused(a.half(), a.half(), dtypes=(torch.bfloat16,))


def test_a_slerp_merge_writes_the_same_bytes_with_or_without_the_kernel(tmp_path, monkeypatch):
    """The whole merge, tensors whole and in slabs (the statistics pass on its own thread), bfloat16 and float16
    checkpoints: with the kernel and with torch's code alone, byte for byte."""
    kernels = ((methods._kernels, methods.ANGLE_DTYPES), (None, {}))
    for dtype in (torch.bfloat16, torch.float16):
        folders = []
        for seed in (0, 1):
            folder = tmp_path / f"{dtype}-{seed}"
            folder.mkdir()
            tensors = {"model.layers.0.mlp.up_proj.weight": hostile(2048 * 520, dtype, seed).view(2048, 520),
                       "model.layers.0.input_layernorm.weight": hostile(77, dtype, seed + 7),
                       "model.layers.1.mlp.down_proj.weight": hostile(3 * 4099, dtype, seed + 9).view(3, 4099)}
            save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
            folders.append(str(folder))
        config = config_from_dict({"method": "slerp", "base": folders[0], "models": [folders[1]],
                                   "parameters": {"t": [0.2, 0.7]}})
        outputs = []
        for kernel, table in kernels:
            monkeypatch.setattr(methods, "_kernels", kernel)
            monkeypatch.setattr(methods, "ANGLE_DTYPES", table)
            monkeypatch.setattr(slabs, "SLAB_BYTES", methods.CHUNK * 2 * 2)
            out = tmp_path / f"out-{dtype}-{kernel is None}"
            run_merge(config, out)
            outputs.append((out / "model.safetensors").read_bytes())
        assert outputs[0] == outputs[1], dtype
