"""The docs-needed estimate beside every "indistinguishable" (sweep.power): against a simulation that resamples the
docs at growing sizes and finds where the paired bootstrap interval excludes 0 in 80% of draws, and in the
sweep's report.md, results.json and summary line."""

import json

import numpy as np
import pytest

from mergekit_lite.evaluate.outcomes import SampleOutcomes
from mergekit_lite.sweep.power import POWER, docs_needed, runner_up
from mergekit_lite.sweep.scoring import TaskRun, paired_bootstrap, summarise

# per task: docs both models answer right, both wrong, only the pick right, only the rival right
OLD_DOCS = {"both": 240, "neither": 100, "pick": 40, "rival": 20}  # pick 0.70, rival 0.65
NEW_DOCS = {"both": 200, "neither": 160, "pick": 24, "rival": 16}  # pick 0.56, rival 0.54


def outcomes(task: str, counts: dict, model: str) -> SampleOutcomes:
    right = []
    for kind, count in counts.items():
        right += [kind == "both" or kind == model] * count
    return SampleOutcomes(task, {f"{task}-{index}": value for index, value in enumerate(right)}, 4)


def models(old: dict, new: dict, aggregation: str = "paper"):
    """pre (the pick's outcomes stand in: the estimate compares only pick and rival), the pick and the rival, every
    doc a report doc."""
    runs = {
        model: [
            TaskRun("old_task", "old", outcomes("old_task", old, model)),
            TaskRun("new_task", "new", outcomes("new_task", new, model)),
        ]
        for model in ("pick", "rival")
    }
    splits = {run.task: (list(run.outcomes.correct), list(run.outcomes.correct)) for run in runs["pick"]}
    points = {model: summarise(model, 0.5, runs[model], runs["pick"], splits, aggregation) for model in runs}
    return points["pick"], points["rival"], splits


def resampled(point, splits, per_task: int, rng):
    """The same draw of `per_task` docs of each task (with replacement) for both models: a paired sample."""
    drawn = {task: [keys[1][i] for i in rng.integers(0, len(keys[1]), per_task)] for task, keys in splits.items()}
    runs = [
        TaskRun(
            run.task,
            run.group,
            SampleOutcomes(run.task, {f"{i}": run.outcomes.correct[key] for i, key in enumerate(drawn[run.task])}, 4),
        )
        for run in point.tasks
    ]
    return runs


def simulated_docs(pick, rival, splits, aggregation: str, seed: int = 0) -> int:
    """The smallest report size (docs of every task together, on a grid growing by 1.25x) at which the 95% paired
    bootstrap interval of HM(pick) - HM(rival) excludes 0 in 80% of resampled doc sets."""
    rng = np.random.default_rng(seed)
    tasks = len(splits)
    per_task = 60
    while per_task < 20000:
        excluded = 0
        draws = 100
        for draw in range(draws):
            state = rng.bit_generator.state
            runs_pick = resampled(pick, splits, per_task, rng)
            rng.bit_generator.state = state  # the rival answers the same drawn docs
            runs_rival = resampled(rival, splits, per_task, rng)
            keys = {run.task: (list(run.outcomes.correct), list(run.outcomes.correct)) for run in runs_pick}
            a = summarise("pick", 0.5, runs_pick, runs_pick, keys, aggregation)
            b = summarise("rival", 0.5, runs_rival, runs_pick, keys, aggregation)
            hm = paired_bootstrap([a, b], keys, aggregation, 200, draw)[:, :, 2]
            low, high = np.percentile(hm[:, 0] - hm[:, 1], [2.5, 97.5])
            excluded += not low <= 0 <= high
        if excluded / draws >= POWER:
            return per_task * tasks
        per_task = int(per_task * 1.25) + 1
    raise AssertionError("no size separated them")


@pytest.mark.parametrize("aggregation", ["paper", "pooled"])
def test_the_estimate_is_within_a_factor_of_two_of_a_simulation(aggregation):
    pick, rival, splits = models(OLD_DOCS, NEW_DOCS, aggregation)
    assert pick.old - rival.old == pytest.approx(0.05) and pick.new - rival.new == pytest.approx(0.02)
    estimate = docs_needed(pick, rival, splits, aggregation)
    assert estimate.difference == pytest.approx(pick.harmonic_mean - rival.harmonic_mean) and estimate.difference > 0
    assert estimate.docs_now == 800
    simulated = simulated_docs(pick, rival, splits, aggregation)
    assert simulated / 2 <= estimate.docs <= simulated * 2, (estimate.docs, simulated)
    assert f"about {estimate.docs} report docs" in estimate.text("alpha 0.3")


def test_no_difference_is_not_estimable():
    same = {"both": 50, "neither": 50, "pick": 10, "rival": 10}  # different docs right, the same accuracy
    pick, rival, splits = models(same, same)
    estimate = docs_needed(pick, rival, splits, "paper")
    assert estimate.difference == 0 and estimate.docs is None and estimate.sd > 0
    assert "not estimable" in estimate.text("alpha 0.3")
    assert estimate.to_json()["report_docs"] is None


def test_the_runner_up_is_the_best_other_selection_score():
    pick, rival, splits = models(OLD_DOCS, NEW_DOCS)
    low, _, _ = models({"both": 10, "neither": 90, "pick": 0, "rival": 0}, {"both": 10, "neither": 90})
    assert runner_up([pick, low, rival], pick) is rival
    assert runner_up([pick], pick) is None


@pytest.mark.slow
def test_the_sweep_reports_the_estimate_beside_indistinguishable(linear_sweep):
    from cli.sweep import summary
    from mergekit_lite.sweep.report import card_section

    result = linear_sweep
    separation = result.separation
    assert separation is not None and separation.pick == result.best.label
    rival = next(point for point in result.points if point.label == separation.rival)
    assert rival is runner_up(result.points, result.best)
    again = docs_needed(result.best, rival, result.splits, result.settings.aggregation)
    assert again == separation
    saved = json.loads((result.out / "results.json").read_text())["pick"]["docs_to_separate"]
    assert saved["report_docs"] == separation.docs and saved["rival"] == rival.label
    report = (result.out / "report.md").read_text()
    line = next(line for line in report.splitlines() if line.startswith("Indistinguishable from the pick"))
    assert "the runner-up (alpha " in line and ("report docs would separate" in line or "not estimable" in line)
    assert separation.text(separation.rival) in summary(result)
    _, card = card_section(result)  # --save-best's model card says it beside the alphas it cannot tell apart
    assert (separation.text() in card) == bool(result.indistinguishable)
