"""Score in-memory transformers models on lm-eval tasks, keeping lm-eval's per-sample records.

Merging sweeps evaluate many models on the same tasks, so the task index is built once and
models are passed as objects (no save/reload). lm-eval is imported lazily: it takes seconds
to import and the CLI must start fast.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from mergekit_lite.errors import InputError
from mergekit_lite.evaluate.outcomes import SampleOutcomes, ScoringRule, outcomes_from_lm_eval

# Everything is local; without these, lm-eval/datasets may wait on a network that isn't there.
# Set at import because huggingface_hub reads them once, when it is first imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


@dataclass
class TaskScore:
    """One task's lm-eval per-sample records and the task config lm-eval reports beside them.

    Scores come from the records through `outcomes.outcomes_from_lm_eval`, the code that also reads
    `--log_samples` files, so a sweep and `mergekit-lite forgetting` score a task the same way (same
    metric, filter and k) and any 0/1 metric lm-eval logs can be swept.
    """

    task: str
    samples: list[dict]  # lm-eval's raw per-sample records (results["samples"][task])
    config: dict  # results["configs"][task]: output_type, metric_list, doc_to_choice, ...

    def outcomes(self, rule: ScoringRule = ScoringRule()) -> SampleOutcomes:
        """Per-sample 0/1 outcomes under `rule` (TaskSkipped when its metric is not 0/1)."""
        return outcomes_from_lm_eval(self.task, self.samples, rule, self.config)

    @property
    def acc(self) -> float:
        """Mean of the task's default 0/1 metric under its first filter."""
        return self.outcomes().accuracy

    @property
    def n_choices(self) -> float:
        """k of the default scoring: choices for multiple choice, math.inf for free-form generation."""
        return self.outcomes().n_choices


class Evaluator:
    """Holds one lm-eval TaskManager (include_path) so repeated evaluations don't re-index tasks."""

    def __init__(
        self,
        tasks: list[str],
        include_path: str | Path | None = None,
        limit: int | None = None,
        batch_size: int = 16,
        device: str = "cpu",
        quiet: bool = False,
    ):
        self.tasks = list(tasks)
        self.quiet = quiet
        self.include_path = str(include_path) if include_path is not None else None
        self.limit = limit
        self.batch_size = batch_size
        self.device = device
        self.task_manager = self._index_tasks()

    def _index_tasks(self):
        """Index only include_path when it holds every task (milliseconds); index lm-eval's
        ~15k built-in tasks (seconds) only when some task must come from there."""
        from lm_eval.tasks import TaskManager

        logging.getLogger("lm_eval").setLevel(logging.ERROR)
        if self.include_path is not None:
            manager = TaskManager(include_path=self.include_path, include_defaults=False)
            if not self._unknown_tasks(manager):
                return manager
        manager = TaskManager(include_path=self.include_path)
        unknown = self._unknown_tasks(manager)
        if unknown:
            raise InputError(
                f"unknown lm-eval task(s) {', '.join(unknown)} "
                f"(not built in, not in include path {self.include_path or '(none given)'})"
            )
        return manager

    def _unknown_tasks(self, manager) -> list[str]:
        """Requested names that are neither task, group nor tag in `manager`'s index."""
        known = set(manager.all_tasks)
        return [task for task in self.tasks if task not in known]

    def evaluate(self, model, tokenizer, samples: dict[str, list[int]] | None = None) -> dict[str, TaskScore]:
        """Score `model` (moved to self.device) on every task; keys are leaf task names. `samples`
        ({leaf task: doc ids}) scores only those docs of those tasks (see `_scores`)."""
        from lm_eval.models.huggingface import HFLM

        model.to(self.device)
        return self._scores(HFLM(pretrained=model, tokenizer=tokenizer, batch_size=self.batch_size, device=self.device),
                            samples=samples)

    def evaluate_with(self, backend: str, model_args: dict,
                      samples: dict[str, list[int]] | None = None) -> dict[str, TaskScore]:
        """Score a model folder through one of lm-eval's own backends (e.g. "vllm" with its model_args)."""
        return self._scores(backend, model_args, samples)

    def _scores(self, model, model_args: dict | None = None,
                samples: dict[str, list[int]] | None = None) -> dict[str, TaskScore]:
        """lm-eval's `samples` ({task: doc ids}) replaces `limit` and keeps the docs' order."""
        import lm_eval

        if samples is not None and not all(samples.values()):
            raise ValueError("every task in samples needs at least one doc id (lm-eval scores all docs of an empty list)")
        # lm-eval passes disable=False to its own progress bars; `quiet` silences them at the stream.
        with _silenced_stderr() if self.quiet else contextlib.nullcontext():
            results = lm_eval.simple_evaluate(
                model=model,
                model_args=model_args,
                tasks=list(samples) if samples is not None else self.tasks,
                task_manager=self.task_manager,
                limit=self.limit if samples is None else None,
                samples={task: sorted(ids) for task, ids in samples.items()} if samples is not None else None,
                log_samples=True,
                bootstrap_iters=0,
            )
        return {task: TaskScore(task, samples, results["configs"].get(task, {}))
                for task, samples in results["samples"].items()}


@contextlib.contextmanager
def _silenced_stderr():
    """Python's stderr and file descriptor 2: lm-eval runs `git describe`, whose complaint bypasses sys.stderr."""
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(io.StringIO()):
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
