"""Sweep one merge coefficient between a pre-trained model ("pre") and its post-trained version ("post").

Every point of the grid is merged, scored on the "old" tasks (what pre could do) and the "new" ones
(what post-training taught), and compared sample by sample with pre (the forgetting map). The pick
is the alpha with the best harmonic mean of old and new: it rewards keeping both skills over
maximising one of them.

What alpha is depends on the method (its main coefficient, `config.MAIN_COEFFICIENT`):
linear -> weight of post (0 = pre, 1 = post); slerp -> t; task_arithmetic, ties, dare_* -> lambda,
the scale of post's task vector (post - pre) added to pre; recall -> the softmax temperature of its
layer weights (the similarities are computed once per sweep and re-weighted per temperature).

A run folder keeps one JSON per finished point (`points/`), written atomically, so a killed sweep
loses at most the point in progress and a rerun of the same command picks up where it stopped.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import shutil
from contextlib import contextmanager
from dataclasses import MISSING, asdict, dataclass, field
from pathlib import Path

from mergekit_lite.errors import InputError
from mergekit_lite.evaluate.forgetting import (
    SampleOutcomes,
    TaskForgetting,
    aggregate,
    compare,
    outcomes_from_lm_eval,
)
from mergekit_lite.merge.config import DTYPES, MAIN_COEFFICIENT, METHODS, MergeConfig, read_yaml

POINTS_DIR = "points"
RECALL_DIR = "recall"
LOCK_FILE = ".sweep.lock"
MERGE_TEMP = ".merging"
GROUPS = ("old", "new")
TIE_TOLERANCE = 1e-9
MEMORY_COPIES = 4  # the model, pre, post (or its task vector) and one being converted, in the evaluation dtype
IDENTITY_FIELDS = ("pre", "post", "method", "old_tasks", "new_tasks", "include_path", "limit",
                   "density", "drop", "seed", "recall_texts", "recall_samples", "eval_dtype")
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


def _alpha_range(spec: str) -> list[float]:
    """Inclusive range; values are rounded to 12 digits so 0:1:0.1 gives 0.3, not 0.30000000000000004."""
    parts = spec.split(":")
    if len(parts) != 3:
        raise InputError(f"alphas: {spec!r} is not START:STOP:STEP")
    start, stop, step = map(_number, parts)
    if step <= 0 or stop < start:
        raise InputError(f"alphas: {spec!r} needs STEP > 0 and START <= STOP")
    count = math.floor((stop - start) / step + 1e-9)
    return [round(start + index * step, 12) for index in range(count + 1)]


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

    def __post_init__(self):
        self.alphas = parse_alphas(self.alphas)
        self.old_tasks, self.new_tasks = parse_tasks(self.old_tasks), parse_tasks(self.new_tasks)
        for name in ("pre", "post", "out", "include_path", "recall_texts", "save_best", "copy_files_from"):
            if getattr(self, name) is not None:
                setattr(self, name, str(getattr(self, name)))
        if self.method not in METHODS:
            raise InputError(f"unknown method {self.method!r} (choose from {', '.join(METHODS)})")
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
        if self.method == "recall" and not self.recall_texts:
            raise InputError("a recall sweep needs typical samples: --recall-texts (one text per line)")
        for alpha in self.alphas:
            self.merge_config(alpha)  # every point's merge is valid before any model is read

    @property
    def coefficient(self) -> str:
        """The merge parameter alpha stands for with this method."""
        return MAIN_COEFFICIENT[self.method]

    def merge_config(self, alpha: float, recall_weights_file: str | None = None) -> MergeConfig:
        """The merge at one point: pre is the base (input 0), post the one model, alpha the main coefficient."""
        parameters = {name: value for name, value in (("density", self.density), ("drop", self.drop))
                      if value is not None}
        data = {"method": self.method, "base": self.pre, "models": [self.post], "parameters": parameters,
                "seed": self.seed, "device": self.device if self.device.startswith("cuda") else "cpu",
                "recall": {"texts": self.recall_texts, "samples": self.recall_samples,
                           "weights_file": recall_weights_file}}
        return MergeConfig.from_dict(data, where="sweep").with_parameter(self.coefficient, alpha)

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
    return settings


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
    """One model's result on one task: accuracy and per-sample outcomes (for the forgetting map)."""

    task: str
    group: str
    acc: float
    outcomes: SampleOutcomes

    def to_json(self) -> dict:
        k = self.outcomes.n_choices
        return {"task": self.task, "group": self.group, "acc": self.acc,
                "n_choices": None if math.isinf(k) else k, "correct": self.outcomes.correct}

    @classmethod
    def from_json(cls, data: dict) -> TaskRun:
        k = math.inf if data["n_choices"] is None else float(data["n_choices"])
        return cls(data["task"], data["group"], float(data["acc"]), SampleOutcomes(data["task"], data["correct"], k))


@dataclass
class PointResult:
    """One evaluated model (pre, post or a merge): scores, and forgetting against pre per task and per group."""

    label: str
    alpha: float | None
    tasks: list[TaskRun]
    old: float
    new: float
    harmonic_mean: float
    forgetting: list[TaskForgetting] = field(default_factory=list)
    groups: dict[str, TaskForgetting] = field(default_factory=dict)


def harmonic_mean(old: float, new: float) -> float:
    """2on/(o+n): high only when both are high; 0 when both are 0."""
    return 0.0 if old + new == 0 else 2 * old * new / (old + new)


def summarise(label: str, alpha: float | None, tasks: list[TaskRun], baseline: list[TaskRun]) -> PointResult:
    """Scores per group (mean accuracy over its tasks) and the forgetting map against the baseline (pre)."""
    means = {group: _mean([run.acc for run in tasks if run.group == group]) for group in GROUPS}
    pre = {run.task: run.outcomes for run in baseline}
    rows = {run.task: compare(pre[run.task], run.outcomes) for run in tasks}
    groups = {group: aggregate([rows[run.task] for run in tasks if run.group == group], group) for group in GROUPS}
    return PointResult(label, alpha, tasks, means["old"], means["new"], harmonic_mean(means["old"], means["new"]),
                       list(rows.values()), groups)


def _mean(values: list[float]) -> float:
    if not values:
        raise InputError("the evaluation returned no task for a group (check --old-tasks / --new-tasks)")
    return math.fsum(values) / len(values)


def dominates(a: PointResult, b: PointResult) -> bool:
    return a.old >= b.old and a.new >= b.new and (a.old > b.old or a.new > b.new)


def pareto_front(points: list[PointResult]) -> list[float]:
    """Alphas no other alpha beats on both old and new."""
    return [p.alpha for p in points if not any(dominates(q, p) for q in points)]


@dataclass
class SweepResult:
    """The whole sweep: the two reference endpoints, every alpha, the pick (best harmonic mean) and the front."""

    settings: SweepSettings
    pre: PointResult
    post: PointResult
    points: list[PointResult]
    best: PointResult
    ties: list[float]
    pareto: list[float]
    evaluated: list[str]  # labels of the points evaluated by this call (the others were resumed)
    out: Path

    @property
    def recovered(self) -> float | None:
        """Share of post's old-skill loss that the pick wins back: (old_best - old_post) / (old_pre - old_post).
        None when post lost nothing (old_pre <= old_post). 1.0 = back to pre's level; can exceed 1."""
        lost = self.pre.old - self.post.old
        return (self.best.old - self.post.old) / lost if lost > 0 else None


def pick(points: list[PointResult]) -> tuple[PointResult, list[float]]:
    """The highest harmonic mean, and every alpha within TIE_TOLERANCE of it; ties go to the smallest alpha."""
    top = max(p.harmonic_mean for p in points)
    tied = [p for p in points if top - p.harmonic_mean <= TIE_TOLERANCE]
    return tied[0], [p.alpha for p in tied]


def point_file(folder: Path, label: str) -> Path:
    return folder / POINTS_DIR / f"{label.replace('=', '_')}.json"


def alpha_label(alpha: float) -> str:
    return f"alpha={alpha!r}"


def write_atomic(path: Path, text: str) -> None:
    """Write beside the target, then rename: readers see the old file or the new one, never half of one."""
    temp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    temp.write_text(text)
    os.replace(temp, path)


def load_points(folder: Path, identity: dict) -> dict[str, list[TaskRun]]:
    """Every finished point in the run folder by label. One saved under other settings -> InputError,
    whether or not this grid includes it: the folder belongs to one sweep."""
    points = {}
    for path in sorted((folder / POINTS_DIR).glob("*.json")):
        try:
            data = json.loads(path.read_text())
            label, saved = data["label"], data["identity"]
            runs = [TaskRun.from_json(entry) for entry in data["tasks"]]
        except (ValueError, KeyError, TypeError):
            raise InputError(f"{path}: not a sweep point file (delete it to evaluate that point again)") from None
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
    """The merge config of each alpha. RECALL's similarities are computed once (running both models)
    and re-weighted per temperature into a weights file in the run folder."""

    def __init__(self, settings: SweepSettings, folder: Path):
        self.settings, self.folder = settings, folder
        self.similarity = None

    def __call__(self, alpha: float) -> MergeConfig:
        if self.settings.method != "recall":
            return self.settings.merge_config(alpha)
        path = self.folder / RECALL_DIR / f"temperature_{alpha!r}.json"
        path.parent.mkdir(exist_ok=True)
        write_atomic(path, json.dumps(self._similarity().with_temperature(alpha).to_json(), indent=2) + "\n")
        return self.settings.merge_config(alpha, recall_weights_file=str(path))

    def _similarity(self):
        from mergekit_lite.merge.recall import compute_recall_weights, read_texts

        if self.similarity is None:
            settings = self.settings
            config = settings.merge_config(settings.alphas[0])
            self.similarity = compute_recall_weights(
                config.inputs, read_texts(settings.recall_texts), n_typical=settings.recall_samples,
                temperature=settings.alphas[0], reference=config.recall.reference, device=config.device,
                seed=settings.seed, max_length=config.recall.max_length)
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
        from mergekit_lite.merge.plan import TensorStep, load_recall_weights, tensor_parameters

        weights = load_recall_weights(config) if config.method == "recall" else None

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
        if in_memory:
            resident = ResidentPair(self.loader, settings, self.sources, settings.merge_config(settings.alphas[0]))
            self.resident = resident if resident.exact else None
        self.tokenizer = AutoTokenizer.from_pretrained(find_tokenizer_dir([settings.pre, settings.post], 0))
        self.evaluators = {
            group: Evaluator(tasks, include_path=settings.include_path, limit=settings.limit,
                             batch_size=settings.batch_size, device=settings.device, quiet=True)
            for group, tasks in (("old", settings.old_tasks), ("new", settings.new_tasks))
        }

    def endpoint(self, index: int) -> list[TaskRun]:
        """pre (0) or post (1) itself."""
        if self.resident is not None and self.resident.endpoint(index):
            return self.evaluate(self.resident.model)
        if index == 0:
            return self.evaluate(self.loader.from_folder(self.settings.pre))
        return self.evaluate(post_model(self.loader, self.settings, self.sources))

    def merged(self, config: MergeConfig) -> list[TaskRun]:
        """A merge written into the resident model, or streamed to a folder in the run folder and loaded from it."""
        from mergekit_lite.merge.engine import run_merge

        if self.resident is not None:
            self.resident.write(config)
            return self.evaluate(self.resident.model)
        temp = self.folder / MERGE_TEMP
        run_merge(config, temp, overwrite=True)
        try:
            return self.evaluate(self.loader.from_folder(temp))
        finally:
            shutil.rmtree(temp, ignore_errors=True)

    def evaluate(self, model) -> list[TaskRun]:
        """Score the model on both groups."""
        runs = []
        for group, evaluator in self.evaluators.items():
            for task, score in evaluator.evaluate(model, self.tokenizer).items():
                runs.append(TaskRun(task, group, score.acc, outcomes_from_lm_eval(task, score.samples)))
            self.bar.update(len(evaluator.tasks))
        return runs


def run_sweep(settings: SweepSettings, progress: bool = False) -> SweepResult:
    """Evaluate pre, post and every alpha (resuming saved points), pick the best, write the report."""
    from tqdm import tqdm

    from mergekit_lite.evaluate.report import write_report

    folder = Path(settings.out)
    if settings.save_best and Path(settings.save_best).exists():
        raise InputError(f"{settings.save_best}: already exists (--save-best writes a new folder)")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / POINTS_DIR).mkdir(exist_ok=True)
    identity = settings.identity()
    plan = [("pre", None), ("post", None)] + [(alpha_label(alpha), alpha) for alpha in settings.alphas]
    n_tasks = len(settings.old_tasks) + len(settings.new_tasks)
    with run_lock(folder):
        runs = load_points(folder, identity)
        todo = [(label, alpha) for label, alpha in plan if label not in runs]
        configs = MergeConfigs(settings, folder)
        with tqdm(total=len(plan) * n_tasks, initial=(len(plan) - len(todo)) * n_tasks, unit="task",
                  desc="sweep", disable=not progress) as bar:
            evaluator = PointEvaluator(settings, folder, bar) if todo else None
            for label, alpha in todo:
                bar.set_postfix_str(label)
                if alpha is None:
                    runs[label] = evaluator.endpoint(0 if label == "pre" else 1)
                else:
                    runs[label] = evaluator.merged(configs(alpha))
                save_point(point_file(folder, label), identity, label, alpha, runs[label])
        result = _result(settings, folder, plan, runs, [label for label, _ in todo])
        write_report(result)
        if settings.save_best:
            from mergekit_lite.merge.engine import run_merge

            best = configs(result.best.alpha)
            if settings.copy_files_from:
                best = MergeConfig.from_dict({**best.to_dict(), "copy_files_from": settings.copy_files_from})
            run_merge(best, settings.save_best, progress=progress)
    return result


def _result(settings, folder, plan, runs, evaluated) -> SweepResult:
    baseline = runs["pre"]
    results = {label: summarise(label, alpha, runs[label], baseline) for label, alpha in plan}
    points = [results[alpha_label(alpha)] for alpha in settings.alphas]
    best, ties = pick(points)
    return SweepResult(settings, results["pre"], results["post"], points, best, ties, pareto_front(points),
                       evaluated, folder)
