"""Tasks a sweep's models score at chance on: there the scores say which option lm-eval's order or a guess
favoured, not what the model knows, so a pick made on them is unsupported. [ours]

A model scores within chance on a task when the interval of its accuracy on the report docs covers the task's
chance level: 1/k for k choices per doc (multiple choice, or a generative multiple-choice task given --choices),
0 for free-form generation (an exact match cannot be guessed). The interval is the Wilson score interval at the
sweep's confidence (a binomial proportion's interval that stays inside [0, 1] on few docs). The sweep warns when pre
is within chance on an old task (there is no skill to forget), post on a new task (there is no skill post-training
taught), or every merge on any task; pre at chance on a new task is what the sweep expects (post-training taught
it), and post at chance on an old one is the forgetting it measures. The usual cause is the prompt (no few-shot, a
chat template the model was not trained with, or one it needs and did not get), so the warning names lm-eval's
settings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

from mergekit_lite.sweep.scoring import PointResult, TaskRun


@dataclass(frozen=True)
class ChanceLevel:
    """One task on which pre, post or every merge scored within chance: who, each one's accuracy and interval."""

    task: str
    chance: float
    within: list[str]  # "pre" (an old task), "post" (a new task), "every merge"
    scores: dict[str, list[float]]  # model label -> [accuracy, low, high] on the report docs
    prompt: str  # lm-eval's settings, as the report names them

    def to_json(self) -> dict:
        return {
            "task": self.task,
            "chance": self.chance,
            "within_chance": self.within,
            "scores": self.scores,
            "lm_eval": self.prompt,
        }

    def text(self) -> str:
        shown = ", ".join(
            f"{label} {acc:.3f} [{low:.3f}, {high:.3f}]"
            for label, (acc, low, high) in self.scores.items()
            if label in self.within or "every merge" in self.within and label not in ("pre", "post")
        )
        return f"{self.task}: {' and '.join(self.within)} within chance ({self.chance:.3g}; {shown})"


def wilson(correct: int, n: int, confidence: float) -> tuple[float, float]:
    """The Wilson score interval of `correct` successes in `n` trials."""
    z = NormalDist().inv_cdf(1 - (1 - confidence) / 2)
    share = correct / n
    centre = (share + z**2 / (2 * n)) / (1 + z**2 / n)
    half = z * math.sqrt(share * (1 - share) / n + z**2 / (4 * n**2)) / (1 + z**2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def chance_of(run: TaskRun) -> float:
    """1/k for k choices per doc; 0 for free-form generation (k infinite)."""
    k = run.outcomes.n_choices
    return 0.0 if math.isinf(k) else 1 / k


def task_interval(run: TaskRun, keys: list[str], confidence: float) -> list[float]:
    """[accuracy, low, high] of a task on `keys`."""
    correct = sum(bool(run.outcomes.correct[key]) for key in keys)
    return [correct / len(keys), *wilson(correct, len(keys), confidence)]


def chance_levels(
    pre: PointResult, post: PointResult, points: list[PointResult], splits: dict, confidence: float, prompt: str
) -> list[ChanceLevel]:
    """The tasks on which pre (an old task), post (a new task) or every merge scores within chance on the report
    docs."""
    levels = []
    merges = [point for point in points if not point.nonfinite]
    for run in pre.tasks:
        if run.outcomes is None:
            continue
        chance, keys = chance_of(run), splits[run.task][1]
        scores, within = {}, {}
        for model in (pre, post, *merges):
            own = next(other for other in model.tasks if other.task == run.task)
            scores[model.label] = task_interval(own, keys, confidence)
            within[model.label] = scores[model.label][1] <= chance <= scores[model.label][2]
        named = [label for label, group in (("pre", "old"), ("post", "new")) if within[label] and run.group == group]
        if merges and all(within[point.label] for point in merges):
            named.append("every merge")
        if named:
            levels.append(ChanceLevel(run.task, chance, named, scores, prompt))
    return levels


def chance_warning(levels: list[ChanceLevel]) -> str | None:
    """One sentence naming the tasks at chance and lm-eval's settings; None when there are none."""
    if not levels:
        return None
    return (
        f"warning: scores within chance on {'; '.join(level.text() for level in levels)}, under {levels[0].prompt}: "
        "these tasks cannot tell the models apart, so the pick is unsupported; check the prompt settings "
        "(--num-fewshot, --apply-chat-template, --fewshot-as-multiturn, --system-instruction) and that the models "
        "can do the task"
    )
