"""Sample-level forgetting between a model before post-training ("pre") and a later one ("post" or a merge).

Benchmark accuracy hides churn: a model can lose 10% of what it knew and gain another 10% and show
no change. Pairing the two models' outcomes sample by sample separates the two flows, and a chance
correction stops lucky guesses on multiple-choice tasks from counting as knowledge.

Source: Harmon, Hochlehnert, Bethge, Prabhu, "Mapping Post-Training Forgetting in Language Models at
Scale" (arXiv 2510.17776, "the paper"), and its official code github.com/post-forget/post-forget
(`src/analyze/process_data.py`, `src/analyze/create_csv.py`, "the official code"). The paper numbers
no equations; citations below name its section and paragraph.

Per task, over N samples aligned between pre and post, with k choices per sample:

    quadrants   kept = 1->1, gained = 0->1, forgotten = 1->0, never = 0->0     (paper §2, Fig. 1)
    a_pre       mean accuracy before = (kept + forgotten) / N
    a_post      mean accuracy after  = (kept + gained) / N
    F           forgotten / N                                                  (paper §2, def. of F)
    BT          gained / N                                                     (paper §2, def. of BT)
    F_chance    ((1 - a_pre) / (k - 1)) * (1 - a_post)       (paper §2, "A chance baseline for flips")
    BT_chance   (1 - a_pre) * ((1 - a_post) / (k - 1))       (same paragraph; numerically equal to F_chance)
    F_true      max(F - F_chance, 0)        (paper §2, "Chance-adjusted forgetting and backward transfer")
    BT_true     max(BT - BT_chance, 0)      (same paragraph)
    F_max       a_pre_true  = max((k * a_pre - 1) / (k - 1), 0)                (paper §2, "Ceilings")
    BT_max      a_post_true = max((k * a_post - 1) / (k - 1), 0)               (paper §2, "Ceilings";
                official code: "Max Possible Improvement" uses acc_after)

k (paper §2: "number of choices in benchmark"; official code: a per-task `num_choices` table in
create_csv.py for the bbh subtasks, 4 for every other task, piqa and ifeval included; `--choices TASK=K`
reproduces one of its values where it differs from the rule below):
  - multiple_choice tasks: the number of choices lm-eval scored (one request per choice);
  - generative multiple choice (the paper's own setting, Appendix B.1: chain of thought, a letter
    extracted and exact-matched): `--choices TASK=K`, else the doc's options named by the task's
    `doc_to_choice` (from lm-eval's results_<timestamp>.json beside the samples, or in-process);
  - free-form generation (gsm8k, ifeval): k = inf, no chance term, as the paper's §2 chance correction is
    for multiple choice. [ours: the official code applies its default k = 4 to ifeval]
  - choices varying per doc: the effective k = 1 / mean(1 / k_i), which keeps the expected chance
    accuracy right. [ours]

Groups (paper Appendix B.2 groups tasks into categories; official code `create_pivot_table`): every
value of a group is the unweighted mean of its tasks' values, computed per seed, then averaged over
seeds. "pooled" [ours] instead pools the quadrant counts of all samples (a 1000-sample task weighs
100 times a 10-sample one) and uses the sample-weighted mean of the per-task chance terms and ceilings.

Seeds (official code: one comparison per (task, seed), the newest file of each, values averaged over
seeds): a results folder may hold several lm-eval runs of one model; runs are told apart by the
seeds lm-eval records in the `results_<timestamp>.json` beside each samples file, and pre and post
are compared seed by seed.

Misaligned tasks (official code: a sample-count mismatch skips that (task, seed) and is listed): a seed of
a task whose samples, or k, differ between pre and post is skipped with a warning and listed in the
output; the task's row and the groups use its other seeds, as the official per-seed means do. [ours: the
official code checks only the count, then pairs the samples sorted by prompt, different docs included]

Reading lm-eval `--log_samples` output (`samples_<task>_<timestamp>.jsonl`) [ours]:
  - a sample's key is its `doc_hash` (else `str(doc_id)`); identical documents share a hash, so the
    second, third, ... copies in doc_id order get the suffix "#2", "#3", ...;
  - the score is one metric lm-eval logs per sample (`--metric`, default: the first of the task's
    `metric_list` that it logged) under one filter (`--filter`, default: the first lm-eval logged);
    every value must be 0/1 (or true/false): a task with any other value (truthfulqa_mc2's
    probability mass) is skipped with a warning, never thresholded.
"""

from __future__ import annotations

import ast
import difflib
import fnmatch
import functools
import io
import json
import math
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from mergekit_lite.errors import InputError
from mergekit_lite.io.validation import (
    MAX_DEPTH,
    check_depth,
    open_regular,
    read_json,
    require_regular_inside,
    validate,
)

SAMPLES_FILE = re.compile(r"^samples_(?P<task>.+?)(?:_(?P<stamp>\d{4}-\d{2}-\d{2}T[0-9.:-]+))?\.jsonl$")
AGGREGATIONS = ("paper", "pooled")
OVERALL = "OVERALL"  # the official tables' name for the mean over categories
NO_SEED = "-"
SHARES = ("acc_pre", "acc_post", "F", "BT", "F_chance", "BT_chance", "F_true", "BT_true", "F_max", "BT_max")


class TaskSkipped(Exception):
    """A task that cannot be scored as asked (non-0/1 metric, misaligned samples): reported, not fatal."""


@dataclass(frozen=True)
class ScoringRule:
    """How one task's lm-eval records become 0/1 outcomes; None means the task's default."""

    metric: str | None = None
    filter: str | None = None
    choices: float | None = None
    required: bool = False  # metric/filter named for this task (not a global preference): missing is an error


@dataclass(frozen=True)
class Scoring:
    """--metric / --filter / --choices: a global value, or TASK=VALUE (TASK may be a pattern like mmlu_*)."""

    metric: str | None = None
    filter: str | None = None
    task_metric: tuple[tuple[str, str], ...] = ()
    task_filter: tuple[tuple[str, str], ...] = ()
    task_choices: tuple[tuple[str, float], ...] = ()

    @classmethod
    def from_specs(cls, metrics: Iterable[str] = (), filters: Iterable[str] = (), choices: Iterable[str] = ()):
        """Parse repeated option values; a bare value is global, TASK=VALUE is per task."""
        metric, task_metric = _split_specs("--metric", metrics)
        filter_, task_filter = _split_specs("--filter", filters)
        global_choices, task_choices = _split_specs("--choices", choices)
        if global_choices is not None:
            raise InputError(f"--choices {global_choices!r}: expected TASK=K (e.g. gpqa_cot=4)")
        return cls(metric, filter_, task_metric, task_filter,
                   tuple((task, _choices_value(task, value)) for task, value in task_choices))

    def check_logged(self, metrics: set[str], filters: set[str], where: str) -> None:
        """A global --metric or --filter is a preference applied where a task logs it; one that no task logs
        at all is a typo, refused with the names that were logged (the default would be scored silently)."""
        for option, wanted, logged in (("--metric", self.metric, metrics), ("--filter", self.filter, filters)):
            if wanted is not None and wanted not in logged:
                close = difflib.get_close_matches(wanted, sorted(logged), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise InputError(f"{option} {wanted!r}: no task in {where} logs it (logged: "
                                 f"{', '.join(sorted(logged)) or 'none'}){hint}")

    def rule(self, task: str) -> ScoringRule:
        metric, filter_ = _match(task, self.task_metric), _match(task, self.task_filter)
        return ScoringRule(metric=metric or self.metric, filter=filter_ or self.filter,
                           choices=_match(task, self.task_choices), required=bool(metric or filter_))


def _split_specs(option: str, specs: Iterable[str]) -> tuple[str | None, tuple[tuple[str, str], ...]]:
    """(global value or None, ((task pattern, value), ...)); at most one global value."""
    global_value, per_task = None, []
    for spec in specs:
        task, equals, value = str(spec).partition("=")
        if not equals:
            if global_value is not None:
                raise InputError(f"{option}: two global values ({global_value!r}, {spec!r}); use TASK=VALUE")
            global_value = spec.strip()
        elif not task.strip() or not value.strip():
            raise InputError(f"{option} {spec!r}: expected VALUE or TASK=VALUE")
        else:
            per_task.append((task.strip(), value.strip()))
    return global_value, tuple(per_task)


def _choices_value(task: str, value: str) -> float:
    try:
        k = float(value)
    except ValueError:
        raise InputError(f"--choices {task}={value}: K must be a number of choices (> 1) or inf") from None
    if math.isfinite(k) and not k.is_integer():
        raise InputError(f"--choices {task}={value}: K must be a whole number of choices (> 1) or inf")
    _check_k(k, task)
    return k


def _match(task: str, pairs):
    """The value of the first pattern matching the task, else None."""
    return next((value for pattern, value in pairs if fnmatch.fnmatchcase(task, pattern)), None)


@dataclass(frozen=True)
class SampleText:
    """One lm-eval record as text [ours]: the prompt (the context of its requests), the gold answer (the
    correct option's continuation for multiple choice, the target for generation), the model's answer (the
    option its metric chose, or its filtered generation) and the completion a replay set trains on. None
    where the log does not say (several contexts per doc, a target that names no option, ...)."""

    prompt: str | None
    gold: str | None
    answer: str | None
    completion: str | None
    doc_hash: str | None = None


@dataclass(frozen=True)
class SampleOutcomes:
    """One model's per-sample 0/1 outcomes on one task, keyed so two runs can be aligned."""

    task: str
    correct: dict[str, bool]
    n_choices: float
    metric: str = ""
    filter: str = ""
    doc_ids: dict[str, int] = field(default_factory=dict)  # key -> lm-eval's doc_id, where the records carry one
    # key -> what the log says as text (prompt, gold, answer): for the sample list and the replay set, not scoring
    texts: dict[str, SampleText] = field(default_factory=dict, compare=False, repr=False)
    answer_rule: str = field(default="", compare=False)  # how `texts[key].answer` was read (which metric decides)

    @property
    def accuracy(self) -> float:
        return sum(self.correct.values()) / len(self.correct)


@dataclass(frozen=True)
class TaskForgetting:
    """Forgetting and backward transfer between two models on one task (counts: seed means when averaged)."""

    task: str
    n: float
    k: float
    acc_pre: float
    acc_post: float
    kept: float
    gained: float
    forgotten: float
    never: float
    F: float
    BT: float
    F_chance: float
    BT_chance: float
    F_true: float
    BT_true: float
    F_max: float
    BT_max: float
    metric: str = ""
    seeds: int = 1

    def to_dict(self) -> dict:
        return _json_ready(self)


@dataclass(frozen=True)
class GroupForgetting:
    """A group of tasks: every share the unweighted mean over its tasks (paper) or from pooled samples (ours)."""

    group: str
    aggregation: str
    tasks: tuple[str, ...]
    n: float
    acc_pre: float
    acc_post: float
    F: float
    BT: float
    F_chance: float
    BT_chance: float
    F_true: float
    BT_true: float
    F_max: float
    BT_max: float

    def to_dict(self) -> dict:
        return _json_ready(self)


def _json_ready(row) -> dict:
    """Strict JSON: k is None for generative tasks because JSON has no infinity."""
    data = asdict(row)
    if "k" in data and math.isinf(data["k"]):
        data["k"] = None
    if "tasks" in data:
        data["tasks"] = list(data["tasks"])
    return data


def chance_flips(acc_pre: float, acc_post: float, k: float) -> float:
    """F_chance (= BT_chance): one side right by a lucky guess, the other wrong (paper §2, chance baseline)."""
    if math.isinf(k):
        return 0.0
    return (1 - acc_pre) * (1 - acc_post) / (k - 1)


def truly_known(acc: float, k: float) -> float:
    """Accuracy without lucky guesses, max((k a - 1)/(k - 1), 0): F_max from a_pre, BT_max from a_post
    (paper §2, "Ceilings")."""
    if math.isinf(k):
        return acc
    return max((k * acc - 1) / (k - 1), 0.0)


def effective_choices(chance_accuracy: float) -> float:
    """The k whose chance accuracy 1/k equals the given mean chance accuracy (inf when it is 0). [ours]"""
    return math.inf if chance_accuracy == 0 else 1 / chance_accuracy


def _check_k(k: float, task: str) -> None:
    """Chance terms divide by k - 1, so fewer than two choices has no meaning."""
    if math.isnan(k) or k <= 1:
        raise InputError(f"task {task!r}: number of choices k must be > 1 (inf for free-form generation), got {k}")


def forgetting_metrics(pre: Sequence[bool], post: Sequence[bool], k: float, task: str = "",
                       metric: str = "") -> TaskForgetting:
    """Metrics for two aligned outcome lists (pre[i] and post[i] are the same sample); paper §2."""
    if len(pre) != len(post):
        raise InputError(f"task {task!r}: pre has {len(pre)} samples but post has {len(post)}; they must be aligned")
    if not pre:
        raise InputError(f"task {task!r}: no samples to compare")
    _check_k(k, task)
    pairs = list(zip(map(bool, pre), map(bool, post)))
    kept, gained = pairs.count((True, True)), pairs.count((False, True))
    forgotten, never = pairs.count((True, False)), pairs.count((False, False))
    n = len(pairs)
    acc_pre, acc_post = (kept + forgotten) / n, (kept + gained) / n
    chance = chance_flips(acc_pre, acc_post, k)
    return TaskForgetting(
        task=task, n=n, k=k, acc_pre=acc_pre, acc_post=acc_post,
        kept=kept, gained=gained, forgotten=forgotten, never=never,
        F=forgotten / n, BT=gained / n, F_chance=chance, BT_chance=chance,
        F_true=max(forgotten / n - chance, 0.0), BT_true=max(gained / n - chance, 0.0),
        F_max=truly_known(acc_pre, k), BT_max=truly_known(acc_post, k), metric=metric,
    )


def compare(pre: SampleOutcomes, post: SampleOutcomes) -> TaskForgetting:
    """Align two runs of one task by sample key; runs that did not score the same samples raise TaskSkipped."""
    if pre.task != post.task:
        raise InputError(f"cannot compare different tasks: pre is {pre.task!r}, post is {post.task!r}")
    only_pre, only_post = pre.correct.keys() - post.correct.keys(), post.correct.keys() - pre.correct.keys()
    if only_pre or only_post:
        raise TaskSkipped(
            f"samples differ (pre {len(pre.correct)}, post {len(post.correct)}; "
            f"{len(only_pre)} only in pre, {len(only_post)} only in post); run both with the same --limit"
        )
    if pre.n_choices != post.n_choices:
        raise TaskSkipped(f"number of choices differs (pre k={pre.n_choices}, post k={post.n_choices})")
    keys = sorted(pre.correct)
    metric = "/".join(part for part in (pre.metric, pre.filter) if part and part != "none")
    return forgetting_metrics([pre.correct[key] for key in keys], [post.correct[key] for key in keys],
                              pre.n_choices, pre.task, metric)


def mean_over_seeds(rows: Sequence[TaskForgetting]) -> TaskForgetting:
    """One task's comparisons under several seeds, averaged field by field (official code: mean over seeds)."""
    if len(rows) == 1:
        return rows[0]
    numbers = {f.name: math.fsum(getattr(row, f.name) for row in rows) / len(rows)
               for f in fields(TaskForgetting) if f.name not in ("task", "k", "metric", "seeds")}
    return TaskForgetting(task=rows[0].task, k=rows[0].k, metric=rows[0].metric, seeds=len(rows), **numbers)


def aggregate(rows: Sequence[TaskForgetting], name: str, aggregation: str = "paper") -> GroupForgetting:
    """One seed's group row: the unweighted mean of the tasks' values (paper, official `create_pivot_table`)
    or, with "pooled" [ours], shares from the pooled counts and n-weighted chance terms and ceilings."""
    if not rows:
        raise InputError(f"group {name!r}: no tasks to aggregate")
    if aggregation not in AGGREGATIONS:
        raise InputError(f"aggregation must be one of {', '.join(AGGREGATIONS)}, got {aggregation!r}")
    total = math.fsum(row.n for row in rows)
    if aggregation == "paper":
        shares = {name_: math.fsum(getattr(row, name_) for row in rows) / len(rows) for name_ in SHARES}
    else:
        pooled = {count: math.fsum(getattr(row, count) for row in rows) for count in ("kept", "gained", "forgotten")}
        weighted = {name_: math.fsum(row.n * getattr(row, name_) for row in rows) / total
                    for name_ in ("F_chance", "BT_chance", "F_max", "BT_max")}
        forgotten, gained = pooled["forgotten"] / total, pooled["gained"] / total
        shares = {"acc_pre": (pooled["kept"] + pooled["forgotten"]) / total,
                  "acc_post": (pooled["kept"] + pooled["gained"]) / total, "F": forgotten, "BT": gained,
                  "F_true": max(forgotten - weighted["F_chance"], 0.0),
                  "BT_true": max(gained - weighted["BT_chance"], 0.0), **weighted}
    return GroupForgetting(group=name, aggregation=aggregation, tasks=tuple(row.task for row in rows), n=total,
                           **shares)


def aggregate_seeds(rows_by_seed: dict[str, Sequence[TaskForgetting]], name: str,
                    aggregation: str = "paper") -> GroupForgetting:
    """Group values per seed, then their mean over seeds (official code `create_pivot_table`)."""
    return mean_of_groups([aggregate(rows, name, aggregation) for rows in rows_by_seed.values() if rows], name)


def mean_of_groups(rows: Sequence[GroupForgetting], name: str) -> GroupForgetting:
    """Group rows averaged field by field, each weighing the same: one group's seeds, or the groups of the
    official code's OVERALL row (`create_pivot_table`: the mean of the category means)."""
    if not rows:
        raise InputError(f"group {name!r}: no tasks to aggregate")
    if len(rows) == 1:
        return replace(rows[0], group=name)
    tasks = tuple(dict.fromkeys(task for row in rows for task in row.tasks))
    means = {name_: math.fsum(getattr(row, name_) for row in rows) / len(rows) for name_ in ("n", *SHARES)}
    return GroupForgetting(group=name, aggregation=rows[0].aggregation, tasks=tasks, **means)


# --- scoring lm-eval records -----------------------------------------------------------------------


def is_generative(sample: dict) -> bool:
    """generate_until requests carry (context, generation kwargs); loglikelihood ones (context, continuation)."""
    arguments = sample.get("arguments")
    first = next(iter(arguments.values()), None) if isinstance(arguments, dict) else (arguments or [None])[0]
    second = (first.get("arg_1") if isinstance(first, dict) else
              first[1] if isinstance(first, (list, tuple)) and len(first) > 1 else None)
    return isinstance(second, dict)


def _doc_choices(sample: dict, config: dict | None) -> list | None:
    """The options a generative multiple-choice doc offers, read from the task's doc_to_choice as lm-eval
    reads it (`ConfigurableTask.doc_to_choice`: a list, a mapping's values, a doc field, or a Jinja template
    giving a list, "{{choices.text}}" included); None for free-form generation (no doc_to_choice), even if
    docs list options, and where the template gives no list."""
    doc = sample.get("doc") if isinstance(sample.get("doc"), dict) else {}
    spec = (config or {}).get("doc_to_choice")
    if isinstance(spec, (list, dict)):
        return list(spec.values()) if isinstance(spec, dict) else spec
    if isinstance(spec, str):
        choices = doc[spec] if spec in doc else _rendered_literal(spec, doc)
        return choices if isinstance(choices, list) else None
    return None


@functools.cache
def _template(text: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return ImmutableSandboxedEnvironment().from_string(text)


def _rendered_literal(template: str, doc: dict) -> Any:
    """A template rendered against the doc and read as a Python literal, as lm-eval does; in Jinja's sandbox,
    because a results file is an input that may run nothing. None where it does not render or parse."""
    try:
        return ast.literal_eval(_template(template).render(**doc))
    except Exception:  # any template or literal error: the doc names no options, so k stays inf
        return None


def sample_choices(sample: dict, config: dict | None, label: str) -> float:
    """k of one record: one loglikelihood request per choice for multiple choice (half of them when
    acc_mutual_info adds unconditional ones); the doc's choices for generative multiple choice; inf for
    free-form generation and single-continuation loglikelihood tasks (lambada)."""
    if is_generative(sample):
        choices = len(_doc_choices(sample, config) or ())
        return float(choices) if choices > 1 else math.inf
    arguments = sample.get("arguments")
    if not isinstance(arguments, (list, dict)):
        raise InputError(f"{label}: 'arguments' missing, cannot count the choices")
    choices = len(arguments) // 2 if "acc_mutual_info" in sample else len(arguments)
    return math.inf if choices < 2 else float(choices)


def logged_metrics(sample: dict) -> list[str]:
    """The metric names lm-eval logged for one record (its `metrics` list; older logs: known score keys)."""
    if isinstance(sample.get("metrics"), list):
        return [str(name) for name in sample["metrics"]]
    return [name for name in ("acc", "acc_norm", "exact_match") if name in sample]


def logged_names(samples: Iterable) -> tuple[set[str], set[str]]:
    """The metrics and the filters lm-eval logged across a task's records: what a global --metric or --filter
    may name (`Scoring.check_logged`)."""
    metrics, filters = set(), set()
    for sample in samples:
        if isinstance(sample, dict):
            metrics.update(logged_metrics(sample))
            filters.add(str(sample.get("filter")))
    return metrics, filters


def default_metric(logged: list[str], config: dict | None) -> str | None:
    """The first metric of the task's metric_list that was logged, else the first logged one."""
    listed = [entry.get("metric") for entry in (config or {}).get("metric_list") or [] if isinstance(entry, dict)]
    return next((name for name in listed if name in logged), logged[0] if logged else None)


def _binary(value) -> bool | None:
    """0/1 (or true/false) as a bool; anything else (a probability, a BLEU score) is None."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    return None


# --- what each sample said, as text [ours] ------------------------------------------------------------

# How lm-eval's multiple-choice metrics pick an option (`ConfigurableTask.process_results`): the argmax of the
# loglikelihoods, divided by the option's length in characters (acc_norm) or UTF-8 bytes (acc_bytes), or
# minus the option's unconditional loglikelihood (acc_mutual_info). Any other metric: the acc rule.
ANSWER_RULES = {
    "acc": "the option of highest loglikelihood (acc)",
    "acc_norm": "the option of highest loglikelihood per character (acc_norm)",
    "acc_bytes": "the option of highest loglikelihood per UTF-8 byte (acc_bytes)",
    "acc_mutual_info": "the option of highest loglikelihood minus its unconditional one (acc_mutual_info)",
}


def _requests(sample: dict) -> list[list]:
    """The arguments of each request, in order: lm-eval's {"gen_args_0": {"arg_0": ...}} or older lists."""
    arguments = sample.get("arguments")
    if isinstance(arguments, dict):
        requests = [arguments[name] for name in sorted(arguments, key=lambda name: int(name.rpartition("_")[2])
                                                          if name.rpartition("_")[2].isdigit() else 0)]
        return [[request[name] for name in sorted(request)] if isinstance(request, dict) else [] for request in requests]
    return [list(request) if isinstance(request, (list, tuple)) else [] for request in arguments or []]


def _number(value) -> float | None:
    """A logged loglikelihood (lm-eval writes them as strings) as a float, else None."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(number) else number


def _loglikelihoods(sample: dict, count: int) -> list[float] | None:
    """The (filtered) loglikelihood of each of the first `count` requests: [ll, is_greedy] pairs, or bare lls."""
    responses = sample.get("filtered_resps")
    if not isinstance(responses, list) or len(responses) < count:
        return None
    values = [_number(response[0] if isinstance(response, (list, tuple)) and response else response)
              for response in responses[:count]]
    return None if None in values else values


def _target_text(target) -> str | None:
    """doc_to_target(doc) as text: lm-eval's files log str() of it, its in-process records (the sweep's) the
    value itself. A list of several targets (multiple_target) has no single gold answer (None); a one-element
    list is its element."""
    if isinstance(target, list):
        return _target_text(target[0]) if len(target) == 1 else None
    if isinstance(target, int) and not isinstance(target, bool):
        return str(target)
    if not isinstance(target, str):
        return None
    text = target.strip()
    if text.startswith("[") and text.endswith("]"):
        try:
            listed = ast.literal_eval(text)
        except (ValueError, SyntaxError, RecursionError, MemoryError):
            return target
        if isinstance(listed, list):
            return str(listed[0]) if len(listed) == 1 else None
    return target


def _index(text: str) -> int | None:
    """A target that is an option's index (digits, as lm-eval's doc_to_target reads them), else None."""
    text = text.strip()
    return int(text) if text.isascii() and text.isdigit() and len(text) < 10 else None


def _option_index(target, options: list[str], delimiter: str) -> int | None:
    """The gold option's index from the logged target: an index, as lm-eval reads a digit target of a
    multiple-choice task, or the text of exactly one option."""
    text = _target_text(target)
    if text is None:
        return None
    if _index(text) is not None:
        return _index(text) if _index(text) < len(options) else None
    matches = [i for i, option in enumerate(options) if option in (text, delimiter + text)]
    return matches[0] if len(matches) == 1 else None


def _chosen_option(lls: list[float], options: list[str], unconditional: list[float] | None, metric: str,
                   delimiter: str) -> int:
    """The option `metric` picks, as lm-eval's process_results does (ANSWER_RULES); the first on a tie, as
    numpy's argmax."""
    choices = [option[len(delimiter):] if delimiter and option.startswith(delimiter) else option for option in options]
    if metric == "acc_norm":
        scores = [ll / max(len(choice), 1) for ll, choice in zip(lls, choices)]
    elif metric == "acc_bytes":
        scores = [ll / max(len(choice.encode()), 1) for ll, choice in zip(lls, choices)]
    elif metric == "acc_mutual_info" and unconditional is not None:
        scores = [ll - free for ll, free in zip(lls, unconditional)]
    else:
        scores = lls
    return max(range(len(scores)), key=scores.__getitem__)


def _generation(sample: dict) -> str | None:
    """The filtered generation (the first one when lm-eval kept several repeats)."""
    responses = sample.get("filtered_resps")
    response = responses[0] if isinstance(responses, list) and responses else responses
    while isinstance(response, (list, tuple)) and response:
        response = response[0]
    return response if isinstance(response, str) else None


def sample_text(sample: dict, metric: str, config: dict | None) -> SampleText:
    """What one record says as text, never failing: a part the log does not give is None.

    The prompt is the requests' shared context. Multiple choice: the gold answer is the continuation lm-eval
    scored for the target's option, the model's answer the option its metric picks, and the replay completion
    the gold continuation itself (target_delimiter included, so prompt + completion is the text lm-eval
    scored). Generation: the gold answer is the target (the option it indexes when the task has a
    doc_to_choice, as lm-eval's process_results maps it), the answer the filtered generation, and the
    completion target_delimiter + target, the way lm-eval joins a few-shot example's answer to its question."""
    delimiter = (config or {}).get("target_delimiter", " ")
    delimiter = delimiter if isinstance(delimiter, str) else " "
    doc_hash = str(sample["doc_hash"]) if sample.get("doc_hash") else None
    requests = _requests(sample)
    if not requests or not all(len(request) >= 2 for request in requests):
        return SampleText(None, None, None, None, doc_hash)
    if is_generative(sample):
        prompt = requests[0][0] if isinstance(requests[0][0], str) else None
        gold = _target_text(sample.get("target"))
        choices = _doc_choices(sample, config)
        if choices is not None and gold is not None and _index(gold) is not None:
            gold = str(choices[_index(gold)]) if _index(gold) < len(choices) else None
        completion = delimiter + gold if gold is not None and prompt is not None else None
        return SampleText(prompt, gold, _generation(sample), completion, doc_hash)
    count = len(requests) // 2 if "acc_mutual_info" in sample else len(requests)
    contexts, options = [request[0] for request in requests[:count]], [request[1] for request in requests[:count]]
    if not all(isinstance(text, str) for text in contexts + options) or len(set(contexts)) != 1:
        return SampleText(None, None, None, None, doc_hash)  # several contexts (multiple_input): no one prompt
    index = _option_index(sample.get("target"), options, delimiter)
    gold = options[index] if index is not None else None
    lls = _loglikelihoods(sample, len(requests))
    answer = None
    if lls is not None and count > 1:
        answer = options[_chosen_option(lls[:count], options, lls[count:] if len(lls) > count else None,
                                        metric, delimiter)]
    return SampleText(contexts[0], gold, answer, gold, doc_hash)


def answer_rule(sample: dict, metric: str, filter_: str | None) -> str:
    """How `sample_text` read the model's answer for this task, said in the sample list."""
    if is_generative(sample):
        return f"the generation under filter {filter_!r}" if filter_ not in (None, "none") else "the generation"
    return ANSWER_RULES.get(metric, ANSWER_RULES["acc"])


def outcomes_from_lm_eval(task: str, samples: list[dict], rule: ScoringRule = ScoringRule(),
                          config: dict | None = None, labels: Sequence[str] | None = None) -> SampleOutcomes:
    """SampleOutcomes from lm-eval's per-sample records (`results["samples"][task]` or a samples jsonl);
    `config` is the task's config lm-eval reports (`results["configs"][task]`), for metric_list and
    doc_to_choice. TaskSkipped when the metric is not 0/1; InputError for records that are not lm-eval's."""
    if not samples:
        raise InputError(f"task {task!r}: no samples")
    labels = labels if labels is not None else [f"task {task!r} sample {i}" for i in range(len(samples))]
    for sample, label in zip(samples, labels):
        if not isinstance(sample, dict):
            raise InputError(f"{label}: expected a JSON object, got {type(sample).__name__}")
    filters = list(dict.fromkeys(sample.get("filter") for sample in samples))
    chosen_filter = filters[0]
    if rule.filter is not None and rule.filter in filters:
        chosen_filter = rule.filter
    elif rule.filter is not None and rule.required:
        raise InputError(f"task {task!r}: no filter {rule.filter!r} (lm-eval logged {', '.join(map(str, filters))})")
    records = sorted(((s, label) for s, label in zip(samples, labels) if s.get("filter") == chosen_filter),
                     key=lambda record: record[0].get("doc_id") if isinstance(record[0].get("doc_id"), int) else 0)
    logged = logged_metrics(records[0][0])
    metric = rule.metric if rule.metric in logged else None
    if metric is None and rule.metric is not None and rule.required:
        raise InputError(f"task {task!r}: no metric {rule.metric!r} (lm-eval logged {', '.join(logged) or 'none'})")
    metric = metric or default_metric(logged, config)
    if metric is None:
        raise InputError(f"{records[0][1]}: no metric logged (run lm-eval with --log_samples)")
    correct: dict[str, bool] = {}
    doc_ids: dict[str, int] = {}
    texts: dict[str, SampleText] = {}
    chance_accuracies = []
    for sample, label in records:
        if metric not in sample:
            raise InputError(f"{label}: no {metric!r} field")
        outcome = _binary(sample[metric])
        if outcome is None:
            if not isinstance(sample[metric], (int, float)):
                raise InputError(f"{label}: {metric!r} must be a number, got {sample[metric]!r}")
            raise TaskSkipped(f"metric {metric!r} is not 0/1 (e.g. {sample[metric]!r} at {label}); "
                              "choose a 0/1 metric with --metric")
        k = rule.choices if rule.choices is not None else sample_choices(sample, config, label)
        key = _unique_key(_sample_key(sample, label), correct)
        correct[key] = outcome
        texts[key] = sample_text(sample, metric, config)
        if isinstance(sample.get("doc_id"), int):
            doc_ids[key] = sample["doc_id"]
        chance_accuracies.append(1 / k)
    return SampleOutcomes(task, correct, effective_choices(math.fsum(chance_accuracies) / len(chance_accuracies)),
                          metric, str(chosen_filter) if chosen_filter is not None else "", doc_ids, texts,
                          answer_rule(records[0][0], metric, chosen_filter))


def _sample_key(sample: dict, label: str) -> str:
    """doc_hash identifies the document across runs; doc_id is the fallback for older logs."""
    if sample.get("doc_hash"):
        return str(sample["doc_hash"])
    if "doc_id" in sample:
        return str(sample["doc_id"])
    raise InputError(f"{label}: neither 'doc_hash' nor 'doc_id' present")


def _unique_key(key: str, taken: dict) -> str:
    """Identical documents share a doc_hash: number the repeats "#2", "#3", ... instead of dropping them."""
    if key not in taken:
        return key
    repeat = 2
    while f"{key}#{repeat}" in taken:
        repeat += 1
    return f"{key}#{repeat}"


# --- reading a results folder ----------------------------------------------------------------------


@dataclass(frozen=True)
class SamplesFile:
    """One samples_<task>_<stamp>.jsonl and what lm-eval's results_<stamp>.json beside it says about the run."""

    path: Path
    task: str
    stamp: str
    seed: str
    model: str
    config: dict | None


@dataclass
class LoadedRun:
    """One model's lm-eval outputs: outcomes per task and seed, and the tasks that could not be scored."""

    model: str
    outcomes: dict[str, dict[str, SampleOutcomes]]
    skipped: dict[str, str] = field(default_factory=dict)


def task_from_filename(path: Path) -> tuple[str, str]:
    """(task, timestamp) from `samples_<task>_<timestamp>.jsonl`; task names may contain underscores."""
    match = SAMPLES_FILE.match(path.name)
    if not match:
        raise InputError(f"{path}: not an lm-eval samples file (expected samples_<task>_<timestamp>.jsonl)")
    return match["task"], match["stamp"] or ""


class ResultsFile(BaseModel):
    """The keys of lm-eval's results_<stamp>.json that are read (model name, seeds, task configs), typed so a
    malformed file is one line naming it and the key; the rest is lm-eval's and passes through."""

    model_config = ConfigDict(strict=True, extra="allow")
    model_name: str | None = None
    config: dict[str, Any] | None = None
    configs: dict[str, dict[str, Any]] | None = None


def _run_info(samples_path: Path, stamp: str, cache: dict, root: Path) -> tuple[str, str, dict]:
    """(seed label, model name, task configs) from results_<stamp>.json; without it one unseeded run of
    the model named by the folder. A results file that links out of `root` is refused, not read."""
    results_path = samples_path.with_name(f"results_{stamp}.json")
    if results_path not in cache:
        found = stamp and os.path.lexists(results_path) and require_regular_inside(results_path, root)
        cache[results_path] = validate(ResultsFile, read_json(results_path), results_path) if found else ResultsFile()
    results = cache[results_path]
    config = results.config or {}
    seeds = [config.get(name) for name in ("random_seed", "numpy_seed", "torch_seed", "fewshot_seed")]
    seed = NO_SEED if all(value is None for value in seeds) else (
        str(seeds[0]) if len(set(seeds)) == 1 else "/".join(map(str, seeds)))
    model = results.model_name or config.get("model_args") or str(samples_path.parent)
    return seed, str(model), results.configs or {}


def find_samples_files(path) -> list[SamplesFile]:
    """Every samples file under `path` (newest per task and seed); a path holding several models is an error."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: no such file or folder")
    folder = path.is_dir()
    paths = sorted(path.rglob("samples_*.jsonl")) if folder else [path]
    if not paths:
        raise InputError(f"{path}: no samples_<task>_<timestamp>.jsonl files (run lm-eval with --log_samples)")
    root = path if folder else path.parent  # reads stay inside what the user named: no link out of it
    cache: dict = {}
    entries = []
    for file in paths:
        task, stamp = task_from_filename(file)
        if folder:
            require_regular_inside(file, root)
        seed, model, configs = _run_info(file, stamp, cache, root)
        entries.append(SamplesFile(file, task, stamp, seed, model, configs.get(task)))
    models = sorted({entry.model for entry in entries})
    if len(models) > 1:
        folders = sorted({str(entry.path.parent) for entry in entries})
        raise InputError(f"{path} holds samples of {len(models)} models ({', '.join(models)}; in "
                         f"{', '.join(folders)}): give one model's folder")
    newest: dict[tuple[str, str], SamplesFile] = {}
    for entry in entries:
        if (entry.task, entry.seed) not in newest or entry.stamp > newest[(entry.task, entry.seed)].stamp:
            newest[(entry.task, entry.seed)] = entry
    return sorted(newest.values(), key=lambda entry: (entry.task, entry.seed))


def read_samples_file(path: Path) -> tuple[list[dict], list[str]]:
    """Records of one jsonl file and a label naming file and line for each."""
    samples, labels = [], []
    # bytes, so a binary file is reported by line like any other bad JSON; a FIFO or device is refused, not waited on
    with io.BufferedReader(open_regular(path)) as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            labels.append(f"{path} line {line_number}")
            samples.append(_parse_line(line, labels[-1]))
    if not samples:
        raise InputError(f"{path}: no samples in file")
    return samples, labels


def _parse_line(line: bytes, label: str):
    """One jsonl record; bad JSON, bad UTF-8 and nesting deeper than the project's limit (`check_depth`)
    are user errors naming file and line (`label`), not a RecursionError from the json module."""
    try:
        record = json.loads(line)
    except RecursionError:
        raise InputError(f"{label}: nested too deeply (more than {MAX_DEPTH} levels)") from None
    except ValueError as error:
        reason = error.msg if isinstance(error, json.JSONDecodeError) else "not UTF-8"
        raise InputError(f"{label}: not JSON ({reason})") from None
    check_depth(record, label)
    return record


def load_lm_eval_run(path, scoring: Scoring = Scoring()) -> LoadedRun:
    """One model's outcomes per task and seed from a samples file or a folder searched recursively."""
    files = find_samples_files(path)
    run = LoadedRun(files[0].model, {})
    metrics, filters = set(), set()
    for entry in files:
        samples, labels = read_samples_file(entry.path)
        logged = logged_names(samples)
        metrics, filters = metrics | logged[0], filters | logged[1]
        try:
            outcomes = outcomes_from_lm_eval(entry.task, samples, scoring.rule(entry.task), entry.config, labels)
        except TaskSkipped as reason:
            run.skipped[entry.task] = str(reason)
            continue
        run.outcomes.setdefault(entry.task, {})[entry.seed] = outcomes
    scoring.check_logged(metrics, filters, str(path))
    return run


# --- the map between two runs ----------------------------------------------------------------------


@dataclass
class ForgettingMap:
    """Per-task rows (seed means), rows per seed for grouping, and what was skipped and why."""

    rows: dict[str, TaskForgetting]
    rows_by_seed: dict[str, dict[str, TaskForgetting]]
    skipped: dict[str, str]

    def group(self, name: str, tasks: Sequence[str], aggregation: str = "paper") -> GroupForgetting:
        by_seed = {seed: [rows[task] for task in tasks if task in rows] for seed, rows in self.rows_by_seed.items()}
        return aggregate_seeds(by_seed, name, aggregation)

    def overall(self, groups: Sequence[tuple[str, Sequence[str]]], aggregation: str = "paper") -> GroupForgetting:
        """The paper's OVERALL row (official `create_pivot_table`): per seed, the mean of the groups' values,
        so each group (category) weighs the same whatever its number of tasks; then the mean over seeds."""
        per_seed = []
        for rows in self.rows_by_seed.values():
            present = [(name, [rows[task] for task in tasks if task in rows]) for name, tasks in groups]
            group_rows = [aggregate(members, name, aggregation) for name, members in present if members]
            if group_rows:
                per_seed.append(mean_of_groups(group_rows, OVERALL))
        return mean_of_groups(per_seed, OVERALL)


def forgetting_map(pre: LoadedRun, post: LoadedRun) -> ForgettingMap:
    """Compare every task both runs scored, seed by seed; what cannot be compared is skipped with a reason."""
    skipped = {task: f"pre: {reason}" for task, reason in pre.skipped.items()}
    skipped.update({task: f"post: {reason}" for task, reason in post.skipped.items() if task not in skipped})
    for task in sorted(pre.outcomes.keys() ^ post.outcomes.keys()):
        if task not in skipped:
            skipped[task] = f"only in {'pre' if task in pre.outcomes else 'post'}"
    rows, rows_by_seed = {}, {}
    for task in sorted(pre.outcomes.keys() & post.outcomes.keys()):
        seeds = sorted(pre.outcomes[task].keys() & post.outcomes[task].keys())
        if not seeds:
            skipped[task] = (f"no seed in common (pre {', '.join(sorted(pre.outcomes[task]))}; "
                             f"post {', '.join(sorted(post.outcomes[task]))})")
            continue
        per_seed, reasons = {}, {}
        for seed in seeds:  # official code: a mismatch skips that (task, seed) only, not the task's other seeds
            try:
                per_seed[seed] = compare(pre.outcomes[task][seed], post.outcomes[task][seed])
            except TaskSkipped as reason:
                reasons[seed] = str(reason)
        if reasons:
            skipped[task] = _seed_skips(reasons, list(per_seed))
        if not per_seed:
            continue
        rows[task] = mean_over_seeds(list(per_seed.values()))
        for seed, row in per_seed.items():
            rows_by_seed.setdefault(seed, {})[task] = row
    return ForgettingMap(rows, rows_by_seed, dict(sorted(skipped.items())))


def _seed_skips(reasons: dict[str, str], compared: list[str]) -> str:
    """Why a task's seeds were skipped: the bare reason when its only seed was, else seed by seed, naming
    the seeds its row and groups still use."""
    if len(reasons) == 1 and not compared:
        return next(iter(reasons.values()))
    text = "; ".join(f"seed {seed}: {reason}" for seed, reason in reasons.items())
    return f"{text} (compared on seed {', '.join(compared)} only)" if compared else text


# --- tables ------------------------------------------------------------------------------------------

TASK_COLUMNS = ("task", "metric", "n", "k", "acc_pre", "acc_post", "kept", "gained", "forgotten", "never",
                "F", "BT", "F_true", "BT_true", "F_max", "BT_max")
GROUP_COLUMNS = ("group", "tasks", "n", "acc_pre", "acc_post", "F", "BT", "F_true", "BT_true", "F_max", "BT_max")


def _cell(column: str, value) -> str:
    """Shares to 3 decimals, counts as integers (1 decimal when seed means), 'inf' k for generative."""
    if column == "k":
        return "inf" if math.isinf(value) else str(int(value)) if value == int(value) else f"{value:.2f}"
    if column == "tasks":
        return str(len(value))
    if column in ("n", "kept", "gained", "forgotten", "never"):
        return str(int(value)) if value == int(value) else f"{value:.1f}"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value) or "-"


def _table_line(cells: Sequence[str], widths: Sequence[int], names: int = 1) -> str:
    """One pipe-table line: the first `names` cells left-aligned, numbers right-aligned."""
    padded = [cell.ljust(width) if i < names else cell.rjust(width) for i, (cell, width) in enumerate(zip(cells, widths))]
    return "| " + " | ".join(padded) + " |"


def format_table(rows: Sequence[TaskForgetting | GroupForgetting], name_header: str | None = None,
                 checkpoints: Sequence[str] | None = None) -> str:
    """Markdown pipe table, padded so it also reads well as plain text; `checkpoints` adds a first column
    naming each row's checkpoint (a trajectory)."""
    columns = GROUP_COLUMNS if rows and isinstance(rows[0], GroupForgetting) else TASK_COLUMNS
    cells = [[name_header or columns[0], *columns[1:]]] + [[_cell(column, getattr(row, column)) for column in columns]
                                                           for row in rows]
    if checkpoints is not None:
        cells = [["checkpoint", *cells[0]]] + [[label, *line] for label, line in zip(checkpoints, cells[1:])]
    names = 1 + (checkpoints is not None)
    widths = [max(len(line[i]) for line in cells) for i in range(len(cells[0]))]
    rule = "|" + "|".join(["-" * (width + 2) for width in widths[:names]] +
                          ["-" * (width + 1) + ":" for width in widths[names:]]) + "|"
    return "\n".join([_table_line(cells[0], widths, names), rule] +
                     [_table_line(line, widths, names) for line in cells[1:]])
