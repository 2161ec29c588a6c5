"""Sample-level forgetting between a model before post-training ("pre") and a later one ("post" or a merge).

Benchmark accuracy hides churn: a model can lose 10% of what it knew and gain another 10% and show
no change. Pairing the two models' outcomes sample by sample separates the two flows, and a chance
correction stops lucky guesses on multiple-choice tasks from counting as knowledge.

Definitions, per task, over N samples aligned between pre and post, with k choices per sample
(k from the task for multiple choice; k = inf for generative tasks, which have no chance term):

    quadrants   kept = 1->1, gained = 0->1, forgotten = 1->0, never = 0->0   (counts; they sum to N)
    a_pre       mean accuracy before = (kept + forgotten) / N
    a_post      mean accuracy after  = (kept + gained) / N
    F           share forgotten      = forgotten / N   (correct before, wrong after)
    BT          backward transfer    = gained / N      (wrong before, correct after)
    F_chance    = ((1 - a_pre) / (k - 1)) * (1 - a_post)
                  F expected from guessing alone: right by luck before, wrong after.
    BT_chance   = (1 - a_pre) * ((1 - a_post) / (k - 1))
                  BT expected from guessing alone: wrong before, right by luck after.
                  (Both chance terms are 0 when k = inf.)
    F_true      = max(F - F_chance, 0)
    BT_true     = max(BT - BT_chance, 0)
    F_max       = a_pre_true = max((k * a_pre - 1) / (k - 1), 0)
                  the share truly known before (a_pre with k = inf): the most that can be forgotten.
    BT_max      = 1 - a_pre_true: the share not truly known before, the most that can be gained.

Example: two independent random guessers on a k = 2 task give F ~ 0.25 but F_true ~ 0 and F_max ~ 0.

Groups of tasks (e.g. "old" skills vs "new" ones) are sample-weighted: the quadrant counts are pooled,
so a 1000-sample task weighs ten times a 100-sample one, and a_pre, a_post, F, BT are recomputed from
the pooled counts. Tasks may differ in k, so the chance terms and F_max of a group are the
sample-weighted means of the per-task values (always, even when every k is equal, so one rule holds);
F_true and BT_true subtract them from the pooled F and BT and clip at 0 once, for the group. The
group's k is the effective k whose chance accuracy 1/k equals the pooled one: N / sum(n_i / k_i).

Reading lm-eval `--log_samples` output (`samples_<task>_<timestamp>.jsonl`):
  - a sample's key is its `doc_hash` (else `str(doc_id)`); identical documents share a hash, so the
    second, third, ... copies in doc_id order get the suffix "#2", "#3", ... to stay aligned;
  - correctness is `acc` when present (k = number of `arguments`, one per choice; half that when the
    task also logs `acc_mutual_info`, whose extra requests are unconditional; k = inf when there is
    a single argument, as in loglikelihood tasks like lambada), else `exact_match` (k = inf);
    a score counts as correct when it is >= 0.5;
  - tasks whose number of choices varies per sample get the effective k = 1 / mean(1 / k_i), which
    keeps the expected chance accuracy right;
  - lm-eval logs every doc once per filter (e.g. gsm8k's strict-match and flexible-extract); the first
    filter in the file is used, the one lm-eval lists first;
  - in a folder, a task found with several timestamps (or in several model sub-folders) is read from
    the newest file only.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from mergekit_lite.errors import InputError

SAMPLES_FILE = re.compile(r"^samples_(?P<task>.+?)(?:_(?P<stamp>\d{4}-\d{2}-\d{2}T[0-9.:-]+))?\.jsonl$")
CORRECT_AT = 0.5
COLUMNS = ("task", "n", "k", "acc_pre", "acc_post", "kept", "gained", "forgotten", "never",
           "F", "BT", "F_true", "BT_true", "F_max", "BT_max")


@dataclass(frozen=True)
class SampleOutcomes:
    """One model's per-sample correctness on one task, keyed so two runs can be aligned."""

    task: str
    correct: dict[str, bool]
    n_choices: float


@dataclass(frozen=True)
class TaskForgetting:
    """Forgetting and backward transfer between two models on one task or one pooled group of tasks."""

    task: str
    n: int
    k: float
    acc_pre: float
    acc_post: float
    kept: int
    gained: int
    forgotten: int
    never: int
    F: float
    BT: float
    F_chance: float
    BT_chance: float
    F_true: float
    BT_true: float
    F_max: float
    BT_max: float

    def to_dict(self) -> dict:
        """Plain JSON-ready dict; k is None for generative tasks because JSON has no infinity."""
        row = asdict(self)
        row["k"] = None if math.isinf(self.k) else self.k
        return row


def chance_forgetting(acc_pre: float, acc_post: float, k: float) -> float:
    """F (and BT) expected from guessing alone: one side right by luck, the other wrong."""
    if math.isinf(k):
        return 0.0
    return (1 - acc_pre) * (1 - acc_post) / (k - 1)


def truly_known(acc: float, k: float) -> float:
    """Accuracy with lucky guesses removed: the share of samples the model actually knows."""
    if math.isinf(k):
        return acc
    return max((k * acc - 1) / (k - 1), 0.0)


def effective_choices(chance_accuracy: float) -> float:
    """The k whose chance accuracy 1/k equals the given mean chance accuracy (inf when it is 0)."""
    return math.inf if chance_accuracy == 0 else 1 / chance_accuracy


def _check_k(k: float, task: str) -> None:
    """Chance terms divide by k - 1, so fewer than two choices has no meaning."""
    if math.isnan(k) or k <= 1:
        raise InputError(f"task {task!r}: number of choices k must be > 1 (math.inf for generative), got {k}")


def _from_counts(
    task: str, kept: int, gained: int, forgotten: int, never: int, k: float, chance: float, f_max: float
) -> TaskForgetting:
    """Fill in the shares from quadrant counts and already-computed chance term and F_max."""
    n = kept + gained + forgotten + never
    forgotten_share, gained_share = forgotten / n, gained / n
    return TaskForgetting(
        task=task,
        n=n,
        k=k,
        acc_pre=(kept + forgotten) / n,
        acc_post=(kept + gained) / n,
        kept=kept,
        gained=gained,
        forgotten=forgotten,
        never=never,
        F=forgotten_share,
        BT=gained_share,
        F_chance=chance,
        BT_chance=chance,
        F_true=max(forgotten_share - chance, 0.0),
        BT_true=max(gained_share - chance, 0.0),
        F_max=f_max,
        BT_max=1 - f_max,
    )


def forgetting_metrics(pre: Sequence[bool], post: Sequence[bool], k: float, task: str = "") -> TaskForgetting:
    """Metrics for two aligned correctness lists (pre[i] and post[i] are the same sample)."""
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
    return _from_counts(
        task, kept, gained, forgotten, never, k, chance_forgetting(acc_pre, acc_post, k), truly_known(acc_pre, k)
    )


def compare(pre: SampleOutcomes, post: SampleOutcomes) -> TaskForgetting:
    """Align two runs of one task by sample key; refuse runs that did not score the same samples."""
    if pre.task != post.task:
        raise InputError(f"cannot compare different tasks: pre is {pre.task!r}, post is {post.task!r}")
    only_pre, only_post = pre.correct.keys() - post.correct.keys(), post.correct.keys() - pre.correct.keys()
    if only_pre or only_post:
        raise InputError(
            f"task {pre.task!r}: samples differ (pre {len(pre.correct)}, post {len(post.correct)}; "
            f"{len(only_pre)} only in pre, {len(only_post)} only in post); run both with the same --limit"
        )
    if pre.n_choices != post.n_choices:
        raise InputError(
            f"task {pre.task!r}: number of choices differs (pre k={pre.n_choices}, post k={post.n_choices})"
        )
    keys = sorted(pre.correct)
    return forgetting_metrics(
        [pre.correct[key] for key in keys], [post.correct[key] for key in keys], pre.n_choices, pre.task
    )


def aggregate(rows: Sequence[TaskForgetting], name: str) -> TaskForgetting:
    """Pool tasks into one sample-weighted row; chance terms and F_max are n-weighted per-task means."""
    if not rows:
        raise InputError(f"group {name!r}: no tasks to aggregate")
    total = sum(row.n for row in rows)
    chance = math.fsum(row.n * row.F_chance for row in rows) / total
    f_max = math.fsum(row.n * row.F_max for row in rows) / total
    return _from_counts(
        name,
        sum(row.kept for row in rows),
        sum(row.gained for row in rows),
        sum(row.forgotten for row in rows),
        sum(row.never for row in rows),
        effective_choices(math.fsum(row.n / row.k for row in rows) / total),
        chance,
        f_max,
    )


def _score(sample: dict, label: str) -> tuple[bool, float]:
    """Correctness and number of choices of one lm-eval sample record."""
    metric = "acc" if "acc" in sample else "exact_match" if "exact_match" in sample else None
    if metric is None:
        raise InputError(f"{label}: no 'acc' or 'exact_match' field (log with lm-eval --log_samples)")
    value = sample[metric]
    if not isinstance(value, (int, float)):
        raise InputError(f"{label}: {metric!r} must be a number, got {value!r}")
    if metric == "exact_match":
        return value >= CORRECT_AT, math.inf
    arguments = sample.get("arguments")
    if not isinstance(arguments, (list, dict)):
        raise InputError(f"{label}: 'arguments' missing, cannot count the choices")
    choices = len(arguments) // 2 if "acc_mutual_info" in sample else len(arguments)
    return value >= CORRECT_AT, math.inf if choices < 2 else float(choices)


def _sample_key(sample: dict, label: str) -> str:
    """doc_hash identifies the document across runs; doc_id is the fallback for older logs."""
    if sample.get("doc_hash"):
        return str(sample["doc_hash"])
    if "doc_id" in sample:
        return str(sample["doc_id"])
    raise InputError(f"{label}: neither 'doc_hash' nor 'doc_id' present")


def _doc_order(sample: dict) -> int:
    """lm-eval's doc_id, so repeated documents are numbered in the same order in every run."""
    doc_id = sample.get("doc_id")
    return doc_id if isinstance(doc_id, int) else 0


def _unique_key(key: str, taken: dict) -> str:
    """Identical documents share a doc_hash: number the repeats "#2", "#3", ... instead of dropping them."""
    if key not in taken:
        return key
    repeat = 2
    while f"{key}#{repeat}" in taken:
        repeat += 1
    return f"{key}#{repeat}"


def outcomes_from_lm_eval(task: str, samples: list[dict], labels: Sequence[str] | None = None) -> SampleOutcomes:
    """SampleOutcomes from lm-eval's per-sample records (`results["samples"][task]` or a samples jsonl).

    `labels` names each record in error messages (the file loader passes "file line N").
    """
    if not samples:
        raise InputError(f"task {task!r}: no samples")
    labels = labels if labels is not None else [f"task {task!r} sample {i}" for i in range(len(samples))]
    for sample, label in zip(samples, labels):
        if not isinstance(sample, dict):
            raise InputError(f"{label}: expected a JSON object, got {type(sample).__name__}")
    first_filter = samples[0].get("filter")
    records = sorted(
        ((sample, label) for sample, label in zip(samples, labels) if sample.get("filter") == first_filter),
        key=lambda record: _doc_order(record[0]),
    )
    correct: dict[str, bool] = {}
    chance_accuracies = []
    for sample, label in records:
        is_correct, k = _score(sample, label)
        correct[_unique_key(_sample_key(sample, label), correct)] = is_correct
        chance_accuracies.append(1 / k)
    return SampleOutcomes(task, correct, effective_choices(math.fsum(chance_accuracies) / len(chance_accuracies)))


def task_from_filename(path: Path) -> tuple[str, str]:
    """(task, timestamp) from `samples_<task>_<timestamp>.jsonl`; task names may contain underscores."""
    match = SAMPLES_FILE.match(path.name)
    if not match:
        raise InputError(f"{path}: not an lm-eval samples file (expected samples_<task>_<timestamp>.jsonl)")
    return match["task"], match["stamp"] or ""


def _read_samples_file(path: Path, task: str) -> SampleOutcomes:
    """Parse one jsonl file, naming the file and line in every error."""
    samples, labels = [], []
    with open(path, "rb") as handle:  # bytes, so a binary file is reported by line like any other bad JSON
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                samples.append(json.loads(line))
            except ValueError as error:
                reason = error.msg if isinstance(error, json.JSONDecodeError) else "not UTF-8"
                raise InputError(f"{path} line {line_number}: not JSON ({reason})") from None
            labels.append(f"{path} line {line_number}")
    if not samples:
        raise InputError(f"{path}: no samples in file")
    return outcomes_from_lm_eval(task, samples, labels)


def load_lm_eval_samples(path) -> dict[str, SampleOutcomes]:
    """Outcomes per task from a samples jsonl file or a folder searched recursively (newest file per task)."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: no such file or folder")
    files = sorted(path.rglob("samples_*.jsonl")) if path.is_dir() else [path]
    if not files:
        raise InputError(f"{path}: no samples_<task>_<timestamp>.jsonl files (run lm-eval with --log_samples)")
    newest: dict[str, tuple[str, Path]] = {}
    for file in files:
        task, stamp = task_from_filename(file)
        if task not in newest or stamp > newest[task][0]:
            newest[task] = (stamp, file)
    return {task: _read_samples_file(file, task) for task, (_, file) in sorted(newest.items())}


def _cell(column: str, value) -> str:
    """Shares to 3 decimals, counts as integers, k as a whole number when it is one, 'inf' for generative."""
    if column == "k":
        return "inf" if math.isinf(value) else str(int(value)) if value == int(value) else f"{value:.2f}"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def _table_line(cells: Sequence[str], widths: Sequence[int]) -> str:
    """One pipe-table line: the task name left-aligned, numbers right-aligned."""
    padded = [cells[0].ljust(widths[0])] + [cell.rjust(width) for cell, width in zip(cells[1:], widths[1:])]
    return "| " + " | ".join(padded) + " |"


def format_table(rows: Sequence[TaskForgetting], name_header: str = "task") -> str:
    """Markdown pipe table, padded so it also reads well as plain text; name_header titles the first column."""
    body = [[_cell(column, getattr(row, column)) for column in COLUMNS] for row in rows]
    cells = [[name_header, *COLUMNS[1:]], *body]
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    rule = "|" + "|".join(["-" * (widths[0] + 2)] + ["-" * (width + 1) + ":" for width in widths[1:]]) + "|"
    return "\n".join([_table_line(cells[0], widths), rule] + [_table_line(line, widths) for line in cells[1:]])
