"""Scoring one model of a sweep: its per-task outcomes (TaskRun), the seeded selection/report split of every
task's docs, old/new group scores and their harmonic mean, the forgetting map against pre (PointResult) and
the paired bootstrap over docs. Tasks are scored by the code that reads lm-eval files for `mergekit-lite
forgetting` (same metric, filter and k), and group scores follow the same aggregation (default: the paper's
unweighted mean over tasks)."""

from __future__ import annotations

import hashlib
import math
import warnings
from dataclasses import dataclass, field

from mergekit_lite.errors import InputError
from mergekit_lite.evaluate.forgetting import GroupForgetting, TaskForgetting, aggregate, compare
from mergekit_lite.evaluate.outcomes import SampleOutcomes, Scoring, TaskSkipped
from mergekit_lite.evaluate.records import SampleText
from mergekit_lite.evaluate.ties import MOSTLY, task_ties
from mergekit_lite.sweep.search import harmonic_mean
from mergekit_lite.sweep.settings import SweepSettings

GROUPS = ("old", "new")
TEXT_FIELDS = ("prompt", "gold", "answer", "completion")  # SampleText's text, as a point file keeps it


@dataclass
class TaskRun:
    """One model's result on one task: per-sample outcomes (None when the task was skipped, with why)."""

    task: str
    group: str
    outcomes: SampleOutcomes | None
    skipped: str | None = None
    nonfinite: bool = False  # the model gave NaN or infinite logits while scoring it: its outcomes mean nothing
    tied: int = 0  # docs whose choices all had one log-likelihood (or an empty generation): lm-eval's order answered

    @property
    def acc(self) -> float:
        return self.outcomes.accuracy

    def to_json(self, prompts: bool = False) -> dict:
        """The point file's entry: outcomes, doc ids and each doc's answer as text; with `prompts` (pre's file)
        also its prompt, gold answer and replay completion, which every model shares (sweep.samples)."""
        if self.outcomes is None:
            return {"task": self.task, "group": self.group, "skipped": self.skipped}
        flagged = {"nonfinite_logits": True} if self.nonfinite else {}
        flagged |= {"tied": self.tied} if self.tied else {}
        k = self.outcomes.n_choices
        kept = TEXT_FIELDS if prompts else ("answer",)
        return {
            "task": self.task,
            "group": self.group,
            "metric": self.outcomes.metric,
            "filter": self.outcomes.filter,
            "n_choices": None if math.isinf(k) else k,
            "correct": self.outcomes.correct,
            "doc_ids": self.outcomes.doc_ids,
            "answer_rule": self.outcomes.answer_rule,
            **flagged,
            "texts": {key: {name: getattr(text, name) for name in kept} for key, text in self.outcomes.texts.items()},
        }

    @classmethod
    def from_json(cls, data: dict) -> TaskRun:
        """A saved entry back; a point file from before texts were kept gives no texts (null in samples.jsonl)."""
        if "correct" not in data:
            return cls(data["task"], data["group"], None, str(data["skipped"]))
        k = math.inf if data["n_choices"] is None else float(data["n_choices"])
        texts = {
            key: SampleText(*(text.get(name) for name in TEXT_FIELDS))
            for key, text in (data.get("texts") or {}).items()
        }
        outcomes = SampleOutcomes(
            data["task"],
            data["correct"],
            k,
            data.get("metric", ""),
            data.get("filter", ""),
            data.get("doc_ids") or {},
            texts,
            data.get("answer_rule") or "",
        )
        return cls(
            data["task"],
            data["group"],
            outcomes,
            nonfinite=bool(data.get("nonfinite_logits")),
            tied=int(data.get("tied") or 0),
        )


def score_task(task: str, group: str, score, scoring: Scoring) -> TaskRun:
    """A TaskRun from lm_harness.TaskScore, scored as `mergekit-lite forgetting` scores files; a task
    whose metric is not 0/1 is kept as skipped, with a warning, never thresholded."""
    try:
        outcomes = score.outcomes(scoring.rule(task))
        tied = task_ties(task, score.samples, score.config).tied
        return TaskRun(task, group, outcomes, nonfinite=nonfinite_responses(score.samples), tied=tied)
    except TaskSkipped as reason:
        warnings.warn(f"task {task!r} skipped: {reason}", stacklevel=2)
        return TaskRun(task, group, None, str(reason))


def nonfinite_responses(samples: list[dict]) -> bool:
    """Whether any response lm-eval recorded holds a NaN or infinite number: the log-likelihoods of a model whose
    logits are not finite (any backend; generated text carries no number, so those need `evaluator.logit_watch`)."""

    def numbers(value):
        if isinstance(value, float):
            yield value
        elif isinstance(value, (list, tuple)):
            for item in value:
                yield from numbers(item)

    return any(not math.isfinite(number) for sample in samples for number in numbers(sample.get("resps")))


def check_not_mostly_tied(label: str, runs: list[TaskRun]) -> None:
    """A model whose answers are mostly ties (evaluate.ties) is refused: its scores say where gold sits among the
    options, not what it knows, so no pick made against it means anything."""
    tied = [run for run in runs if run.outcomes is not None and run.tied > MOSTLY * len(run.outcomes.correct)]
    if tied:
        counts = ", ".join(f"{run.task} {run.tied} of {len(run.outcomes.correct)}" for run in tied)
        raise InputError(
            f"{label}'s answers are mostly ties (every choice equally likely, or empty generations: {counts} docs); "
            "check its tokenizer and weights, no pick can be made against it"
        )


def check_groups_disjoint(runs: list[TaskRun]) -> None:
    """No task scored as both old and new: an lm-eval group named in one list may hold a task of the other."""
    groups = {}
    for run in runs:
        if groups.setdefault(run.task, run.group) != run.group:
            raise InputError(
                f"task {run.task!r} is both an old and a new task (an lm-eval group or tag in "
                "--old-tasks or --new-tasks holds it); list each task in one of them"
            )


@dataclass(frozen=True)
class Scores:
    """old, new (group scores) and their harmonic mean on one split."""

    old: float
    new: float
    harmonic_mean: float


@dataclass
class PointResult:
    """One evaluated model (pre, post or a merge): scores on the selection and report splits, the
    forgetting map against pre on the report split, and bootstrap intervals (filled by the sweep)."""

    label: str
    alpha: float | None
    tasks: list[TaskRun]
    report: Scores
    selection: Scores
    forgetting: list[TaskForgetting] = field(default_factory=list)
    groups: dict[str, GroupForgetting] = field(default_factory=dict)
    intervals: dict[str, list[float]] = field(default_factory=dict)  # name -> [low, high]
    second: tuple[str, float] | None = None  # a 2-D grid's cell: (the second coefficient, its value)

    @property
    def key(self) -> float | tuple[float, float] | None:
        """What names this point in picks, ties and fronts: alpha, or (alpha, second value) in a 2-D grid."""
        return self.alpha if self.second is None else (self.alpha, self.second[1])

    @property
    def old(self) -> float:
        return self.report.old

    @property
    def nonfinite(self) -> bool:
        """The model gave NaN or infinite logits: its scores are noise and it is never the pick."""
        return any(run.nonfinite for run in self.tasks)

    @property
    def new(self) -> float:
        return self.report.new

    @property
    def harmonic_mean(self) -> float:
        return self.report.harmonic_mean


def split_docs(keys, seed: int, fraction: float) -> tuple[list[str], list[str]]:
    """(selection, report) keys: a doc goes to selection when a seeded hash of its key falls below
    `fraction`. Hashing the key (doc_hash), not the position, keeps the split the same for every model,
    for any --limit and any order. [ours]"""
    selection, report = [], []
    for key in sorted(keys):
        digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
        (selection if int.from_bytes(digest[:8], "big") / 2**64 < fraction else report).append(key)
    return selection, report


def task_accuracy(outcomes: SampleOutcomes, keys: list[str]) -> float:
    return sum(outcomes.correct[key] for key in keys) / len(keys)


def group_scores(tasks: list[TaskRun], keys: dict[str, list[str]], aggregation: str) -> Scores:
    """old and new on the given docs of each task: the unweighted mean over a group's tasks (paper), or
    the share of all its samples (pooled)."""
    values = {}
    for group in GROUPS:
        runs = [run for run in tasks if run.group == group and run.outcomes is not None]
        if not runs:
            raise InputError(f"no {group} task could be scored (check --{group}-tasks and --metric)")
        if aggregation == "paper":
            values[group] = math.fsum(task_accuracy(run.outcomes, keys[run.task]) for run in runs) / len(runs)
        else:
            values[group] = sum(sum(run.outcomes.correct[key] for key in keys[run.task]) for run in runs) / sum(
                len(keys[run.task]) for run in runs
            )
    return Scores(values["old"], values["new"], harmonic_mean(values["old"], values["new"]))


def restricted(outcomes: SampleOutcomes, keys: list[str]) -> SampleOutcomes:
    return SampleOutcomes(
        outcomes.task,
        {key: outcomes.correct[key] for key in keys},
        outcomes.n_choices,
        outcomes.metric,
        outcomes.filter,
    )


def summarise(
    label: str,
    alpha: float | None,
    tasks: list[TaskRun],
    baseline: list[TaskRun],
    splits: dict[str, tuple[list[str], list[str]]],
    aggregation: str = "paper",
) -> PointResult:
    """Scores on both splits and the forgetting map against the baseline (pre) on the report split."""
    pre = {run.task: run.outcomes for run in baseline}
    rows = {}
    for run in tasks:
        if run.outcomes is None:
            continue
        report_keys = splits[run.task][1]
        try:
            rows[run.task] = compare(restricted(pre[run.task], report_keys), restricted(run.outcomes, report_keys))
        except TaskSkipped as reason:
            raise InputError(f"task {run.task!r} of {label}: {reason}") from None
    groups = {
        group: aggregate(
            [rows[run.task] for run in tasks if run.group == group and run.task in rows], group, aggregation
        )
        for group in GROUPS
    }
    return PointResult(
        label,
        alpha,
        tasks,
        group_scores(tasks, {task: keys[1] for task, keys in splits.items()}, aggregation),
        group_scores(tasks, {task: keys[0] for task, keys in splits.items()}, aggregation),
        list(rows.values()),
        groups,
    )


def doc_splits(settings: SweepSettings, baseline: list[TaskRun]) -> dict[str, tuple[list[str], list[str]]]:
    """Every scored task's (selection, report) doc keys, from pre's samples."""
    splits = {}
    for run in baseline:
        if run.outcomes is None:
            continue
        keys = list(run.outcomes.correct)
        selection, report = (
            split_docs(keys, settings.seed, settings.selection_fraction)
            if settings.selection == "docs"
            else (keys, keys)
        )
        if not selection or not report:
            raise InputError(
                f"task {run.task!r}: {len(keys)} doc(s) cannot be split into selection and report "
                "docs (raise --limit, or use --selection none)"
            )
        splits[run.task] = (selection, report)
    return splits


def paired_bootstrap(
    models: list[PointResult],
    splits: dict[str, tuple[list[str], list[str]]],
    aggregation: str,
    iterations: int,
    seed: int,
    split: int = 1,
):
    """Resampled (old, new, harmonic mean) of every model: array [iterations, models, 3]. Each task's docs
    of `split` (0 selection, 1 report) are resampled with replacement, the same draw for every model
    (paired: they answered the same samples), independently per task (stratified). [ours]"""
    import numpy as np

    rng = np.random.default_rng(seed)
    sums = {group: np.zeros((iterations, len(models))) for group in GROUPS}
    counts = dict.fromkeys(GROUPS, 0)
    for run in models[0].tasks:
        if run.outcomes is None:
            continue
        keys = splits[run.task][split]
        correct = np.array(
            [
                [model_run.outcomes.correct[key] for key in keys]
                for model in models
                for model_run in model.tasks
                if model_run.task == run.task
            ],
            float,
        )
        weights = rng.multinomial(len(keys), np.full(len(keys), 1 / len(keys)), size=iterations)
        hits = weights @ correct.T  # [iterations, models]: correct answers in each resample
        if aggregation == "paper":
            sums[run.group] += hits / len(keys)
            counts[run.group] += 1
        else:
            sums[run.group] += hits
            counts[run.group] += len(keys)
    old, new = sums["old"] / counts["old"], sums["new"] / counts["new"]
    with np.errstate(invalid="ignore", divide="ignore"):
        hm = np.where(old + new > 0, 2 * old * new / (old + new), 0.0)
    return np.stack([old, new, hm], axis=-1)
