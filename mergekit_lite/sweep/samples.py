"""What the sweep's pick did to each doc of the report split, next to pre and post [ours]: the docs post forgot
that the pick wins back (`recovered`) or still loses (`still_lost`), those it loses though post kept them
(`newly_lost`), and the other transitions, written to samples.jsonl with counts per task for results.json and
report.md. Point files keep each doc's 0/1 outcome, not lm-eval's text, so the prompt, gold answer and answers
are null here and no replay set can be built from a sweep (`forgetting --samples/--replay` on lm-eval's own
output files has them)."""

from __future__ import annotations

from pathlib import Path

from mergekit_lite.evaluate.trajectory import doc_order, jsonl
from mergekit_lite.io.outputs import write_atomic
from mergekit_lite.sweep.result import SweepResult

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
NO_TEXT = "point files keep 0/1 outcomes per doc, not lm-eval's text"


def doc_hash(key: str, doc_id: int | None) -> str | None:
    """The doc_hash a sample key holds (`_unique_key` numbers repeats "#2", ...); None for keys that fell back
    to doc_id (logs without doc_hash)."""
    return None if doc_id is not None and key == str(doc_id) else key.partition("#")[0]


def sample_rows(result: SweepResult) -> list[dict]:
    """One row per (task, report doc) of every scored task, in task and lm-eval doc order: its class, the 0/1
    outcomes of pre, post and the pick, and null text fields (NO_TEXT)."""
    models = {"pre": result.pre, "post": result.post, "pick": result.best}
    outcomes = {name: {run.task: run.outcomes for run in point.tasks if run.outcomes is not None}
                for name, point in models.items()}
    rows = []
    for task in sorted(outcomes["pre"]):
        report = set(result.splits[task][1])
        for key in doc_order(outcomes["pre"][task]):
            if key not in report:
                continue
            right = {name: outcomes[name][task].correct[key] for name in models}
            doc_id = outcomes["pre"][task].doc_ids.get(key)
            rows.append({"task": task, "doc_id": doc_id, "doc_hash": doc_hash(key, doc_id), "key": key,
                         "class": CLASSES[tuple(right.values())], **{name: int(value) for name, value in right.items()},
                         "prompt": None, "gold": None, "answers": None})
    return rows


def class_counts(rows: list[dict]) -> dict[str, dict[str, int]]:
    """task -> class -> docs (every class listed, zeros included)."""
    counts: dict[str, dict[str, int]] = {}
    for row in rows:
        counts.setdefault(row["task"], dict.fromkeys(CLASSES.values(), 0))[row["class"]] += 1
    return counts


def samples_json(result: SweepResult, shown: int = 5) -> dict:
    """results.json's `samples`: the file, the pick it describes, the counts per task, and the first few docs of
    each class a merge is for (task and doc id; the sample key where the log had no doc_id)."""
    rows = sample_rows(result)
    examples = {name: [[row["task"], row["doc_id"] if row["doc_id"] is not None else row["key"]]
                       for row in rows if row["class"] == name][:shown] for name in SHOWN}
    return {"file": SAMPLES_FILE, "split": "report", "pick": result.best.label, "text": None, "why_no_text": NO_TEXT,
            "counts": class_counts(rows), "examples": examples}


def samples_lines(samples: dict) -> list[str]:
    """report.md: the counts per task of the classes a merge is for, and a few doc ids of each."""
    lines = [f"## What the pick did to the docs post forgot (report split, `{SAMPLES_FILE}`)", "",
             "| task | " + " | ".join(SHOWN) + " |", "|---|" + "---:|" * len(SHOWN)]
    lines += [f"| {task} | " + " | ".join(str(counts[name]) for name in SHOWN) + " |"
              for task, counts in samples["counts"].items()]
    lines.append("")
    for name in SHOWN:
        total = sum(counts[name] for counts in samples["counts"].values())
        ids = ", ".join(f"{task} doc {doc}" for task, doc in samples["examples"][name])
        lines.append(f"- {name.replace('_', ' ')}: {total}" + (f" (e.g. {ids})" if ids else ""))
    return lines + ["", f"Doc ids only: {NO_TEXT}; `mergekit-lite forgetting --samples` on lm-eval's output files "
                    "shows the texts.", ""]


def write_samples(result: SweepResult) -> None:
    """samples.jsonl in the run folder (`sample_rows`), whole or not at all."""
    write_atomic(Path(result.out) / SAMPLES_FILE, jsonl(sample_rows(result)))
