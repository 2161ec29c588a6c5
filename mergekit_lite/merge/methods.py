"""Merge math: pure functions, tensors in, one float32 tensor out. No files, no names, no config.

Task arithmetic, TIES, DARE-linear and DARE-TIES are one family (`task_vector_merge`): task vectors
(model - base), an optional sparsifier (magnitude trim or random drop-and-rescale), an optional sign
consensus, and a weighted sum added back to the base. Each method in `TASK_VECTOR_METHODS` names one
combination, as mergekit's generalized task arithmetic does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

COLINEAR_DOT = 0.9995
NORM_EPS = 1e-8
CHUNK = 1 << 20  # elements per chunk: a few MB of float32 temporaries, few enough calls to amortize
THRESHOLD_SAMPLE = 1 << 16  # strided sample that brackets TIES's trim threshold on large tensors


def linear(tensors: Sequence[torch.Tensor], weights: Sequence[float], normalize: bool = True) -> torch.Tensor:
    """Weighted sum of tensors (LERP/EMA for two); with `normalize`, weights are proportions of their sum."""
    if normalize:
        total = math.fsum(weights)
        if total == 0:
            raise ValueError("linear weights sum to zero; cannot normalize")
        weights = [w / total for w in weights]
    merged = tensors[0].to(torch.float32, copy=True).mul_(weights[0])
    for tensor, weight in zip(tensors[1:], weights[1:]):
        merged.add_(tensor, alpha=weight)
    return merged


def lerp(start: torch.Tensor, end: torch.Tensor, alpha: float) -> torch.Tensor:
    """alpha*end + (1-alpha)*start, exact at alpha 0 and 1."""
    return linear([start, end], [1.0 - alpha, alpha], normalize=False)


def slerp_weights(start: torch.Tensor, end: torch.Tensor, t: float) -> tuple[float, float]:
    """The two coefficients SLERP puts on `start` and `end`: sin((1-t)θ)/sinθ and sin(tθ)/sinθ.

    The angle comes from the normalized vectors, the interpolation uses the raw ones (as mergekit and
    the original SLERP merges do), so norms are interpolated too. Nearly colinear vectors and zero
    vectors get the linear coefficients (1-t, t), where the spherical formula loses precision or is
    undefined. Reductions run chunk by chunk in float32 and accumulate in float64.
    """
    start_flat, end_flat = start.reshape(-1), end.reshape(-1)
    dot = start_sq = end_sq = 0.0
    for begin in range(0, start_flat.numel(), CHUNK):
        a = start_flat[begin:begin + CHUNK].to(torch.float32)
        b = end_flat[begin:begin + CHUNK].to(torch.float32)
        dot += torch.dot(a, b).item()
        start_sq += torch.dot(a, a).item()
        end_sq += torch.dot(b, b).item()
    start_norm, end_norm = math.sqrt(start_sq), math.sqrt(end_sq)
    if start_norm < NORM_EPS or end_norm < NORM_EPS:
        return 1.0 - t, t
    cosine = max(-1.0, min(1.0, dot / (start_norm * end_norm)))
    if abs(cosine) > COLINEAR_DOT:
        return 1.0 - t, t
    theta = math.acos(cosine)
    sin_theta = math.sin(theta)
    return math.sin((1.0 - t) * theta) / sin_theta, math.sin(t * theta) / sin_theta


def slerp(start: torch.Tensor, end: torch.Tensor, t: float) -> torch.Tensor:
    """Spherical interpolation of two tensors seen as flat vectors (see `slerp_weights`)."""
    return linear([start, end], slerp_weights(start, end, t), normalize=False)


def magnitude_threshold(magnitudes: torch.Tensor, keep: int) -> float:
    """The `keep`-th largest value of a non-negative tensor: a linear-time selection (kthvalue), not a sort."""
    flat = magnitudes.reshape(-1)
    return torch.kthvalue(flat, flat.numel() - keep + 1).values.item()


def trim_threshold(base: torch.Tensor, model: torch.Tensor, density: float, mergekit_rules: bool = False) -> float:
    """The magnitude below which TIES's trim zeroes entries of model - base, keeping the top `density` share.

    The share is round(density * n) entries (TIES §3, "keep the top-k% values"), plus any entries tied at
    the threshold, so equal magnitudes are treated alike; with `mergekit_rules`, max(1, int(density * n)) as
    mergekit's sparsify.magnitude counts (it then breaks ties by sort order, which is not reproducible).

    Exact, without materializing the task vector: a strided sample brackets the threshold between two
    sample quantiles a few binomial standard deviations apart, one chunked pass counts the entries above
    the bracket and gathers the few inside it, and the answer is selected among those. When the bracket
    misses (rare), it falls back to kthvalue over all magnitudes. Same value as a full selection either way.
    """
    total = base.numel()
    keep = max(1, int(density * total)) if mergekit_rules else round(density * total)
    if density >= 1.0:
        return 0.0
    if keep == 0:
        return math.inf
    base_flat, model_flat = base.reshape(-1), model.reshape(-1)

    def magnitudes(part: slice) -> torch.Tensor:
        return (model_flat[part].to(torch.float32) - base_flat[part].to(torch.float32)).abs_()

    if total <= CHUNK:
        return magnitude_threshold(magnitudes(slice(None)), keep)
    sample = magnitudes(slice(None, None, max(total // THRESHOLD_SAMPLE, 1))).sort().values
    quantile = 1.0 - keep / total
    margin = 6.0 * math.sqrt(sample.numel() * quantile * (1.0 - quantile)) + 8
    low = sample[max(int(quantile * sample.numel() - margin), 0)].item()
    high = sample[min(int(quantile * sample.numel() + margin), sample.numel() - 1)].item()
    above, band = 0, []
    for begin in range(0, total, CHUNK):
        chunk = magnitudes(slice(begin, begin + CHUNK))
        above += int(torch.count_nonzero(chunk > high))
        band.append(chunk[(chunk >= low) & (chunk <= high)])
    band = torch.cat(band)
    rank_in_band = keep - above
    if 1 <= rank_in_band <= band.numel():
        return torch.kthvalue(band, band.numel() - rank_in_band + 1).values.item()
    return magnitude_threshold(magnitudes(slice(None)), keep)


def trim(delta: torch.Tensor, threshold: float) -> torch.Tensor:
    """TIES's trim in place: zero the entries of magnitude below `threshold` (Yadav et al. 2023, section 3).

    A multiply by the keep mask is about twice as fast as masked_fill; adding +0.0 turns the -0.0 it leaves
    for trimmed negative entries into +0.0, so the bytes equal a masked_fill's (trimmed entries are finite).
    """
    return delta.mul_(delta.abs() >= threshold).add_(0.0)


def random_drop(delta: torch.Tensor, drop: float, generator: torch.Generator, rescale: bool = True) -> torch.Tensor:
    """DARE: drop each entry with probability `drop`, rescale survivors by 1/(1-drop) to keep the expectation
    (DARE §3; `rescale=False` keeps them as they are).

    The mask is drawn on the CPU from the caller's seeded generator, so the same seed gives the same
    mask on any device.
    """
    if drop <= 0.0:
        return delta
    drop_mask = torch.rand(delta.shape, generator=generator, dtype=torch.float32) < drop
    if rescale:
        delta.mul_(1.0 / (1.0 - drop))
    return delta.masked_fill_(drop_mask.to(delta.device), 0.0)


def sign_consensus(weighted_deltas: torch.Tensor, zero_sum_positive: bool = False) -> torch.Tensor:
    """TIES's elect step (§3): the sign with the larger total mass wins per entry; True where a delta agrees.

    An exact tie elects no sign, so nothing is kept there; `zero_sum_positive` elects + as mergekit does.
    Zero deltas never agree with an elected sign.
    """
    total = weighted_deltas.sum(dim=0)
    elected = torch.where(total >= 0, 1.0, -1.0).to(total.dtype) if zero_sum_positive else total.sign()
    return weighted_deltas.sign() == elected


@dataclass(frozen=True)
class TaskVectorRecipe:
    """One member of the task-vector family: which sparsifier, whether signs must agree, default normalization."""

    sparsifier: str | None  # None, "magnitude" or "random"
    consensus: bool
    normalize: bool


TASK_VECTOR_METHODS = {
    "task_arithmetic": TaskVectorRecipe(sparsifier=None, consensus=False, normalize=False),
    "ties": TaskVectorRecipe(sparsifier="magnitude", consensus=True, normalize=True),
    "dare_linear": TaskVectorRecipe(sparsifier="random", consensus=False, normalize=False),
    "dare_ties": TaskVectorRecipe(sparsifier="random", consensus=True, normalize=True),
}


def task_vector_merge(
    base: torch.Tensor,
    models: Sequence[torch.Tensor],
    weights: Sequence[float],
    *,
    scale: float = 1.0,
    sparsifier: str | None = None,
    densities: Sequence[float] | None = None,
    thresholds: Sequence[float] | None = None,
    drops: Sequence[float] | None = None,
    generators: Sequence[torch.Generator] | None = None,
    consensus: bool = False,
    normalize: bool = False,
    rescale: bool = True,
    mergekit_rules: bool = False,
) -> torch.Tensor:
    """base + scale * combine(weight_i * sparsify(model_i - base)).

    combine is a plain sum, or with `consensus` the sum of the entries agreeing with the elected sign.
    `normalize` divides by the sum of the weights that contributed to each entry (TIES's disjoint mean).
    The magnitude trim takes `thresholds` (from `trim_threshold`, so a tensor can be merged in chunks),
    or computes them here from `densities`. `rescale` is DARE's 1/(1-drop); `mergekit_rules` selects
    mergekit's trim count and sign vote (see `trim_threshold`, `sign_consensus`).
    """
    base32 = base.to(torch.float32)
    if sparsifier == "magnitude" and thresholds is None:
        thresholds = [trim_threshold(base32, model, density, mergekit_rules) for model, density in zip(models, densities)]
    if consensus:
        stacked = torch.empty((len(models), *base32.shape), dtype=torch.float32, device=base32.device)
    merged = None
    for index, (model, weight) in enumerate(zip(models, weights)):
        delta = model.to(torch.float32).sub(base32)
        if sparsifier == "magnitude":
            trim(delta, thresholds[index])
        elif sparsifier == "random":
            delta = random_drop(delta, drops[index], generators[index], rescale)
        delta.mul_(weight)
        if consensus:
            stacked[index] = delta
        elif merged is None:
            merged = delta
        else:
            merged.add_(delta)
    if consensus:
        agree = sign_consensus(stacked, zero_sum_positive=mergekit_rules)
        merged = stacked.mul_(agree).sum(dim=0)
        if normalize:
            weight_column = torch.tensor(weights, dtype=torch.float32, device=base32.device)
            weight_column = weight_column.reshape(-1, *([1] * base32.dim()))
            divisor = (agree * weight_column).sum(dim=0)
            divisor.masked_fill_(divisor.abs() < NORM_EPS, 1.0)
            merged.div_(divisor)
    elif normalize:
        total = math.fsum(weights)
        if abs(total) >= NORM_EPS:
            merged.div_(total)
    return merged.mul_(scale).add_(base32)
