"""One model's lm-eval run as per-sample 0/1 outcomes per task and seed: the scoring rules (--metric,
--filter, --choices), the outcomes of one task's records, and a results folder read as lm-eval wrote it.

Reading lm-eval `--log_samples` output (`samples_<task>_<timestamp>.jsonl`) [ours]:
  - a sample's key is its `doc_hash` (else `str(doc_id)`); identical documents share a hash, so the
    second, third, ... copies in doc_id order get the suffix "#2", "#3", ...;
  - the score is one metric lm-eval logs per sample (`--metric`, default: the first of the task's
    `metric_list` that it logged) under one filter (`--filter`, default: the first lm-eval logged);
    every value must be 0/1 (or true/false): a task with any other value (truthfulqa_mc2's
    probability mass) is skipped with a warning, never thresholded.
  - k, the number of choices, as defined in evaluate/forgetting.py: `--choices`, else each record's own
    (records.sample_choices), the effective k when it varies per doc.
"""

from __future__ import annotations

import difflib
import fnmatch
import io
import json
import math
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from mergekit_lite.errors import InputError
from mergekit_lite.evaluate.records import (
    SampleText,
    answer_rule,
    binary_outcome,
    default_metric,
    logged_metrics,
    logged_names,
    sample_choices,
    sample_text,
)
from mergekit_lite.io.validation import (
    MAX_DEPTH,
    check_depth,
    open_regular,
    read_json,
    require_regular_inside,
    validate,
)

SAMPLES_FILE = re.compile(r"^samples_(?P<task>.+?)(?:_(?P<stamp>\d{4}-\d{2}-\d{2}T[0-9.:-]+))?\.jsonl$")
NO_SEED = "-"


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
    check_k(k, task)
    return k


def _match(task: str, pairs):
    """The value of the first pattern matching the task, else None."""
    return next((value for pattern, value in pairs if fnmatch.fnmatchcase(task, pattern)), None)


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


def effective_choices(chance_accuracy: float) -> float:
    """The k whose chance accuracy 1/k equals the given mean chance accuracy (inf when it is 0). [ours]"""
    return math.inf if chance_accuracy == 0 else 1 / chance_accuracy


def check_k(k: float, task: str) -> None:
    """Chance terms divide by k - 1, so fewer than two choices has no meaning."""
    if math.isnan(k) or k <= 1:
        raise InputError(f"task {task!r}: number of choices k must be > 1 (inf for free-form generation), got {k}")


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
        outcome = binary_outcome(sample[metric])
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
