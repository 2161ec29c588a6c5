"""Evaluating one point: PointEvaluator holds what every point reuses (opened inputs, resident model,
tokenizer, lm-eval task indexes); `evaluate_point` scores pre, post or a merge and saves its point file,
the one step a local sweep and a Ray actor share."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from mergekit_lite.evaluate.lm_eval_settings import LmEvalSettings
from mergekit_lite.evaluate.records import logged_names
from mergekit_lite.io.validation import check_folder_files
from mergekit_lite.merge.config import MergeConfig
from mergekit_lite.sweep.models import ModelLoader, ResidentPair, fits_in_memory, post_model
from mergekit_lite.sweep.scoring import TaskRun, check_groups_disjoint, doc_splits, score_task, summarise
from mergekit_lite.sweep.settings import SweepSettings
from mergekit_lite.sweep.store import point_file, save_point

MERGE_TEMP = ".merging"


class PointEvaluator:
    """What every point reuses: the opened inputs, the model (when it fits), the tokenizer, the task indexes."""

    def __init__(self, settings: SweepSettings, folder: Path, bar):
        import torch

        from mergekit_lite.io.sources import open_inputs
        from mergekit_lite.merge.recall import find_tokenizer_dir

        self.settings, self.folder, self.bar = settings, folder, bar
        self.sources = open_inputs([settings.pre, settings.post], settings.pre, allow_pickle=False)
        dtype = getattr(torch, settings.eval_dtype)
        self.loader = ModelLoader(settings.pre, dtype, settings.device, settings.lm_eval.loading_args())
        in_memory = not settings.stream if settings.stream is not None else fits_in_memory(self.sources[0], dtype)
        self.resident = None
        self.tokenizer_dir = find_tokenizer_dir([settings.pre, settings.post], 0)
        if in_memory and settings.backend == "hf":
            resident = ResidentPair(self.loader, settings, self.sources, settings.merge_config(settings.alphas[0]))
            self.resident = resident if resident.exact else None
        self.tokenizer = evaluation_tokenizer(settings, self.tokenizer_dir)
        self.evaluators = self.group_evaluators(settings.lm_eval)

    def group_evaluators(self, lm_eval: LmEvalSettings) -> dict:
        """An lm-eval Evaluator per group (old, new) under `lm_eval`'s settings."""
        from mergekit_lite.evaluate.lm_harness import Evaluator

        settings = self.settings
        return {
            group: Evaluator(
                tasks,
                include_path=settings.include_path,
                limit=settings.limit,
                batch_size=settings.batch_size,
                device=settings.device,
                quiet=True,
                settings=lm_eval,
            )
            for group, tasks in (("old", settings.old_tasks), ("new", settings.new_tasks))
        }

    def close(self) -> None:
        """Close the inputs' files (a later merge would open them again)."""
        for source in self.sources:
            source.close()

    def endpoint(self, index: int, samples: dict[str, dict[str, list[int]]] | None = None) -> list[TaskRun]:
        """pre (0) or post (1) itself, on every doc or only on `samples`."""
        if self.settings.backend == "vllm":
            return self.evaluate_folder(self.settings.pre if index == 0 else self.settings.post, samples)
        if self.resident is not None and self.resident.endpoint(index):
            return self.evaluate(self.resident.model, samples)
        if index == 0:
            return self.evaluate(self.loader.from_folder(self.settings.pre), samples)
        return self.evaluate(post_model(self.loader, self.settings, self.sources), samples)

    def realigned_post(self, shots: int, samples: dict[str, dict[str, list[int]]]) -> list[TaskRun]:
        """post scored again with `shots` demonstrations (lm-eval picks them as its --num_fewshot does), the sweep's
        other lm-eval settings kept, only on `samples` ({group: {task: doc ids}}; a group left out is not scored)."""
        every_doc = self.evaluators
        self.evaluators = self.group_evaluators(replace(self.settings.lm_eval, num_fewshot=shots))
        try:
            return self.endpoint(1, samples)
        finally:
            self.evaluators = every_doc

    def merged(self, config: MergeConfig, samples: dict[str, dict[str, list[int]]] | None = None) -> list[TaskRun]:
        """A merge written into the resident model, or streamed to a folder in the run folder and loaded from it;
        scored on every doc, or only on `samples` ({group: {task: doc ids}}, probe mode)."""
        from mergekit_lite.audited import run_merge

        if self.resident is not None:
            self.resident.write(config)
            return self.evaluate(self.resident.model, samples)
        temp = self.folder / f"{MERGE_TEMP}-{os.getpid()}"  # one per process: Ray actors share the run folder
        run_merge(config, temp, overwrite=True)
        try:
            if self.settings.backend == "vllm":
                return self.evaluate_folder(temp, samples)
            return self.evaluate(self.loader.from_folder(temp), samples)
        finally:
            shutil.rmtree(temp, ignore_errors=True)

    def evaluate_folder(self, folder, samples=None) -> list[TaskRun]:
        """Score a model folder with lm-eval's vLLM backend (it loads weights from disk itself)."""
        from mergekit_lite.evaluate.backends import vllm_model_args

        model_args = vllm_model_args(str(folder), str(self.tokenizer_dir), self.settings.vllm_options())
        return self._runs(lambda evaluator, chosen: evaluator.evaluate_with("vllm", model_args, chosen), samples)

    def evaluate(self, model, samples=None) -> list[TaskRun]:
        """Score the in-memory model on both groups, every task marked when its logits were not all finite."""
        with logit_watch(model) as watched:
            runs = self._runs(lambda evaluator, chosen: evaluator.evaluate(model, self.tokenizer, chosen), samples)
        return [replace(run, nonfinite=True) for run in runs] if watched.nonfinite else runs

    def _runs(self, scores, samples=None) -> list[TaskRun]:
        runs, scoring, metrics, filters = [], self.settings.scoring(), set(), set()
        for group, evaluator in self.evaluators.items():
            if samples is not None and not samples.get(group):
                continue
            for task, score in scores(evaluator, None if samples is None else samples[group]).items():
                runs.append(score_task(task, group, score, scoring))
                logged = logged_names(score.samples)
                metrics, filters = metrics | logged[0], filters | logged[1]
            self.bar.update(len(evaluator.tasks))
        scoring.check_logged(metrics, filters, "the evaluated tasks")  # a typo, before any point is saved with it
        check_groups_disjoint(runs)
        return runs


@dataclass
class LogitWatch:
    nonfinite: bool = False


@contextmanager
def logit_watch(model) -> Iterator[LogitWatch]:
    """Watch every forward pass of `model` (scoring and generation alike) for NaN or infinite logits: a model whose
    weights are finite can still overflow inside (a task vector scaled by 1e38), and lm-eval scores its NaN
    log-likelihoods and argmax-of-NaN tokens as if they were answers. One reduction per batch, stopped once seen."""
    import torch

    watched = LogitWatch()

    def check(module, inputs, output) -> None:
        logits = getattr(output, "logits", None)
        if not watched.nonfinite and isinstance(logits, torch.Tensor) and not bool(torch.isfinite(logits).all()):
            watched.nonfinite = True

    handle = model.register_forward_hook(check)
    try:
        yield watched
    finally:
        handle.remove()


def evaluation_tokenizer(settings: SweepSettings, folder: str):
    """The tokenizer every point is scored with: `folder`'s (pre's when it has one). With --apply-chat-template and
    no chat template there, post's template: a base model paired with its instruct model has none, and the
    instruct model's is the one the merges are used with (--save-best copies it too)."""
    from transformers import AutoTokenizer

    from mergekit_lite.merge.recall import TOKENIZER_FILES

    trust = settings.lm_eval.trusts_remote_code
    check_folder_files(folder), check_folder_files(settings.post)  # transformers reads their side files by name
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust)
    has_tokenizer = any((Path(settings.post) / name).is_file() for name in TOKENIZER_FILES)
    if (
        settings.lm_eval.apply_chat_template
        and not tokenizer.chat_template
        and has_tokenizer
        and Path(folder).resolve() != Path(settings.post).resolve()
    ):
        tokenizer.chat_template = AutoTokenizer.from_pretrained(settings.post, trust_remote_code=trust).chat_template
    return tokenizer


def evaluate_point(
    evaluator: PointEvaluator, settings: SweepSettings, label: str, alpha: float | None, config: MergeConfig | None
) -> list[TaskRun]:
    """Evaluate one point (pre or post themselves when alpha is None, else the merge `config`) and save
    its point file: the one step a local sweep and a Ray actor share."""
    if alpha is None:
        runs = evaluator.endpoint(0 if label == "pre" else 1)
    else:
        runs = evaluator.merged(config)
    if label == "pre":  # too few docs to split, no task scorable: said now, not after the whole grid has run
        summarise(label, alpha, runs, runs, doc_splits(settings, runs), settings.aggregation)
    save_point(point_file(Path(settings.out), label), settings.cell_identity(), label, alpha, runs)
    return runs
