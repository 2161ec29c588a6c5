"""How many report docs would separate two models the report split cannot tell apart: a paired power estimate on
the per-doc score differences. [ours]

Two models answered the same docs, so their harmonic-mean difference is estimated from the per-doc differences
d = correct(a) - correct(b) in {-1, 0, 1}, task by task. The harmonic mean is a smooth function of the group scores,
and each group score is a weighted mean of its tasks' accuracies (paper: 1/tasks each; pooled: each task's share of
the group's docs), so to first order (delta method) the difference is sum_t w_t * mean_t(d), where w_t is
d HM / d group (2 new^2 / (old + new)^2 for old, 2 old^2 / (old + new)^2 for new, at the two models' mean scores)
times the task's weight in its group. Its variance over n_t docs per task is sum_t w_t^2 var_t(d) / n_t (the paired
variance: each task's docs resampled on their own, as the paired bootstrap does). With the docs of every task
growing in today's proportions, that is sd^2 / n for n report docs in all, and a two-sided test at level a = 0.05
with power 0.8 needs

    n = ((z_{1-a/2} + z_{power}) * sd / diff)^2

report docs at the observed difference `diff` (the standard normal-approximation sample size of a paired
comparison). A difference of 0 gives no estimate: no number of docs separates two models that score alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mergekit_lite.sweep.scoring import GROUPS, PointResult

LEVEL, POWER = 0.05, 0.8
Z_LEVEL = 1.959963984540054  # z_{1 - 0.05/2}
Z_POWER = 0.8416212335729143  # z_{0.8}
NO_DIFFERENCE = 1e-12


@dataclass(frozen=True)
class DocsNeeded:
    """The report docs that would separate `pick` from `rival` at their observed harmonic-mean difference (level
    LEVEL, power POWER); `docs` None when the difference is 0 (not estimable)."""

    pick: str
    rival: str
    difference: float  # HM(pick) - HM(rival) on the report split
    sd: float  # per-doc standard deviation of the difference (delta method, stratified by task)
    docs: int | None
    docs_now: int  # report docs scored now, every task together
    kind: str = "report"  # which docs: the report split's, or probe mode's samples of the selection split

    def to_json(self) -> dict:
        return {
            "pick": self.pick,
            "rival": self.rival,
            "difference": self.difference,
            "sd": self.sd,
            f"{self.kind}_docs": self.docs,
            f"{self.kind}_docs_now": self.docs_now,
            "level": LEVEL,
            "power": POWER,
        }

    def text(self, rival: str | None = None, subject: str = "the pick") -> str:
        """In words: how many report docs would separate the two, against how many there are."""
        rival = rival or self.rival
        if self.docs is None:
            return (
                f"{self.kind} docs to separate {subject} from {rival}: not estimable (the two score alike on the "
                f"{self.kind} docs)"
            )
        return (
            f"about {self.docs} {self.kind} docs would separate {subject} from {rival} at the observed difference "
            f"({self.difference:+.4f}; {POWER:.0%} power, level {LEVEL:g}; {self.docs_now} now)"
        )


def task_weights(a: PointResult, b: PointResult, splits: dict, aggregation: str) -> dict[str, float]:
    """d HM / d (task accuracy) for every scored task, at the mean of the two models' report-split group scores."""
    old = (a.report.old + b.report.old) / 2
    new = (a.report.new + b.report.new) / 2
    total = old + new
    slope = {"old": 2 * new**2 / total**2, "new": 2 * old**2 / total**2} if total > 0 else dict.fromkeys(GROUPS, 1.0)
    runs = [run for run in a.tasks if run.outcomes is not None]
    weights = {}
    for group in GROUPS:
        members = [run.task for run in runs if run.group == group]
        docs = sum(len(splits[task][1]) for task in members)
        for task in members:
            share = 1 / len(members) if aggregation == "paper" else len(splits[task][1]) / docs
            weights[task] = slope[group] * share
    return weights


def docs_needed(a: PointResult, b: PointResult, splits: dict, aggregation: str) -> DocsNeeded:
    """The report docs that would separate `a` (the pick) from `b` at their observed report-split difference."""
    weights = task_weights(a, b, splits, aggregation)
    outcomes_b = {run.task: run.outcomes for run in b.tasks if run.outcomes is not None}
    variance, docs_now = 0.0, 0
    for run in a.tasks:
        if run.outcomes is None or run.task not in weights:
            continue
        keys = splits[run.task][1]
        differences = [int(run.outcomes.correct[key]) - int(outcomes_b[run.task].correct[key]) for key in keys]
        mean = sum(differences) / len(differences)
        spread = sum((d - mean) ** 2 for d in differences) / max(len(differences) - 1, 1)
        variance += weights[run.task] ** 2 * spread / len(differences)
        docs_now += len(keys)
    sd = math.sqrt(variance * docs_now)
    difference = a.harmonic_mean - b.harmonic_mean
    docs = None
    if abs(difference) > NO_DIFFERENCE:
        docs = max(1, math.ceil(((Z_LEVEL + Z_POWER) * sd / abs(difference)) ** 2))
    return DocsNeeded(a.label, b.label, difference, sd, docs, docs_now)


def docs_from_standard_error(pick: str, rival: str, difference: float, se: float, docs_now: int) -> DocsNeeded:
    """Probe mode's estimate: its two estimates differ by `difference` with standard error `se` (unpaired: probe mode
    tells points apart by |diff| <= z * hypot(se_a, se_b)) on `docs_now` probe docs each; standard errors shrink as
    1 / sqrt(docs), so n = docs_now * ((z_{1-a/2} + z_power) * se / diff)^2 probe docs."""
    docs = None
    if abs(difference) > NO_DIFFERENCE:
        docs = max(1, math.ceil(docs_now * ((Z_LEVEL + Z_POWER) * se / abs(difference)) ** 2))
    return DocsNeeded(pick, rival, difference, se * math.sqrt(docs_now), docs, docs_now, "probe")


def runner_up(points: list[PointResult], best: PointResult) -> PointResult | None:
    """The point the pick beat by the least on the selection split (its rule): the highest selection harmonic mean
    but the pick's; the first of equals, as the pick's ties go. None when the pick has no rival."""
    rivals = [point for point in points if point is not best and not point.nonfinite]
    if not rivals:
        return None
    top = max(point.selection.harmonic_mean for point in rivals)
    return next(point for point in rivals if point.selection.harmonic_mean == top)
