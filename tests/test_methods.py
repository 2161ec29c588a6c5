"""The pure merge math against values computed by hand."""

import math

import pytest
import torch

from mergekit_lite.merge.methods import REGISTRY, geometric, task_vectors
from mergekit_lite.merge.methods import tensor_math as methods
from mergekit_lite.merge.methods.task_vectors import TaskVectorMethod, dare_key


def t(*values):
    return torch.tensor(values, dtype=torch.float32)


def test_linear_normalizes_weights():
    merged = methods.linear([t(0.0, 2.0), t(4.0, 6.0)], [1.0, 3.0])
    assert torch.equal(merged, t(3.0, 5.0))


def test_linear_without_normalization_is_a_plain_weighted_sum():
    merged = methods.linear([t(1.0, 2.0), t(3.0, 4.0)], [2.0, -1.0], normalize=False)
    assert torch.equal(merged, t(-1.0, 0.0))


def test_linear_rejects_weights_summing_to_zero():
    with pytest.raises(ValueError):
        methods.linear([t(1.0), t(2.0)], [1.0, -1.0])


def test_lerp_is_exact_at_the_ends_in_bf16():
    start = torch.randn(64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    end = torch.randn(64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    assert torch.equal(methods.lerp(start, end, 0.0).to(torch.bfloat16), start)
    assert torch.equal(methods.lerp(start, end, 1.0).to(torch.bfloat16), end)
    assert torch.allclose(methods.lerp(start, end, 0.25), 0.75 * start.float() + 0.25 * end.float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_lerp_into_its_output_rounds_the_float32_lerp_once_at_any_size_and_over_its_start(dtype):
    """LERP writes bf16/fp16/fp32 results straight into the output: the bytes of computing in float32 and rounding
    once, for sizes that end in the kernel's scalar tail (1, 7 and 1003 entries), for weights on both sides of its
    0.5 switch and outside [0, 1], and with the output overlaying `start` (as over the engine's ring). Against
    float64 arithmetic it is off by at most the rounding to the dtype plus float32's."""
    generator = torch.Generator().manual_seed(7)
    for size in (1, 7, 1003):
        start = torch.randn(size, generator=generator).to(dtype)
        end = torch.randn(size, generator=generator).to(dtype)
        for alpha in (0.3, 0.5, 0.7, -0.4, 1.3):
            float32 = methods.lerp(start, end, alpha)
            assert float32.dtype == torch.float32
            direct = methods.lerp(start, end, alpha, out=torch.empty_like(start))
            assert direct.dtype == dtype and torch.equal(
                direct.view(-1).view(torch.uint8), float32.to(dtype).view(-1).view(torch.uint8)
            )
            overlay = start.clone()
            assert methods.lerp(overlay, end, alpha, out=overlay) is overlay and torch.equal(overlay, direct)
            exact = (1 - alpha) * start.double() + alpha * end.double()
            ulp = torch.finfo(dtype).eps * exact.abs().clamp_min(torch.finfo(dtype).tiny)
            assert ((direct.double() - exact).abs() <= ulp + 4e-7 * (start.double().abs() + end.double().abs())).all()


def test_linear_of_two_proportions_is_their_lerp_and_other_weights_a_weighted_sum():
    """Two normalized weights (or two summing to exactly 1) are a LERP and can go straight into an output; other
    weights (SLERP's, a sum of three) are summed in float32 in model order, two of them straight into a bfloat16
    output where the compiled kernel runs (the bytes of the float32 sum rounded once: tests/test_kernels.py)."""
    generator = torch.Generator().manual_seed(3)
    a, b, c = (torch.randn(257, generator=generator).to(torch.bfloat16) for _ in range(3))
    assert torch.equal(methods.linear([a, b], [1.0, 3.0]), methods.lerp(a, b, 0.75))
    assert torch.equal(methods.linear([a, b], [0.25, 0.75], normalize=False), methods.lerp(a, b, 0.75))
    out = torch.empty_like(a)
    assert methods.linear([a, b], [2.0, 2.0], out=out) is out and torch.equal(out, methods.lerp(a, b, 0.5).to(a.dtype))
    summed = methods.linear([a, b], [0.8, 0.7], normalize=False)
    assert summed.dtype == torch.float32
    into = methods.linear([a, b], [0.8, 0.7], normalize=False, out=out)  # `out` itself where the kernel runs
    assert torch.equal(into.to(torch.bfloat16), summed.to(torch.bfloat16))
    assert torch.allclose(summed.double(), a.double() * 0.8 + b.double() * 0.7, rtol=1e-6, atol=1e-7)
    three = methods.linear([a, b, c], [1.0, 1.0, 2.0])
    assert torch.allclose(three.double(), (a.double() + b.double() + 2 * c.double()) / 4, rtol=1e-6, atol=1e-7)


def test_slerp_on_orthogonal_unit_vectors_follows_the_arc():
    merged = methods.slerp(t(1.0, 0.0), t(0.0, 1.0), 0.5)
    assert torch.allclose(merged, t(math.sqrt(0.5), math.sqrt(0.5)), atol=1e-7)
    third = methods.slerp(t(1.0, 0.0), t(0.0, 1.0), 1 / 3)
    assert torch.allclose(third, t(math.cos(math.pi / 6), math.sin(math.pi / 6)), atol=1e-7)


def test_slerp_falls_back_to_lerp_for_colinear_and_zero_vectors():
    assert torch.allclose(methods.slerp(t(1.0, 1.0), t(2.0, 2.0), 0.5), t(1.5, 1.5))
    assert torch.allclose(methods.slerp(t(0.0, 0.0), t(2.0, 4.0), 0.25), t(0.5, 1.0))


def test_trim_threshold_keeps_the_largest_share():
    base = t(1.0, 1.0, 1.0, 1.0, 1.0, 1.0)
    model = base + t(0.1, -5.0, 0.3, 2.0, -0.2, 1.0)
    assert methods.trim_threshold(base, model, 0.5) == pytest.approx(1.0)
    assert methods.trim_threshold(base, model, 1.0) == 0.0
    assert methods.trim_threshold(base, model, 0.01) == math.inf
    trimmed = methods.task_vector_merge(base, [model], [1.0], sparsifier="magnitude", densities=[0.5])
    assert torch.allclose(trimmed, base + t(0.0, -5.0, 0.0, 2.0, 0.0, 1.0))


@pytest.mark.parametrize("shape", [(1000, 3001)])
def test_trim_threshold_on_large_tensors_equals_a_full_selection(shape):
    generator = torch.Generator().manual_seed(5)
    base = torch.randn(shape, generator=generator).to(torch.bfloat16)
    deltas = {
        "gaussian": torch.randn(shape, generator=generator) * 0.01,
        "heavy tail": (torch.randn(shape, generator=generator) * 0.3) ** 5,
        "few distinct values": torch.randint(-3, 4, shape, generator=generator).float() * 0.01,
        "sorted": torch.randn(shape, generator=generator).reshape(-1).sort().values.reshape(shape) * 0.01,
    }
    for label, delta in deltas.items():
        model = (base.float() + delta).to(torch.bfloat16)
        magnitudes = (model.float() - base.float()).abs().reshape(-1)
        for density in (0.001, 0.2, 0.5, 0.9):
            keep = round(density * magnitudes.numel())
            exact = torch.kthvalue(magnitudes, magnitudes.numel() - keep + 1).values.item()
            assert methods.trim_threshold(base, model, density) == exact, (label, density)


def test_slerp_weights_are_linear_for_colinear_and_zero_vectors():
    assert methods.slerp_weights(t(1.0, 1.0), t(2.0, 2.0), 0.3) == (0.7, 0.3)
    assert methods.slerp_weights(t(0.0, 0.0), t(2.0, 1.0), 0.3) == (0.7, 0.3)


@pytest.mark.parametrize("size", [10_001, 300_007])
def test_magnitude_threshold_equals_the_sorted_value(size):
    generator = torch.Generator().manual_seed(3)
    samples = {
        "gaussian": torch.randn(size, generator=generator),
        "heavy tail": torch.randn(size, generator=generator) ** 5,
        "many ties": torch.randint(0, 7, (size,), generator=generator).float(),
        "sorted rows": torch.randn(size, generator=generator).sort().values,
    }
    for label, values in samples.items():
        ordered = values.abs().sort(descending=True).values
        for keep in (1, 17, size // 10, size // 2, size - 3, size):
            assert methods.magnitude_threshold(values.abs(), keep) == ordered[keep - 1].item(), (label, keep)


MASK64 = (1 << 64) - 1


def philox4x64(counter: list[int], key: list[int], rounds: int = 10) -> list[int]:
    """Philox4x64 as Salmon et al. 2011 define it (§4, with the multipliers and Weyl key increments of their Table 2),
    in plain integers: the reference DARE's masks (`methods.keep_indicator`) must equal."""
    for step in range(rounds):
        if step:
            key = [(key[0] + 0x9E3779B97F4A7C15) & MASK64, (key[1] + 0xBB67AE8584CAA73B) & MASK64]
        high = counter[0] * 0xD2E7470EE14C6C93
        low = counter[2] * 0xCA5A826395121157
        counter = [(low >> 64) ^ counter[1] ^ key[0], low & MASK64, (high >> 64) ^ counter[3] ^ key[1], high & MASK64]
    return counter


def reference_draws(key: int, begin: int, size: int) -> list[int]:
    """Entry i's 16-bit draw: word i mod 16 of Philox4x64-10 at counter i // 16 + 1, 64-bit words in order, each
    read from its low 16 bits up (the mask version 2 docs/methods.md documents)."""
    halves = [key & MASK64, key >> 64]
    draws = []
    for entry in range(begin, begin + size):
        word = philox4x64([entry // 16 + 1, 0, 0, 0], halves)[entry % 16 // 4]
        draws.append(word >> (16 * (entry % 4)) & 0xFFFF)
    return draws


def test_philox_reference_gives_random123s_known_answers():
    """The known-answer vectors of Random123 (the paper's library, kat_vectors) for philox4x64 with 10 rounds."""
    assert philox4x64([0] * 4, [0, 0]) == [
        0x16554D9ECA36314C,
        0xDB20FE9D672D0FDC,
        0xD7E772CEE186176B,
        0x7E68B68AEC7BA23B,
    ]
    assert philox4x64([MASK64] * 4, [MASK64] * 2) == [
        0x87B092C3013FE90B,
        0x438C3C67BE8D0224,
        0x9CC7D7C69CD777B6,
        0xA09CAEBF594F0BA0,
    ]
    assert philox4x64(
        [0x243F6A8885A308D3, 0x13198A2E03707344, 0xA4093822299F31D0, 0x082EFA98EC4E6C89],
        [0x452821E638D01377, 0xBE5466CF34E90C6C],
    ) == [0xA528F45403E61D95, 0x38C72DBD566E9788, 0xA5A1610E72FD18B5, 0x57BD43B5E52B7FE6]


@pytest.mark.parametrize("begin, size", [(0, 40), (5, 1), (13, 70), (16 * 1000 + 3, 29), ((1 << 40) + 7, 33)])
def test_keep_indicator_is_philox_at_each_entrys_own_counter(begin, size):
    """Version 2 masks are a function of (key, entry) alone: the paper's Philox at the entry's counter, compared in
    integers with the drop's 2^-16 steps, from any offset (not only a multiple of 16) and of any length."""
    key = 0x0123456789ABCDEF_FEDCBA9876543210
    for drop in (0.3, 0.5, 0.97):
        threshold = methods.drop_threshold(drop)
        expected = [1.0 if draw >= threshold else 0.0 for draw in reference_draws(key, begin, size)]
        assert methods.keep_indicator(key, begin, size, drop).tolist() == expected, drop


def test_drop_threshold_quantises_to_2_to_the_minus_16():
    assert [methods.drop_threshold(drop) for drop in (0.0, 1e-6, 0.5, 0.3, 1 - 1e-9)] == [0, 0, 32768, 19661, 65535]
    for drop in (0.1, 0.3, 0.5, 0.6, 0.9):
        assert abs(methods.drop_threshold(drop) / 65536 - drop) <= 2**-17
    assert methods.keep_indicator(5, 0, 100, 1e-6) is None  # below half a step nothing drops


@pytest.mark.parametrize("chunk", [1, 7, 16, 100, 4096, 1 << 18])
def test_keep_masks_do_not_depend_on_the_chunk_size_or_order(chunk):
    """Chunks drawn in reverse order, of any size, concatenate to the whole tensor's mask."""
    key, total, drop = 987654321, 300_007 if chunk >= 100 else 3_001, 0.4
    whole = methods.keep_indicator(key, 0, total, drop)
    parts = {
        begin: methods.keep_indicator(key, begin, min(chunk, total - begin), drop)
        for begin in reversed(range(0, total, chunk))
    }
    assert torch.equal(torch.cat([parts[begin] for begin in sorted(parts)]), whole)


TENSOR = "model.layers.0.mlp.up_proj.weight"


@pytest.mark.parametrize("drop", [0.01, 0.1, 0.3, 0.5, 0.75, 0.9, 0.99])
def test_dare_masks_drop_at_the_rate_asked_and_independently(drop):
    """Over 2^21 entries the drop rate is within 5 binomial standard deviations of the applied drop; and pairs
    drop together at the product of their rates (within 5 standard deviations): two models' masks (different
    keys), adjacent entries, entries 4 apart (the next 64-bit word), 16 apart (the next Philox counter) and one
    engine chunk apart (2^18, the next chunk of the same tensor)."""
    total = 1 << 21
    applied = methods.drop_threshold(drop) / 65536
    first = 1.0 - methods.keep_indicator(dare_key(0, TENSOR, 0), 0, total, drop).double()
    second = 1.0 - methods.keep_indicator(dare_key(0, TENSOR, 1), 0, total, drop).double()

    def within_bounds(observed: float, expected: float, count: int) -> bool:
        return abs(observed - expected) <= 5 * math.sqrt(expected * (1 - expected) / count)

    assert within_bounds(first.mean().item(), applied, total), first.mean().item()
    assert within_bounds(second.mean().item(), applied, total)
    pairs = {"models": (first, second)}
    for gap in (1, 4, 16, 1 << 18):
        pairs[f"gap {gap}"] = (first[:-gap], first[gap:])
    for name, (left, right) in pairs.items():
        both = (left * right).mean().item()
        assert within_bounds(both, applied**2, left.numel()), (name, both, applied**2)


def test_random_drop_rescales_survivors_by_the_applied_drop():
    delta = torch.ones(10_000)
    keep = methods.keep_indicator(7, 0, 10_000, 0.75)
    dropped = methods.random_drop(delta.clone(), 0.75, keep)
    assert set(dropped.unique().tolist()) == {0.0, 4.0}  # 0.75 is a whole number of 2^-16 steps
    assert torch.equal((dropped != 0).float(), keep)
    assert methods.random_drop(delta.clone(), 0.75, keep, rescale=False).tolist() == keep.tolist()
    third = methods.random_drop(delta.clone(), 1 / 3, methods.keep_indicator(7, 0, 10_000, 1 / 3))
    assert third.max().item() == pytest.approx(65536 / (65536 - 21845), rel=1e-7)  # not exactly 1.5


def test_at_least_is_a_comparison_as_floats():
    """The float-only keep indicator equals `values >= threshold` at and around every threshold, subnormals and
    the ends of the range included, so trims and drops keep exactly what a comparison keeps."""
    tiny = torch.finfo(torch.float32).tiny
    special = torch.tensor([0.0, 1e-45, 2e-45, tiny, 0.1, 0.5, 0.5000001, 1.0, 3.4e38, math.inf])
    values = torch.cat(
        [
            special,
            torch.nextafter(special, torch.tensor(math.inf)),
            torch.nextafter(special, torch.tensor(0.0)),
            torch.rand(10_000),
        ]
    )
    for threshold in [*special.tolist(), 0.3, 1.0 / 3.0, -1.0, math.nan]:
        expected = (values >= threshold).to(torch.float32)
        assert torch.equal(methods.at_least(values.clone(), threshold), expected), threshold


def test_trim_is_a_masked_fill_bit_for_bit():
    """One hardshrink equals masking magnitudes below the threshold with +0.0, at and around every threshold,
    signed zeros, subnormals, inf and NaN entries included (NaN and inf are kept as the mask keeps them)."""
    tiny = torch.finfo(torch.float32).tiny
    special = torch.tensor([0.0, 1e-45, 2e-45, tiny, 0.1, 0.5, 0.5000001, 1.0, 3.4e38, math.inf])
    magnitudes = torch.cat(
        [
            special,
            torch.nextafter(special, torch.tensor(math.inf)),
            torch.nextafter(special, torch.tensor(0.0)),
            torch.rand(10_000),
        ]
    )
    deltas = torch.cat([magnitudes, -magnitudes, torch.tensor([math.nan, -math.nan])])
    for threshold in [*special.tolist(), 0.3, 1.0 / 3.0]:
        expected = deltas.masked_fill(deltas.abs() < threshold, 0.0).add_(0.0)  # + 0.0: a kept -0.0 becomes +0.0
        trimmed = methods.trim(deltas.clone(), threshold)
        assert torch.equal(trimmed.view(torch.int32), expected.view(torch.int32)), threshold


def test_sum_of_products_adds_in_model_order_as_torch_sums_up_to_four_rows():
    """Agreement-weighted sums: exact 0/1 factors (as floats, with -0.0 products), rows of mixed scales."""
    generator = torch.Generator().manual_seed(5)
    for rows in (1, 2, 3, 4):
        stacked = torch.randn(rows, 50_000, generator=generator) * torch.logspace(-6, 6, rows).reshape(-1, 1)
        stacked[:, :1000] = -0.0
        factors = torch.randint(0, 2, stacked.shape, generator=generator).to(torch.float32)
        expected = (stacked * factors).sum(dim=0)
        assert torch.equal(methods.sum_of_products(stacked, factors).view(torch.int32), expected.view(torch.int32))
    stacked, factors = torch.randn(7, 1000, generator=generator), torch.ones(7, 1000)
    in_order = stacked[0] + 0.0
    for row in stacked[1:]:
        in_order = in_order + row
    assert torch.equal(methods.sum_of_products(stacked, factors), in_order)


def test_row_sum_weighs_agreement_rows_in_model_order():
    generator = torch.Generator().manual_seed(6)
    agree = torch.randint(0, 2, (3, 10_000), generator=generator).to(torch.float32)
    weights = [0.7, 1.0, 1e-8]
    expected = agree[0] * 0.7 + agree[1] + agree[2] * 1e-8
    assert torch.equal(methods.row_sum(agree, weights), expected)
    deltas = torch.randn(4, 10_000, generator=generator)
    assert torch.equal(methods.row_sum(deltas), deltas[0] + deltas[1] + deltas[2] + deltas[3])
    assert methods.row_sum(deltas[:1]).data_ptr() == deltas.data_ptr()  # one row with weight 1: no copy


@pytest.mark.parametrize(
    "model_dtype, base_dtype",
    [
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.bfloat16),
        (torch.float32, torch.float32),
        (torch.float64, torch.float32),
        (torch.bfloat16, torch.float64),
    ],
)
def test_task_vector_has_the_bytes_of_torch_sub_and_leaves_its_inputs(model_dtype, base_dtype):
    """The copy-then-subtract path (bf16, fp16, fp32) and torch's promotion (float64) against torch.sub of the
    base in float32, signed zeros, subnormals, inf and NaN included; a float32 model is not written into."""
    generator = torch.Generator().manual_seed(8)
    values = torch.cat(
        [
            torch.randn(5000, generator=generator),
            torch.tensor([0.0, -0.0, 1e-40, -1e-40, math.inf, -math.inf, math.nan, 3e38, -3e38]),
        ]
    )
    model, base = values.to(model_dtype), values.flip(0).to(base_dtype)
    kept = model.clone()
    expected = torch.sub(model, base.to(torch.float32))
    result = methods.task_vector(model, base)
    assert result.dtype == expected.dtype and torch.equal(model.view(torch.uint8), kept.view(torch.uint8))
    assert torch.equal(result.view(torch.uint8), expected.view(torch.uint8))
    out = torch.empty(values.shape, dtype=torch.float32)
    assert methods.task_vector(model, base, out=out).data_ptr() == out.data_ptr()
    assert torch.equal(out.view(torch.int32), expected.to(torch.float32).view(torch.int32))


def test_sign_consensus_elects_the_sign_with_more_mass():
    stacked = torch.stack([t(1.0, -3.0, 0.0), t(-2.0, 1.0, 0.5), t(0.5, 1.0, 0.0)])
    agree = methods.sign_consensus(stacked)
    # column 0: 1 - 2 + 0.5 < 0 -> negative wins; column 1: -3 + 2 < 0; column 2: positive
    assert agree.tolist() == [[False, True, False], [True, False, True], [False, False, False]]


def test_ties_by_hand():
    base = t(0.0, 0.0, 0.0, 0.0)
    a = t(4.0, -1.0, 2.0, 0.5)
    b = t(-1.0, -2.0, 3.0, 0.25)
    merged = methods.task_vector_merge(
        base,
        [a, b],
        [1.0, 1.0],
        scale=1.0,
        sparsifier="magnitude",
        densities=[0.5, 0.5],
        consensus=True,
        normalize=True,
    )
    # trimmed: a -> (4, 0, 2, 0), b -> (0, -2, 3, 0); all surviving entries agree with their column's sign
    assert torch.equal(merged, t(4.0, -2.0, 2.5, 0.0))


def test_ties_disjoint_mean_ignores_disagreeing_entries_and_applies_lambda():
    base = t(1.0, 1.0)
    a = t(3.0, 0.0)  # delta (2, -1)
    b = t(-2.0, 4.0)  # delta (-3, 3)
    c = t(4.0, 2.0)  # delta (3, 1)
    merged = methods.task_vector_merge(
        base,
        [a, b, c],
        [1.0, 1.0, 1.0],
        scale=0.5,
        sparsifier="magnitude",
        densities=[1.0, 1.0, 1.0],
        consensus=True,
        normalize=True,
    )
    # column 0: 2 - 3 + 3 > 0 -> mean(2, 3) = 2.5; column 1: -1 + 3 + 1 > 0 -> mean(3, 1) = 2
    assert torch.allclose(merged, t(1.0 + 0.5 * 2.5, 1.0 + 0.5 * 2.0))


def test_task_arithmetic_allows_negative_weights():
    base, model = t(1.0, 2.0), t(3.0, 1.0)
    merged = methods.task_vector_merge(base, [model], [-1.0], scale=1.0)
    assert torch.equal(merged, t(-1.0, 3.0))


def test_family_recipes_name_the_documented_combinations():
    recipes = {name: method for name, method in REGISTRY.items() if isinstance(method, TaskVectorMethod)}
    assert (recipes["ties"].sparsifier, recipes["ties"].consensus) == ("magnitude", True)
    assert (recipes["dare_ties"].sparsifier, recipes["dare_ties"].consensus) == ("random", True)
    assert (recipes["dare_linear"].sparsifier, recipes["dare_linear"].consensus) == ("random", False)
    assert recipes["task_arithmetic"].sparsifier is None


def unit(angle_degrees: float) -> torch.Tensor:
    return t(math.cos(math.radians(angle_degrees)), math.sin(math.radians(angle_degrees)))


def test_model_stock_ratio_follows_the_paper_formula():
    """t = N·cosθ / (1 + (N-1)·cosθ): 60 degrees apart (cos 1/2) with N=2 gives 2/3; same direction 1; orthogonal 0."""
    base = t(0.0, 0.0)
    for angle, expected in ((60.0, 2 / 3), (0.0, 1.0), (90.0, 0.0)):
        gram = methods.gram_matrix([unit(0.0), 3 * unit(angle)], origin=base)
        assert geometric.model_stock_ratio(gram).item() == pytest.approx(expected, abs=1e-7)  # float32 inputs
    coefficients = geometric.model_stock_coefficients(methods.gram_matrix([unit(0.0), unit(60.0)], origin=base))
    assert coefficients.tolist() == pytest.approx([1 / 3, 1 / 3, 1 / 3])


def test_karcher_mean_of_points_on_a_circle_is_their_mean_angle():
    """On a great circle the Fréchet mean of nearby points is the point at their mean angle; norms average."""
    points = [unit(0.0), 2 * unit(30.0), 3 * unit(90.0)]
    coefficients = geometric.karcher_coefficients(methods.gram_matrix(points), max_iter=50, tol=1e-12)
    merged = methods.linear(points, coefficients.tolist(), normalize=False)
    assert torch.allclose(merged, 2.0 * unit(40.0), atol=1e-6)


def test_nuslerp_is_slerp_and_multislerp_of_two_symmetric_points_is_their_bisector():
    gram = methods.gram_matrix([unit(0.0), unit(90.0)])
    assert geometric.nuslerp_coefficients(gram, 1 / 3).tolist() == pytest.approx(
        list(methods.spherical_weights(0.0, 1 / 3))
    )
    bisector = methods.linear(
        [unit(0.0), unit(80.0)],
        geometric.multislerp_coefficients(methods.gram_matrix([unit(0.0), unit(80.0)]), [0.5, 0.5]).tolist(),
        normalize=False,
    )
    assert torch.allclose(bisector, unit(40.0), atol=1e-6)


def test_outlier_band_drops_the_largest_gamma_then_the_smallest():
    base = torch.zeros(10)
    model = t(*range(1, 11))  # magnitudes 1..10
    # keep int(0.5·10) = 5, drop int(0.2·10) = 2 outliers (9, 10), then the 3 smallest: keep 4..8
    assert methods.outlier_band(base, model, 0.5, 0.2) == (4.0, 8.0)
    merged = methods.task_vector_merge(
        base, [model], [1.0], sparsifier="outliers", densities=[0.5], gammas=[0.2], rescale=False
    )
    assert merged.tolist() == [0, 0, 0, 4, 5, 6, 7, 8, 0, 0]
    assert methods.outlier_band(base, model, 1.0, 0.2) == (0.0, math.inf)


def test_magprune_probabilities_rise_linearly_with_rank_within_each_row():
    delta = t(0.3, -0.1, 0.5, 0.2, -0.4).reshape(1, 5)
    probabilities = methods.magprune_keep_probabilities(delta, density=0.5, epsilon=0.2)
    # ranks by magnitude: 0.1 -> 0, 0.2 -> 1, 0.3 -> 2, 0.4 -> 3, 0.5 -> 4; p = 0.3 + 0.4·rank/4
    assert torch.allclose(probabilities, t(0.5, 0.3, 0.7, 0.4, 0.6).reshape(1, 5))


def _task_vector_merge_step_by_step(
    base, models, weights, scale, sparsifier, thresholds, drops, keys, consensus, normalize, mergekit_rules=False
):
    """TIES / DARE / task arithmetic in the plain form of the papers, one whole-tensor op per step: the reference
    the fused task_vector_merge must equal bit for bit (its shortcuts are exact, not approximations)."""
    base32 = base.to(torch.float32)
    deltas = []
    for index, model in enumerate(models):
        delta = model.to(torch.float32) - base32
        if sparsifier == "magnitude":
            delta = delta.masked_fill(delta.abs() < thresholds[index], 0.0)
        if sparsifier == "random":
            threshold = round(drops[index] * 65536)
            dropped = torch.tensor(reference_draws(keys[index], 0, delta.numel())) < threshold
            delta = (delta * (65536 / (65536 - threshold))).masked_fill(dropped, 0.0)
        deltas.append(delta * weights[index])
    stacked = torch.stack(deltas)
    if not consensus:
        merged = stacked[0]
        for delta in stacked[1:]:
            merged = merged + delta
        if normalize:
            merged = merged / math.fsum(weights)
        return merged * scale + base32
    total = stacked.sum(dim=0)
    agree = stacked.sign() == (torch.where(total >= 0, 1.0, -1.0) if mergekit_rules else total.sign())
    merged = (stacked * agree).sum(dim=0)
    if normalize:
        divisor = (agree * torch.tensor(weights).reshape(-1, *([1] * base.dim()))).sum(dim=0)
        merged = merged / divisor.masked_fill(divisor.abs() < methods.NORM_EPS, 1.0)
    return merged * scale + base32


@pytest.mark.parametrize(
    "weights, scale",
    [([1.0, 1.0, 1.0], 1.0), ([0.7, -0.4, 1.3], 0.6), ([0.5, 1e-8, 1.3], -1.0), ([1.0, 1.0], 1.0), ([1.0], 1.0)],
)
@pytest.mark.parametrize(
    "sparsifier, consensus, normalize, mergekit_rules",
    [
        (None, False, False, False),
        (None, False, True, False),
        ("magnitude", True, True, False),
        ("magnitude", True, False, False),
        ("magnitude", True, True, True),
        ("random", True, True, False),
        ("random", True, True, True),
        ("random", False, False, False),
    ],
)
def test_task_vector_merge_equals_the_step_by_step_form_bit_for_bit(
    weights, scale, sparsifier, consensus, normalize, mergekit_rules
):
    """Positive weights take the float-only disjoint merge, others the general form; both must give these bytes."""
    generator = torch.Generator().manual_seed(3)
    base = (torch.randn(4099, generator=generator) * 0.02).to(torch.bfloat16)
    models = [(base.float() + torch.randn(4099, generator=generator) * 0.002).to(torch.bfloat16) for _ in weights]
    base[:64] = -0.0  # signed zeros and unchanged entries, where a shortcut could flip a zero's sign
    models[0][:32], models[-1][16:48] = 0.0, -0.0
    models[-1][100:200] = base[100:200]
    thresholds = [methods.trim_threshold(base, model, 0.5) for model in models]
    drops, keys = [0.5, 0.3, 0.6][: len(models)], [11, 12, 2**128 - 13][: len(models)]
    fused = methods.task_vector_merge(
        base,
        models,
        weights,
        scale=scale,
        sparsifier=sparsifier,
        thresholds=thresholds,
        drops=drops,
        keys=keys,
        consensus=consensus,
        normalize=normalize,
        mergekit_rules=mergekit_rules,
    )
    reference = _task_vector_merge_step_by_step(
        base, models, weights, scale, sparsifier, thresholds, drops, keys, consensus, normalize, mergekit_rules
    )
    assert torch.equal(fused.view(torch.int32), reference.view(torch.int32))
    assert torch.equal(fused.to(torch.bfloat16).view(torch.int16), reference.to(torch.bfloat16).view(torch.int16))


@pytest.mark.parametrize(
    "weights, scale", [([1.0, 1.0], 1.0), ([0.7, -0.4, 1.3], 0.6), ([0.0, 1.0], 0.0), ([1.0], -1.0)]
)
@pytest.mark.parametrize(
    "sparsifier, consensus, normalize, mergekit_rules, rescale",
    [
        (None, False, False, False, True),
        (None, False, True, False, True),
        ("random", True, True, False, True),
        ("random", True, True, True, True),
        ("random", True, False, False, False),
        ("random", False, False, False, True),
        ("random", False, True, False, True),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dare_and_dense_merges_carry_every_nonfinite_input_entry_into_the_result(
    weights, scale, sparsifier, consensus, normalize, mergekit_rules, rescale, dtype
):
    """Why the engine checks only the result of these methods (Method.hides_nonfinite): NaN, +Inf and -Inf in the
    base or in any model, alone or together, dropped by DARE's mask or kept, stay non-finite in that entry."""
    generator = torch.Generator().manual_seed(5)
    size = 64
    base = (torch.randn(size, generator=generator) * 0.02).to(dtype)
    models = [(base.float() + torch.randn(size, generator=generator) * 0.002).to(dtype) for _ in weights]
    bad_values = [math.nan, math.inf, -math.inf]
    poisoned = []
    for entry in range(0, size, 2):  # odd entries stay finite: they must stay so
        row = entry // 2 % (len(models) + 2)  # the base, one model, or (last) the base and every model
        value = bad_values[entry // 2 % 3]
        for tensor in [base] if row == 0 else [models[row - 1]] if row <= len(models) else [base, *models]:
            tensor[entry] = value if tensor is base else -value
        poisoned.append(entry)
    keeps = [torch.tensor([float(i % 4 < 2) for i in range(size)]).roll(index) for index in range(len(models))]
    merged = methods.task_vector_merge(
        base,
        models,
        weights,
        scale=scale,
        sparsifier=sparsifier,
        drops=[0.5] * len(models),
        keeps=keeps if sparsifier else None,
        consensus=consensus,
        normalize=normalize,
        rescale=rescale,
        mergekit_rules=mergekit_rules,
    )
    assert not torch.isfinite(merged[poisoned]).any()
    assert torch.isfinite(merged[1::2]).all()


def test_sce_selects_by_variance_weighs_by_mean_square_and_erases_by_sign():
    """SCE (arXiv 2408.07990 §3.3) on hand-made task vectors: variances across the models 9, 1 and 0 (both
    models agree on entry 2), so a share of the two non-zero variances keeps int(2 * share) entries."""
    base = torch.zeros(3)
    first, second = torch.tensor([4.0, -1.0, 1.0]), torch.tensor([-2.0, 1.0, 1.0])
    assert task_vectors.variance_keep(torch.stack([first, second]), 1.0).tolist() == [1.0, 1.0, 0.0]
    assert task_vectors.variance_keep(torch.stack([first, second]), 2 / 3).tolist() == [1.0, 0.0, 0.0]
    merged = task_vectors.sce(base, [first, second], select_topk=1.0)
    # weights: mean squares 18/3 and 6/3, shares 3/4 and 1/4; entry 0: sum +2, so only the first (+4) is kept;
    # entry 1: sum 0 elects +, only the second (+1) is kept; entry 2: both agree: (3/4 + 1/4) * 1 / 1
    torch.testing.assert_close(merged, torch.tensor([4.0, 1.0, 1.0]))
    selected = task_vectors.sce(base, [first, second], select_topk=0.5)  # int(2 * 0.5) = 1 entry: entry 0 only
    torch.testing.assert_close(selected, torch.tensor([4.0, 0.0, 0.0]))
    assert torch.equal(task_vectors.sce(base, [base, base]), base)  # no task vector: equal shares, nothing to add
