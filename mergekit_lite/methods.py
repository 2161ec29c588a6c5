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


def linear(tensors: Sequence[torch.Tensor], weights: Sequence[float], normalize: bool = True) -> torch.Tensor:
    """Weighted sum of tensors (LERP/EMA for two); with `normalize`, weights are proportions of their sum."""
    if normalize:
        total = math.fsum(weights)
        if total == 0:
            raise ValueError("linear weights sum to zero; cannot normalize")
        weights = [w / total for w in weights]
    merged = tensors[0].to(torch.float32) * weights[0]
    for tensor, weight in zip(tensors[1:], weights[1:]):
        merged.add_(tensor, alpha=weight)
    return merged


def lerp(start: torch.Tensor, end: torch.Tensor, alpha: float) -> torch.Tensor:
    """alpha*end + (1-alpha)*start, exact at alpha 0 and 1."""
    return linear([start, end], [1.0 - alpha, alpha], normalize=False)


def slerp(start: torch.Tensor, end: torch.Tensor, t: float) -> torch.Tensor:
    """Spherical interpolation of two flattened tensors; linear where the angle is degenerate.

    The angle comes from the normalized vectors, the interpolation uses the raw ones (as mergekit and
    the original SLERP merges do), so norms are interpolated too. Nearly colinear vectors and zero
    vectors fall back to `lerp`, where the spherical formula loses precision or is undefined.
    """
    start32, end32 = start.to(torch.float32), end.to(torch.float32)
    start_norm = torch.linalg.vector_norm(start32).item()
    end_norm = torch.linalg.vector_norm(end32).item()
    if start_norm < NORM_EPS or end_norm < NORM_EPS:
        return lerp(start32, end32, t)
    cosine = torch.dot(start32.reshape(-1), end32.reshape(-1)).item() / (start_norm * end_norm)
    cosine = max(-1.0, min(1.0, cosine))
    if abs(cosine) > COLINEAR_DOT:
        return lerp(start32, end32, t)
    theta = math.acos(cosine)
    sin_theta = math.sin(theta)
    merged = start32 * (math.sin((1.0 - t) * theta) / sin_theta)
    merged.add_(end32, alpha=math.sin(t * theta) / sin_theta)
    return merged


def magnitude_threshold(magnitudes: torch.Tensor, keep: int) -> float:
    """The `keep`-th largest value of a non-negative tensor: a linear-time selection (kthvalue), not a sort."""
    flat = magnitudes.reshape(-1)
    return torch.kthvalue(flat, flat.numel() - keep + 1).values.item()


def magnitude_trim(delta: torch.Tensor, density: float) -> torch.Tensor:
    """TIES's trim: keep the top `density` share of entries by magnitude, zero the rest."""
    if density >= 1.0:
        return delta
    keep = round(density * delta.numel())
    if keep == 0:
        return torch.zeros_like(delta)
    magnitudes = delta.abs()
    threshold = magnitude_threshold(magnitudes, keep)
    return delta.masked_fill_(magnitudes < threshold, 0.0)


def random_drop(delta: torch.Tensor, drop: float, generator: torch.Generator) -> torch.Tensor:
    """DARE: drop each entry with probability `drop`, rescale survivors by 1/(1-drop) to keep the expectation.

    The mask is drawn on the CPU from the caller's seeded generator, so the same seed gives the same
    mask on any device.
    """
    if drop <= 0.0:
        return delta
    keep_mask = torch.rand(delta.shape, generator=generator, dtype=torch.float32) >= drop
    delta.mul_(1.0 / (1.0 - drop))
    return delta.masked_fill_(~keep_mask.to(delta.device), 0.0)


def sign_consensus(weighted_deltas: torch.Tensor) -> torch.Tensor:
    """TIES's elect step: the sign with the larger total mass wins per entry; True where a delta agrees."""
    elected = weighted_deltas.sum(dim=0).sign()
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
    drops: Sequence[float] | None = None,
    generators: Sequence[torch.Generator] | None = None,
    consensus: bool = False,
    normalize: bool = False,
) -> torch.Tensor:
    """base + scale * combine(weight_i * sparsify(model_i - base)).

    combine is a plain sum, or with `consensus` the sum of the entries agreeing with the elected sign.
    `normalize` divides by the sum of the weights that contributed to each entry (TIES's disjoint mean).
    """
    base32 = base.to(torch.float32)
    if consensus:
        stacked = torch.empty((len(models), *base32.shape), dtype=torch.float32, device=base32.device)
    merged = None
    for index, (model, weight) in enumerate(zip(models, weights)):
        delta = model.to(torch.float32) - base32
        if sparsifier == "magnitude":
            delta = magnitude_trim(delta, densities[index])
        elif sparsifier == "random":
            delta = random_drop(delta, drops[index], generators[index])
        delta.mul_(weight)
        if consensus:
            stacked[index] = delta
        elif merged is None:
            merged = delta
        else:
            merged.add_(delta)
    if consensus:
        agree = sign_consensus(stacked)
        merged = stacked.mul_(agree).sum(dim=0)
        if normalize:
            weight_column = torch.tensor(weights, dtype=torch.float32, device=base32.device)
            weight_column = weight_column.reshape(-1, *([1] * base32.dim()))
            divisor = (agree * weight_column).sum(dim=0)
            divisor[divisor.abs() < NORM_EPS] = 1.0
            merged.div_(divisor)
    elif normalize:
        total = math.fsum(weights)
        if abs(total) >= NORM_EPS:
            merged.div_(total)
    return merged.mul_(scale).add_(base32)
