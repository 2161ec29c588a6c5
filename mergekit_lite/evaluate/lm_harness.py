"""Score in-memory transformers models on lm-eval tasks, keeping lm-eval's per-sample records.

Merging sweeps evaluate many models on the same tasks, so the task index is built once and
models are passed as objects (no save/reload). lm-eval is imported lazily: it takes seconds
to import and the CLI must start fast.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from mergekit_lite.errors import InputError
from mergekit_lite.evaluate.lm_eval_settings import LmEvalSettings
from mergekit_lite.evaluate.outcomes import SampleOutcomes, ScoringRule, outcomes_from_lm_eval
from mergekit_lite.io.outputs import check_chat_template_text

# Everything is local; without these, lm-eval/datasets may wait on a network that isn't there.
# Set at import because huggingface_hub reads them once, when it is first imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
VERBOSE_ENV = "MERGEKIT_LITE_VERBOSE"  # set (sweep --verbose): lm-eval's bars and logs are shown, never silenced


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


def task_index(tasks: list[str], include_path: str | None = None):
    """lm-eval's TaskManager that knows every one of `tasks` (task, group or tag names), else a one-line InputError
    naming the unknown ones. Only include_path is indexed when it holds every task (milliseconds); lm-eval's ~15k
    built-in tasks (seconds) only when some task must come from there. Indexes are kept per process, so checking the
    tasks before any model is read costs nothing later."""
    state = _folder_state(include_path)
    if include_path is not None:
        manager = _task_manager(include_path, False, state)
        if not _unknown_tasks(manager, tasks):
            return manager
    manager = _task_manager(include_path, True, state)
    unknown = _unknown_tasks(manager, tasks)
    if unknown:
        where = f"not in --include-path {include_path}" if include_path else "no --include-path given"
        raise InputError(f"unknown lm-eval task(s) {', '.join(unknown)} (not built in, {where})")
    return manager


def _folder_state(folder: str | None) -> tuple:
    """Each file under `folder` with its size and time: a task folder edited since it was indexed is indexed again."""
    if folder is None:
        return ()
    return tuple(
        sorted(
            (
                os.path.join(root, name),
                os.stat(os.path.join(root, name)).st_mtime_ns,
                os.stat(os.path.join(root, name)).st_size,
            )
            for root, _, names in os.walk(folder)
            for name in names
        )
    )


@functools.lru_cache(maxsize=8)
def _task_manager(include_path: str | None, include_defaults: bool, state: tuple):
    from lm_eval.tasks import TaskManager

    if not os.environ.get(VERBOSE_ENV):
        logging.getLogger("lm_eval").setLevel(logging.ERROR)
    return TaskManager(include_path=include_path, include_defaults=include_defaults)


def _unknown_tasks(manager, tasks: list[str]) -> list[str]:
    """Requested names that are neither task, group nor tag in `manager`'s index."""
    known = set(manager.all_tasks)
    return [task for task in tasks if task not in known]


def check_fewshot_pools(tasks: list[str], include_path: str | None, shots: dict[str, int]) -> None:
    """Each flag asking for K demonstrations (`shots`: flag -> K, e.g. --num-fewshot, --realign-shots) against every
    task's pool of them, before any model is scored: lm-eval draws K docs at random from the task's few-shot split
    (K + 1 when that is the split being scored, the doc itself then left out), and a pool smaller than that fails
    only at the first prompt ("Sample larger than population"), after pre and post were scored."""
    shots = {flag: k for flag, k in shots.items() if k}
    if not shots:
        return
    from lm_eval.tasks import get_task_dict

    with _silenced_stderr():
        leaves = _leaf_tasks(get_task_dict(tasks, task_index(tasks, include_path)))
    for name, task in sorted(leaves.items()):
        pool = task.fewshot_docs()
        if pool is None:
            continue
        same = getattr(getattr(task, "fewshot_cfg", None), "split", None) == task.config.test_split
        for flag, k in shots.items():
            most = len(pool) - same
            if k > most:
                split = " (its test split, less the doc scored)" if same else ""
                raise InputError(
                    f"{flag} {k}: task {name!r} has {most} docs to draw demonstrations from{split}; give at most {most}"
                )


def _leaf_tasks(task_dict: dict) -> dict:
    """lm-eval's nested {group: {task: Task}} as {task name: Task}."""
    leaves = {}
    for key, value in task_dict.items():
        if isinstance(value, dict):
            leaves.update(_leaf_tasks(value))
        else:
            leaves[getattr(value, "task_name", None) or getattr(key, "group_name", key)] = value
    return leaves


def check_chat_template(tokenizer, settings: LmEvalSettings, where: str) -> None:
    """--apply-chat-template needs a tokenizer with a chat template (a named one: a template of that name), checked
    before any model is read; lm-eval itself would fail only once the first prompt is built."""
    if not settings.apply_chat_template:
        return
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise InputError(
            f"--apply-chat-template: the tokenizer in {where} has no chat template (chat_template in "
            "tokenizer_config.json or chat_template.jinja); give a model whose tokenizer has one"
        )
    check_chat_template_text(template, f"--apply-chat-template: the chat template of the tokenizer in {where}")
    name = settings.apply_chat_template
    if isinstance(template, dict):
        wanted = "default" if name is True else name
        if wanted not in template:
            raise InputError(
                f"--apply-chat-template: the tokenizer in {where} has no template named {wanted!r} "
                f"(it has {', '.join(sorted(template))})"
            )


class Evaluator:
    """Holds one lm-eval TaskManager (include_path) so repeated evaluations don't re-index tasks."""

    def __init__(
        self,
        tasks: list[str],
        include_path: str | Path | None = None,
        limit: int | float | None = None,
        batch_size: int = 16,
        device: str = "cpu",
        quiet: bool = False,
        settings: LmEvalSettings = LmEvalSettings(),
    ):
        self.tasks = list(tasks)
        self.quiet = quiet
        self.include_path = str(include_path) if include_path is not None else None
        self.limit = limit
        self.batch_size = batch_size
        self.device = device
        self.settings = settings
        self.task_manager = task_index(self.tasks, self.include_path)

    def evaluate(self, model, tokenizer, samples: dict[str, list[int]] | None = None) -> dict[str, TaskScore]:
        """Score `model` (moved to self.device) on every task; keys are leaf task names. `samples`
        ({leaf task: doc ids}) scores only those docs of those tasks (see `_scores`)."""
        from lm_eval.models.huggingface import HFLM

        model.to(self.device)
        lm = HFLM(
            pretrained=model,
            tokenizer=tokenizer,
            batch_size=self.batch_size,
            device=self.device,
            **self.settings.hflm_args(),
        )
        return self._scores(lm, samples=samples)

    def evaluate_with(
        self, backend: str, model_args: dict, samples: dict[str, list[int]] | None = None
    ) -> dict[str, TaskScore]:
        """Score a model folder through one of lm-eval's own backends (e.g. "vllm" with its model_args)."""
        return self._scores(backend, model_args, samples)

    def _scores(
        self, model, model_args: dict | None = None, samples: dict[str, list[int]] | None = None
    ) -> dict[str, TaskScore]:
        """lm-eval's `samples` ({task: doc ids}) replaces `limit` and keeps the docs' order."""
        import lm_eval

        if samples is not None and not all(samples.values()):
            raise ValueError(
                "every task in samples needs at least one doc id (lm-eval scores all docs of an empty list)"
            )
        # lm-eval passes disable=False to its own progress bars; `quiet` silences them at the stream.
        silenced = self.quiet and not os.environ.get(VERBOSE_ENV)
        with _silenced_stderr() if silenced else contextlib.nullcontext(), _empty_encoding_named():
            results = lm_eval.simple_evaluate(
                model=model,
                model_args=model_args,
                tasks=list(samples) if samples is not None else self.tasks,
                task_manager=self.task_manager,
                limit=self.limit if samples is None else None,
                samples={task: sorted(ids) for task, ids in samples.items()} if samples is not None else None,
                log_samples=True,
                bootstrap_iters=0,
                **self.settings.simple_evaluate_args(),
            )
        return {
            task: TaskScore(task, samples, results["configs"].get(task, {}))
            for task, samples in results["samples"].items()
        }


@contextlib.contextmanager
def _empty_encoding_named():
    """lm-eval asserts that every prompt and answer encodes to at least one token (a bare AssertionError on
    `len(context_enc) > 0` or `len(continuation_enc) > 0`): the tokenizer's doing, said in one line; and a chat
    template that fails to render, named as the template's fault."""
    import traceback

    from jinja2.exceptions import TemplateError

    try:
        yield
    except AssertionError as error:
        frames = traceback.extract_tb(error.__traceback__)
        if not frames or "_enc) > 0" not in (frames[-1].line or ""):
            raise
        raise InputError(
            "the tokenizer encodes a prompt or an answer to no tokens (lm-eval scores at least one "
            "token of each): check the tokenizer (its vocabulary, unknown-token handling) and the "
            "task's doc_to_text, doc_to_choice and target_delimiter"
        ) from None
    except TemplateError as error:
        raise InputError(f"the tokenizer's chat template fails to render a prompt: {error}") from None


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
