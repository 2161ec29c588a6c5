"""`--budget N`: a cheap-first search over a sweep's points, 1-D or 2-D: successive halving on probe docs
(Jamieson & Talwalkar, "Non-stochastic Best Arm Identification and Hyperparameter Optimization", AISTATS
2016: every arm on a small budget, keep the best share, double the budget), then every doc for the
survivors. [ours: the arms are merges, the budget is docs, the estimator is probe mode's]

How the budget is counted: in full evaluations, pre and post one each, every merge scored on every doc one,
and a merge scored on probe docs the share of the docs it scored (its probe docs / every doc of the scored
tasks). A probe evaluation counted as a whole one would make halving dearer than the grid it prunes (every
point probed once, plus at least one in full, is more than every point once): what a probe saves is docs, so
docs are what is counted. When the whole grid fits (points + 2 <= N) every point is evaluated on every doc.

The schedule: round k scores the points still in the race on probe docs of the selection split (where pre and
post disagree, plus a seeded share of the rest: `--probe`, default 0.1, doubled each round up to every
selection doc), ranks them by the estimated harmonic mean (probe mode's estimator) and keeps the best
1/keep of them; once the survivors' full evaluations fit what is left, they are scored on every doc and the
pick is the best of them on the selection split, as in any sweep. keep is the smallest factor (2: halving,
3: thirds, ...) whose schedule fits N; it is fixed as soon as pre and post are scored (their docs decide
the probe sizes), so a rerun makes the same choices and resumes every probe and point.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from mergekit_lite.errors import InputError
from mergekit_lite.sweep.adaptive import on_pre_keys, probe_plans, probe_samples
from mergekit_lite.sweep.scoring import TaskRun, doc_splits
from mergekit_lite.sweep.search import estimate_scores
from mergekit_lite.sweep.settings import SweepSettings
from mergekit_lite.sweep.store import PROBES_DIR, load_points, point_file, probe_identity, save_point

BUDGET_PROBE = 0.1  # the first round's share of the agreeing selection docs when --probe is not given


@dataclass(frozen=True)
class HalvingPlan:
    """How many points each probe round scores, how many are then scored on every doc, and the total cost."""

    rounds: list[int]
    survivors: int
    keep: int  # each round keeps ceil(points / keep)
    cost: float  # full evaluations, pre and post included


def halving_plan(n: int, budget: float, costs: list[float]) -> HalvingPlan | None:
    """The schedule with the smallest keep factor whose cost fits `budget`; `costs[k]` is one probe evaluation's
    cost in round k (the last repeats). None when even probing every point once and one in full does not fit."""
    for keep in range(2, max(n, 2) + 1):
        rounds, spent, alive = [], 2.0, n
        while True:
            spent += alive * costs[min(len(rounds), len(costs) - 1)]
            rounds.append(alive)
            survivors = math.ceil(alive / keep)
            if spent + survivors <= budget + 1e-9:
                return HalvingPlan(rounds, survivors, keep, spent + survivors)
            if survivors == alive:
                break
            alive = survivors
    return None


def run_budget(
    settings: SweepSettings, found: dict, folder: Path, runs: dict[str, list[TaskRun]], probe, evaluate
) -> dict:
    """Successive halving over `found` (label -> grid.Cell), pre and post already in `runs`; `probe(label, alpha,
    samples)` scores one merge on {group: {task: doc ids}}, `evaluate(label, alpha)` scores it on every doc. The
    rounds' probe points go to probes/ (a rerun resumes them). Returns the trace results.json keeps."""
    labels, budget = list(found), settings.budget
    if len(labels) + 2 <= budget:
        for label in labels:
            evaluate(label, found[label].alpha)
        return {
            "budget": budget,
            "cost": len(labels) + 2,
            "evaluations": len(labels) + 2,
            "rounds": [],
            "full": labels,
            "note": "the whole grid fits the budget: every point on every doc",
        }
    baseline = runs["pre"]
    splits = doc_splits(settings, baseline)
    rates = [settings.probe or BUDGET_PROBE]
    while rates[-1] < 1:
        rates.append(min(1.0, 2 * rates[-1]))
    plans = [probe_plans(settings, runs, splits, rate) for rate in rates]
    total = sum(len(run.outcomes.correct) for run in baseline if run.task in plans[0])
    costs = [sum(len(plan.scored) for plan in by_task.values()) / total for by_task in plans]
    schedule = halving_plan(len(labels), budget, costs)
    if schedule is None:
        raise InputError(
            f"budget {budget} is too small for {len(labels)} points: probing each once on "
            f"{costs[0]:.0%} of the docs and one in full costs {3 + len(labels) * costs[0]:.1f} "
            "full evaluations (raise --budget, or lower --probe)"
        )
    identity = {**probe_identity(settings), "probe": rates[0]}
    (folder / PROBES_DIR).mkdir(exist_ok=True)
    saved = load_points(folder, identity, PROBES_DIR)
    pre = {run.task: run.outcomes for run in baseline}
    groups = {run.task: run.group for run in baseline}
    alive, trace = labels, []
    for index in range(len(schedule.rounds)):
        rate, by_task = rates[min(index, len(rates) - 1)], plans[min(index, len(plans) - 1)]
        samples = probe_samples(by_task, baseline)
        estimates = {}
        for label in alive:
            name = f"{label},probe={rate!r}"
            if name not in saved:
                scored = [
                    on_pre_keys(run, samples[run.group][run.task], pre[run.task])
                    for run in probe(label, found[label].alpha, samples)
                    if run.task in by_task
                ]
                save_point(point_file(folder, name, PROBES_DIR), identity, name, found[label].alpha, scored)
                saved[name] = scored
            observed = {run.task: run.outcomes.correct for run in saved[name]}
            estimates[label] = estimate_scores(by_task, groups, observed, settings.aggregation).harmonic_mean
        keep = schedule.rounds[index + 1] if index + 1 < len(schedule.rounds) else schedule.survivors
        best = set(sorted(alive, key=lambda label: (-estimates[label], labels.index(label)))[:keep])
        alive = [label for label in alive if label in best]
        trace.append(
            {
                "probe": rate,
                "docs_per_point": sum(len(plan.scored) for plan in by_task.values()),
                "cost_per_point": costs[min(index, len(costs) - 1)],
                "estimates": estimates,
                "kept": alive,
            }
        )
    for label in alive:
        evaluate(label, found[label].alpha)
    return {
        "budget": budget,
        "cost": schedule.cost,
        "evaluations": 2 + sum(schedule.rounds) + schedule.survivors,
        "keep": schedule.keep,
        "docs_per_full_point": total,
        "rounds": trace,
        "full": alive,
    }
