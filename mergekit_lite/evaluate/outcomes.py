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
    record_filters,
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
        return cls(
            metric,
            filter_,
            task_metric,
            task_filter,
            tuple((task, _choices_value(task, value)) for task, value in task_choices),
        )

    def check_logged(self, metrics: set[str], filters: set[str], where: str) -> None:
        """A global --metric or --filter is a preference applied where a task logs it; one that no task logs
        at all is a typo, refused with the names that were logged (the default would be scored silently)."""
        for option, wanted, logged in (("--metric", self.metric, metrics), ("--filter", self.filter, filters)):
            if wanted is not None and wanted not in logged:
                close = difflib.get_close_matches(wanted, sorted(logged), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise InputError(
                    f"{option} {wanted!r}: no task in {where} logs it (logged: "
                    f"{', '.join(sorted(logged)) or 'none'}){hint}"
                )

    def rule(self, task: str) -> ScoringRule:
        metric, filter_ = _match(task, self.task_metric), _match(task, self.task_filter)
        return ScoringRule(
            metric=metric or self.metric,
            filter=filter_ or self.filter,
            choices=_match(task, self.task_choices),
            required=bool(metric or filter_),
        )


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
    num_fewshot: int | None = field(default=None, compare=False)  # the task config's, where lm-eval reports it

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


def outcomes_from_lm_eval(
    task: str,
    samples: list[dict],
    rule: ScoringRule = ScoringRule(),
    config: dict | None = None,
    labels: Sequence[str] | None = None,
) -> SampleOutcomes:
    """SampleOutcomes from lm-eval's per-sample records (`results["samples"][task]` or a samples jsonl);
    `config` is the task's config lm-eval reports (`results["configs"][task]`), for metric_list and
    doc_to_choice. TaskSkipped when the metric is not 0/1; InputError for records that are not lm-eval's."""
    if not samples:
        raise InputError(f"task {task!r}: no samples")
    labels = labels if labels is not None else [f"task {task!r} sample {i}" for i in range(len(samples))]
    for sample, label in zip(samples, labels, strict=True):
        if not isinstance(sample, dict):
            raise InputError(f"{label}: expected a JSON object, got {type(sample).__name__}")
    record_filter = record_filters(samples, config, labels[0])
    filters = list(dict.fromkeys(record_filter))
    chosen_filter = filters[0]
    if rule.filter is not None and rule.filter in filters:
        chosen_filter = rule.filter
    elif rule.filter is not None and rule.required:
        raise InputError(f"task {task!r}: no filter {rule.filter!r} (lm-eval logged {', '.join(map(str, filters))})")
    records = sorted(
        ((s, label) for s, label, name in zip(samples, labels, record_filter, strict=True) if name == chosen_filter),
        key=lambda record: record[0].get("doc_id") if isinstance(record[0].get("doc_id"), int) else 0,
    )
    logged = logged_metrics(records[0][0], config)
    if records[0][0].get("metrics") == [] or logged == ["bypass"]:
        raise InputError(
            f"{records[0][1]}: no scores: lm-eval ran with --predict_only, which logs the model's "
            "outputs and no metric; run it without --predict_only"
        )
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
            raise _not_binary(
                task,
                metric,
                sample[metric],
                label,
                [name for name in logged if name != metric],
                [record for record, _ in records],
            )
        k = rule.choices if rule.choices is not None else sample_choices(sample, config, label)
        key = _unique_key(_sample_key(sample, label), correct)
        correct[key] = outcome
        texts[key] = sample_text(sample, metric, config)
        if isinstance(sample.get("doc_id"), int):
            doc_ids[key] = sample["doc_id"]
        chance_accuracies.append(1 / k)
    shots = (config or {}).get("num_fewshot")
    return SampleOutcomes(
        task,
        correct,
        effective_choices(math.fsum(chance_accuracies) / len(chance_accuracies)),
        metric,
        str(chosen_filter) if chosen_filter is not None else "",
        doc_ids,
        texts,
        answer_rule(records[0][0], metric, chosen_filter),
        shots if isinstance(shots, int) and not isinstance(shots, bool) else None,
    )


def _not_binary(task: str, metric: str, value, label: str, others: list[str], records: list[dict]) -> Exception:
    """Why a metric value cannot be a 0/1 outcome: TaskSkipped for what lm-eval logs for a metric that is not
    0/1 (a probability, a loglikelihood, or the (reference, prediction) pair or [loglikelihood, length] it
    keeps for a corpus-level score such as bleu, f1 or word_perplexity), naming the task's 0/1 metrics;
    InputError for anything else (a string: not lm-eval's)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, list, tuple)):
        return InputError(f"{label}: {metric!r} must be a number, got {value!r}")
    what = "a per-sample pair lm-eval aggregates over the corpus" if isinstance(value, (list, tuple)) else "not 0/1"
    binary = [name for name in others if all(binary_outcome(record.get(name)) is not None for record in records)]
    hint = (
        f"; it also logs the 0/1 metric {binary[0]!r}: --metric {task}={binary[0]}"
        if binary
        else "; choose a 0/1 metric with --metric"
    )
    shown = repr(value if not isinstance(value, (list, tuple)) else list(value)[:2])
    return TaskSkipped(f"metric {metric!r} is {what} (e.g. {shown[:80]} at {label}){hint}")


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
    groups: dict = field(default_factory=dict, compare=False)  # lm-eval's group_subtasks: group -> its tasks


@dataclass
class LoadedRun:
    """One model's lm-eval outputs: outcomes per task and seed, the tasks that could not be scored, and lm-eval's
    groups (group_subtasks of its results files: a group's tasks and subgroups)."""

    model: str
    outcomes: dict[str, dict[str, SampleOutcomes]]
    skipped: dict[str, str] = field(default_factory=dict)
    groups: dict[str, list[str]] = field(default_factory=dict)


def task_from_filename(path: Path) -> tuple[str, str]:
    """(task, timestamp) from `samples_<task>_<timestamp>.jsonl`; task names may contain underscores."""
    match = SAMPLES_FILE.match(path.name)
    if not match:
        raise InputError(f"{path}: not an lm-eval samples file (expected samples_<task>_<timestamp>.jsonl)")
    return match["task"], match["stamp"] or ""


class ResultsFile(BaseModel):
    """The keys of lm-eval's results_<stamp>.json that are read (model name, seeds, task configs, groups), typed
    so a malformed file is one line naming it and the key; the rest is lm-eval's and passes through."""

    model_config = ConfigDict(strict=True, extra="allow")
    model_name: str | None = None
    config: dict[str, Any] | None = None
    configs: dict[str, dict[str, Any]] | None = None
    group_subtasks: dict[str, list[str]] | None = None


def _results(results_path: Path, root: Path, cache: dict) -> ResultsFile:
    """A results file read once; one that links out of `root` is refused, not read."""
    if results_path not in cache:
        require_regular_inside(results_path, root)
        cache[results_path] = validate(ResultsFile, read_json(results_path), results_path)
    return cache[results_path]


def _run_info(results: ResultsFile, fallback_model: str) -> tuple[str, str]:
    """(seed label, model name) of one lm-eval run: its four seeds (one label when they agree; NO_SEED where
    the file records none, as lm-eval before 0.4.3 did) and its model_name, else model_args."""
    config = results.config or {}
    seeds = [config.get(name) for name in ("random_seed", "numpy_seed", "torch_seed", "fewshot_seed")]
    seed = (
        NO_SEED
        if all(value is None for value in seeds)
        else (str(seeds[0]) if len(set(seeds)) == 1 else "/".join(map(str, seeds)))
    )
    return seed, str(results.model_name or config.get("model_args") or fallback_model)


def _samples_file(file: Path, root: Path, cache: dict) -> SamplesFile:
    """A samples file with its run's results_<stamp>.json; without one, one unseeded run of the model named by
    the folder."""
    task, stamp = task_from_filename(file)
    results_path = file.with_name(f"results_{stamp}.json")
    results = _results(results_path, root, cache) if stamp and os.path.lexists(results_path) else ResultsFile()
    seed, model = _run_info(results, str(file.parent))
    return SamplesFile(file, task, stamp, seed, model, (results.configs or {}).get(task), results.group_subtasks or {})


def _legacy_files(root: Path, cache: dict) -> list[SamplesFile]:
    """lm-eval before 0.4.3 (`--output_path DIR --log_samples`, lm_eval/__main__.py of v0.4.0 to v0.4.2) wrote
    DIR/results.json and, for each task of its configs, DIR/<model_args, '/' and '=' as '__'>_<task>.jsonl
    holding one JSON array of records."""
    entries = []
    for results_path in sorted(root.rglob("results.json")):
        results = _results(results_path, root, cache)
        model_args = (results.config or {}).get("model_args")
        if not isinstance(model_args, str):
            continue
        seed, model = _run_info(results, model_args)
        for task, config in sorted((results.configs or {}).items()):
            name = f"{re.sub('/|=', '__', model_args)}_{task}.jsonl"
            file = results_path.parent / name
            if "/" not in name and "\0" not in name and os.path.lexists(file):
                entries.append(
                    SamplesFile(
                        require_regular_inside(file, root), task, "", seed, model, config, results.group_subtasks or {}
                    )
                )
    return entries


def _no_samples(path: Path) -> InputError:
    """No per-sample log under `path`: lm-eval ran without --log_samples where its results files are there."""
    if any(path.rglob("results*.json")):
        return InputError(
            f"{path}: lm-eval results without per-sample logs (samples_<task>_<timestamp>.jsonl): "
            "rerun lm-eval with --log_samples"
        )
    return InputError(f"{path}: no samples_<task>_<timestamp>.jsonl files (run lm-eval with --log_samples)")


def find_samples_files(path) -> list[SamplesFile]:
    """Every samples file under `path` (newest per task and seed), or lm-eval < 0.4.3's files beside its
    results.json; a path holding several models is an error."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: no such file or folder")
    folder = path.is_dir()
    root = path if folder else path.parent  # reads stay inside what the user named: no link out of it
    cache: dict = {}
    paths = sorted(path.rglob("samples_*.jsonl")) if folder else [path]
    entries = [_samples_file(require_regular_inside(file, root) if folder else file, root, cache) for file in paths]
    entries = entries or (_legacy_files(path, cache) if folder else [])
    if not entries:
        raise _no_samples(path)
    models = sorted({entry.model for entry in entries})
    if len(models) > 1:
        folders = sorted({str(entry.path.parent) for entry in entries})
        raise InputError(
            f"{path} holds samples of {len(models)} models ({', '.join(models)}; in "
            f"{', '.join(folders)}): give one model's folder"
        )
    newest: dict[tuple[str, str], SamplesFile] = {}
    for entry in entries:
        if (entry.task, entry.seed) not in newest or entry.stamp > newest[(entry.task, entry.seed)].stamp:
            newest[(entry.task, entry.seed)] = entry
    return sorted(newest.values(), key=lambda entry: (entry.task, entry.seed))


def read_samples_file(path: Path) -> tuple[list[dict], list[str]]:
    """Records of one jsonl file and a label naming file and line for each; lm-eval < 0.4.3's file is one JSON
    array, labelled by record."""
    samples, labels = [], []
    # bytes, so a binary file is reported by line like any other bad JSON; a FIFO or device is refused, not waited on
    with io.BufferedReader(open_regular(path)) as handle:
        if handle.peek(1)[:1] == b"[":
            records = _parse_line(handle.read(), str(path))
            if not isinstance(records, list):
                raise InputError(f"{path}: not JSON lines nor a JSON array of records")
            return _records_or_error(records, [f"{path} record {i}" for i in range(len(records))], path)
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            labels.append(f"{path} line {line_number}")
            samples.append(_parse_line(line, labels[-1]))
    return _records_or_error(samples, labels, path)


def _records_or_error(samples: list, labels: list[str], path: Path) -> tuple[list, list[str]]:
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
    groups = {group: tasks for entry in files for group, tasks in entry.groups.items()}
    run = LoadedRun(files[0].model, {}, groups=groups)
    metrics, filters = set(), set()
    for entry in files:
        samples, labels = read_samples_file(entry.path)
        logged = logged_names(samples, entry.config, labels[0])
        metrics, filters = metrics | logged[0], filters | logged[1]
        try:
            outcomes = outcomes_from_lm_eval(entry.task, samples, scoring.rule(entry.task), entry.config, labels)
        except TaskSkipped as reason:
            run.skipped[entry.task] = str(reason)
            continue
        run.outcomes.setdefault(entry.task, {})[entry.seed] = outcomes
    scoring.check_logged(metrics, filters, str(path))
    return run
