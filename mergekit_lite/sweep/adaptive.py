"""Fewer evaluations per sweep, on top of the pure helpers of `search.py`: the golden-section search over
the grid (two points are indistinguishable when the paired bootstrap interval of their difference on the
selection docs holds 0) and probe mode (every alpha scored on probe samples of the selection docs, its
scores estimated, only the pick scored in full). Both are ours; their points are the grid's own (same
labels, same files), so a later full-grid run resumes from them."""

from __future__ import annotations

import math
from pathlib import Path

from mergekit_lite.errors import InputError
from mergekit_lite.evaluate.outcomes import SampleOutcomes
from mergekit_lite.sweep.power import docs_from_standard_error
from mergekit_lite.sweep.result import ProbeTrace
from mergekit_lite.sweep.scoring import GROUPS, PointResult, TaskRun, doc_splits, paired_bootstrap, summarise
from mergekit_lite.sweep.search import (
    ProbeEstimate,
    ProbePlan,
    SearchTrace,
    estimate_scores,
    golden_section,
    probe_plan,
)
from mergekit_lite.sweep.settings import SweepSettings
from mergekit_lite.sweep.store import (
    PROBES_DIR,
    load_points,
    point_file,
    point_label,
    probe_identity,
    save_point,
)


def golden_search(settings: SweepSettings, runs: dict[str, list[TaskRun]], evaluate) -> SearchTrace:
    """Golden-section search for the best selection-split harmonic mean over the grid's alphas (pre and post
    already in `runs`); two points are indistinguishable when the paired bootstrap interval of their
    difference on the selection docs holds 0. `evaluate(label, alpha)` adds a point to `runs`."""
    import numpy as np

    baseline = runs["pre"]
    splits = doc_splits(settings, baseline)
    summaries: dict[int, PointResult] = {}

    def at(index: int) -> PointResult:
        if index not in summaries:
            alpha = settings.alphas[index]
            label = point_label(settings, alpha)
            evaluate(label, alpha)
            summaries[index] = summarise(label, alpha, runs[label], baseline, splits, settings.aggregation)
        return summaries[index]

    def indistinguishable(i: int, j: int) -> bool:
        draws = paired_bootstrap(
            [at(i), at(j)], splits, settings.aggregation, settings.bootstrap, settings.seed, split=0
        )
        tail = (1 - settings.confidence) / 2 * 100
        low, high = np.percentile(draws[:, 0, 2] - draws[:, 1, 2], [tail, 100 - tail])
        return low <= 0 <= high

    return golden_section(
        len(settings.alphas), lambda i: at(i).selection.harmonic_mean, indistinguishable if settings.bootstrap else None
    )


def probe_plans(
    settings: SweepSettings,
    runs: dict[str, list[TaskRun]],
    splits: dict[str, tuple[list[str], list[str]]],
    rate: float | None = None,
) -> dict[str, ProbePlan]:
    """Per scored task, on its selection docs: where pre and post disagree, plus a seeded share of the rest
    (`rate`, by default --probe's)."""
    post = {run.task: run.outcomes for run in runs["post"]}
    plans = {}
    for run in runs["pre"]:
        if run.outcomes is None or post.get(run.task) is None:
            continue
        keys = splits[run.task][0]
        if any(key not in run.outcomes.doc_ids for key in keys):
            raise InputError(
                f"task {run.task!r}: pre's saved point has no lm-eval doc ids (written before --probe "
                "existed); use another --out"
            )
        plans[run.task] = probe_plan(
            {key: run.outcomes.correct[key] for key in keys},
            {key: post[run.task].correct[key] for key in keys if key in post[run.task].correct},
            rate or settings.probe,
            f"{settings.seed}:{run.task}",
        )
    return plans


def probe_samples(plans: dict[str, ProbePlan], baseline: list[TaskRun]) -> dict[str, dict[str, list[int]]]:
    """{group: {task: lm-eval doc ids}} of every probe sample."""
    pre = {run.task: run for run in baseline}
    samples: dict[str, dict[str, list[int]]] = {group: {} for group in GROUPS}
    for task, plan in plans.items():
        samples[pre[task].group][task] = sorted(pre[task].outcomes.doc_ids[key] for key in plan.scored)
    empty = [group for group in GROUPS if not samples[group]]
    if empty:
        raise InputError(f"no {empty[0]} task could be scored (check --{empty[0]}-tasks and --metric)")
    return samples


def on_pre_keys(run: TaskRun, chosen: list[int], pre: SampleOutcomes) -> TaskRun:
    """A probe run keyed as pre's full run. Records are matched to the chosen docs in doc order (lm-eval's
    `samples` keeps the docs' order; whether a record's doc_id is the task's own or its rank among the chosen
    differs between lm-eval versions) and each match is checked by doc_hash where lm-eval logs one."""
    if run.outcomes is None:
        raise InputError(f"task {run.task!r}: probe run skipped ({run.skipped}) though pre's full run was scored")
    key_of = {doc_id: key for key, doc_id in pre.doc_ids.items()}
    expected = [key_of[doc_id] for doc_id in sorted(chosen)]
    observed = sorted(run.outcomes.correct, key=lambda key: run.outcomes.doc_ids.get(key, -1))
    if len(observed) != len(expected):
        raise InputError(
            f"task {run.task!r}: lm-eval scored {len(observed)} probe docs, {len(expected)} were asked for"
        )
    correct = {}
    for key, original, doc_id in zip(observed, expected, sorted(chosen), strict=True):
        hashed = original.split("#")[0] != str(doc_id)
        if hashed and original.split("#")[0] != key.split("#")[0]:
            raise InputError(f"task {run.task!r}: lm-eval returned a probe doc ({key}) that is not one asked for")
        correct[original] = run.outcomes.correct[key]
    outcomes = SampleOutcomes(run.task, correct, run.outcomes.n_choices, run.outcomes.metric, run.outcomes.filter)
    return TaskRun(run.task, run.group, outcomes)


def run_probes(
    settings: SweepSettings, folder: Path, runs: dict[str, list[TaskRun]], probe
) -> tuple[ProbeTrace, SearchTrace | None]:
    """Score alphas on probe samples (every alpha, or those the golden search visits), estimate each one's
    selection-split scores with their standard errors, and pick the best estimated harmonic mean (ties to the
    smallest alpha). `probe(label, alpha, samples)` scores one merge on {group: {task: doc ids}}. Probe points
    are saved in probes/ (rerunning resumes them); pre and post must be in `runs`. [ours]"""
    from statistics import NormalDist

    baseline = runs["pre"]
    splits = doc_splits(settings, baseline)
    plans = probe_plans(settings, runs, splits)
    samples = probe_samples(plans, baseline)
    pre = {run.task: run.outcomes for run in baseline}
    groups = {run.task: run.group for run in baseline}
    identity = probe_identity(settings)
    (folder / PROBES_DIR).mkdir(exist_ok=True)
    saved = load_points(folder, identity, PROBES_DIR)
    estimates: dict[int, ProbeEstimate] = {}

    def at(index: int) -> ProbeEstimate:
        if index not in estimates:
            alpha = settings.alphas[index]
            label = point_label(settings, alpha)
            if label not in saved:
                scored = [
                    on_pre_keys(run, samples[run.group][run.task], pre[run.task])
                    for run in probe(label, alpha, samples)
                    if run.task in plans
                ]
                save_point(point_file(folder, label, PROBES_DIR), identity, label, alpha, scored)
                saved[label] = scored
            observed = {run.task: run.outcomes.correct for run in saved[label]}
            estimates[index] = estimate_scores(plans, groups, observed, settings.aggregation)
        return estimates[index]

    z = NormalDist().inv_cdf((1 + settings.confidence) / 2)

    def indistinguishable(i: int, j: int) -> bool:
        return abs(at(i).harmonic_mean - at(j).harmonic_mean) <= z * math.hypot(
            at(i).harmonic_mean_se, at(j).harmonic_mean_se
        )

    search = None
    if settings.search == "golden":
        search = golden_section(len(settings.alphas), lambda i: at(i).harmonic_mean, indistinguishable)
        best = search.best
    else:
        best = max(range(len(settings.alphas)), key=lambda i: (at(i).harmonic_mean, -i))
    trace = ProbeTrace(
        settings.probe,
        {settings.alphas[i]: estimates[i] for i in sorted(estimates)},
        settings.alphas[best],
        [settings.alphas[i] for i in sorted(estimates) if i != best and indistinguishable(i, best)],
        sum(len(plan.scored) for plan in plans.values()),
        sum(len(run.outcomes.correct) for run in baseline if run.task in plans),
    )
    rivals = [i for i in sorted(estimates) if i != best]
    if rivals:  # the best other estimate, and the probe docs that would tell it from the pick
        rival = max(rivals, key=lambda i: (at(i).harmonic_mean, -i))
        trace.separation = docs_from_standard_error(
            point_label(settings, settings.alphas[best]),
            point_label(settings, settings.alphas[rival]),
            at(best).harmonic_mean - at(rival).harmonic_mean,
            math.hypot(at(best).harmonic_mean_se, at(rival).harmonic_mean_se),
            trace.samples_probed,
        )
    return trace, search
