"""Sweep one merge coefficient between a pre-trained model ("pre") and its post-trained version ("post").

Every point of the grid is merged, scored on the "old" tasks (what pre could do) and the "new" ones
(what post-training taught), and compared sample by sample with pre (the forgetting map). The pick
is the alpha with the best harmonic mean of old and new: it rewards keeping both skills over
maximising one of them.

Leakage-free selection (the probing protocol of "Audit Before You Merge": choose coefficients on a
probe split, report on a held-out one): every task's docs are split by a seeded hash of their
doc_hash into a selection part, which picks alpha, and a disjoint report part, on which every alpha
is reported. A paired bootstrap over the report samples (every model is scored on the same samples)
gives intervals for old, new, the harmonic mean and each alpha's difference to the pick. [ours]
Tasks are scored by the code that reads lm-eval files for `mergekit-lite forgetting` (same metric,
filter and k), and group scores follow the same aggregation (default: the paper's unweighted mean
over tasks).

What alpha is depends on the method (its main coefficient, `config.MAIN_COEFFICIENT`):
linear -> weight of post (0 = pre, 1 = post); slerp -> t; task_arithmetic, ties, dare_* -> lambda,
the scale of post's task vector (post - pre) added to pre; recall -> the softmax temperature of its
layer weights; recall_lerp -> the global weight of post its per-layer profile centres on (for both, the
similarities are computed once per sweep).

A run folder keeps one JSON per finished point (`points/`), written atomically, so a killed sweep
loses at most the point in progress and a rerun of the same command picks up where it stopped.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import shutil
import warnings
from contextlib import contextmanager
from dataclasses import MISSING, asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mergekit_lite import interrupts
from mergekit_lite.errors import InputError
from mergekit_lite.evaluate.backends import BACKENDS, VllmOptions, parse_vllm_options
from mergekit_lite.evaluate.forgetting import (
    AGGREGATIONS,
    GroupForgetting,
    SampleOutcomes,
    Scoring,
    TaskForgetting,
    TaskSkipped,
    aggregate,
    compare,
)
from mergekit_lite.evaluate.search import (
    ProbeEstimate,
    ProbePlan,
    SearchTrace,
    estimate_scores,
    golden_section,
    harmonic_mean,
    probe_plan,
)
from mergekit_lite.io.outputs import (
    check_output_folder,
    prepare_run_folder,
    write_atomic,
)
from mergekit_lite.io.validation import read_json, read_yaml, validate
from mergekit_lite.merge.config import (
    DTYPES,
    MAIN_COEFFICIENT,
    METHODS,
    RECALL_METHODS,
    MergeConfig,
)

POINTS_DIR = "points"
PROBES_DIR = "probes"  # probe-mode points: scored on probe samples only, never resumed as full points
RECALL_DIR = "recall"
SIMILARITY_FILE = "similarity.json"
LOCK_FILE = ".sweep.lock"
MERGE_TEMP = ".merging"
GROUPS = ("old", "new")
TIE_TOLERANCE = 1e-9
MEMORY_COPIES = 4  # the model, pre, post (or its task vector) and one being converted, in the evaluation dtype
IDENTITY_FIELDS = ("pre", "post", "method", "old_tasks", "new_tasks", "include_path", "limit",
                   "density", "drop", "seed", "recall_texts", "recall_samples", "metric", "filter", "choices",
                   "eval_dtype")
SEARCHES = ("grid", "golden")
SELECTIONS = ("docs", "none")  # docs: seeded doc_hash partition; none: pick and report on the same docs
PATH_FIELDS = ("pre", "post", "include_path", "recall_texts")


def parse_alphas(spec) -> list[float]:
    """A grid from "START:STOP:STEP" (STOP included), "a,b,c", a number or a list of numbers; sorted, unique."""
    if isinstance(spec, (list, tuple)):
        values = [_number(value) for value in spec]
    elif isinstance(spec, str) and ":" in spec:
        values = _alpha_range(spec)
    elif isinstance(spec, str):
        values = [_number(part) for part in spec.split(",") if part.strip()]
    else:
        values = [_number(spec)]
    if not values:
        raise InputError("alphas: no values (give START:STOP:STEP or a comma list)")
    return sorted(set(values))


def _number(value) -> float:
    if isinstance(value, bool):
        raise InputError(f"alphas: {value!r} is not a number")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise InputError(f"alphas: {str(value).strip()!r} is not a number") from None
    if not math.isfinite(number):
        raise InputError(f"alphas: {number} is not a finite number")
    return number


MAX_ALPHA_POINTS = 500


def _alpha_range(spec: str) -> list[float]:
    """Inclusive range; values are rounded to 12 digits so 0:1:0.1 gives 0.3, not 0.30000000000000004.

    The number of points is computed before the grid is built and capped at MAX_ALPHA_POINTS: every point
    is a merge and a full evaluation, so even a few hundred take hours, and more is a mistyped STEP
    (0:1:1e-12 would not finish building its list, let alone its sweep)."""
    parts = spec.split(":")
    if len(parts) != 3:
        raise InputError(f"alphas: {spec!r} is not START:STOP:STEP")
    start, stop, step = map(_number, parts)
    if step <= 0 or stop < start:
        raise InputError(f"alphas: {spec!r} needs STEP > 0 and START <= STOP")
    steps = (stop - start) / step + 1e-9  # may be inf for a subnormal STEP
    if not steps < MAX_ALPHA_POINTS:
        raise InputError(f"alphas: {spec!r} is a grid of {steps + 1:,.0f} points; at most {MAX_ALPHA_POINTS} "
                         "(each point is a merge and an evaluation), use a larger STEP")
    return [round(start + index * step, 12) for index in range(math.floor(steps) + 1)]


def parse_tasks(spec) -> list[str]:
    """Task names from a comma-separated string or a list of them (repeated flags); order kept, duplicates dropped."""
    items = [spec] if isinstance(spec, str) else list(spec or [])
    names = [name.strip() for item in items for name in str(item).split(",") if name.strip()]
    return list(dict.fromkeys(names))


@dataclass
class SweepSettings:
    """One sweep: the pair, the method and grid, the tasks, where results go, and method options."""

    pre: str
    post: str
    method: str
    alphas: list[float]
    old_tasks: list[str]
    new_tasks: list[str]
    include_path: str | None
    out: str
    limit: int | None = None
    batch_size: int = 16
    device: str = "cpu"
    density: float | None = None
    drop: float | None = None
    seed: int = 0
    recall_texts: str | None = None
    recall_samples: int = 8
    save_best: str | None = None
    stream: bool | None = None  # None: merge in memory when the model fits, else through a folder on disk
    eval_dtype: str | None = None  # None: float32 on CPU, bfloat16 on GPU
    copy_files_from: str | None = None  # --save-best's side files (default: see engine.write_side_files)
    ray: str | None = None  # None: points one after another here; "local" or a cluster address: Ray actors
    search: str = "grid"  # grid: every alpha; golden: golden-section search over the grid (fewer points)
    backend: str = "hf"  # hf: in-memory transformers model; vllm: lm-eval's vLLM backend on a merged folder
    vllm_args: str | None = None  # lm-eval model_args for vllm, e.g. tensor_parallel_size=2,gpu_memory_utilization=0.8
    probe: float | None = None  # probe mode: share of the samples pre and post agree on that every alpha is scored on
    # scoring (as `mergekit-lite forgetting`): [TASK=]METRIC, [TASK=]FILTER, TASK=K
    metric: list[str] = field(default_factory=list)
    filter: list[str] = field(default_factory=list)
    choices: list[str] = field(default_factory=list)
    aggregation: str = "paper"
    # selection split, bootstrap
    selection: str = "docs"
    selection_fraction: float = 0.5
    bootstrap: int = 1000
    confidence: float = 0.95

    def __post_init__(self):
        self.alphas = parse_alphas(self.alphas)
        self.old_tasks, self.new_tasks = parse_tasks(self.old_tasks), parse_tasks(self.new_tasks)
        self.metric, self.filter, self.choices = (_spec_list(getattr(self, name))
                                                  for name in ("metric", "filter", "choices"))
        self.scoring()  # bad --metric/--filter/--choices fail before any model is read
        if self.aggregation not in AGGREGATIONS:
            raise InputError(f"aggregation must be one of {', '.join(AGGREGATIONS)}, got {self.aggregation!r}")
        if self.backend not in BACKENDS:
            raise InputError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.vllm_args is not None and self.backend != "vllm":
            raise InputError("--vllm-args applies to --backend vllm")
        self.vllm_options()  # bad vLLM arguments fail before any model is read
        if self.search not in SEARCHES:
            raise InputError(f"search must be one of {', '.join(SEARCHES)}, got {self.search!r}")
        if self.search == "golden" and self.ray is not None:
            raise InputError("--search golden evaluates one point after another: run it without --ray")
        if self.probe is not None:
            if isinstance(self.probe, bool) or not isinstance(self.probe, (int, float)) or not 0 < self.probe <= 1:
                raise InputError(f"probe must be a share in (0, 1], got {self.probe!r}")
            if self.ray is not None:
                raise InputError("--probe evaluates its points in this process: run it without --ray")
        if self.selection not in SELECTIONS:
            raise InputError(f"selection must be one of {', '.join(SELECTIONS)}, got {self.selection!r}")
        if not 0 < self.selection_fraction < 1:
            raise InputError(f"selection_fraction must be in (0, 1), got {self.selection_fraction!r}")
        if not 0 < self.confidence < 1:
            raise InputError(f"confidence must be in (0, 1), got {self.confidence!r}")
        if isinstance(self.bootstrap, bool) or not isinstance(self.bootstrap, int) or self.bootstrap < 0:
            raise InputError(f"bootstrap must be a whole number >= 0 (0: no intervals), got {self.bootstrap!r}")
        for name in ("pre", "post", "out", "include_path", "recall_texts", "save_best", "copy_files_from"):
            if getattr(self, name) is not None:
                setattr(self, name, str(getattr(self, name)))
        if self.method not in MAIN_COEFFICIENT:
            kind = "has no coefficient to sweep between pre and post" if self.method in METHODS else "is unknown"
            raise InputError(f"method {self.method!r} {kind} (choose from {', '.join(MAIN_COEFFICIENT)})")
        if not self.old_tasks or not self.new_tasks:
            raise InputError("give at least one old task and one new task (--old-tasks, --new-tasks)")
        shared = [task for task in self.old_tasks if task in self.new_tasks]
        if shared:
            raise InputError(f"task {shared[0]!r} is both an old and a new task")
        for name in ("limit", "batch_size", "recall_samples"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise InputError(f"{name} must be a whole number >= 1, got {value!r}")
        default_dtype = "bfloat16" if str(self.device).startswith("cuda") else "float32"
        dtype = str(self.eval_dtype or default_dtype).lower()
        if dtype not in DTYPES:
            raise InputError(f"unknown eval dtype {self.eval_dtype!r} (use bf16, fp16 or fp32)")
        self.eval_dtype = DTYPES[dtype]
        if self.method in RECALL_METHODS and not self.recall_texts:
            raise InputError(f"a {self.method} sweep needs typical samples: --recall-texts (one text per line)")
        for alpha in self.alphas:
            self.merge_config(alpha)  # every point's merge is valid before any model is read

    def vllm_options(self) -> VllmOptions:
        return parse_vllm_options(self.vllm_args)

    def scoring(self) -> Scoring:
        return Scoring.from_specs(self.metric, self.filter, self.choices)

    @property
    def coefficient(self) -> str:
        """The merge parameter alpha stands for with this method."""
        return MAIN_COEFFICIENT[self.method]

    def merge_config(self, alpha: float, recall_weights_file: str | None = None) -> MergeConfig:
        """The merge at one point: pre is the base (input 0), post the one model, alpha the main coefficient."""
        parameters = {name: value for name, value in (("density", self.density), ("drop", self.drop),
                                                      (self.coefficient, alpha)) if value is not None}
        data = {"method": self.method, "base": self.pre, "models": [self.post], "parameters": parameters,
                "seed": self.seed, "device": self.device if self.device.startswith("cuda") else "cpu",
                "recall": {"texts": self.recall_texts, "samples": self.recall_samples,
                           "weights_file": recall_weights_file}}
        return MergeConfig.from_dict(data, where="sweep")

    def identity(self) -> dict:
        """What a saved point depends on; paths absolute so `pre/` and `./pre` are the same model."""
        identity = {name: getattr(self, name) for name in IDENTITY_FIELDS}
        for name in PATH_FIELDS:
            if identity[name] is not None:
                identity[name] = str(Path(identity[name]).resolve())
        return identity

    def to_dict(self) -> dict:
        return asdict(self)


SETTINGS_KEYS = tuple(SweepSettings.__dataclass_fields__)


def _spec_list(value) -> list[str]:
    """Scoring specs from a string, a list, or a mapping {task: value} (YAML)."""
    if value is None:
        return []
    if isinstance(value, dict):
        return [f"{task}={item}" for task, item in value.items()]
    return [str(item) for item in ([value] if isinstance(value, (str, int, float)) else value)]


Spec = str | int | float  # a scoring spec value as YAML may write it


class SweepFile(BaseModel):
    """The types a sweep YAML may give each setting (strict: a quoted "false" is not a boolean)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    pre: str | None = None
    post: str | None = None
    method: str | None = None
    alphas: str | float | list[float] | None = None
    old_tasks: str | list[str] | None = None
    new_tasks: str | list[str] | None = None
    include_path: str | None = None
    out: str | None = None
    limit: int | None = Field(None, ge=1)
    batch_size: int | None = Field(None, ge=1)
    device: str | None = None
    density: float | None = None
    drop: float | None = None
    seed: int | None = None
    recall_texts: str | None = None
    recall_samples: int | None = Field(None, ge=1)
    save_best: str | None = None
    stream: bool | None = None
    ray: str | None = None
    search: str | None = None
    metric: Spec | list[Spec] | dict[str, Spec] | None = None
    filter: Spec | list[Spec] | dict[str, Spec] | None = None
    choices: Spec | list[Spec] | dict[str, Spec] | None = None
    aggregation: str | None = None
    selection: str | None = None
    selection_fraction: float | None = None
    bootstrap: int | None = Field(None, ge=0)
    confidence: float | None = None
    copy_files_from: str | None = None
    eval_dtype: str | None = None
    backend: str | None = None
    vllm_args: str | None = None
    probe: float | None = Field(None, gt=0, le=1)


def load_sweep_file(path: str | Path) -> dict:
    """A YAML sweep config with SweepSettings' keys (dashes or underscores); unknown keys are an error."""
    path = Path(path)
    data = read_yaml(path)
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a mapping of sweep settings")
    settings = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in SETTINGS_KEYS:
            raise InputError(f"{path}: unknown key {key!r} (known: {', '.join(SETTINGS_KEYS)})")
        settings[name] = value
    validate(SweepFile, settings, path)
    return {name: value for name, value in settings.items() if value is not None}


def settings_from_dict(data: dict) -> SweepSettings:
    """SweepSettings from merged config-file and flag values, naming the first missing setting."""
    required = [name for name, spec in SweepSettings.__dataclass_fields__.items()
                if spec.default is MISSING and spec.default_factory is MISSING and name != "include_path"]
    missing = [name for name in required if data.get(name) in (None, [], ())]
    if missing:
        flag = "--" + missing[0].replace("_", "-")
        raise InputError(f"missing setting {missing[0]!r} (give {flag} or put it in the config file)")
    try:
        return SweepSettings(**{"include_path": None, **data})
    except TypeError as error:
        raise InputError(f"sweep settings: {error}") from None


@dataclass
class TaskRun:
    """One model's result on one task: per-sample outcomes (None when the task was skipped, with why)."""

    task: str
    group: str
    outcomes: SampleOutcomes | None
    skipped: str | None = None

    @property
    def acc(self) -> float:
        return self.outcomes.accuracy

    def to_json(self) -> dict:
        if self.outcomes is None:
            return {"task": self.task, "group": self.group, "skipped": self.skipped}
        k = self.outcomes.n_choices
        return {"task": self.task, "group": self.group, "metric": self.outcomes.metric,
                "filter": self.outcomes.filter, "n_choices": None if math.isinf(k) else k,
                "correct": self.outcomes.correct, "doc_ids": self.outcomes.doc_ids}

    @classmethod
    def from_json(cls, data: dict) -> TaskRun:
        if "correct" not in data:
            return cls(data["task"], data["group"], None, str(data["skipped"]))
        k = math.inf if data["n_choices"] is None else float(data["n_choices"])
        outcomes = SampleOutcomes(data["task"], data["correct"], k, data.get("metric", ""), data.get("filter", ""),
                                  data.get("doc_ids") or {})
        return cls(data["task"], data["group"], outcomes)


def score_task(task: str, group: str, score, scoring: Scoring) -> TaskRun:
    """A TaskRun from lm_harness.TaskScore, scored as `mergekit-lite forgetting` scores files; a task
    whose metric is not 0/1 is kept as skipped, with a warning, never thresholded."""
    try:
        return TaskRun(task, group, score.outcomes(scoring.rule(task)))
    except TaskSkipped as reason:
        warnings.warn(f"task {task!r} skipped: {reason}", stacklevel=2)
        return TaskRun(task, group, None, str(reason))


@dataclass(frozen=True)
class Scores:
    """old, new (group scores) and their harmonic mean on one split."""

    old: float
    new: float
    harmonic_mean: float


@dataclass
class PointResult:
    """One evaluated model (pre, post or a merge): scores on the selection and report splits, the
    forgetting map against pre on the report split, and bootstrap intervals (filled by the sweep)."""

    label: str
    alpha: float | None
    tasks: list[TaskRun]
    report: Scores
    selection: Scores
    forgetting: list[TaskForgetting] = field(default_factory=list)
    groups: dict[str, GroupForgetting] = field(default_factory=dict)
    intervals: dict[str, list[float]] = field(default_factory=dict)  # name -> [low, high]

    @property
    def old(self) -> float:
        return self.report.old

    @property
    def new(self) -> float:
        return self.report.new

    @property
    def harmonic_mean(self) -> float:
        return self.report.harmonic_mean


def split_docs(keys, seed: int, fraction: float) -> tuple[list[str], list[str]]:
    """(selection, report) keys: a doc goes to selection when a seeded hash of its key falls below
    `fraction`. Hashing the key (doc_hash), not the position, keeps the split the same for every model,
    for any --limit and any order. [ours]"""
    selection, report = [], []
    for key in sorted(keys):
        digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
        (selection if int.from_bytes(digest[:8], "big") / 2**64 < fraction else report).append(key)
    return selection, report


def task_accuracy(outcomes: SampleOutcomes, keys: list[str]) -> float:
    return sum(outcomes.correct[key] for key in keys) / len(keys)


def group_scores(tasks: list[TaskRun], keys: dict[str, list[str]], aggregation: str) -> Scores:
    """old and new on the given docs of each task: the unweighted mean over a group's tasks (paper), or
    the share of all its samples (pooled)."""
    values = {}
    for group in GROUPS:
        runs = [run for run in tasks if run.group == group and run.outcomes is not None]
        if not runs:
            raise InputError(f"no {group} task could be scored (check --{group}-tasks and --metric)")
        if aggregation == "paper":
            values[group] = math.fsum(task_accuracy(run.outcomes, keys[run.task]) for run in runs) / len(runs)
        else:
            values[group] = (sum(sum(run.outcomes.correct[key] for key in keys[run.task]) for run in runs)
                             / sum(len(keys[run.task]) for run in runs))
    return Scores(values["old"], values["new"], harmonic_mean(values["old"], values["new"]))


def restricted(outcomes: SampleOutcomes, keys: list[str]) -> SampleOutcomes:
    return SampleOutcomes(outcomes.task, {key: outcomes.correct[key] for key in keys}, outcomes.n_choices,
                          outcomes.metric, outcomes.filter)


def summarise(label: str, alpha: float | None, tasks: list[TaskRun], baseline: list[TaskRun],
              splits: dict[str, tuple[list[str], list[str]]], aggregation: str = "paper") -> PointResult:
    """Scores on both splits and the forgetting map against the baseline (pre) on the report split."""
    pre = {run.task: run.outcomes for run in baseline}
    rows = {}
    for run in tasks:
        if run.outcomes is None:
            continue
        report_keys = splits[run.task][1]
        try:
            rows[run.task] = compare(restricted(pre[run.task], report_keys), restricted(run.outcomes, report_keys))
        except TaskSkipped as reason:
            raise InputError(f"task {run.task!r} of {label}: {reason}") from None
    groups = {group: aggregate([rows[run.task] for run in tasks if run.group == group and run.task in rows],
                               group, aggregation) for group in GROUPS}
    return PointResult(label, alpha, tasks,
                       group_scores(tasks, {task: keys[1] for task, keys in splits.items()}, aggregation),
                       group_scores(tasks, {task: keys[0] for task, keys in splits.items()}, aggregation),
                       list(rows.values()), groups)


def dominates(a: Scores, b: Scores) -> bool:
    return a.old >= b.old and a.new >= b.new and (a.old > b.old or a.new > b.new)


def pareto_front(points: list[PointResult]) -> list[float]:
    """Alphas no other alpha beats on both old and new, on the selection split."""
    return [p.alpha for p in points if not any(dominates(q.selection, p.selection) for q in points)]


@dataclass
class ProbeTrace:
    """Probe mode: every alpha scored on probe samples of the selection docs, its estimated scores, and
    what that cost against scoring every doc. [ours]"""

    rate: float
    estimates: dict[float, ProbeEstimate]  # alpha -> estimated selection-split scores
    pick: float
    indistinguishable: list[float]  # alphas whose estimated HM is within the interval of the pick's
    samples_probed: int  # docs scored per probed alpha
    samples_all: int  # docs of every scored task (both splits): what each alpha costs in a full grid


@dataclass
class SweepResult:
    """The whole sweep: the two reference endpoints, every alpha, the pick (best harmonic mean on the
    selection split), the alphas the report split cannot tell from it, and the Pareto front."""

    settings: SweepSettings
    pre: PointResult
    post: PointResult
    points: list[PointResult]
    best: PointResult
    ties: list[float]
    pareto: list[float]
    evaluated: list[str]  # labels of the points evaluated by this call (the others were resumed)
    out: Path
    splits: dict[str, tuple[list[str], list[str]]] = field(default_factory=dict)  # task -> (selection, report) keys
    indistinguishable: list[float] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    search: SearchTrace | None = None  # the golden-section search's trace; None for a full grid
    probe: ProbeTrace | None = None  # probe mode's estimates; None when every point was scored in full

    @property
    def recovered(self) -> float | None:
        """Share of post's old-skill loss that the pick wins back: (old_best - old_post) / (old_pre - old_post).
        None when post lost nothing (old_pre <= old_post). 1.0 = back to pre's level; can exceed 1."""
        lost = self.pre.old - self.post.old
        return (self.best.old - self.post.old) / lost if lost > 0 else None


def pick(points: list[PointResult]) -> tuple[PointResult, list[float]]:
    """The highest harmonic mean on the selection split, and every alpha within TIE_TOLERANCE of it;
    ties go to the smallest alpha."""
    top = max(p.selection.harmonic_mean for p in points)
    tied = [p for p in points if top - p.selection.harmonic_mean <= TIE_TOLERANCE]
    return tied[0], [p.alpha for p in tied]


def paired_bootstrap(models: list[PointResult], splits: dict[str, tuple[list[str], list[str]]], aggregation: str,
                     iterations: int, seed: int, split: int = 1):
    """Resampled (old, new, harmonic mean) of every model: array [iterations, models, 3]. Each task's docs
    of `split` (0 selection, 1 report) are resampled with replacement, the same draw for every model
    (paired: they answered the same samples), independently per task (stratified). [ours]"""
    import numpy as np

    rng = np.random.default_rng(seed)
    sums = {group: np.zeros((iterations, len(models))) for group in GROUPS}
    counts = dict.fromkeys(GROUPS, 0)
    for run in models[0].tasks:
        if run.outcomes is None:
            continue
        keys = splits[run.task][split]
        correct = np.array([[model_run.outcomes.correct[key] for key in keys]
                            for model in models for model_run in model.tasks if model_run.task == run.task], float)
        weights = rng.multinomial(len(keys), np.full(len(keys), 1 / len(keys)), size=iterations)
        hits = weights @ correct.T  # [iterations, models]: correct answers in each resample
        if aggregation == "paper":
            sums[run.group] += hits / len(keys)
            counts[run.group] += 1
        else:
            sums[run.group] += hits
            counts[run.group] += len(keys)
    old, new = sums["old"] / counts["old"], sums["new"] / counts["new"]
    with np.errstate(invalid="ignore", divide="ignore"):
        hm = np.where(old + new > 0, 2 * old * new / (old + new), 0.0)
    return np.stack([old, new, hm], axis=-1)


def add_intervals(result: SweepResult) -> None:
    """Percentile intervals for old, new, harmonic mean and the harmonic-mean difference to the pick; the
    alphas whose difference interval holds 0 are indistinguishable from the pick on the report split."""
    import numpy as np

    settings = result.settings
    if settings.bootstrap == 0:
        return
    models = [result.pre, result.post, *result.points]
    draws = paired_bootstrap(models, result.splits, settings.aggregation, settings.bootstrap, settings.seed)
    tail = (1 - settings.confidence) / 2 * 100
    pick_index = models.index(result.best)
    for index, model in enumerate(models):
        for position, name in enumerate(("old", "new", "harmonic_mean")):
            model.intervals[name] = np.percentile(draws[:, index, position], [tail, 100 - tail]).tolist()
        difference = draws[:, index, 2] - draws[:, pick_index, 2]
        model.intervals["diff_to_pick"] = np.percentile(difference, [tail, 100 - tail]).tolist()
    result.indistinguishable = [point.alpha for point in result.points if point is not result.best
                                and point.intervals["diff_to_pick"][0] <= 0 <= point.intervals["diff_to_pick"][1]]


def point_file(folder: Path, label: str, directory: str = POINTS_DIR) -> Path:
    return folder / directory / f"{label.replace('=', '_')}.json"


def alpha_label(alpha: float) -> str:
    return f"alpha={alpha!r}"


class SavedTask(BaseModel):
    """One task of a saved point, as `TaskRun.to_json` writes it: per-sample outcomes, or why it was skipped."""

    model_config = ConfigDict(strict=True, extra="forbid")
    task: str
    group: Literal["old", "new"]
    metric: str | None = None
    filter: str | None = None
    n_choices: int | float | None = None
    correct: dict[str, bool] | None = None
    doc_ids: dict[str, int] | None = None
    skipped: str | None = None


class PointFile(BaseModel):
    """One finished point as `save_point` writes it."""

    model_config = ConfigDict(strict=True, extra="forbid")
    identity: dict[str, Any]
    label: str
    alpha: float | None
    tasks: list[SavedTask]


def load_points(folder: Path, identity: dict, directory: str = POINTS_DIR) -> dict[str, list[TaskRun]]:
    """Every finished point in the run folder by label. One saved under other settings -> InputError,
    whether or not this grid includes it: the folder belongs to one sweep."""
    points = {}
    for path in sorted((folder / directory).glob("*.json")):
        try:
            point = validate(PointFile, read_json(path), path)
        except InputError as error:
            raise InputError(f"{error} (not a sweep point file; delete it to evaluate that point again)") from None
        label, saved = point.label, point.identity
        runs = [TaskRun.from_json(entry.model_dump(exclude_unset=True)) for entry in point.tasks]
        changed = next((key for key in identity if saved.get(key) != identity[key]), None)
        if changed:
            raise InputError(f"{folder} holds a sweep with other settings ({changed}: {saved.get(changed)!r} "
                             f"there, {identity[changed]!r} now); use another --out")
        points[label] = runs
    return points


def save_point(path: Path, identity: dict, label: str, alpha: float | None, runs: list[TaskRun]) -> None:
    data = {"identity": identity, "label": label, "alpha": alpha, "tasks": [run.to_json() for run in runs]}
    write_atomic(path, json.dumps(data) + "\n")


@contextmanager
def run_lock(folder: Path):
    """One sweep per run folder: a second one fails at once instead of racing on the same files."""
    handle = open(folder / LOCK_FILE, "a")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise InputError(f"{folder}: another sweep is running in this run folder (it holds {LOCK_FILE})") from None
    try:
        yield
    finally:
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()


class MergeConfigs:
    """The merge config of each alpha. RECALL's similarities are computed once per run folder (running
    both models), kept in recall/similarity.json, and re-weighted per temperature (recall) or turned
    into per-layer alphas by the plan (recall_lerp)."""

    def __init__(self, settings: SweepSettings, folder: Path):
        self.settings, self.folder = settings, folder
        self.similarity = None

    def __call__(self, alpha: float) -> MergeConfig:
        if self.settings.method not in RECALL_METHODS:
            return self.settings.merge_config(alpha)
        if self.settings.method == "recall_lerp":
            return self.settings.merge_config(alpha, recall_weights_file=str(self.similarity_file()))
        path = self.folder / RECALL_DIR / f"temperature_{alpha!r}.json"
        write_atomic(path, json.dumps(self.weights().with_temperature(alpha).to_json(), indent=2) + "\n")
        return self.settings.merge_config(alpha, recall_weights_file=str(path))

    def similarity_file(self) -> Path:
        """recall/similarity.json, computed on first use; the run folder's identity check guards its settings."""
        from mergekit_lite.merge.recall import compute_recall_weights, read_texts

        path = self.folder / RECALL_DIR / SIMILARITY_FILE
        if not path.is_file():
            settings = self.settings
            config = settings.merge_config(settings.alphas[0])
            weights = compute_recall_weights(
                config.inputs, read_texts(settings.recall_texts), n_typical=settings.recall_samples,
                reference=config.recall.reference, device=config.device, seed=settings.seed,
                max_length=config.recall.max_length, bandwidth=config.recall.bandwidth,
                special_tokens=config.recall.special_tokens)
            path.parent.mkdir(exist_ok=True)
            write_atomic(path, json.dumps(weights.to_json(), indent=2) + "\n")
        return path

    def weights(self):
        from mergekit_lite.merge.recall import RecallWeights

        if self.similarity is None:
            self.similarity = RecallWeights.from_json(json.loads(self.similarity_file().read_text()))
        return self.similarity


def fits_in_memory(source, dtype) -> bool:
    """MEMORY_COPIES copies of the model in the evaluation dtype must fit in the memory free now."""
    model_bytes = sum(math.prod(source.shape(name)) for name in source.names) * dtype.itemsize
    return model_bytes * MEMORY_COPIES < os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class ModelLoader:
    """Models built through transformers' own loading path (from_pretrained), so its key conversions apply:
    fused MoE experts in transformers 5, multimodal wrappers, tied heads."""

    def __init__(self, pre: str, dtype, device: str):
        import transformers

        self.config = transformers.AutoConfig.from_pretrained(pre)
        architecture = next(iter(self.config.architectures or []), None)
        self.model_class = getattr(transformers, architecture, None) if architecture else None
        if self.model_class is None:
            self.model_class = transformers.AutoModelForCausalLM._model_mapping[type(self.config)]
        self.dtype, self.device = dtype, device

    def from_folder(self, folder) -> object:
        return self._checked(str(folder), self.model_class.from_pretrained(
            str(folder), dtype=self.dtype, output_loading_info=True))

    def from_state(self, state: dict, what: str) -> object:
        """A model from on-disk tensor names (e.g. an adapter applied to pre, or a task vector)."""
        return self._checked(what, self.model_class.from_pretrained(
            None, config=self.config, state_dict=state, dtype=self.dtype, output_loading_info=True))

    def _checked(self, what, loaded):
        model, info = loaded
        if info["missing_keys"]:
            raise InputError(f"{what}: lacks tensor {sorted(info['missing_keys'])[0]}, which the "
                             f"{self.model_class.__name__} built from --pre's config.json needs")
        return model.to(self.device).eval()


def converts_tensors(model) -> bool:
    """Whether transformers assembles some parameters from several on-disk tensors (e.g. fused experts)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    return any(isinstance(transform, WeightConverter) for transform in get_model_conversion_mapping(model))


class ResidentPair:
    """pre's model, loaded once, with pre and post (or post's task vector) held beside it in the evaluation
    dtype: each point writes its merged weights into the model's parameters in place, no I/O, no copy.

    What is held depends on the method. linear, slerp, task_arithmetic and recall combine pre and post
    tensor by tensor with coefficients that are elementwise-linear in the parameters, so they run on the
    model's own (converted) parameters. TIES and DARE sparsify the task vector with per-tensor statistics
    that fused tensors would change: the sparsified vector is computed once on the on-disk tensors, at
    lambda 1 (it does not depend on lambda), and mapped to the parameters through transformers'
    conversion; each point is then pre + lambda * vector, the engine's own formula.
    """

    def __init__(self, loader: ModelLoader, settings: SweepSettings, sources, config: MergeConfig):
        import torch

        from mergekit_lite.io.architecture import layout
        from mergekit_lite.merge.methods import TASK_VECTOR_METHODS
        from mergekit_lite.merge.plan import layer_count

        self.method = settings.method
        self.model = loader.from_folder(settings.pre)
        self.parameters = dict(self.model.named_parameters())
        self.pre = {name: parameter.detach().clone() for name, parameter in self.parameters.items()}
        recipe = TASK_VECTOR_METHODS.get(settings.method)
        self.sparsified = recipe is not None and recipe.sparsifier is not None
        if self.sparsified:
            held = loader.from_state(task_vector_state(config, sources), "the task vector post - pre")
        else:
            held = post_model(loader, settings, sources)
        self.held = {name: parameter.detach() for name, parameter in held.named_parameters()}
        del held
        self.identical = {name for name in self.parameters
                          if not self.sparsified and torch.equal(self.pre[name], self.held[name])}
        self.layout = layout(sources[0].config)
        self.n_layers = layer_count(self.layout, sources[0].names)

    @property
    def exact(self) -> bool:
        """False for SLERP on a model whose parameters fuse on-disk tensors: its angle is per on-disk tensor,
        so such a sweep merges through a folder on disk instead."""
        return self.method != "slerp" or not converts_tensors(self.model)

    def endpoint(self, index: int) -> bool:
        """Write pre (0) or post (1) into the model; False when post is not held (a task vector is)."""
        if index == 1 and self.sparsified:
            return False
        self._write(lambda name: (self.pre if index == 0 else self.held)[name])
        return True

    def write(self, config: MergeConfig) -> None:
        """Write one point's merge into the model's parameters."""
        import torch

        from mergekit_lite.merge.engine import merge_tensor
        from mergekit_lite.merge.plan import (
            TensorStep,
            load_recall_weights,
            tensor_parameters,
        )

        weights = load_recall_weights(config) if config.method in RECALL_METHODS else None

        def merged(name):
            pre, held = self.pre[name], self.held[name]
            parameters = tensor_parameters(config, name, self.layout, self.n_layers, weights)
            if self.sparsified:
                return held.to(torch.float32, copy=True).mul_(parameters["lambda"]).add_(pre)
            if name in self.identical:
                return pre
            step = TensorStep(name, tuple(pre.shape), pre.dtype, "merge", parameters)
            return merge_tensor(config, step, [pre, held])

        self._write(merged)

    def _write(self, tensor_for) -> None:
        import torch

        with torch.no_grad():
            for name, parameter in self.parameters.items():
                parameter.copy_(tensor_for(name))


def post_model(loader: ModelLoader, settings: SweepSettings, sources):
    """post through from_pretrained, or, for a LoRA adapter, pre + its update by on-disk name."""
    from mergekit_lite.io.lora import LoraAdapter

    if LoraAdapter.is_adapter_dir(settings.post):
        return loader.from_state({name: sources[1].load(name) for name in sources[1].names}, settings.post)
    return loader.from_folder(settings.post)


def task_vector_state(config: MergeConfig, sources) -> dict:
    """post - pre after the method's sparsifier (TIES trim, DARE drop and rescale), per on-disk tensor:
    the engine's merge at lambda 1 with pre taken as zero, so masks and thresholds are the engine's own."""
    import dataclasses

    import torch

    from mergekit_lite.merge.engine import merge_tensor
    from mergekit_lite.merge.plan import plan_merge

    config = config.with_parameter("lambda", 1.0)
    state = {}
    for step in plan_merge(config, sources).steps:
        pre = sources[0].load(step.name)
        if not pre.is_floating_point():
            state[step.name] = pre
            continue
        if step.action == "copy":
            state[step.name] = torch.zeros(step.shape, dtype=torch.float32)
            continue
        delta = sources[1].load(step.name).to(torch.float32).sub_(pre.to(torch.float32))
        step = dataclasses.replace(step, out_dtype=torch.float32)
        state[step.name] = merge_tensor(config, step, [torch.zeros_like(delta), delta])
    return state


class PointEvaluator:
    """What every point reuses: the opened inputs, the model (when it fits), the tokenizer, the task indexes."""

    def __init__(self, settings: SweepSettings, folder: Path, bar):
        import torch
        from transformers import AutoTokenizer

        from mergekit_lite.evaluate.lm_harness import Evaluator
        from mergekit_lite.io.sources import open_inputs
        from mergekit_lite.merge.recall import find_tokenizer_dir

        if not (Path(settings.pre) / "config.json").is_file():
            raise InputError(f"{settings.pre}: --pre must be a model folder with a config.json")
        self.settings, self.folder, self.bar = settings, folder, bar
        self.sources = open_inputs([settings.pre, settings.post], settings.pre, allow_pickle=False)
        dtype = getattr(torch, settings.eval_dtype)
        self.loader = ModelLoader(settings.pre, dtype, settings.device)
        in_memory = not settings.stream if settings.stream is not None else fits_in_memory(self.sources[0], dtype)
        self.resident = None
        self.tokenizer_dir = find_tokenizer_dir([settings.pre, settings.post], 0)
        if in_memory and settings.backend == "hf":
            resident = ResidentPair(self.loader, settings, self.sources, settings.merge_config(settings.alphas[0]))
            self.resident = resident if resident.exact else None
        self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_dir)
        self.evaluators = {
            group: Evaluator(tasks, include_path=settings.include_path, limit=settings.limit,
                             batch_size=settings.batch_size, device=settings.device, quiet=True)
            for group, tasks in (("old", settings.old_tasks), ("new", settings.new_tasks))
        }

    def endpoint(self, index: int) -> list[TaskRun]:
        """pre (0) or post (1) itself."""
        if self.settings.backend == "vllm":
            return self.evaluate_folder(self.settings.pre if index == 0 else self.settings.post)
        if self.resident is not None and self.resident.endpoint(index):
            return self.evaluate(self.resident.model)
        if index == 0:
            return self.evaluate(self.loader.from_folder(self.settings.pre))
        return self.evaluate(post_model(self.loader, self.settings, self.sources))

    def merged(self, config: MergeConfig, samples: dict[str, dict[str, list[int]]] | None = None) -> list[TaskRun]:
        """A merge written into the resident model, or streamed to a folder in the run folder and loaded from it;
        scored on every doc, or only on `samples` ({group: {task: doc ids}}, probe mode)."""
        from mergekit_lite.merge.engine import run_merge

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
        """Score the in-memory model on both groups."""
        return self._runs(lambda evaluator, chosen: evaluator.evaluate(model, self.tokenizer, chosen), samples)

    def _runs(self, scores, samples=None) -> list[TaskRun]:
        runs = []
        for group, evaluator in self.evaluators.items():
            for task, score in scores(evaluator, None if samples is None else samples[group]).items():
                runs.append(score_task(task, group, score, self.settings.scoring()))
            self.bar.update(len(evaluator.tasks))
        return runs


def evaluate_point(evaluator: PointEvaluator, settings: SweepSettings, label: str, alpha: float | None,
                   config: MergeConfig | None) -> list[TaskRun]:
    """Evaluate one point (pre or post themselves when alpha is None, else the merge `config`) and save
    its point file: the one step a local sweep and a Ray actor share."""
    if alpha is None:
        runs = evaluator.endpoint(0 if label == "pre" else 1)
    else:
        runs = evaluator.merged(config)
    save_point(point_file(Path(settings.out), label), settings.identity(), label, alpha, runs)
    return runs


def run_sweep(settings: SweepSettings, progress: bool = False) -> SweepResult:
    """Evaluate pre, post and every alpha (resuming saved points), pick the best, write the report."""
    from tqdm import tqdm

    from mergekit_lite.evaluate.report import write_report

    inputs = [settings.pre, settings.post, settings.include_path, settings.recall_texts]
    if settings.save_best:
        check_output_folder(settings.save_best, inputs)
    folder = prepare_run_folder(settings.out, inputs)
    (folder / POINTS_DIR).mkdir(exist_ok=True)
    identity = settings.identity()
    plan = [("pre", None), ("post", None)] + [(alpha_label(alpha), alpha) for alpha in settings.alphas]
    n_tasks = len(settings.old_tasks) + len(settings.new_tasks)
    search = probed = None
    with run_lock(folder):
        runs = load_points(folder, identity)
        todo = [(label, alpha) for label, alpha in plan if label not in runs]
        configs = MergeConfigs(settings, folder)
        evaluated = []
        total = len(plan) + (1 if settings.probe is not None else 0)  # probe mode: every alpha, then the pick
        with tqdm(total=total * n_tasks, initial=(len(plan) - len(todo)) * n_tasks, unit="task",
                  desc="sweep", disable=not progress) as bar:
            if settings.ray is not None and todo:
                from mergekit_lite.evaluate.distributed import run_points_on_ray

                points = [(label, alpha, None if alpha is None else configs(alpha).to_dict()) for label, alpha in todo]
                for _ in run_points_on_ray(settings, points, settings.ray):
                    bar.update(n_tasks)
                runs.update(load_points(folder, identity))
                evaluated = [label for label, _ in todo]
            else:
                evaluator = None

                def point_evaluator() -> PointEvaluator:
                    nonlocal evaluator
                    interrupts.check()
                    evaluator = evaluator or PointEvaluator(settings, folder, bar)
                    return evaluator

                def evaluate(label: str, alpha: float | None) -> None:
                    if label in runs:
                        return
                    point = point_evaluator()
                    bar.set_postfix_str(label)
                    runs[label] = evaluate_point(point, settings, label, alpha, None if alpha is None else configs(alpha))
                    evaluated.append(label)

                def probe(label: str, alpha: float, samples: dict) -> list[TaskRun]:
                    point = point_evaluator()
                    bar.set_postfix_str(f"{label} (probe)")
                    return point.merged(configs(alpha), samples)

                full_grid = settings.search == "grid" and settings.probe is None
                for label, alpha in plan if full_grid else plan[:2]:
                    evaluate(label, alpha)
                if settings.probe is not None:
                    probed, search = run_probes(settings, folder, runs, probe)
                    evaluate(alpha_label(probed.pick), probed.pick)  # the pick, scored on every doc
                    plan = plan[:2] + [(alpha_label(probed.pick), probed.pick)]
                elif settings.search == "golden":
                    search = golden_search(settings, runs, evaluate)
                    bar.total = (len(search.evaluated) + 2) * n_tasks
                    bar.refresh()
        plan = [(label, alpha) for label, alpha in plan if label in runs]
        result = _result(settings, folder, plan, runs, evaluated)
        result.search, result.probe = search, probed
        write_report(result)
        if settings.save_best:
            from mergekit_lite.merge.engine import run_merge

            check_output_folder(settings.save_best, inputs)
            best = configs(result.best.alpha)
            if settings.copy_files_from:
                best = MergeConfig.from_dict({**best.to_dict(), "copy_files_from": settings.copy_files_from})
            run_merge(best, settings.save_best, progress=progress)
    return result


def _result(settings, folder, plan, runs, evaluated) -> SweepResult:
    """Split every task's docs, summarise every model on both splits, pick on selection, bootstrap on report."""
    skipped = {run.task: f"{label}: {run.skipped}" for label, _ in plan for run in runs[label] if run.outcomes is None}
    runs = {label: [TaskRun(run.task, run.group, None, skipped[run.task]) if run.task in skipped else run
                    for run in runs[label]] for label, _ in plan}  # a task skipped for one model is for all
    baseline = runs["pre"]
    splits = doc_splits(settings, baseline)
    results = {label: summarise(label, alpha, runs[label], baseline, splits, settings.aggregation)
               for label, alpha in plan}
    points = [results[label] for label, alpha in plan if alpha is not None]
    best, ties = pick(points)
    result = SweepResult(settings, results["pre"], results["post"], points, best, ties, pareto_front(points),
                         evaluated, folder, splits, skipped=skipped)
    add_intervals(result)
    return result


def doc_splits(settings: SweepSettings, baseline: list[TaskRun]) -> dict[str, tuple[list[str], list[str]]]:
    """Every scored task's (selection, report) doc keys, from pre's samples."""
    splits = {}
    for run in baseline:
        if run.outcomes is None:
            continue
        keys = list(run.outcomes.correct)
        selection, report = split_docs(keys, settings.seed, settings.selection_fraction) \
            if settings.selection == "docs" else (keys, keys)
        if not selection or not report:
            raise InputError(f"task {run.task!r}: {len(keys)} doc(s) cannot be split into selection and report "
                             "docs (raise --limit, or use --selection none)")
        splits[run.task] = (selection, report)
    return splits


def golden_search(settings: SweepSettings, runs: dict[str, list[TaskRun]], evaluate) -> SearchTrace:
    """Golden-section search for the best selection-split harmonic mean over the grid's alphas (pre and post
    already in `runs`); two points are indistinguishable when the paired bootstrap interval of their
    difference on the selection docs holds 0. `evaluate(label, alpha)` adds a point to `runs`."""
    import numpy as np

    baseline = runs["pre"]
    splits = doc_splits(settings, baseline)
    summaries: dict[int, PointResult] = {}

    def at(index: int) -> PointResult:
        if index not in summaries:
            alpha = settings.alphas[index]
            evaluate(alpha_label(alpha), alpha)
            summaries[index] = summarise(alpha_label(alpha), alpha, runs[alpha_label(alpha)], baseline, splits,
                                         settings.aggregation)
        return summaries[index]

    def indistinguishable(i: int, j: int) -> bool:
        draws = paired_bootstrap([at(i), at(j)], splits, settings.aggregation, settings.bootstrap, settings.seed,
                                 split=0)
        tail = (1 - settings.confidence) / 2 * 100
        low, high = np.percentile(draws[:, 0, 2] - draws[:, 1, 2], [tail, 100 - tail])
        return low <= 0 <= high

    return golden_section(len(settings.alphas), lambda i: at(i).selection.harmonic_mean,
                          indistinguishable if settings.bootstrap else None)


# --- probe mode ---------------------------------------------------------------------------------------


def probe_identity(settings: SweepSettings) -> dict:
    """What a probe point depends on beyond a full point's identity: the rate and the docs it samples from."""
    return {**settings.identity(), "probe": settings.probe, "selection": settings.selection,
            "selection_fraction": settings.selection_fraction}


def probe_plans(settings: SweepSettings, runs: dict[str, list[TaskRun]],
                splits: dict[str, tuple[list[str], list[str]]]) -> dict[str, ProbePlan]:
    """Per scored task, on its selection docs: where pre and post disagree, plus a seeded share of the rest."""
    post = {run.task: run.outcomes for run in runs["post"]}
    plans = {}
    for run in runs["pre"]:
        if run.outcomes is None or post.get(run.task) is None:
            continue
        keys = splits[run.task][0]
        if any(key not in run.outcomes.doc_ids for key in keys):
            raise InputError(f"task {run.task!r}: pre's saved point has no lm-eval doc ids (written before --probe "
                             "existed); use another --out")
        plans[run.task] = probe_plan({key: run.outcomes.correct[key] for key in keys},
                                     {key: post[run.task].correct[key] for key in keys if key in post[run.task].correct},
                                     settings.probe, f"{settings.seed}:{run.task}")
    return plans


def probe_samples(plans: dict[str, ProbePlan], baseline: list[TaskRun]) -> dict[str, dict[str, list[int]]]:
    """{group: {task: lm-eval doc ids}} of every probe sample."""
    pre = {run.task: run for run in baseline}
    samples: dict[str, dict[str, list[int]]] = {group: {} for group in GROUPS}
    for task, plan in plans.items():
        samples[pre[task].group][task] = sorted(pre[task].outcomes.doc_ids[key] for key in plan.scored)
    empty = [group for group in GROUPS if not samples[group]]
    if empty:
        raise InputError(f"no {empty[0]} task could be scored (check --{empty[0]}-tasks and --metric)")
    return samples


def on_pre_keys(run: TaskRun, chosen: list[int], pre: SampleOutcomes) -> TaskRun:
    """A probe run keyed as pre's full run. Records are matched to the chosen docs in doc order (lm-eval's
    `samples` keeps the docs' order; whether a record's doc_id is the task's own or its rank among the chosen
    differs between lm-eval versions) and each match is checked by doc_hash where lm-eval logs one."""
    if run.outcomes is None:
        raise InputError(f"task {run.task!r}: probe run skipped ({run.skipped}) though pre's full run was scored")
    key_of = {doc_id: key for key, doc_id in pre.doc_ids.items()}
    expected = [key_of[doc_id] for doc_id in sorted(chosen)]
    observed = sorted(run.outcomes.correct, key=lambda key: run.outcomes.doc_ids.get(key, -1))
    if len(observed) != len(expected):
        raise InputError(f"task {run.task!r}: lm-eval scored {len(observed)} probe docs, {len(expected)} were asked for")
    correct = {}
    for key, original, doc_id in zip(observed, expected, sorted(chosen)):
        hashed = original.split("#")[0] != str(doc_id)
        if hashed and original.split("#")[0] != key.split("#")[0]:
            raise InputError(f"task {run.task!r}: lm-eval returned a probe doc ({key}) that is not one asked for")
        correct[original] = run.outcomes.correct[key]
    outcomes = SampleOutcomes(run.task, correct, run.outcomes.n_choices, run.outcomes.metric, run.outcomes.filter)
    return TaskRun(run.task, run.group, outcomes)


def run_probes(settings: SweepSettings, folder: Path, runs: dict[str, list[TaskRun]],
               probe) -> tuple[ProbeTrace, SearchTrace | None]:
    """Score alphas on probe samples (every alpha, or those the golden search visits), estimate each one's
    selection-split scores with their standard errors, and pick the best estimated harmonic mean (ties to the
    smallest alpha). `probe(label, alpha, samples)` scores one merge on {group: {task: doc ids}}. Probe points
    are saved in probes/ (rerunning resumes them); pre and post must be in `runs`. [ours]"""
    from statistics import NormalDist

    baseline = runs["pre"]
    splits = doc_splits(settings, baseline)
    plans = probe_plans(settings, runs, splits)
    samples = probe_samples(plans, baseline)
    pre = {run.task: run.outcomes for run in baseline}
    groups = {run.task: run.group for run in baseline}
    identity = probe_identity(settings)
    (folder / PROBES_DIR).mkdir(exist_ok=True)
    saved = load_points(folder, identity, PROBES_DIR)
    estimates: dict[int, ProbeEstimate] = {}

    def at(index: int) -> ProbeEstimate:
        if index not in estimates:
            alpha = settings.alphas[index]
            label = alpha_label(alpha)
            if label not in saved:
                scored = [on_pre_keys(run, samples[run.group][run.task], pre[run.task])
                          for run in probe(label, alpha, samples) if run.task in plans]
                save_point(point_file(folder, label, PROBES_DIR), identity, label, alpha, scored)
                saved[label] = scored
            observed = {run.task: run.outcomes.correct for run in saved[label]}
            estimates[index] = estimate_scores(plans, groups, observed, settings.aggregation)
        return estimates[index]

    z = NormalDist().inv_cdf((1 + settings.confidence) / 2)

    def indistinguishable(i: int, j: int) -> bool:
        return abs(at(i).harmonic_mean - at(j).harmonic_mean) <= z * math.hypot(at(i).harmonic_mean_se,
                                                                                 at(j).harmonic_mean_se)

    search = None
    if settings.search == "golden":
        search = golden_section(len(settings.alphas), lambda i: at(i).harmonic_mean, indistinguishable)
        best = search.best
    else:
        best = max(range(len(settings.alphas)), key=lambda i: (at(i).harmonic_mean, -i))
    trace = ProbeTrace(settings.probe, {settings.alphas[i]: estimates[i] for i in sorted(estimates)},
                       settings.alphas[best], [settings.alphas[i] for i in sorted(estimates)
                                               if i != best and indistinguishable(i, best)],
                       sum(len(plan.scored) for plan in plans.values()),
                       sum(len(run.outcomes.correct) for run in baseline if run.task in plans))
    return trace, search
