"""Answers that are ties, not choices: lm-eval records whose choices all have the same log-likelihood (what a broken
or silently replaced tokenizer gives, or a model whose output does not depend on its input), and generations that
are all empty. lm-eval's argmax then takes the first option, so such an "answer" says whether gold happens to be
option 0, not what the model knows. [ours]"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from mergekit_lite.evaluate.outcomes import find_samples_files, read_samples_file
from mergekit_lite.evaluate.records import _generation, _loglikelihoods, is_generative, record_filters

MOSTLY = 0.5  # a model whose answers are more than this share ties is not scored: its answers are the order


@dataclass(frozen=True)
class TaskTies:
    """One task of one model: how many of its docs are ties (all choices equally likely, or an empty generation)."""

    task: str
    tied: int
    docs: int
    kind: str  # "equal log-likelihoods" or "empty generations"
    keys: tuple[str, ...] = field(default=(), compare=False)

    @property
    def share(self) -> float:
        return self.tied / self.docs if self.docs else 0.0

    def to_dict(self) -> dict:
        return {"task": self.task, "tied": self.tied, "docs": self.docs, "share": self.share, "kind": self.kind}


@dataclass(frozen=True)
class ModelTies:
    """Every task of one model's lm-eval output with at least one tied doc."""

    model: str
    tasks: tuple[TaskTies, ...]

    @property
    def tied(self) -> int:
        return sum(task.tied for task in self.tasks)

    @property
    def mostly_tied(self) -> list[TaskTies]:
        return [task for task in self.tasks if task.share > MOSTLY]

    def text(self, label: str) -> str:
        """One line per model: how many of how many and on which tasks."""
        return f"{label} ({self.model}): " + "; ".join(
            f"{task.task} {task.tied} of {task.docs} docs tied ({task.kind})" for task in self.tasks
        )

    def to_dict(self) -> dict:
        return {"model": self.model, "tasks": [task.to_dict() for task in self.tasks]}


def is_tied(sample: dict) -> bool | None:
    """Whether one record is a tie: every choice's logged log-likelihood equal (multiple choice, k >= 2), or the
    filtered generation empty; None where the record says neither (a single continuation, no responses)."""
    if is_generative(sample):
        generation = _generation(sample)
        return None if generation is None else not generation.strip()
    arguments = sample.get("arguments")
    count = len(arguments) if isinstance(arguments, (list, dict)) else 0
    count = count // 2 if "acc_mutual_info" in sample else count
    if count < 2:
        return None
    lls = _loglikelihoods(sample, count)
    return None if lls is None else all(math.isclose(ll, lls[0], rel_tol=0, abs_tol=1e-9) for ll in lls)


def task_ties(task: str, samples: list[dict], config: dict | None = None, label: str = "") -> TaskTies:
    """The ties among one task's records, under its first filter (one record per doc)."""
    filters = record_filters(samples, config, label or task)
    first = filters[0] if filters else None
    records = [sample for sample, name in zip(samples, filters, strict=True) if name == first]
    verdicts = [(sample, is_tied(sample)) for sample in records]
    kind = "empty generations" if records and is_generative(records[0]) else "equal log-likelihoods"
    keys = tuple(str(sample.get("doc_hash") or sample.get("doc_id")) for sample, tied in verdicts if tied)
    return TaskTies(task, len(keys), sum(tied is not None for _, tied in verdicts), kind, keys)


def run_ties(path) -> ModelTies:
    """The tied docs of one model's lm-eval --log_samples output (a file or a folder, read as `forgetting` reads
    it)."""
    files = find_samples_files(path)
    found = []
    for entry in files:
        samples, labels = read_samples_file(Path(entry.path))
        ties = task_ties(entry.task, samples, entry.config, labels[0])
        if ties.tied:
            found.append(ties)
    return ModelTies(files[0].model, tuple(found))
