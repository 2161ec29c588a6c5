"""The compiled merge math (mergekit_lite/merge/kernels.c) against torch's arithmetic: the same bytes.

The kernels are an optional extension; where it was not built, the merge runs the torch code in merge/methods/tensor_math.py
instead (`angle_sums`, `linear`'s float32 sum, `task_vector_merge`'s passes, `TrimThreshold`'s numpy count).
Each test here checks that the two agree bit for bit, on random and hostile values (overflow, subnormals, signed
zeros, ties, negative weights, short last blocks), and that whole merges write the same files either way."""

import itertools
import math

import pytest
import torch
from safetensors.torch import save_file

from mergekit_lite.audited import run_merge
from mergekit_lite.merge import slabs
from mergekit_lite.merge.methods import tensor_math as methods
from mergekit_lite.merge.schema import config_from_dict

compiled = pytest.mark.skipif(methods._kernels is None, reason="the optional extension was not built here")
SIZES = (
    0,
    1,
    5,
    methods.ANGLE_LANES - 1,
    methods.ANGLE_LANES + 3,
    methods.ANGLE_BLOCK,
    methods.ANGLE_BLOCK + 1,
    3 * methods.ANGLE_BLOCK + 17,
    methods.CHUNK + 5,
)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int16 if tensor.element_size() == 2 else torch.int32)


def hostile(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Finite random entries over many magnitudes, with zeros of both signs, the dtype's extremes and subnormals."""
    generator = torch.Generator().manual_seed(seed)
    info = torch.finfo(dtype)
    spread = min(20, int(math.log2(info.max)) - 4)
    values = torch.randn(n, generator=generator, dtype=torch.float64) * torch.exp2(
        torch.randint(-spread, spread, (n,), generator=generator).double()
    )
    specials = torch.tensor(
        [0.0, -0.0, info.max, -info.max, info.tiny, info.tiny / 4, -info.smallest_normal / 8], dtype=torch.float64
    )
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
        compiled_sums = methods._kernels.angle_sums(
            start.data_ptr(), end.data_ptr(), n, code, methods.ANGLE_BLOCK, (1.5, -2.0, 0.25)
        )
        assert compiled_sums == methods.angle_sums(start, end, (1.5, -2.0, 0.25)), (dtype, n)
        a, b = start.double().tolist(), end.double().tolist()
        exact = (
            1.5 + math.fsum(x * x for x in a),
            -2.0 + math.fsum(x * y for x, y in zip(a, b, strict=True)),
            0.25 + math.fsum(y * y for y in b),
        )
        for got, want, scale in zip(
            compiled_sums, exact, (exact[0], math.sqrt(exact[0] * exact[2]), exact[2]), strict=True
        ):
            assert abs(got - want) <= 1e-12 * scale, (dtype, n, got, want)  # float64 sums, no float32 overflow


@compiled
def test_the_angle_fed_in_slabs_is_the_angle_of_the_whole_tensor():
    """Slabs start at multiples of CHUNK, so each block's additions are the whole tensor's and the totals go on."""
    start, end = (
        hostile(3 * methods.CHUNK + 999, torch.bfloat16, 1),
        hostile(3 * methods.CHUNK + 999, torch.bfloat16, 2),
    )
    whole, in_slabs = methods.SlerpAngle(), methods.SlerpAngle()
    whole.add(start, end)
    for begin in range(0, start.numel(), 2 * methods.CHUNK):
        in_slabs.add(start[begin : begin + 2 * methods.CHUNK], end[begin : begin + 2 * methods.CHUNK])
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


@compiled
@pytest.mark.parametrize("n", [1, 255, 256, 257, 5000])
def test_the_compiled_task_vector_merge_is_torchs(n):
    """Every mix the kernel takes, one to three models: no sparsifier, TIES's trim (thresholds of 0 too) or DARE's
    drop (a model that drops nothing too); with or without the sign consensus (mergekit's zero-sum rule too) and
    the disjoint mean; positive, mixed and negative weights; a scale; the output over the base itself."""
    base = hostile(n, torch.bfloat16, 0)
    models = [(base.float() + 0.1 * hostile(n, torch.bfloat16, seed).float()).to(torch.bfloat16) for seed in (1, 2, 3)]
    models[2][: n // 3] = base[: n // 3]  # zero deltas
    keeps = [methods.keep_indicator(7 + i, 0, n, drop) for i, drop in enumerate((0.3, 0.0, 0.9))]
    for count, sparsifier, consensus, normalize, scale, weights, rules in itertools.product(
        (1, 2, 3),
        (None, "magnitude", "random"),
        (False, True),
        (False, True),
        (1.0, 0.7),
        ((1.0, 1.0, 1.0), (0.3, 1.2, 0.5), (0.5, -0.4, 1.0), (-1.0, -0.5, -2.0)),
        (False, True),
    ):
        options = dict(
            scale=scale,
            sparsifier=sparsifier,
            consensus=consensus,
            normalize=normalize,
            mergekit_rules=rules,
            thresholds=[0.05, 0.0, 0.11][:count] if sparsifier == "magnitude" else None,
            drops=[0.3, 0.0, 0.9][:count],
            keeps=keeps[:count] if sparsifier == "random" else None,
        )
        expected = methods.task_vector_merge(base, models[:count], list(weights[:count]), **options)
        assert expected.dtype == torch.float32
        out = torch.empty_like(base)
        assert methods.task_vector_merge(base, models[:count], list(weights[:count]), out=out, **options) is out
        case = (count, sparsifier, consensus, normalize, scale, weights, rules)
        assert torch.equal(bits(out), bits(expected.to(torch.bfloat16))), case
        over_base = base.clone()
        methods.task_vector_merge(over_base, models[:count], list(weights[:count]), out=over_base, **options)
        assert torch.equal(bits(over_base), bits(out)), case


def nonfinite(tensor: torch.Tensor, seed: int) -> torch.Tensor:
    """`tensor` with NaN, +Inf and -Inf at a few random entries (what --allow-nonfinite lets through)."""
    spoiled = tensor.clone()
    where = torch.randperm(tensor.numel(), generator=torch.Generator().manual_seed(seed))[:30]
    spoiled[where[:10]], spoiled[where[10:20]], spoiled[where[20:]] = math.nan, math.inf, -math.inf
    return spoiled


@compiled
def test_nonfinite_entries_are_written_as_torch_writes_them():
    """With --allow-nonfinite, NaN and infinities flow through both compiled merges as through torch's code: the
    same bits, a NaN written as the pattern torch's float32 -> bfloat16 conversion writes."""
    n = 4099
    base, start, end = (nonfinite(hostile(n, torch.bfloat16, seed), seed) for seed in (0, 1, 2))
    out = torch.empty_like(start)
    methods.linear([start, end], [0.6, 0.4], normalize=False, out=out)
    expected = methods.linear([start, end], [0.6, 0.4], normalize=False).to(torch.bfloat16)
    assert torch.equal(bits(out), bits(expected)) and torch.isnan(out).any()
    models = [
        nonfinite((base.float() + hostile(n, torch.bfloat16, seed).float()).to(torch.bfloat16), seed) for seed in (3, 4)
    ]
    keeps = [methods.keep_indicator(seed, 0, n, 0.3) for seed in (5, 6)]
    for sparsifier, consensus in itertools.product((None, "magnitude", "random"), (False, True)):
        options = dict(
            scale=0.9,
            sparsifier=sparsifier,
            consensus=consensus,
            normalize=consensus,
            drops=[0.3, 0.3],
            thresholds=[0.05, 0.1] if sparsifier == "magnitude" else None,
            keeps=keeps if sparsifier == "random" else None,
        )
        methods.task_vector_merge(base, models, [1.0, -0.5], out=out, **options)
        expected = methods.task_vector_merge(base, models, [1.0, -0.5], **options).to(torch.bfloat16)
        assert torch.equal(bits(out), bits(expected)) and torch.isnan(out).any(), (sparsifier, consensus)


@compiled
@pytest.mark.parametrize("compress", [False, True])
def test_the_compiled_threshold_count_is_numpys(monkeypatch, compress):
    """TIES's threshold from the compiled count (with AVX-512's compressing store, where the CPU has one, and
    without) and from numpy's: the same count above the bracket, the same band in the same order, the same value;
    bf16 deltas repeat magnitudes, so the band holds ties."""
    if compress and not methods._kernels.HAS_COMPRESS:
        pytest.skip("this CPU has no AVX-512")
    count = methods._kernels.magnitude_band
    monkeypatch.setattr(
        methods,
        "_kernels",
        type("Kernels", (), {"magnitude_band": staticmethod(lambda *args: count(*args[:-1], compress))})(),
    )
    for n, density in (
        (methods.ELEMENTWISE_CHUNK + 1, 0.3),
        (3 * methods.ELEMENTWISE_CHUNK + 77, 0.05),
        (1 << 21, 0.9),
    ):
        base = hostile(n, torch.bfloat16, n)
        model = (base.float() + 0.01 * hostile(n, torch.bfloat16, n + 1).float()).to(torch.bfloat16)
        model[:1000] = base[:1000]
        results = []
        for kernels in (methods._kernels, None):
            monkeypatch.setattr(methods, "_kernels", kernels)
            trim = methods.TrimThreshold(n, density)
            stride = max(n // methods.THRESHOLD_SAMPLE, 1)
            trim.sample(base[::stride], model[::stride])
            for begin in range(0, n, 2 * methods.ELEMENTWISE_CHUNK):  # in slabs, as merge/slabs.py feeds it
                trim.count(
                    base[begin : begin + 2 * methods.ELEMENTWISE_CHUNK],
                    model[begin : begin + 2 * methods.ELEMENTWISE_CHUNK],
                )
            band = torch.cat([torch.from_numpy(part) for part in trim._band])
            results.append((trim._above, bits(band), trim.select(lambda: (base, model))))
        (above, band, value), (torch_above, torch_band, torch_value) = results
        assert above == torch_above and torch.equal(band, torch_band) and band.numel() and value == torch_value, (
            n,
            density,
        )
        assert value == methods.trim_threshold(base, model, density)


def checkpoint(folder, dtype: torch.dtype, seed: int, finite_deltas: bool) -> str:
    """A model of three tensors (one in two row slabs, one of 77 entries): hostile values, or a shared base plus
    `seed` times a hostile delta, small enough that task vectors and their sums stay finite."""

    def values(n: int, offset: int) -> torch.Tensor:
        drawn = hostile(n, dtype, seed + offset)
        if not finite_deltas:
            return drawn
        return (hostile(n, dtype, offset).float().clamp(-1e30, 1e30) + seed * drawn.float().clamp(-1e28, 1e28)).to(
            dtype
        )

    folder.mkdir()
    save_file(
        {
            "model.layers.0.mlp.up_proj.weight": values(2048 * 520, 0).view(2048, 520),
            "model.layers.0.input_layernorm.weight": values(77, 7),
            "model.layers.1.mlp.down_proj.weight": values(3 * 4099, 9).view(3, 4099),
        },
        folder / "model.safetensors",
        metadata={"format": "pt"},
    )
    return str(folder)


@pytest.mark.parametrize(
    "method, dtype, parameters",
    [
        ("slerp", torch.bfloat16, {"t": [0.2, 0.7]}),
        ("slerp", torch.float16, {"t": [0.2, 0.7]}),
        ("ties", torch.bfloat16, {"density": 0.4, "normalize": True}),
        ("dare_ties", torch.bfloat16, {"drop": 0.3, "normalize": True}),
        ("task_arithmetic", torch.bfloat16, {"lambda": 0.8}),
    ],
)
def test_merges_write_the_same_bytes_with_or_without_the_kernels(tmp_path, monkeypatch, method, dtype, parameters):
    """Whole merges, tensors whole and in slabs (the statistics pass on its own thread): with the kernels and with
    torch's code alone, byte for byte."""
    folders = [checkpoint(tmp_path / str(seed), dtype, seed, method != "slerp") for seed in (0, 1, 2)]
    models = folders[1:2] if method == "slerp" else folders[1:]
    config = config_from_dict({"method": method, "base": folders[0], "models": models, "parameters": parameters})
    outputs = []
    for kernels, angle_dtypes, most_models in (
        (methods._kernels, methods.ANGLE_DTYPES, methods.MAX_FUSED_MODELS),
        (None, {}, 0),
    ):
        monkeypatch.setattr(methods, "_kernels", kernels)
        monkeypatch.setattr(methods, "ANGLE_DTYPES", angle_dtypes)
        monkeypatch.setattr(methods, "MAX_FUSED_MODELS", most_models)
        monkeypatch.setattr(slabs, "SLAB_BYTES", methods.CHUNK * 2 * 2)
        out = tmp_path / f"out-{kernels is None}"
        run_merge(config, out)
        outputs.append((out / "model.safetensors").read_bytes())
    assert outputs[0] == outputs[1]
