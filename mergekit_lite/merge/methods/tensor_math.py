"""The math several merge methods share: pure functions, tensors in, one float32 tensor out (`lerp` may write its
result straight into a given output instead). No files, no names, no config. A method's own math sits in its
module (`geometric.py`'s coefficients, `task_vectors.py`'s SCE, `lines.py`, `nearswap.py`, `ema.py`).

Task arithmetic, TIES, DARE, DELLA and Model Breadcrumbs are one family (`task_vector_merge`): task
vectors (model - base), an optional sparsifier (magnitude trim, random drop, magnitude-ranked random
drop, or an outlier band), an optional sign consensus, and a weighted sum added back to the base. Each
method of `task_vectors.py` names one combination, as mergekit's generalized task arithmetic does.

The geometric methods (SLERP, NuSLERP, Multi-SLERP, Karcher mean, Model Stock) all return a linear
combination of their inputs whose coefficients depend only on the inputs' inner products. So each is a
`*_coefficients` function (`geometric.py`; SLERP's `slerp_weights` here) of a Gram matrix (`gram_matrix`, one
chunked pass in float64) and the merge
itself is `linear` with those coefficients, chunk by chunk. Their row-wise variants take a batch of
Gram matrices, one per row.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy
import torch

from mergekit_lite.merge.methods.chunks import CHUNK, ELEMENTWISE_CHUNK
from mergekit_lite.merge.methods.variants import Sparsifier

try:  # the merge math fused in C (kernels.c), an optional extension: the same bytes as the torch code below
    from mergekit_lite.merge import _kernels
except ImportError:  # not built (no C compiler where the package was installed)
    _kernels = None
MAX_FUSED_MODELS = 0 if _kernels is None else _kernels.MAX_MODELS  # models per compiled task-vector merge
# the input dtypes of the compiled angle, by the kernel's code for each (float16 where the compiler had _Float16)
ANGLE_DTYPES = {
    dtype: code
    for dtype, code in ((torch.bfloat16, "b"), (torch.float16, "h"), (torch.float32, "f"))
    if _kernels is not None and code in _kernels.ANGLE_DTYPES
}

COLINEAR_DOT = 0.9995
NORM_EPS = 1e-8
ANGLE_BLOCK = 1 << 16  # SLERP's angle: entries per block of its sums (a divisor of CHUNK, where slabs start)
ANGLE_LANES = 1 << 10  # SLERP's angle: a block is read as rows of this many entries (`SlerpAngle`)
ANGLE_STEP = 1 << 20  # SLERP's angle in torch ops: entries per step (float64 temporaries of a few tens of MB)
# Elements per chunk of the memory-bound methods' passes (linear, SLERP, task arithmetic, ...): their two to four
# float32 temporaries per chunk then fit in a core's L2 cache (benchmarks/RESULTS.md, `chunk_math.py --dense-chunk`)
DENSE_CHUNK = 1 << 16
# Dtypes that float32 holds exactly: torch.lerp computes them in float32 and rounds once to the dtype (CPU and
# CUDA kernels alike), and `task_vector` converts them before subtracting
EXACT_IN_FLOAT32 = (torch.float32, torch.bfloat16, torch.float16)
THRESHOLD_SAMPLE = 1 << 16  # strided sample that brackets TIES's trim threshold on large tensors
FUSED_SPARSIFIERS = (None, Sparsifier.MAGNITUDE, Sparsifier.RANDOM)  # what kernels.c's task-vector merge takes


def linear(
    tensors: Sequence[torch.Tensor], weights: Sequence[float], normalize: bool = True, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Weighted sum of tensors; with `normalize`, weights are proportions of their sum. Two tensors whose weights
    are proportions (normalized, or summing to exactly 1) are a `lerp`, which may write into `out`."""
    if normalize:
        total = math.fsum(weights)
        if total == 0:
            raise ValueError("linear weights sum to zero; cannot normalize")
        weights = [w / total for w in weights]
    if len(tensors) == 2 and (normalize or weights[0] + weights[1] == 1.0):
        return lerp(tensors[0], tensors[1], weights[1], out)
    if len(tensors) == 2 and out is not None and fused(tensors[0], tensors[1], out, dtypes=(torch.bfloat16,)):
        _kernels.weighted_pair(out.data_ptr(), tensors[0].data_ptr(), tensors[1].data_ptr(), out.numel(), *weights)
        return out
    merged = tensors[0].to(torch.float32, copy=True).mul_(weights[0])
    for tensor, weight in zip(tensors[1:], weights[1:], strict=True):
        merged.add_(tensor.to(torch.float32), alpha=weight)  # converted first: a mixed-dtype add is slower
    return merged


def lerp(start: torch.Tensor, end: torch.Tensor, alpha: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """(1-alpha)*start + alpha*end as torch.lerp computes it in float32: start + alpha*(end - start) for |alpha| < 0.5,
    else end - (1-alpha)*(end - start), each one fused multiply-add, so exact at alpha 0 and 1.

    Given `out` of the inputs' dtype and device (bf16, fp16 or fp32), the result goes straight there, rounded once
    from float32: the same bytes as rounding the float32 result, in one pass instead of four (convert both inputs,
    combine, round). `out` may be `start` itself. Else the float32 result is returned.
    """
    if (
        out is not None
        and start.dtype == end.dtype == out.dtype
        and out.dtype in EXACT_IN_FLOAT32
        and start.device == end.device == out.device
    ):
        return torch.lerp(start, end, alpha, out=out)
    return torch.lerp(start.to(torch.float32), end.to(torch.float32), alpha)


def slerp_weights(start: torch.Tensor, end: torch.Tensor, t: float) -> tuple[float, float]:
    """The two coefficients SLERP puts on `start` and `end`: sin((1-t)θ)/sinθ and sin(tθ)/sinθ.

    The angle comes from the normalized vectors, the interpolation uses the raw ones (as mergekit and
    the original SLERP merges do), so norms are interpolated too. Nearly colinear vectors and zero
    vectors get the linear coefficients (1-t, t), where the spherical formula loses precision or is
    undefined. See `SlerpAngle` for the reductions.
    """
    angle = SlerpAngle()
    angle.add(start, end)
    return angle.weights(t)


class SlerpAngle:
    """The inner products behind SLERP's angle, start·start, start·end and end·end, summed block by block of
    ANGLE_BLOCK entries: a block is read as rows of ANGLE_LANES entries, each lane adds its products (exact in
    float64) row after row, lanes j and j + h are then added for h = ANGLE_LANES/2 .. 1, and the block's sums are
    added to the totals in block order. Fed a tensor's row slabs in order, slabs that start at multiples of CHUNK
    (merge/slabs.py), it gives the sums, and so the weights, of the whole tensor.

    Every addition has a fixed place, so the sums are the same bits whether the compiled kernel (kernels.c, one
    pass over bfloat16, float16 or float32 inputs on the CPU) or the torch code (`angle_sums`: elementwise
    operations only, so on any device) computes them."""

    def __init__(self):
        self._totals = (0.0, 0.0, 0.0)

    def add(self, start: torch.Tensor, end: torch.Tensor) -> None:
        if fused(start, end, dtypes=ANGLE_DTYPES):
            self._totals = _kernels.angle_sums(
                start.data_ptr(), end.data_ptr(), start.numel(), ANGLE_DTYPES[start.dtype], ANGLE_BLOCK, self._totals
            )
        else:
            self._totals = angle_sums(start.reshape(-1), end.reshape(-1), self._totals)

    def weights(self, t: float) -> tuple[float, float]:
        """`slerp_weights` for what was added."""
        start_sq, dot, end_sq = self._totals
        start_norm, end_norm = math.sqrt(start_sq), math.sqrt(end_sq)
        if start_norm < NORM_EPS or end_norm < NORM_EPS:
            return 1.0 - t, t
        cosine = max(-1.0, min(1.0, dot / (start_norm * end_norm)))
        if abs(cosine) > COLINEAR_DOT:
            return 1.0 - t, t
        return spherical_weights(cosine, t)


def angle_sums(
    start: torch.Tensor, end: torch.Tensor, totals: tuple[float, float, float]
) -> tuple[float, float, float]:
    """`SlerpAngle`'s sums of two flat tensors added to `totals`, in torch ops, addition for addition as kernels.c
    adds them (a short last block padded with zeros), ANGLE_STEP entries at a time."""
    running = torch.tensor(totals, dtype=torch.float64, device=start.device)
    for begin in range(0, start.numel(), ANGLE_STEP):
        pair = [tensor[begin : begin + ANGLE_STEP].to(torch.float64) for tensor in (start, end)]
        blocks = -(-pair[0].numel() // ANGLE_BLOCK)
        a, b = (
            torch.nn.functional.pad(x, (0, blocks * ANGLE_BLOCK - x.numel())).view(blocks, -1, ANGLE_LANES)
            for x in pair
        )
        lanes = torch.zeros((3, blocks, ANGLE_LANES), dtype=torch.float64, device=start.device)
        for sums, x, y in zip(lanes, (a, a, b), (a, b, b), strict=True):
            for row in range(x.shape[1]):
                sums.addcmul_(x[:, row], y[:, row])  # the product is exact: added once, fused or not
        half = ANGLE_LANES // 2
        while half:
            lanes = lanes[..., :half] + lanes[..., half : 2 * half]
            half //= 2
        for block in lanes[..., 0].unbind(1):
            running += block
    return tuple(running.tolist())


def fused(*tensors: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> bool:
    """Whether kernels.c can take these tensors: built, contiguous on the CPU, of one of its dtypes and one dtype,
    and (the first being the output where there is one) overlapping another only where they are the same entries."""
    if _kernels is None or tensors[0].dtype not in dtypes:
        return False
    spans = set()
    for tensor in tensors:
        if (
            tensor.device.type != "cpu"
            or not tensor.is_contiguous()
            or tensor.dtype != tensors[0].dtype
            or tensor.numel() != tensors[0].numel()
        ):
            return False
        spans.add((tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()))
    spans = sorted(spans)
    return all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))


def spherical_weights(cosine: float, t: float) -> tuple[float, float]:
    """sin((1-t)θ)/sinθ and sin(tθ)/sinθ for cosθ = `cosine` (Shoemake 1985, the SLERP formula)."""
    theta = math.acos(cosine)
    sin_theta = math.sin(theta)
    return math.sin((1.0 - t) * theta) / sin_theta, math.sin(t * theta) / sin_theta


def slerp(start: torch.Tensor, end: torch.Tensor, t: float) -> torch.Tensor:
    """Spherical interpolation of two tensors seen as flat vectors (see `slerp_weights`)."""
    return linear([start, end], slerp_weights(start, end, t), normalize=False)


def task_vector(model: torch.Tensor, base: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """model - base in float32 (Ilharco et al. 2023's task vector), into `out` when given.

    bfloat16, float16 and float32 convert to float32 exactly, so copying the model into float32 and subtracting
    the base in place gives the bytes of a subtraction across dtypes, in half its time on the CPU (torch's mixed
    dtype kernels convert element by element). Other dtypes subtract as torch promotes them.
    """
    if model.dtype not in EXACT_IN_FLOAT32 or base.dtype not in EXACT_IN_FLOAT32:
        return torch.sub(model, base.to(torch.float32), out=out)
    if out is None:
        out = torch.empty(model.shape, dtype=torch.float32, device=model.device)
    return out.copy_(model).sub_(base)


def magnitude_threshold(magnitudes: torch.Tensor, keep: int) -> float:
    """The `keep`-th largest value of a non-negative tensor: a linear-time selection (kthvalue), not a sort."""
    flat = magnitudes.reshape(-1)
    return torch.kthvalue(flat, flat.numel() - keep + 1).values.item()


def trim_threshold(base: torch.Tensor, model: torch.Tensor, density: float, mergekit_rules: bool = False) -> float:
    """The magnitude below which TIES's trim zeroes entries of model - base, keeping the top `density` share.

    The share is round(density * n) entries (TIES §3, "keep the top-k% values"), plus any entries tied at
    the threshold, so equal magnitudes are treated alike; with `mergekit_rules`, max(1, int(density * n)) as
    mergekit's sparsify.magnitude counts (it then breaks ties by sort order, which is not reproducible).
    Computed by `TrimThreshold` from the tensors as one slab.
    """
    trim = TrimThreshold(base.numel(), density, mergekit_rules)
    if trim.value is None:
        stride = max(base.numel() // THRESHOLD_SAMPLE, 1)
        trim.sample(base.reshape(-1)[::stride], model.reshape(-1)[::stride])
        trim.count(base, model)
        trim.select(lambda: (base, model))
    return trim.value


class TrimThreshold:
    """`trim_threshold` fed a spread-out sample of the entries (`sample`), then the whole tensors in order, whole
    or as row slabs (`count`; merge/slabs.py), then `select`: the same value however it is fed.

    Exact, without materializing the task vector: the sample brackets the threshold between two sample
    quantiles a few binomial standard deviations apart, one chunked pass counts the entries above the bracket
    and gathers the few inside it, and the answer is selected among those. When the bracket misses (rare), it
    falls back to kthvalue over all magnitudes (`whole()` gives the tensors). The sample only decides how few
    entries are gathered, never the value. The counting and gathering run in numpy, whose comparisons and
    compress take a fraction of torch's time on the CPU (torch builds bool tensors slowly).
    """

    def __init__(self, total: int, density: float, mergekit_rules: bool = False):
        self.total, self.keep = total, max(1, int(density * total)) if mergekit_rules else round(density * total)
        self.value = 0.0 if density >= 1.0 else math.inf if self.keep == 0 else None
        self._samples, self._band, self._above, self._bracket = [], [], 0, None

    @staticmethod
    def _magnitudes(base: torch.Tensor, model: torch.Tensor, part: slice) -> torch.Tensor:
        return task_vector(model.reshape(-1)[part], base.reshape(-1)[part]).abs_()

    def sample(self, base: torch.Tensor, model: torch.Tensor) -> None:
        """Add these entries (some THRESHOLD_SAMPLE spread over the tensor, in any number of calls) to the sample."""
        if self.value is None and self.total > ELEMENTWISE_CHUNK:
            self._samples.append(self._magnitudes(base, model, slice(None)).cpu())

    def count(self, base: torch.Tensor, model: torch.Tensor) -> None:
        """Count the entries (the next slab, starting at a whole chunk) above the bracket; keep those inside it."""
        if self.value is not None or self.total <= ELEMENTWISE_CHUNK:
            return
        if self._bracket is None:
            sample = torch.cat(self._samples).numpy()
            quantile = 1.0 - self.keep / self.total
            margin = 6.0 * math.sqrt(sample.size * quantile * (1.0 - quantile)) + 8
            ranks = (
                max(int(quantile * sample.size - margin), 0),
                min(int(quantile * sample.size + margin), sample.size - 1),
            )
            self._bracket = numpy.partition(sample, ranks)[list(ranks)]  # two order statistics, not a full sort
        low, high = self._bracket
        if fused(base, model, dtypes=(torch.bfloat16,)):  # kernels.c: the same counts and band in one pass
            band = numpy.empty(base.numel(), dtype=numpy.float32)
            above, inside = _kernels.magnitude_band(
                base.data_ptr(), model.data_ptr(), base.numel(), low, high, band.ctypes.data, True
            )
            self._band.append(band[:inside].copy())
            self._above += above
            return
        for begin in range(0, base.numel(), ELEMENTWISE_CHUNK):
            chunk = self._magnitudes(base, model, slice(begin, begin + ELEMENTWISE_CHUNK)).cpu().numpy()
            reach_low = chunk >= low
            self._band.append(numpy.compress(reach_low & (chunk <= high), chunk))
            self._above += numpy.count_nonzero(reach_low) - self._band[-1].size  # reaching the bracket, not inside

    def select(self, whole) -> float:
        """The threshold, once every slab was sampled and counted; `whole()` gives (base, model) if the bracket
        missed, or for a tensor of at most one chunk."""
        if self.value is not None:
            return self.value
        if self.total > ELEMENTWISE_CHUNK:
            # kthvalue, not numpy's partition, which slowed down badly on the band's millions of repeated magnitudes
            band = torch.from_numpy(numpy.concatenate(self._band))
            rank_in_band = self.keep - int(self._above)
            if 1 <= rank_in_band <= band.numel():
                self.value = torch.kthvalue(band, band.numel() - rank_in_band + 1).values.item()
                return self.value
        self.value = magnitude_threshold(self._magnitudes(*whole(), slice(None)), self.keep)
        return self.value


def below(value: float) -> float:
    """The largest float32 under a positive `value` (inf for NaN, which nothing reaches): for float32 x >= 0,
    `x > below(v)` is `x >= v`."""
    if math.isnan(value):
        return math.inf
    return float(numpy.nextafter(numpy.float32(value), numpy.float32(0.0)))


def at_least(values: torch.Tensor, threshold: float) -> torch.Tensor:
    """1.0 where non-negative `values` reach `threshold`, else 0.0, in place.

    Float ops only (hardshrink keeps what exceeds the float just below the threshold, sign maps it to 1): a
    comparison writing bools and a multiply by them cost several times more on the CPU. A NaN value gives 0.0,
    1.0 or NaN, any of which carries a NaN delta through the multiply.
    """
    if threshold <= 0.0:
        return values.fill_(1.0)
    return torch.hardshrink(values, below(threshold), out=values).sign_()


def trim(delta: torch.Tensor, threshold: float) -> torch.Tensor:
    """TIES's trim in place: zero the entries of magnitude below `threshold` (Yadav et al. 2023, section 3).

    One float op: hardshrink at the float just below the threshold keeps exactly the entries whose magnitude
    reaches it and writes +0.0 elsewhere, the bytes of a masked_fill. A threshold of 0 keeps everything and
    turns -0.0 into +0.0, as masking nothing and adding +0.0 would.
    """
    return torch.hardshrink(delta, trim_lambda(threshold), out=delta)


def trim_lambda(threshold: float) -> float:
    """The hardshrink bound of `trim` (also kernels.c's): the float just below a positive threshold, else 0."""
    return below(threshold) if threshold > 0.0 else 0.0


def outlier_band(base: torch.Tensor, model: torch.Tensor, density: float, gamma: float) -> tuple[float, float]:
    """Model Breadcrumbs' band (Davari & Belilovsky 2023, §3): the magnitudes [low, high] of model - base kept
    after dropping the largest `gamma` share (outliers) and then the smallest, so int(density·n) entries stay.

    As in mergekit, a full density keeps everything and the outlier cut shrinks when density + gamma > 1.
    """
    if density >= 1.0:
        return 0.0, math.inf
    total = base.numel()
    keep = int(density * total)
    if keep == 0:
        return math.inf, math.inf
    bottom = max(0, total - keep - int(gamma * total))
    magnitudes = (model.to(torch.float32) - base.to(torch.float32)).abs_().reshape(-1)
    low = torch.kthvalue(magnitudes, bottom + 1).values.item()
    high = torch.kthvalue(magnitudes, bottom + keep).values.item()
    return low, high


DRAW_LEVELS = 1 << 16  # DARE draws 16 bits per entry: drop probabilities are multiples of 2^-16
ENTRIES_PER_COUNTER = 16  # one Philox4x64 block is four 64-bit words: 16 draws of 16 bits


def drop_threshold(drop: float) -> int:
    """DARE's drop probability in steps of 2^-16: an entry is dropped where its 16-bit draw is below this count.

    The applied drop is round(drop·2^16)/2^16, within 2^-17 (7.6e-6) of `drop`; below 2^-17 nothing is dropped,
    and the largest is 1 - 2^-16. Any one tensor's realized drop rate scatters by sqrt(drop(1-drop)/n) around it,
    more than 2^-17 for every tensor under ~10^9 entries at drops of 0.1-0.9, so the step is lost in the noise
    DARE already makes; the rescale (`random_drop`) uses the applied drop, so the expectation stays exact.
    """
    return min(round(drop * DRAW_LEVELS), DRAW_LEVELS - 1)


def keep_indicator(key: int, begin: int, size: int, drop: float) -> torch.Tensor | None:
    """DARE's keep mask (mask version 2) for entries [begin, begin + size) of one model's flattened task vector:
    float32 1.0 where the entry is kept, 0.0 where dropped; None when nothing drops.

    Entry i's draw is the 16-bit word i mod 16 (little-endian, words in order) of Philox4x64-10 (Salmon et al.
    2011, "Parallel random numbers: as easy as 1, 2, 3", §4) at counter i // 16 + 1 under the 128-bit `key`:
    numpy's Philox, whose streams numpy keeps stable, starts one counter past the one it is given. So a chunk's
    mask depends only on (key, begin, size), and chunks are drawn in any order, on any thread, in any size.
    The entry is kept where its draw reaches `drop_threshold(drop)`, compared in integers.
    """
    threshold = drop_threshold(drop)
    if threshold == 0:
        return None
    counter, skip = divmod(begin, ENTRIES_PER_COUNTER)
    words = numpy.random.Philox(key=key, counter=counter).random_raw(-(-(skip + size) // 4))
    draws = words.astype("<u8", copy=False).view("<u2")[skip : skip + size]
    return torch.from_numpy(numpy.greater_equal(draws, threshold).astype(numpy.float32))


def random_drop(delta: torch.Tensor, drop: float, keep: torch.Tensor | None, rescale: bool = True) -> torch.Tensor:
    """DARE: drop each entry with probability `drop`, rescale survivors by 1/(1-drop) to keep the expectation
    (DARE §3; `rescale=False` keeps them as they are). `keep` is the mask from `keep_indicator`, whose applied
    drop (`drop_threshold`) the rescale divides by.

    The mask depends only on the seed, the tensor, the model and the entry, so the same seed gives the same
    mask on any device. Dropping multiplies by the float keep indicator, several times faster than a
    masked_fill on a random mask (no branch to mispredict). One addcmul does it all: +0.0 + (scale·delta)·keep,
    the rescaled delta times an exact 0 or 1, plus +0.0, which turns the -0.0 of dropped negative entries into
    the +0.0 a masked_fill writes; a fused multiply-add rounds it the same (a delta overflowed to inf would
    become NaN, which the result check reports).
    """
    if keep is None:
        return delta
    return torch.addcmul(
        delta.new_zeros(()), delta, keep.to(delta.device), value=drop_rescale(drop, rescale), out=delta
    )


def drop_rescale(drop: float, rescale: bool = True) -> float:
    """The factor on DARE's survivors (`random_drop`, also kernels.c's): 1/(1 - applied drop), or 1."""
    return DRAW_LEVELS / (DRAW_LEVELS - drop_threshold(drop)) if rescale else 1.0


def magprune_keep_probabilities(delta: torch.Tensor, density: float, epsilon: float) -> torch.Tensor:
    """DELLA's MagPrune (Deep et al. 2024, §3.1): keep probabilities rising linearly with magnitude rank.

    Within each row (dim 1; a vector is one row), the smallest entry is kept with probability
    density - epsilon, the largest with density + epsilon, evenly spaced in rank between them, so the
    expected kept share is `density`.
    """
    rows = delta.unsqueeze(0) if delta.dim() < 2 else delta
    ranks = rows.abs().argsort(dim=1).argsort(dim=1).to(torch.float32)
    rank_share = ranks / max(rows.shape[1] - 1, 1)
    return ((density - epsilon) + rank_share * (2.0 * epsilon)).reshape(delta.shape)


def magprune(delta: torch.Tensor, density: float, epsilon: float, generator: torch.Generator) -> torch.Tensor:
    """Drop entries of `delta` at random with MagPrune's magnitude-ranked probabilities (a full density keeps all)."""
    if density >= 1.0:
        return delta
    keep = magprune_keep_probabilities(delta, density, epsilon)
    draws = torch.rand(delta.shape, generator=generator, dtype=torch.float32).to(delta.device)
    return delta.masked_fill_(draws >= keep, 0.0)


def l1_rescaled(sparse: torch.Tensor, dense_l1: float) -> torch.Tensor:
    """Scale a sparsified delta back to the L1 norm it had before (mergekit's `rescale`); near-zero norms stay."""
    sparse_l1 = sparse.abs().sum().item()
    if dense_l1 < 1e-7 or sparse_l1 < 1e-7:
        return sparse
    return sparse.mul_(dense_l1 / sparse_l1)


def sum_of_products(rows: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """Σ rows[i]·factors[i] added model after model from +0.0, one addcmul per row: a fixed rounding order,
    unlike torch's blocked sum(dim=0) (the same bytes for up to four rows). For factors of exact 0s and 1s (the
    agreement), where a fused multiply-add rounds as a multiply and an add do."""
    total = torch.addcmul(rows.new_zeros(()), rows[0], factors[0])
    for row, factor in zip(rows[1:], factors[1:], strict=True):
        total.addcmul_(row, factor)
    return total


def row_sum(rows: torch.Tensor, weights: Sequence[float] | None = None) -> torch.Tensor:
    """Σ weights[i]·rows[i] in model order, one add per row. Unlike `sum_of_products` it does not start from
    +0.0, so a zero sum may be -0.0: for sums whose zero's sign nothing reads (the total whose sign is elected,
    the guarded divisor). Weighted rows must be of exact 0s and 1s, where add's alpha rounds as a multiply."""
    weights = [1.0] * len(rows) if weights is None else weights
    total = rows[0] if weights[0] == 1.0 else rows[0] * weights[0]
    for row, weight in zip(rows[1:], weights[1:], strict=True):
        total = torch.add(total, row, alpha=weight)
    return total


def sign_consensus(weighted_deltas: torch.Tensor, zero_sum_positive: bool = False) -> torch.Tensor:
    """TIES's elect step (§3): the sign with the larger total mass wins per entry; True where a delta agrees.

    An exact tie elects no sign, so nothing is kept there; `zero_sum_positive` elects + as mergekit does.
    Zero deltas never agree with an elected sign.
    """
    total = row_sum(weighted_deltas)  # -0.0 >= 0 and -0.0 == 0.0: a zero's sign changes nothing below
    elected = torch.where(total >= 0, 1.0, -1.0).to(total.dtype) if zero_sum_positive else total.sign()
    return weighted_deltas.sign() == elected


def positive_agreement(weighted_deltas: torch.Tensor, zero_sum_positive: bool = False) -> torch.Tensor:
    """`sign_consensus` as float32 for deltas weighted by at least NORM_EPS: 1.0 where a delta agrees, else ±0.0.

    The merge's bytes are those of the comparison, in float ops only (bool tensors are slow on the CPU):
    sign(d·elected) (elected is -1, 0 or 1, so d·elected is exact), clamped at 0, can differ from it only in the
    sign of a zero term, and a zero's sign reaches the result only where the base is -0.0. There every zero delta
    is +0.0 (x - (-0.0) is never -0.0, the sparsifiers write +0.0, positive weights keep it), so where no sign is
    elected both sum to +0.0, and where one is, some row strictly agrees and the sum is the agreeing rows'. The
    total's zero may be -0.0 (`row_sum`): only when every delta is a zero, which no elected sign keeps.
    """
    total = row_sum(weighted_deltas)
    elected = (
        torch.copysign(torch.ones((), dtype=total.dtype, device=total.device), total)
        if zero_sum_positive
        else total.sign_()
        if len(weighted_deltas) > 1
        else torch.sign(total)
    )  # one row: total is that row
    return torch.mul(weighted_deltas, elected).sign_().clamp_min_(0.0)


@dataclass(frozen=True, kw_only=True)
class TaskVectorRecipe:
    """What `task_vector_merge` does with its inputs: the combination a method names (`sparsifier`, `consensus`,
    `normalize`, `rescale`, `mergekit_rules`, `scale`) and the sparsifier's inputs per model. Every field defaults
    to plain task arithmetic; `sparsifier` may be given by its value ("magnitude").

    The magnitude trim takes `thresholds` (from `trim_threshold`) and the outlier band (low, high) pairs (from
    `outlier_band`), so a tensor can be merged in chunks; both are computed from `densities` (and `gammas`) when
    not given. DARE drops with `drops`, its masks drawn from each model's Philox `keys` over the whole tensor
    where no chunk's masks are given; MagPrune draws with `densities` and `epsilons` from each model's
    `generators`. `rescale` is the sparsifier's own: DARE's 1/(1-drop), or for MagPrune and the outlier band the
    delta's L1 norm before sparsification (mergekit's; whole tensors only). `mergekit_rules` selects mergekit's
    trim count and sign vote (see `trim_threshold`, `sign_consensus`).
    """

    scale: float = 1.0
    sparsifier: Sparsifier | None = None
    consensus: bool = False
    normalize: bool = False
    rescale: bool = True
    mergekit_rules: bool = False
    densities: Sequence[float] | None = None
    thresholds: Sequence | None = None
    drops: Sequence[float] | None = None
    keys: Sequence[int] | None = None
    generators: Sequence[torch.Generator] | None = None
    epsilons: Sequence[float] | None = None
    gammas: Sequence[float] | None = None

    def __post_init__(self):
        if self.sparsifier is not None:
            object.__setattr__(self, "sparsifier", Sparsifier(self.sparsifier))


def task_vector_merge(
    base: torch.Tensor,
    models: Sequence[torch.Tensor],
    weights: Sequence[float],
    recipe: TaskVectorRecipe | None = None,
    *,
    keeps: Sequence[torch.Tensor | None] | None = None,
    out: torch.Tensor | None = None,
    **recipe_fields,
) -> torch.Tensor:
    """base + scale * combine(weight_i * sparsify(model_i - base)), in float32, or rounded once into `out` where
    the compiled kernel takes the inputs (`fused_task_vectors`; the same bytes), as `recipe` says (or its fields
    given as keywords: `scale=0.5, sparsifier="magnitude", densities=[0.5]`; with a recipe, they replace its own).

    combine is a plain sum, or with `consensus` the sum of the entries agreeing with the elected sign.
    `normalize` divides by the sum of the weights that contributed to each entry (TIES's disjoint mean).
    `keeps` are DARE's masks of this chunk per model (from `keep_indicator`; None where a model drops nothing).
    """
    if recipe is None or recipe_fields:
        recipe = TaskVectorRecipe(**recipe_fields) if recipe is None else replace(recipe, **recipe_fields)
    sparsifier, thresholds = recipe.sparsifier, recipe.thresholds
    if sparsifier is Sparsifier.MAGNITUDE and thresholds is None:
        thresholds = [
            trim_threshold(base, model, density, recipe.mergekit_rules)
            for model, density in zip(models, recipe.densities, strict=True)
        ]
    if sparsifier is Sparsifier.RANDOM and keeps is None:
        keeps = [
            keep_indicator(key, 0, base.numel(), drop) for key, drop in zip(recipe.keys, recipe.drops, strict=True)
        ]
    if (
        out is not None
        and sparsifier in FUSED_SPARSIFIERS
        and len(models) <= MAX_FUSED_MODELS
        and fused(out, base, *models, dtypes=(torch.bfloat16,))
        and all(keep is None or fused(keep, dtypes=(torch.float32,)) for keep in keeps or ())
    ):
        trims = thresholds if sparsifier is Sparsifier.MAGNITUDE else None
        return fused_task_vectors(out, base, models, weights, recipe, trims, keeps)
    base32 = base.to(torch.float32)
    if sparsifier is Sparsifier.OUTLIERS and thresholds is None:
        thresholds = [
            outlier_band(base32, model, density, gamma)
            for model, density, gamma in zip(models, recipe.densities, recipe.gammas, strict=True)
        ]
    consensus, rescale = recipe.consensus, recipe.rescale
    if consensus:
        stacked = torch.empty((len(models), *base32.shape), dtype=torch.float32, device=base32.device)
    restores_l1 = rescale and sparsifier is not None and sparsifier.l1_rescaled
    merged = None
    for index, (model, weight) in enumerate(zip(models, weights, strict=True)):
        slot = stacked[index] if consensus else None
        delta = task_vector(model, base32, out=slot)
        dense_l1 = delta.abs().sum().item() if restores_l1 else None
        if sparsifier is Sparsifier.MAGNITUDE:
            trim(delta, thresholds[index])
        elif sparsifier is Sparsifier.RANDOM:
            keep = None if keeps[index] is None else keeps[index].view(delta.shape)
            delta = random_drop(delta, recipe.drops[index], keep, rescale)
        elif sparsifier is Sparsifier.MAGPRUNE:
            delta = magprune(delta, recipe.densities[index], recipe.epsilons[index], recipe.generators[index])
        elif sparsifier is Sparsifier.OUTLIERS:
            low, high = thresholds[index]
            magnitudes = delta.abs()
            delta.masked_fill_((magnitudes < low) | (magnitudes > high), 0.0)
        if dense_l1 is not None:
            delta = l1_rescaled(delta, dense_l1)
        if weight != 1.0:  # x * 1.0 == x exactly: skipping the pass changes no byte
            delta.mul_(weight)
        if not consensus:  # with consensus, delta is its row of the stack already: the sparsifiers work in place
            merged = delta if merged is None else merged.add_(delta)
    if consensus:
        positive = weighted_at_least_eps(weights)
        agree = (
            positive_agreement(stacked, recipe.mergekit_rules)
            if positive
            else sign_consensus(stacked, zero_sum_positive=recipe.mergekit_rules).to(torch.float32)
        )  # converted once
        merged = sum_of_products(stacked, agree)
        if recipe.normalize:
            divisor = row_sum(agree, weights)
            if positive:  # every non-zero divisor is then at least NORM_EPS: a clamp does the masked fill's work
                divisor = divisor.clamp_min_(NORM_EPS)  # in place: a new sum, or the agreement, read already
            else:
                divisor = divisor.masked_fill(divisor.abs() < NORM_EPS, 1.0)
            if recipe.scale == 1.0:  # base + merged / divisor in one pass: a division, then an addition, as unfused
                return torch.addcdiv(base32, merged, divisor, out=merged)
            merged.div_(divisor)
    elif recipe.normalize:
        total = math.fsum(weights)
        if abs(total) >= NORM_EPS:
            merged.div_(total)
    if recipe.scale != 1.0:
        merged.mul_(recipe.scale)
    return merged.add_(base32)


def weighted_at_least_eps(weights: Sequence[float]) -> bool:
    """Every weight at least NORM_EPS: the consensus of `positive_agreement` applies, else of `sign_consensus`."""
    return all(weight >= NORM_EPS for weight in weights)


def fused_task_vectors(
    out: torch.Tensor,
    base: torch.Tensor,
    models: Sequence[torch.Tensor],
    weights: Sequence[float],
    recipe: TaskVectorRecipe,
    thresholds: Sequence[float] | None,
    keeps: Sequence[torch.Tensor | None] | None,
) -> torch.Tensor:
    """`task_vector_merge` for bfloat16 inputs and output on the CPU, in kernels.c's one pass: the same operations
    in the same order (trim's hardshrink at `below` the threshold, DARE's addcmul, the weights, the sum or the
    consensus of `positive_agreement` or `sign_consensus`, the divisor of `row_sum`, the scale and the base), so
    the same bytes as the float32 result rounded. `thresholds`: the magnitude trim's, else None."""
    scale, drops, consensus, normalize = recipe.scale, recipe.drops, recipe.consensus, recipe.normalize
    count = len(models)
    lambdas = [-1.0] * count if thresholds is None else [trim_lambda(threshold) for threshold in thresholds]
    keeps = [None] * count if keeps is None else keeps
    keep_scales = [
        drop_rescale(drop, recipe.rescale) if keep is not None else 1.0
        for keep, drop in zip(keeps, drops or [0.0] * count, strict=True)
    ]
    agreement = 0 if not consensus else 1 if weighted_at_least_eps(weights) else 2
    total = math.fsum(weights)
    _kernels.task_vectors(
        out.data_ptr(),
        base.data_ptr(),
        [model.data_ptr() for model in models],
        out.numel(),
        list(weights),
        lambdas,
        [0 if keep is None else keep.data_ptr() for keep in keeps],
        keep_scales,
        agreement,
        recipe.mergekit_rules,
        normalize,
        not consensus and normalize and abs(total) >= NORM_EPS,
        scale != 1.0,
        total,
        scale,
        NORM_EPS,
    )
    return out


def gram_matrix(tensors: Sequence[torch.Tensor], origin: torch.Tensor | None = None) -> torch.Tensor:
    """The float64 [k, k] inner products <x_i, x_j> of flattened tensors (minus `origin` when given), chunked."""
    flats = [tensor.reshape(-1) for tensor in tensors]
    origin_flat = None if origin is None else origin.reshape(-1)
    gram = torch.zeros((len(flats), len(flats)), dtype=torch.float64)
    for begin in range(0, flats[0].numel(), CHUNK):
        part = slice(begin, begin + CHUNK)
        rows = torch.stack([flat[part].to(torch.float64) for flat in flats])
        if origin_flat is not None:
            rows -= origin_flat[part].to(torch.float64)
        gram += (rows @ rows.T).cpu()
    return gram


def as_rows(tensor: torch.Tensor, axis: int) -> torch.Tensor:
    """The tensor as [rows, size] with the vectors along `axis` as rows (a vector is one row)."""
    if tensor.dim() < 2:
        return tensor.reshape(1, -1)
    return tensor.movedim(axis, -1).reshape(-1, tensor.shape[axis])


def row_gram_matrices(tensors: Sequence[torch.Tensor], axis: int, origin: torch.Tensor | None = None) -> torch.Tensor:
    """[rows, k, k] Gram matrices of the vectors along `axis` (minus `origin` when given), summed in float64
    from float32 products, one pair at a time."""
    rows = [as_rows(tensor, axis).to(torch.float32) for tensor in tensors]
    if origin is not None:
        rows = [row - as_rows(origin, axis).to(torch.float32) for row in rows]
    gram = torch.empty((rows[0].shape[0], len(rows), len(rows)), dtype=torch.float64)
    for i in range(len(rows)):
        for j in range(i, len(rows)):
            gram[:, i, j] = gram[:, j, i] = (rows[i] * rows[j]).sum(dim=-1, dtype=torch.float64).cpu()
    return gram


def combine_rows(tensors: Sequence[torch.Tensor], coefficients: torch.Tensor, axis: int) -> torch.Tensor:
    """Σ_i coefficients[:, i] * tensor_i row by row (rows along `axis`, as `as_rows`), in float32."""
    shape = tensors[0].shape
    moved = tensors[0].movedim(axis, -1).shape if tensors[0].dim() >= 2 else shape
    merged = torch.zeros(as_rows(tensors[0], axis).shape, dtype=torch.float32, device=tensors[0].device)
    for index, tensor in enumerate(tensors):
        column = coefficients[:, index : index + 1].to(torch.float32).to(merged.device)
        merged.add_(as_rows(tensor, axis).to(torch.float32) * column)
    if tensors[0].dim() < 2:
        return merged.reshape(shape)
    return merged.reshape(moved).movedim(-1, axis)
