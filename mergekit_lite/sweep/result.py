"""A finished sweep (SweepResult): every point's scores, the pick (best selection-split harmonic mean), its
ties, the Pareto front and the bootstrap intervals on the report split. What the report and the CLI read."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mergekit_lite.errors import InputError
from mergekit_lite.merge import methods
from mergekit_lite.sweep.chance import ChanceLevel, chance_levels, chance_warning
from mergekit_lite.sweep.power import DocsNeeded, docs_needed, runner_up
from mergekit_lite.sweep.scoring import (
    PointResult,
    Scores,
    TaskRun,
    check_not_mostly_tied,
    doc_splits,
    paired_bootstrap,
    summarise,
)
from mergekit_lite.sweep.search import ProbeEstimate, SearchTrace
from mergekit_lite.sweep.settings import SweepSettings

TIE_TOLERANCE = 1e-9


def dominates(a: Scores, b: Scores) -> bool:
    return a.old >= b.old and a.new >= b.new and (a.old > b.old or a.new > b.new)


def pareto_front(points: list[PointResult]) -> list[float]:
    """Alphas no other alpha beats on both old and new, on the selection split (models with non-finite logits
    are on no front)."""
    points = [point for point in points if not point.nonfinite]
    return [p.key for p in points if not any(dominates(q.selection, p.selection) for q in points)]


@dataclass
class ProbeTrace:
    """Probe mode: every alpha scored on probe samples of the selection docs, its estimated scores, and
    what that cost against scoring every doc. [ours]"""

    rate: float
    estimates: dict[float, ProbeEstimate]  # alpha -> estimated selection-split scores
    pick: float
    indistinguishable: list[float]  # alphas whose estimated HM is within the interval of the pick's
    samples_probed: int  # docs scored per probed alpha
    samples_all: int  # docs of every scored task (both splits): what each alpha costs in a full grid
    separation: DocsNeeded | None = None  # probe docs that would separate the pick from the runner-up (sweep.power)


@dataclass
class SweepResult:
    """The whole sweep: the two reference endpoints, every alpha, the pick (best harmonic mean on the
    selection split), the alphas the report split cannot tell from it, and the Pareto front."""

    settings: SweepSettings
    pre: PointResult
    post: PointResult
    points: list[PointResult]
    best: PointResult
    ties: list[float]
    pareto: list[float]
    evaluated: list[str]  # labels of the points evaluated by this call (the others were resumed)
    out: Path
    splits: dict[str, tuple[list[str], list[str]]] = field(default_factory=dict)  # task -> (selection, report) keys
    indistinguishable: list[float] = field(default_factory=list)
    better: list[PointResult] = field(default_factory=list)  # beat the pick on the report split, interval above 0
    skipped: dict[str, str] = field(default_factory=dict)
    search: SearchTrace | None = None  # the golden-section search's trace; None for a full grid
    probe: ProbeTrace | None = None  # probe mode's estimates; None when every point was scored in full
    rows: list[dict] | None = None  # a 2-D grid: each row's search (golden / probe), as sweep.grid reports it
    budget: dict | None = None  # --budget: the successive-halving rounds (sweep.budget)
    realigned: list[TaskRun] | None = None  # --realign-shots: post again with K demonstrations on the docs it forgot
    drift: object | None = None  # evaluate.drift.DriftReport of post against pre
    vector: dict | None = None  # --groups/--modules: the vector search against the scalar pick (sweep.vector_search)
    chance: list[ChanceLevel] = field(default_factory=list)  # tasks pre, post or every merge scored at chance on
    separation: DocsNeeded | None = None  # report docs that would separate the pick from the runner-up (sweep.power)

    @property
    def recovered(self) -> float | None:
        """Share of post's old-skill loss that the pick wins back: (old_best - old_post) / (old_pre - old_post).
        None when post lost nothing (old_pre <= old_post). 1.0 = back to pre's level; can exceed 1."""
        lost = self.pre.old - self.post.old
        return (self.best.old - self.post.old) / lost if lost > 0 else None

    @property
    def kept(self) -> float | None:
        """Share of post's new-skill gain the pick keeps: (new_best - new_pre) / (new_post - new_pre). None when post
        gained nothing (new_post <= new_pre). 1.0 = post's level."""
        gained = self.post.new - self.pre.new
        return (self.best.new - self.pre.new) / gained if gained > 0 else None

    @property
    def pick_is(self) -> str | None:
        """ "pre" or "post" when the merge at the pick is that model itself (e.g. linear at alpha 0 or 1): then the
        sweep found no merge better than an endpoint, and a recovery percentage would describe no merge."""
        settings, best = self.settings, self.best
        method = methods.method(settings.method)  # its declaration says which coefficients give pre or post
        if best.alpha == 0 and method.pre_at_zero:
            return "pre"
        beta = best.second[1] if best.second and best.second[0] == "beta" else settings.beta
        if best.alpha == 1 and (
            method.post_at_one and best.second is None or method.post_at_one_without_beta and not beta
        ):
            return "post"
        return None

    def outcome_text(self) -> str:
        """What the pick gives back, in one sentence: forgetting recovered and new skill kept, or, when the pick is
        pre or post itself, that instead."""
        settings, best = self.settings, self.best
        if endpoint := self.pick_is:
            return (
                f"the pick is {endpoint} itself ({settings.method} at {settings.coefficient}={best.alpha!r}): no "
                f"merge beat {endpoint} on the selection split, so there is no recovery to report"
            )
        recovered = f"{self.recovered:.1%}" if self.recovered is not None else "N/A (post lost no old-task accuracy)"
        kept = f"{self.kept:.1%}" if self.kept is not None else "N/A (post gained no new-task accuracy)"
        return f"forgetting recovered {recovered}, new skill kept {kept}"

    @property
    def unsupported(self) -> bool:
        """The pick rests on a task that pre (old), post (new) or every merge scored within chance on (sweep.chance)."""
        return bool(self.chance)

    def chance_text(self) -> str | None:
        """The warning naming the tasks scored within chance and lm-eval's settings; None when there are none."""
        return chance_warning(self.chance)

    def warning_text(self) -> str | None:
        """A sentence naming the points that beat the pick on the report split with an interval above zero: the pick
        made on the selection docs did not hold up on the others."""
        if not self.better:
            return None
        named = ", ".join(
            f"{point.label} (HM - pick [{point.intervals['diff_to_pick'][0]:+.3f}, "
            f"{point.intervals['diff_to_pick'][1]:+.3f}])"
            for point in self.better
        )
        return (
            f"warning: on the report split {named} beat{'s' if len(self.better) == 1 else ''} the pick with an "
            f"interval above zero; the pick made on the selection docs does not hold up on the others: consider "
            f"{self.better[0].label}, or score more docs (--limit)"
        )


def pick_fields(result: SweepResult) -> dict:
    """results.json's account of the pick: what it gives back (null where it is pre or post itself), which endpoint it
    is, and the alphas that beat it on the report split."""
    return {
        "recovered": None if result.pick_is else result.recovered,
        "kept": None if result.pick_is else result.kept,
        "pick_is": result.pick_is,
        "better": [point.label for point in result.better],
        "unsupported": result.unsupported,  # a task pre, post or every merge scored within chance on
    }


def pick(points: list[PointResult]) -> tuple[PointResult, list[float]]:
    """The highest harmonic mean on the selection split, and every point within TIE_TOLERANCE of it;
    ties go to the first point (the smallest alpha; in a 2-D grid, the smallest second value, then alpha). A model
    with non-finite logits is never picked: its scores are those of NaN log-likelihoods."""
    broken = [point.label for point in points if point.nonfinite]
    points = [point for point in points if not point.nonfinite]
    if not points:
        raise InputError(
            f"every merged model gave NaN or infinite logits ({', '.join(broken)}); no alpha can be "
            "picked: sweep smaller coefficients"
        )
    top = max(p.selection.harmonic_mean for p in points)
    tied = [p for p in points if top - p.selection.harmonic_mean <= TIE_TOLERANCE]
    return tied[0], [p.key for p in tied]


def add_intervals(result: SweepResult) -> None:
    """Percentile intervals for old, new, harmonic mean and the harmonic-mean difference to the pick; the
    alphas whose difference interval holds 0 are indistinguishable from the pick on the report split."""
    import numpy as np

    settings = result.settings
    if settings.bootstrap == 0:
        return
    models = [result.pre, result.post, *result.points]
    draws = paired_bootstrap(models, result.splits, settings.aggregation, settings.bootstrap, settings.seed)
    tail = (1 - settings.confidence) / 2 * 100
    pick_index = models.index(result.best)
    for index, model in enumerate(models):
        for position, name in enumerate(("old", "new", "harmonic_mean")):
            model.intervals[name] = np.percentile(draws[:, index, position], [tail, 100 - tail]).tolist()
        difference = draws[:, index, 2] - draws[:, pick_index, 2]
        model.intervals["diff_to_pick"] = np.percentile(difference, [tail, 100 - tail]).tolist()
    candidates = [point for point in result.points if not point.nonfinite]  # a broken model is never a rival
    result.indistinguishable = [
        point.key
        for point in candidates
        if point is not result.best and point.intervals["diff_to_pick"][0] <= 0 <= point.intervals["diff_to_pick"][1]
    ]
    rival = runner_up(result.points, result.best)
    if rival is not None:
        result.separation = docs_needed(result.best, rival, result.splits, settings.aggregation)
    result.better = sorted(
        (point for point in candidates if point.intervals["diff_to_pick"][0] > 0),
        key=lambda point: -point.intervals["diff_to_pick"][0],
    )


def build_result(
    settings, folder, plan, runs, evaluated, cells: dict[str, tuple[str, float]] | None = None
) -> SweepResult:
    """Split every task's docs, summarise every model on both splits, pick on selection, bootstrap on report;
    `cells`: a 2-D grid's label -> (second coefficient, value)."""
    skipped = {run.task: f"{label}: {run.skipped}" for label, _ in plan for run in runs[label] if run.outcomes is None}
    runs = {
        label: [
            TaskRun(run.task, run.group, None, skipped[run.task]) if run.task in skipped else run for run in runs[label]
        ]
        for label, _ in plan
    }  # a task skipped for one model is for all
    for label in ("pre", "post"):
        check_not_mostly_tied(label, runs[label])
    baseline = runs["pre"]
    splits = doc_splits(settings, baseline)
    results = {
        label: summarise(label, alpha, runs[label], baseline, splits, settings.aggregation) for label, alpha in plan
    }
    for label, second in (cells or {}).items():
        if label in results:
            results[label].second = second
    points = [results[label] for label, alpha in plan if alpha is not None]
    best, ties = pick(points)
    result = SweepResult(
        settings,
        results["pre"],
        results["post"],
        points,
        best,
        ties,
        pareto_front(points),
        evaluated,
        folder,
        splits,
        skipped=skipped,
    )
    add_intervals(result)
    result.chance = chance_levels(
        result.pre, result.post, points, splits, settings.confidence, settings.lm_eval.describe()
    )
    return result
