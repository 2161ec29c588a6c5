"""Fewer evaluations per sweep: an adaptive search over the alpha grid, and probe-set scoring (pure helpers on
indices and outcomes; `adaptive.py` runs them over the sweep's points).

Both are ours; neither changes what a point is, so their points are the grid's own (same labels,
same files) and a later full-grid run resumes from them.

- `golden_section`: the harmonic mean of old and new along an interpolation path rises from one end,
  peaks and falls (old falls towards post, new rises from pre). Under that unimodality a golden-
  section search on the grid's indices finds the peak in about log_1.618(n) + 2 evaluations instead
  of n. It stops early once the bracket it has left is flat within the sampling noise (every
  evaluated point inside it is indistinguishable from the best by the paired bootstrap).
- `probe_plan` / `estimate_accuracy`: samples on which pre and post agree rarely change when the two
  are interpolated ("Demystifying Language Model Forgetting with Low-Rank Example Associations",
  NeurIPS 2025, finds forgetting concentrated on few examples). Every alpha is scored on the samples
  where pre and post disagree, plus a seeded random share of the rest; the full-set accuracy is the
  survey-sampling difference estimator (exact on the disagreeing samples, pre's outcome corrected by
  the observed change rate on the agreeing ones), with its standard error.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

GOLDEN = (math.sqrt(5) - 1) / 2  # 0.618...


@dataclass
class SearchTrace:
    """What the search evaluated and why it stopped (shown in the report)."""

    evaluated: list[int]
    best: int
    reason: str


def golden_section(
    n: int, score: Callable[[int], float], indistinguishable: Callable[[int, int], bool] | None = None
) -> SearchTrace:
    """The index in range(n) with the highest score, evaluating few of them.

    `score(i)` is called at most once per index (results are cached here). `indistinguishable(i, j)`
    says whether two evaluated indices cannot be told apart (e.g. the paired bootstrap interval of
    their difference holds 0); with it, the search stops once the bracket is flat within the noise.
    """
    if n < 1:
        raise ValueError("golden_section needs at least one point")
    cache: dict[int, float] = {}

    def value(index: int) -> float:
        if index not in cache:
            cache[index] = score(index)
        return cache[index]

    low, high = 0, n - 1
    value(low), value(high)
    reason = "bracket narrowed to adjacent grid points"
    while high - low > 2:
        left = low + max(1, round((1 - GOLDEN) * (high - low)))
        right = low + min(high - low - 1, round(GOLDEN * (high - low)))
        if right <= left:
            right = left + 1
        if value(left) >= value(right):
            high = right
        else:
            low = left
        inside = [i for i in cache if low <= i <= high]
        best = max(inside, key=lambda i: (cache[i], -i))
        if (
            indistinguishable is not None
            and len(inside) >= 3
            and all(i == best or indistinguishable(i, best) for i in inside)
        ):
            reason = "every point left in the bracket is indistinguishable from the best"
            break
    else:
        for index in range(low, high + 1):
            value(index)
    best = max(cache, key=lambda i: (cache[i], -i))
    return SearchTrace(sorted(cache), best, reason)


@dataclass(frozen=True)
class ProbePlan:
    """Which samples of one task every alpha is scored on."""

    disagree: tuple[Hashable, ...]  # pre and post differ: always scored
    agree_sampled: tuple[Hashable, ...]  # a seeded random share of the samples where they agree
    agree_total: int
    agree_correct: int  # how many agreeing samples pre (and post) got right
    pre_sampled: tuple[bool, ...]  # pre's outcome on each sampled agreeing sample

    @property
    def scored(self) -> tuple[Hashable, ...]:
        return self.disagree + self.agree_sampled


def probe_plan(
    pre: Mapping[Hashable, bool], post: Mapping[Hashable, bool], rate: float, seed: int, minimum: int = 8
) -> ProbePlan:
    """Disagreeing samples, plus `rate` of the agreeing ones (at least `minimum`), chosen by `seed`."""
    if not 0 < rate <= 1:
        raise ValueError(f"probe rate must be in (0, 1], got {rate}")
    shared = [key for key in pre if key in post]
    disagree = tuple(key for key in shared if bool(pre[key]) != bool(post[key]))
    agree = [key for key in shared if bool(pre[key]) == bool(post[key])]
    count = min(len(agree), max(minimum, math.ceil(rate * len(agree))))
    position = {key: index for index, key in enumerate(agree)}
    sampled = tuple(sorted(random.Random(seed).sample(agree, count), key=position.__getitem__))
    return ProbePlan(
        disagree, sampled, len(agree), sum(bool(pre[key]) for key in agree), tuple(bool(pre[key]) for key in sampled)
    )


def estimate_accuracy(plan: ProbePlan, observed: Mapping[Hashable, bool]) -> tuple[float, float]:
    """(estimated full-set accuracy, its standard error) from the outcomes on `plan.scored`.

    Difference estimator: the disagreeing samples are counted exactly; on the agreeing ones the
    estimate is pre's count plus the agreeing total times the mean change (observed - pre) on the
    sample, whose variance carries the finite-population correction.
    """
    missing = [key for key in plan.scored if key not in observed]
    if missing:
        raise ValueError(f"no outcome for probe sample {missing[0]!r}")
    total = len(plan.disagree) + plan.agree_total
    if total == 0:
        raise ValueError("no samples to estimate from")
    exact = sum(bool(observed[key]) for key in plan.disagree)
    changes = [
        int(bool(observed[key])) - int(before) for key, before in zip(plan.agree_sampled, plan.pre_sampled, strict=True)
    ]
    if not changes:
        return (exact + plan.agree_correct) / total, 0.0
    mean = sum(changes) / len(changes)
    variance = sum((c - mean) ** 2 for c in changes) / max(len(changes) - 1, 1)
    # Seeing no change in the sample is not certainty: floor the variance with one pseudo-change
    # (the add-one idea of Agresti-Coull intervals), so the interval never collapses to a point.
    smoothed = (sum(c != 0 for c in changes) + 1) / (len(changes) + 2)
    variance = max(variance, smoothed * (1 - smoothed))
    correction = 1 - len(changes) / plan.agree_total
    standard_error = plan.agree_total * math.sqrt(max(variance * correction, 0.0) / len(changes))
    return (exact + plan.agree_correct + plan.agree_total * mean) / total, standard_error / total


def harmonic_mean(old: float, new: float) -> float:
    """2on/(o+n): high only when both are high; 0 when both are 0."""
    return 0.0 if old + new == 0 else 2 * old * new / (old + new)


@dataclass(frozen=True)
class ProbeEstimate:
    """old, new and their harmonic mean estimated from probe samples, each with its standard error."""

    old: float
    new: float
    harmonic_mean: float
    old_se: float
    new_se: float
    harmonic_mean_se: float


def estimate_scores(
    plans: Mapping[str, ProbePlan],
    groups: Mapping[str, str],
    observed: Mapping[str, Mapping[Hashable, bool]],
    aggregation: str = "paper",
) -> ProbeEstimate:
    """Group scores from each task's `estimate_accuracy`, aggregated as the sweep aggregates full scores
    ("paper": the unweighted mean over a group's tasks; "pooled": weighted by samples), with errors
    propagated assuming independent tasks; the harmonic mean's error by the delta method. [ours]"""
    values = {}
    for group in ("old", "new"):
        tasks = [task for task in plans if groups[task] == group]
        if not tasks:
            raise ValueError(f"no {group} task to estimate")
        estimates = {task: estimate_accuracy(plans[task], observed[task]) for task in tasks}
        weights = {task: 1 / len(tasks) for task in tasks}
        if aggregation == "pooled":
            sizes = {task: len(plans[task].disagree) + plans[task].agree_total for task in tasks}
            weights = {task: sizes[task] / sum(sizes.values()) for task in tasks}
        values[group] = (
            math.fsum(weights[task] * estimates[task][0] for task in tasks),
            math.sqrt(math.fsum((weights[task] * estimates[task][1]) ** 2 for task in tasks)),
        )
    (old, old_se), (new, new_se) = values["old"], values["new"]
    if old + new == 0:
        return ProbeEstimate(old, new, 0.0, old_se, new_se, 0.0)
    d_old, d_new = 2 * new**2 / (old + new) ** 2, 2 * old**2 / (old + new) ** 2
    return ProbeEstimate(
        old, new, harmonic_mean(old, new), old_se, new_se, math.sqrt((d_old * old_se) ** 2 + (d_new * new_se) ** 2)
    )


def evaluations_saved(plans: Sequence[ProbePlan], n_points: int) -> tuple[int, int]:
    """(sample evaluations with probes, without) over a sweep of `n_points` merged models."""
    full = sum(len(plan.disagree) + plan.agree_total for plan in plans)
    probed = sum(len(plan.scored) for plan in plans)
    return probed * n_points, full * n_points
