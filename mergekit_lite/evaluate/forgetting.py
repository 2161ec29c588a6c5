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
a task whose samples, k, metric, filter or number of few-shot examples differ between pre and post is
skipped with a warning and listed in the output; the task's row and the groups use its other seeds, as the
official per-seed means do. [ours: the official code checks only the count, then pairs the samples sorted by
prompt, different docs included]

Where the outcomes come from: evaluate/outcomes.py reads lm-eval's per-sample records (evaluate/records.py
reads one record); this module compares two models' outcomes and aggregates the comparisons.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace

from mergekit_lite.errors import InputError
from mergekit_lite.evaluate.outcomes import NO_SEED, LoadedRun, SampleOutcomes, TaskSkipped, check_k

AGGREGATIONS = ("paper", "pooled")
OVERALL = "OVERALL"  # the official tables' name for the mean over categories
SHARES = ("acc_pre", "acc_post", "F", "BT", "F_chance", "BT_chance", "F_true", "BT_true", "F_max", "BT_max")


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


def forgetting_metrics(
    pre: Sequence[bool], post: Sequence[bool], k: float, task: str = "", metric: str = ""
) -> TaskForgetting:
    """Metrics for two aligned outcome lists (pre[i] and post[i] are the same sample); paper §2."""
    if len(pre) != len(post):
        raise InputError(f"task {task!r}: pre has {len(pre)} samples but post has {len(post)}; they must be aligned")
    if not pre:
        raise InputError(f"task {task!r}: no samples to compare")
    check_k(k, task)
    pairs = list(zip(map(bool, pre), map(bool, post), strict=True))
    kept, gained = pairs.count((True, True)), pairs.count((False, True))
    forgotten, never = pairs.count((True, False)), pairs.count((False, False))
    n = len(pairs)
    acc_pre, acc_post = (kept + forgotten) / n, (kept + gained) / n
    chance = chance_flips(acc_pre, acc_post, k)
    return TaskForgetting(
        task=task,
        n=n,
        k=k,
        acc_pre=acc_pre,
        acc_post=acc_post,
        kept=kept,
        gained=gained,
        forgotten=forgotten,
        never=never,
        F=forgotten / n,
        BT=gained / n,
        F_chance=chance,
        BT_chance=chance,
        F_true=max(forgotten / n - chance, 0.0),
        BT_true=max(gained / n - chance, 0.0),
        F_max=truly_known(acc_pre, k),
        BT_max=truly_known(acc_post, k),
        metric=metric,
    )


def compare(pre: SampleOutcomes, post: SampleOutcomes) -> TaskForgetting:
    """Align two runs of one task by sample key; runs that did not score the same samples raise TaskSkipped."""
    if pre.task != post.task:
        raise InputError(f"cannot compare different tasks: pre is {pre.task!r}, post is {post.task!r}")
    only_pre, only_post = pre.correct.keys() - post.correct.keys(), post.correct.keys() - pre.correct.keys()
    if only_pre or only_post:
        raise TaskSkipped(
            f"samples differ (pre {len(pre.correct)}, post {len(post.correct)}; "
            f"{len(only_pre)} only in pre, {len(only_post)} only in post); run both on the same docs "
            "(--limit, --samples)"
        )
    if pre.n_choices != post.n_choices:
        raise TaskSkipped(f"number of choices differs (pre k={pre.n_choices}, post k={post.n_choices})")
    for what, before, after in (
        ("metric", pre.metric, post.metric),
        ("filter", pre.filter, post.filter),
        ("num_fewshot", pre.num_fewshot, post.num_fewshot),
    ):
        if before not in (None, "") and after not in (None, "") and before != after:  # "" / None: not logged
            raise TaskSkipped(f"scored otherwise ({what} {before} in pre, {after} in post): not the same evaluation")
    keys = sorted(pre.correct)
    metric = "/".join(part for part in (pre.metric, pre.filter) if part and part != "none")
    return forgetting_metrics(
        [pre.correct[key] for key in keys], [post.correct[key] for key in keys], pre.n_choices, pre.task, metric
    )


def mean_over_seeds(rows: Sequence[TaskForgetting]) -> TaskForgetting:
    """One task's comparisons under several seeds, averaged field by field (official code: mean over seeds)."""
    if len(rows) == 1:
        return rows[0]
    numbers = {
        f.name: math.fsum(getattr(row, f.name) for row in rows) / len(rows)
        for f in fields(TaskForgetting)
        if f.name not in ("task", "k", "metric", "seeds")
    }
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
        weighted = {
            name_: math.fsum(row.n * getattr(row, name_) for row in rows) / total
            for name_ in ("F_chance", "BT_chance", "F_max", "BT_max")
        }
        forgotten, gained = pooled["forgotten"] / total, pooled["gained"] / total
        shares = {
            "acc_pre": (pooled["kept"] + pooled["forgotten"]) / total,
            "acc_post": (pooled["kept"] + pooled["gained"]) / total,
            "F": forgotten,
            "BT": gained,
            "F_true": max(forgotten - weighted["F_chance"], 0.0),
            "BT_true": max(gained - weighted["BT_chance"], 0.0),
            **weighted,
        }
    return GroupForgetting(
        group=name, aggregation=aggregation, tasks=tuple(row.task for row in rows), n=total, **shares
    )


def aggregate_seeds(
    rows_by_seed: dict[str, Sequence[TaskForgetting]], name: str, aggregation: str = "paper"
) -> GroupForgetting:
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
            unknown = NO_SEED in pre.outcomes[task].keys() | post.outcomes[task].keys()
            skipped[task] = (
                f"no seed in common (pre {', '.join(sorted(pre.outcomes[task]))}; "
                f"post {', '.join(sorted(post.outcomes[task]))})"
                + (
                    f"; {NO_SEED}: no seed recorded (no results_<timestamp>.json beside the samples, or "
                    "lm-eval before 0.4.3)"
                    if unknown
                    else ""
                )
            )
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

TASK_COLUMNS = (
    "task",
    "metric",
    "n",
    "k",
    "acc_pre",
    "acc_post",
    "kept",
    "gained",
    "forgotten",
    "never",
    "F",
    "BT",
    "F_true",
    "BT_true",
    "F_max",
    "BT_max",
)
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
    padded = [
        cell.ljust(width) if i < names else cell.rjust(width)
        for i, (cell, width) in enumerate(zip(cells, widths, strict=True))
    ]
    return "| " + " | ".join(padded) + " |"


def format_table(
    rows: Sequence[TaskForgetting | GroupForgetting],
    name_header: str | None = None,
    checkpoints: Sequence[str] | None = None,
) -> str:
    """Markdown pipe table, padded so it also reads well as plain text; `checkpoints` adds a first column
    naming each row's checkpoint (a trajectory)."""
    columns = GROUP_COLUMNS if rows and isinstance(rows[0], GroupForgetting) else TASK_COLUMNS
    cells = [[name_header or columns[0], *columns[1:]]] + [
        [_cell(column, getattr(row, column)) for column in columns] for row in rows
    ]
    if checkpoints is not None:
        cells = [["checkpoint", *cells[0]]] + [
            [label, *line] for label, line in zip(checkpoints, cells[1:], strict=True)
        ]
    names = 1 + (checkpoints is not None)
    widths = [max(len(line[i]) for line in cells) for i in range(len(cells[0]))]
    rule = (
        "|"
        + "|".join(
            ["-" * (width + 2) for width in widths[:names]] + ["-" * (width + 1) + ":" for width in widths[names:]]
        )
        + "|"
    )
    return "\n".join(
        [_table_line(cells[0], widths, names), rule] + [_table_line(line, widths, names) for line in cells[1:]]
    )
