"""What the sweep's pick did to each doc, next to pre and post [ours]: the docs post forgot that the pick wins
back (`recovered`) or still loses (`still_lost`), those it loses though post kept them (`newly_lost`), and the
other transitions. samples.jsonl holds every doc of both splits (its `split` field says which) with the
forgetting command's fields (`trajectory.sample_row`: prompt, gold answer, each model's answer); the counts in
results.json and report.md are on the report split, as the forgetting maps are. The texts come from the point
files (pre's keeps the prompts and gold answers, every point its answers); a run folder from before they were
kept resumes with null texts. `--replay` writes the still-lost docs (or every doc post forgot) as a training set
("Demystifying Language Model Forgetting with Low-Rank Example Associations" replays the forgotten examples)."""

from __future__ import annotations

import os
from pathlib import Path

from mergekit_lite.errors import InputError
from mergekit_lite.evaluate.outcomes import NO_SEED
from mergekit_lite.evaluate.trajectory import OUTCOMES, doc_order, jsonl, replay_records, sample_row
from mergekit_lite.io.outputs import check_output_file, write_atomic
from mergekit_lite.io.report_page import Cell, Prose, Section, Table
from mergekit_lite.sweep.result import SweepResult
from mergekit_lite.sweep.scoring import GROUPS
from mergekit_lite.sweep.settings import SweepSettings
from mergekit_lite.sweep.store import record_written, wrote_before

SAMPLES_FILE = "samples.jsonl"
# (pre, post, pick) right -> class; the first three are what a merge is for, the rest for completeness
CLASSES = {
    (True, False, True): "recovered",  # forgotten by post, won back by the pick
    (True, False, False): "still_lost",  # forgotten by post, still lost by the pick
    (True, True, False): "newly_lost",  # kept by post, lost by the pick
    (True, True, True): "kept",
    (False, False, False): "never",
    (False, False, True): "gained",  # right only with the pick
    (False, True, True): "gain_kept",  # gained by post, kept by the pick
    (False, True, False): "gain_lost",  # gained by post, lost by the pick
}
SHOWN = ("recovered", "still_lost", "newly_lost")
PROMPT_WIDTH = 160  # characters of a prompt's end the report shows (few-shot prompts end with the question)


def doc_hash(key: str, doc_id: int | None) -> str | None:
    """The doc_hash a sample key holds (`_unique_key` numbers repeats "#2", ...); None for keys that fell back
    to doc_id (logs without doc_hash)."""
    return None if doc_id is not None and key == str(doc_id) else key.partition("#")[0]


def sample_rows(result: SweepResult, kinds: dict[str, dict[str, str]] | None = None) -> list[dict]:
    """One row per (task, doc) of every scored task, in task and lm-eval doc order: its split and class, the
    outcomes of post and of the pick against pre, and `sample_row`'s scores, texts and answers for
    [pre, post, pick]. `kinds`: result_kinds, when the caller has them."""
    models = (result.pre, result.post, result.best)
    outcomes = [{run.task: run.outcomes for run in point.tasks if run.outcomes is not None} for point in models]
    kinds = result_kinds(result) if kinds is None and result.realigned is not None else kinds
    rows = []
    for task in sorted(outcomes[0]):
        report = set(result.splits[task][1])
        task_outcomes = [scored[task] for scored in outcomes]
        for key in doc_order(task_outcomes[0]):
            row = sample_row(task_outcomes, key, NO_SEED)
            pre, post, pick = (bool(score) for score in row["scores"])
            rows.append(
                {
                    "task": task,
                    "doc_id": row["doc_id"],
                    "doc_hash": doc_hash(key, row["doc_id"]),
                    "key": key,
                    "split": "report" if key in report else "selection",
                    "class": CLASSES[pre, post, pick],
                    "outcome_post": OUTCOMES[pre, post],
                    "outcome_pick": OUTCOMES[pre, pick],
                    "models": ["pre", "post", result.best.label],
                    "seed": row["seed"],
                    "scores": row["scores"],
                    "prompt": row["prompt"],
                    "gold": row["gold"],
                    "answers": row["answers"],
                    "answer_rule": row["answer_rule"] or None,
                    "completion": row["completion"],
                }
            )
            if kinds is not None:  # --realign-shots: spurious or genuine where post forgot the doc, else null
                rows[-1]["forgetting_kind"] = kinds[task].get(key)
    return rows


def realign_json_of(result: SweepResult, rows: list[dict], kinds: dict[str, dict[str, str]]) -> dict:
    """results.json's `realign` (sweep.realign.realign_json) from the sample rows' classes and the report split."""
    from mergekit_lite.sweep.realign import realign_json

    classes = {(row["task"], row["key"]): row["class"] for row in rows}
    report = {task: set(keys[1]) for task, keys in result.splits.items()}
    return realign_json(result.settings, result.pre.tasks, kinds, report, classes)


def result_kinds(result: SweepResult) -> dict[str, dict[str, str]] | None:
    """--realign-shots: task -> each doc post forgot -> spurious or genuine (sweep.realign); None without it."""
    if result.realigned is None:
        return None
    from mergekit_lite.sweep.realign import forgetting_kinds, realigned_label

    where = f"{result.out}/{realigned_label(result.settings.realign_shots)}"
    return forgetting_kinds(result.pre.tasks, result.post.tasks, result.realigned, where)


def class_counts(rows: list[tuple[str, dict]]) -> dict[str, dict[str, int]]:
    """name -> class -> docs (every class listed, zeros included), rows grouped by `name` (a task or a group)."""
    counts: dict[str, dict[str, int]] = {}
    for name, row in rows:
        counts.setdefault(name, dict.fromkeys(CLASSES.values(), 0))[row["class"]] += 1
    return counts


def _tail(text: str | None, width: int = PROMPT_WIDTH) -> str | None:
    """A text on one line, its end kept when long."""
    if text is None:
        return None
    flat = " ".join(text.split())
    return flat if len(flat) <= width else "..." + flat[-(width - 3) :]


def samples_json(result: SweepResult, rows: list[dict], shown: int = 3) -> dict:
    """results.json's `samples`: the file, the pick it describes, the report split's counts per task and per
    group, and the first few report docs of each class a merge is for, as text (prompt's end, gold answer,
    post's and the pick's answers); `rows`: sample_rows."""
    rows = [row for row in rows if row["split"] == "report"]
    group = {run.task: run.group for run in result.pre.tasks}
    by_group = class_counts([(group[row["task"]], row) for row in rows])
    examples = {
        name: [
            {
                "task": row["task"],
                "doc_id": row["doc_id"] if row["doc_id"] is not None else row["key"],
                "prompt": _tail(row["prompt"]),
                "gold": row["gold"],
                "post": row["answers"][1],
                "pick": row["answers"][2],
            }
            for row in rows
            if row["class"] == name
        ][:shown]
        for name in SHOWN
    }
    return {
        "file": SAMPLES_FILE,
        "rows": "every doc, its split in `split`",
        "split": "report",
        "pick": result.best.label,
        "counts": class_counts([(row["task"], row) for row in rows]),
        "groups": {name: by_group[name] for name in GROUPS if name in by_group},
        "without_text": sum(row["prompt"] is None or row["gold"] is None for row in rows),
        "examples": examples,
    }


def _code(text: str | None) -> str:
    """Inline code for report.md (backticks swapped for quotes); `?` where the point files keep no text."""
    return "?" if text is None else "`" + " ".join(text.split()).replace("`", "'") + "`"


def samples_section(samples: dict) -> Section:
    """The counts per task and group of the classes a merge is for, and a few report docs of each."""
    rows = [
        [Cell(task), *(Cell(str(counts[name]), counts[name]) for name in SHOWN)]
        for task, counts in samples["counts"].items()
    ]
    rows += [
        [Cell(name, strong=True), *(Cell(str(counts[name]), counts[name]) for name in SHOWN)]
        for name, counts in samples["groups"].items()
    ]
    lines = []
    for name in SHOWN:
        total = sum(counts[name] for counts in samples["counts"].values())
        lines.append(f"- {name.replace('_', ' ')}: {total}")
        lines += [
            f"  - {example['task']} doc {example['doc_id']}: {_code(example['prompt'])} gold "
            f"{_code(example['gold'])}, post {_code(example['post'])}, pick {_code(example['pick'])}"
            for example in samples["examples"][name]
        ]
    blocks = [Table(["task", *SHOWN], rows, "l" + "r" * len(SHOWN), key="samples"), Prose(lines)]
    if samples["without_text"]:
        blocks.append(
            Prose(
                [
                    f"{samples['without_text']} report docs have no prompt or gold answer in the point files (`?`: "
                    "points saved before they were kept, or a log that does not give them)."
                ]
            )
        )
    return Section(
        "sample-counts", f"What the pick did to the docs post forgot (report split, `{SAMPLES_FILE}`)", blocks
    )


def write_samples(result: SweepResult, rows: list[dict]) -> None:
    """samples.jsonl in the run folder (`sample_rows`), whole or not at all."""
    write_atomic(Path(result.out) / SAMPLES_FILE, jsonl(rows))


def check_replay(path: str | os.PathLike, settings: SweepSettings) -> None:
    """--replay, checked before any work: a new file, or the one this run folder's sweep wrote there before (the same
    command run again writes it again); outside the inputs and the folders the sweep writes."""
    parents = Path(os.path.realpath(path)).parents  # the sweep's own folders first: they may not exist yet
    for what, folder in (
        ("the run folder", settings.out),
        ("--save-best", settings.save_best),
        ("--save-best-adapter", settings.save_best_adapter),
    ):
        if folder is not None and Path(os.path.realpath(folder)) in parents:
            raise InputError(f"{path}: is inside {what} {folder}; write the replay set elsewhere")
    check_output_file(
        path,
        [settings.pre, settings.post, settings.include_path, settings.recall_texts],
        recognise=lambda existing: wrote_before(settings.out, "replay", existing),
    )


def write_replay(
    result: SweepResult,
    path: str | os.PathLike,
    replay_format: str = "prompt-completion",
    every_forgotten: bool = False,
) -> tuple[int, int]:
    """The docs of both splits the pick still loses (`every_forgotten`: every doc post forgot) as TRL training
    records (`trajectory.replay_records`), whole or not at all; (records written, docs left out for lack of a
    prompt or gold answer)."""
    chosen = {"still_lost", "recovered"} if every_forgotten else {"still_lost"}
    records, unrecoverable = replay_records(sample_rows(result), replay_format, lambda row: row["class"] in chosen)
    write_atomic(Path(path), jsonl(records))
    record_written(result.out, "replay", path)
    return len(records), unrecoverable
