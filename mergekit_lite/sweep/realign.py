"""`--realign-shots K`: is post's forgetting lost knowledge or lost task alignment? Post is scored again with K
demonstrations (lm-eval's own few-shot docs) on only the docs it forgot, and each forgotten doc is spurious (the
demonstrations bring it back) or genuine, as `forgetting --realigned` splits them (evaluate.spurious: the definitions,
the chance correction and the group shares are that module's). The realigned evaluation is saved in points/ under a
label and identity that hold K, so a resumed sweep reuses it and another K is another evaluation."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from mergekit_lite.evaluate.spurious import (
    SPLIT_COLUMNS,
    SPURIOUS,
    SpuriousMap,
    SpuriousSplit,
    forgotten_kinds,
    format_split_table,
    split,
)
from mergekit_lite.io.report_page import Cell, Prose, Section, Table
from mergekit_lite.sweep.scoring import GROUPS, TaskRun
from mergekit_lite.sweep.settings import SweepSettings


def realigned_label(shots: int) -> str:
    return f"realigned-shots={shots}"


def realigned_identity(settings: SweepSettings) -> dict:
    """What the realigned evaluation depends on: the sweep's identity (pair, tasks, lm-eval's settings) and K."""
    return {**settings.identity(), "realign_shots": settings.realign_shots}


def forgotten_docs(pre: list[TaskRun], post: list[TaskRun]) -> dict[str, dict[str, list[int]]]:
    """{group: {task: lm-eval doc ids}} of every doc (both splits) pre gets right and post wrong; tasks and groups
    without one left out (lm-eval scores every doc of an empty list)."""
    post_by_task = {run.task: run for run in post}
    docs: dict[str, dict[str, list[int]]] = {}
    for run in pre:
        after = post_by_task.get(run.task)
        if run.outcomes is None or after is None or after.outcomes is None:
            continue
        ids = sorted(
            run.outcomes.doc_ids[key]
            for key, right in run.outcomes.correct.items()
            if right and not after.outcomes.correct.get(key, True)
        )
        if ids:
            docs.setdefault(run.group, {})[run.task] = ids
    return docs


def evaluate_realigned(
    settings: SweepSettings, runs: dict[str, list[TaskRun]], score: Callable[[int, dict], list[TaskRun]]
) -> list[TaskRun]:
    """The realigned runs: saved ones (`runs`, by label) when there, else `score(K, docs)` (None docs: post forgot
    nothing, nothing to score)."""
    label = realigned_label(settings.realign_shots)
    if label not in runs:
        docs = forgotten_docs(runs["pre"], runs["post"])
        runs[label] = score(settings.realign_shots, docs) if docs else []
    return runs[label]


def forgetting_kinds(
    pre: list[TaskRun], post: list[TaskRun], realigned: list[TaskRun], where: str
) -> dict[str, dict[str, str]]:
    """task -> forgotten doc key -> spurious or genuine (evaluate.spurious.forgotten_kinds), both splits' docs."""
    post_by_task = {run.task: run.outcomes for run in post}
    again = {run.task: run.outcomes for run in realigned if run.outcomes is not None}
    kinds = {}
    for run in pre:
        if run.outcomes is None or post_by_task.get(run.task) is None:
            continue
        # a task post forgot nothing of was not scored again: an empty run (a forgotten doc there is refused)
        realigned_run = again.get(run.task) or replace(run.outcomes, correct={}, doc_ids={}, texts={})
        kinds[run.task] = forgotten_kinds(run.outcomes, post_by_task[run.task], realigned_run, where)
    return kinds


def _splits(name_keys: dict[str, list[str]], kinds: dict[str, dict[str, str]], ks: dict[str, float]) -> SpuriousMap:
    """The split of the given keys per task (counts, chance-corrected shares), as a SpuriousMap for its groups."""
    tasks = {}
    for task, keys in name_keys.items():
        chosen = [kinds[task][key] for key in keys]
        tasks[task] = split(task, len(chosen), chosen.count(SPURIOUS), ks[task])
    return SpuriousMap(tasks, {}, {}, [], ks)


def realign_json(
    settings: SweepSettings,
    pre: list[TaskRun],
    kinds: dict[str, dict[str, str]],
    report_keys: dict[str, set[str]],
    classes: dict[tuple[str, str], str],
) -> dict:
    """results.json's `realign`: on the report split, post's forgotten docs and the pick's still-lost docs split into
    spurious and genuine per task and group (counts; chance-corrected shares as `forgetting --realigned` gives them).
    `classes`: (task, key) -> the doc's class in samples.jsonl."""
    ks = {run.task: run.outcomes.n_choices for run in pre if run.task in kinds}
    group_of = {run.task: run.group for run in pre}
    forgotten = {task: [key for key in sorted(kinds[task]) if key in report_keys[task]] for task in kinds}
    still_lost = {task: [key for key in keys if classes[task, key] == "still_lost"] for task, keys in forgotten.items()}
    out = {
        "shots": settings.realign_shots,
        "lm_eval": replace(settings.lm_eval, num_fewshot=settings.realign_shots).describe(),
        "split": "report",
    }
    for name, keys in (("forgetting", forgotten), ("still_lost", still_lost)):
        mapped = _splits(keys, kinds, ks)
        groups = {group: mapped.group(group, [task for task in keys if group_of[task] == group]) for group in GROUPS}
        out[name] = {
            "tasks": {task: row.to_dict() for task, row in mapped.tasks.items()},
            "groups": {group: row.to_dict() for group, row in groups.items()},
        }
    return out


def realign_section(realign: dict) -> Section:
    """The forgetting and the pick's still-lost docs split into spurious and genuine."""

    def table(part: dict, key: str) -> Table:
        rows = [SpuriousSplit(**row) for row in (*part["tasks"].values(), *part["groups"].values())]
        cells = [
            [Cell(row.name)]
            + [
                Cell(
                    "-" if value is None else str(value) if isinstance(value, int) else format_count(column, value),
                    value,
                )
                for column in SPLIT_COLUMNS[1:]
                for value in [getattr(row, column)]
            ]
            for row in rows
        ]
        return Table(
            list(SPLIT_COLUMNS), cells, "l" + "r" * (len(SPLIT_COLUMNS) - 1), format_split_table(rows), key=key
        )

    return Section(
        "realign",
        f"Spurious or genuine forgetting (report split, post again with {realign['shots']} demonstrations)",
        [
            Prose(
                [
                    f"Post was scored again on the docs it forgot with {realign['lm_eval']}. A forgotten doc is "
                    "**spurious** when the demonstrations bring it back (the task's format was lost, not the "
                    "knowledge) and **genuine** when they do not; the `_true` shares remove lucky guesses on K-choice "
                    "docs (docs/forgetting.md)."
                ]
            ),
            Prose(["Post's forgetting (pre right, post wrong):"]),
            table(realign["forgetting"], "realign-forgetting"),
            Prose(["The docs the pick still loses (pre right, post and the pick wrong):"]),
            table(realign["still_lost"], "realign-still-lost"),
        ],
    )


def format_count(column: str, value: float) -> str:
    """A split's cell as format_split_table prints it: counts as integers (one decimal for seed means), shares to 3."""
    if column in ("forgotten", "spurious", "genuine"):
        return str(int(value)) if value == int(value) else f"{value:.1f}"
    return f"{value:.3f}"
