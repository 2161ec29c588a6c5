"""A sweep's settings: the pair, the method and its alpha grid, the tasks, scoring, selection and where it
runs; their checks (every bad value fails before any model is read), the YAML schema of a sweep file and the
merge config each alpha stands for."""

from __future__ import annotations

import math
from dataclasses import MISSING, asdict, dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from mergekit_lite.errors import InputError
from mergekit_lite.evaluate.backends import BACKENDS, VllmOptions, parse_vllm_options
from mergekit_lite.evaluate.forgetting import AGGREGATIONS
from mergekit_lite.evaluate.lm_eval_settings import LM_EVAL_KEYS, LmEvalSettings, check_task_folder, parse_limit
from mergekit_lite.evaluate.outcomes import Scoring
from mergekit_lite.io.hub import resolve_model
from mergekit_lite.io.layout import content_identity
from mergekit_lite.io.validation import check_folder_files, read_yaml, validate
from mergekit_lite.merge import methods
from mergekit_lite.merge.config import DTYPES, MergeConfig, did_you_mean
from mergekit_lite.merge.schema import config_from_dict
from mergekit_lite.settings import setting

IDENTITY_FIELDS = (
    "pre",
    "post",
    "method",
    "old_tasks",
    "new_tasks",
    "include_path",
    "limit",
    "density",
    "drop",
    "seed",
    "recall_texts",
    "recall_samples",
    "metric",
    "filter",
    "choices",
    "eval_dtype",
)
SEARCHES = ("grid", "golden")
CHAT_TEMPLATE_DEFAULT = "default"  # --apply-chat-template given bare: the tokenizer's default template
SELECTIONS = ("docs", "none")  # docs: seeded doc_hash partition; none: pick and report on the same docs
PATH_FIELDS = ("pre", "post", "include_path", "recall_texts")
RESULTS = ("pre_results", "post_results")  # lm-eval output folders an endpoint is scored from (sweep.reuse)
# a 2-D grid: the list setting that sweeps a second coefficient beside alpha, and the merge parameter it sets
DTYPE_MAX = {"float32": 3.4028234663852886e38, "bfloat16": 3.3895313892515355e38, "float16": 65504.0}  # torch.finfo
SECOND_AXES = {"betas": "beta", "densities": "density", "drops": "drop"}
# a vector of coefficients (sweep.vector): layer groups, module types, the search, its trials and its start
VECTOR_KEYS = ("groups", "modules", "vector_search", "trials", "vector_start", "vector_prune", "trial_batch")
VECTOR_SEARCHES = ("tpe", "cmaes", "revert")  # Optuna's TPE or CMA-ES; revert: each slot pre's or the merge's
VECTOR_STARTS = ("scalar", "drift")
# --modules: the module types of evaluate.drift.module_type inside decoder layers, and attn / mlp for their groups
MODULE_KINDS = ("attn", "mlp", "norm", "q", "k", "v", "o", "qkv", "gate", "up", "down", "gate_up")
MODULE_KINDS += ("experts", "shared_expert", "router")
# settings written out only when given
OPTIONAL_KEYS = ("beta", *SECOND_AXES, "budget", "realign_shots", *VECTOR_KEYS, "save_best_adapter", *RESULTS)


def parse_alphas(spec, name: str = "alphas") -> list[float]:
    """A grid from "START:STOP:STEP" (STOP included), "a,b,c", a number or a list of numbers; sorted, unique."""
    if isinstance(spec, (list, tuple)):
        values = [_number(value, name) for value in spec]
    elif isinstance(spec, str) and ":" in spec:
        values = _alpha_range(spec, name)
    elif isinstance(spec, str):
        values = [_number(part, name) for part in spec.split(",") if part.strip()]
    else:
        values = [_number(spec, name)]
    if not values:
        raise InputError(f"{name}: no values (give START:STOP:STEP or a comma list)")
    return sorted(set(values))


def _number(value, name: str = "alphas") -> float:
    if isinstance(value, bool):
        raise InputError(f"{name}: {value!r} is not a number")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise InputError(f"{name}: {str(value).strip()!r} is not a number") from None
    if not math.isfinite(number):
        raise InputError(f"{name}: {number} is not a finite number")
    return number


MAX_ALPHA_POINTS = 500


def _alpha_range(spec: str, name: str = "alphas") -> list[float]:
    """Inclusive range; values are rounded to 12 digits so 0:1:0.1 gives 0.3, not 0.30000000000000004.

    The number of points is computed before the grid is built and capped at MAX_ALPHA_POINTS: every point
    is a merge and a full evaluation, so even a few hundred take hours, and more is a mistyped STEP
    (0:1:1e-12 would not finish building its list, let alone its sweep)."""
    parts = spec.split(":")
    if len(parts) != 3:
        raise InputError(f"{name}: {spec!r} is not START:STOP:STEP")
    start, stop, step = (_number(part, name) for part in parts)
    if step <= 0 or stop < start:
        raise InputError(f"{name}: {spec!r} needs STEP > 0 and START <= STOP")
    steps = (stop - start) / step + 1e-9  # may be inf for a subnormal STEP
    if not steps < MAX_ALPHA_POINTS:
        raise InputError(
            f"{name}: {spec!r} is a grid of {steps + 1:,.0f} points; at most {MAX_ALPHA_POINTS} "
            "(each point is a merge and an evaluation), use a larger STEP"
        )
    values = [round(start + index * step, 12) for index in range(math.floor(steps) + 1)]
    if not math.isclose(values[-1], stop, rel_tol=1e-9, abs_tol=1e-9):
        # STOP is documented as included: a grid that silently ends short of it (0:1:0.3 -> 0.9) drops the
        # endpoint the user asked for
        raise InputError(
            f"{name}: {spec!r} does not reach STOP {stop:g} (its last value is {values[-1]:g}; STOP is "
            "included, so STOP - START must be a whole number of STEPs): use another STEP or list "
            "the values"
        )
    return values


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
    limit: int | float | None = None  # docs per task, or a share of each task's docs in (0, 1), as lm-eval's --limit
    batch_size: int = 16
    device: str = "cpu"
    density: float | None = None
    drop: float | None = None
    seed: int = 0
    recall_texts: str | None = None
    recall_samples: int = 8
    save_best: str | None = None
    save_best_adapter: str | None = None  # the pick as a LoRA adapter (post an adapter, a method that scales it)
    stream: bool | None = None  # None: merge in memory when the model fits, else through a folder on disk
    eval_dtype: str | None = None  # None: float32 on CPU, bfloat16 on GPU
    copy_files_from: str | None = None  # --save-best's side files (default: see engine.write_side_files)
    ray: str | None = None  # None: points one after another here; "local" or a cluster address: Ray actors
    search: str = "grid"  # grid: every alpha; golden: golden-section search over the grid (fewer points)
    backend: str = "hf"  # hf: in-memory transformers model; vllm: lm-eval's vLLM backend on a merged folder
    vllm_args: str | None = None  # lm-eval model_args for vllm, e.g. tensor_parallel_size=2,gpu_memory_utilization=0.8
    probe: float | None = None  # probe mode: share of the samples pre and post agree on that every alpha is scored on
    beta: float | None = None  # lines: the task vector's rise from the first layer to the last (default 1 - alpha)
    # a 2-D grid (sweep.grid): at most one of these, the second coefficient's values beside alpha
    betas: list[float] | None = None
    densities: list[float] | None = None
    drops: list[float] | None = None
    budget: int | None = None  # sweep.budget: at most this many full evaluations' worth of scored docs
    realign_shots: int | None = None  # sweep.realign: post scored again with K demonstrations on the docs it forgot
    # sweep.reuse: pre / post scored from lm-eval --log_samples folders the user has, checked against this sweep
    pre_results: str | None = None
    post_results: str | None = None
    # sweep.vector: one coefficient per group of decoder layers and/or module type, searched beside the scalar pick
    groups: int | None = None
    modules: list[str] | None = None
    vector_search: str | None = None  # tpe (default), cmaes or revert
    trials: int | None = None  # how many vectors the search scores (default 24)
    vector_start: str | None = None  # scalar (default): the scalar pick's vector first; drift: also one from drift
    vector_prune: float | None = None  # cheap-first: each trial on this probe share first, Optuna's pruner stops it
    trial_batch: int | None = None  # trials asked at once (Ray: in parallel); default 1, with --ray the actors
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
    lm_eval: LmEvalSettings = field(default_factory=LmEvalSettings)  # few-shot, chat template, ... as lm-eval's CLI

    def __post_init__(self):
        self.alphas = parse_alphas(self.alphas)
        self._check_grid()
        self._check_vector()
        self.old_tasks, self.new_tasks = parse_tasks(self.old_tasks), parse_tasks(self.new_tasks)
        self.metric, self.filter, self.choices = (
            _spec_list(getattr(self, name)) for name in ("metric", "filter", "choices")
        )
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
        for name in (*PATH_FIELDS, "out", "save_best", "save_best_adapter", "copy_files_from", *RESULTS):
            if getattr(self, name) is not None:
                setattr(self, name, str(getattr(self, name)))
        if self.method not in methods.SWEEPABLE:
            kind = (
                "has no coefficient to sweep between pre and post" if self.method in methods.REGISTRY else "is unknown"
            )
            raise InputError(f"method {self.method!r} {kind} (choose from {', '.join(methods.SWEEPABLE)})")
        if not self.old_tasks or not self.new_tasks:
            raise InputError("give at least one old task and one new task (--old-tasks, --new-tasks)")
        shared = [task for task in self.old_tasks if task in self.new_tasks]
        if shared:
            raise InputError(f"task {shared[0]!r} is both an old and a new task")
        self.limit = parse_limit(self.limit)
        if self.realign_shots is not None and (
            isinstance(self.realign_shots, bool) or not isinstance(self.realign_shots, int) or self.realign_shots < 1
        ):
            raise InputError(f"realign_shots must be a whole number of demonstrations >= 1, got {self.realign_shots!r}")
        if isinstance(self.lm_eval, dict):  # as asdict() gives it (a Ray actor's settings)
            self.lm_eval = LmEvalSettings(**self.lm_eval)
        if self.lm_eval.model_args and self.backend != "hf":
            raise InputError("--model-args applies to --backend hf; give vLLM's through --vllm-args")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise InputError(f"seed must be a whole number in [0, 2**63), got {self.seed!r}")
        for name in ("batch_size", "recall_samples"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise InputError(f"{name} must be a whole number >= 1, got {value!r}")
        default_dtype = "bfloat16" if str(self.device).startswith("cuda") else "float32"
        dtype = str(self.eval_dtype or default_dtype).lower()
        if dtype not in DTYPES:
            raise InputError(f"unknown eval dtype {self.eval_dtype!r} (use bf16, fp16 or fp32)")
        self.eval_dtype = DTYPES[dtype]
        self._check_representable()
        if methods.SWEEPABLE[self.method].reads_recall_weights and not self.recall_texts:
            raise InputError(f"a {self.method} sweep needs typical samples: --recall-texts (one text per line)")
        for value in self.second_values() or [None]:
            for alpha in self.alphas:
                self.merge_config(alpha, cell=value)  # every point's merge is valid before any model is read

    def _check_representable(self) -> None:
        """Every value of every grid axis (and a fixed beta), for every method, before any work: beyond the largest
        number of the evaluation dtype every weight it scales is infinite; beyond its square root, a product of two
        such weights (a query by a key, the MLP's gate by its up projection) overflows wherever the task vector's
        entries reach 1, and the model's logits are NaN or infinite (task arithmetic at 1e38, LiNeS beta 1e38). A
        LiNeS cell scales its last layer by alpha + beta: that sum is checked too."""
        largest = DTYPE_MAX[self.eval_dtype]
        values = [("alphas", value) for value in self.alphas] + [("beta", self.beta)]
        values += [(self.second + "s", value) for value in self.second_values() or []]
        betas = self.betas or ([] if self.beta is None else [self.beta])  # unset: 1 - alpha, the last layer at 1
        if "beta" in methods.parameters_of(self.method):  # LiNeS: the last layer's scale is alpha + beta
            values += [("alphas + betas", alpha + beta) for alpha in self.alphas for beta in betas]
        for name, value in values:
            if isinstance(value, (int, float)) and not abs(value) <= largest:
                raise InputError(
                    f"{name}: {value!r} overflows {self.eval_dtype} (largest {largest:.4g}); every weight "
                    "it scales would be infinite"
                )
        for name, value in values:
            if isinstance(value, (int, float)) and not abs(value) <= math.sqrt(largest):
                raise InputError(
                    f"{name}: {value!r} overflows {self.eval_dtype} in the forward pass (beyond "
                    f"{math.sqrt(largest):.4g}, the square root of its largest number, a product of two weights it "
                    "scales overflows wherever the task vector's entries reach 1): its logits would be NaN or "
                    "infinite; sweep smaller coefficients"
                )

    def _check_grid(self) -> None:
        """At most one second coefficient, one the method takes; the budget a whole number, only where it decides."""
        given = [name for name in SECOND_AXES if getattr(self, name) is not None]
        if len(given) > 1:
            raise InputError(f"sweep one second coefficient at a time (got {' and '.join(given)})")
        for name in given:
            setattr(self, name, parse_alphas(getattr(self, name), name))
            if SECOND_AXES[name] not in methods.parameters_of(self.method):
                raise InputError(f"{name}: method {self.method!r} has no {SECOND_AXES[name]} to sweep")
            if len(self.alphas) * len(getattr(self, name)) > MAX_ALPHA_POINTS:
                raise InputError(
                    f"alphas x {name}: {len(self.alphas)} x {len(getattr(self, name))} points; at most "
                    f"{MAX_ALPHA_POINTS} (each point is a merge and an evaluation)"
                )
        if self.budget is not None:
            if isinstance(self.budget, bool) or not isinstance(self.budget, int) or self.budget < 3:
                raise InputError(f"budget must be a whole number >= 3 (pre, post and one merge), got {self.budget!r}")
            if self.search == "golden" or self.ray is not None:
                raise InputError(
                    "--budget chooses which points to evaluate itself: run it without --search golden and --ray"
                )

    def _check_vector(self) -> None:
        """--groups/--modules: a whole number of groups >= 1, known module types, a method whose coefficient applies
        per tensor, at least two coefficients; the search settings only with them."""
        if isinstance(self.modules, str):
            self.modules = parse_tasks(self.modules)
        if self.groups is None and not self.modules:
            given = [name for name in VECTOR_KEYS[2:] if getattr(self, name) is not None]
            if given:
                raise InputError(f"{given[0]} shapes the search of --groups/--modules: give one of them")
            self.modules = None
            return
        if self.groups is not None and (isinstance(self.groups, bool) or not isinstance(self.groups, int)):
            raise InputError(f"groups must be a whole number of layer groups >= 1, got {self.groups!r}")
        if self.groups is not None and self.groups < 1:
            raise InputError(f"groups must be a whole number of layer groups >= 1, got {self.groups!r}")
        unknown = [name for name in self.modules or [] if name not in MODULE_KINDS]
        if unknown:
            raise InputError(
                f"modules: unknown module type {unknown[0]!r}{did_you_mean(unknown[0], MODULE_KINDS)} "
                f"(choose from {', '.join(MODULE_KINDS)})"
            )
        if (self.groups or 1) == 1 and not self.modules:
            raise InputError("groups 1 is the scalar sweep itself: give --groups 2 or more, or --modules")
        method = methods.SWEEPABLE.get(self.method)
        if method is not None and (method.reads_recall_weights or method.parameter("beta") is not None):
            raise InputError(
                f"--groups/--modules: {self.method}'s coefficient is already a per-layer schedule; use a method "
                "whose coefficient applies per tensor (linear, slerp, task_arithmetic, ties, dare_*, ...)"
            )
        for name, allowed in (("vector_search", VECTOR_SEARCHES), ("vector_start", VECTOR_STARTS)):
            if getattr(self, name) is not None and getattr(self, name) not in allowed:
                raise InputError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if self.trials is not None and (isinstance(self.trials, bool) or not isinstance(self.trials, int)):
            raise InputError(f"trials must be a whole number >= 1, got {self.trials!r}")
        if self.trials is not None and self.trials < 1:
            raise InputError(f"trials must be a whole number >= 1, got {self.trials!r}")
        if self.vector_prune is not None and not (
            isinstance(self.vector_prune, (int, float))
            and not isinstance(self.vector_prune, bool)
            and 0 < self.vector_prune <= 1
        ):
            raise InputError(f"vector_prune must be a share of docs in (0, 1], got {self.vector_prune!r}")
        if self.trial_batch is not None and (
            isinstance(self.trial_batch, bool) or not isinstance(self.trial_batch, int) or self.trial_batch < 1
        ):
            raise InputError(f"trial_batch must be a whole number >= 1, got {self.trial_batch!r}")

    @property
    def second(self) -> str | None:
        """The second coefficient of a 2-D grid (beta, density or drop); None for a 1-D sweep."""
        return next((SECOND_AXES[name] for name in SECOND_AXES if getattr(self, name) is not None), None)

    def second_values(self) -> list[float] | None:
        return next((getattr(self, name) for name in SECOND_AXES if getattr(self, name) is not None), None)

    @property
    def read_paths(self) -> list[str | None]:
        """What the sweep reads and no output may touch: the models, task folder, RECALL's texts and the lm-eval
        outputs it reuses (None where not given)."""
        return [getattr(self, name) for name in (*PATH_FIELDS, *RESULTS)]

    def vllm_options(self) -> VllmOptions:
        return parse_vllm_options(self.vllm_args)

    def scoring(self) -> Scoring:
        return Scoring.from_specs(self.metric, self.filter, self.choices)

    @property
    def coefficient(self) -> str:
        """The merge parameter alpha stands for with this method."""
        return methods.method(self.method).main_coefficient

    def merge_config(
        self, alpha: float, recall_weights_file: str | None = None, cell: float | None = None
    ) -> MergeConfig:
        """The merge at one point: pre is the base (input 0), post the one model, alpha the main coefficient;
        `cell`, in a 2-D grid, the second coefficient's value (else this settings' own)."""
        fixed = {"density": self.density, "drop": self.drop, "beta": self.beta}
        if self.second is not None:
            fixed[self.second] = getattr(self, self.second) if cell is None else cell
        parameters = {name: value for name, value in (*fixed.items(), (self.coefficient, alpha)) if value is not None}
        data = {
            "method": self.method,
            "base": self.pre,
            "models": [self.post],
            "parameters": parameters,
            "seed": self.seed,
            "device": self.device if self.device.startswith("cuda") else "cpu",
            "recall": {"texts": self.recall_texts, "samples": self.recall_samples, "weights_file": recall_weights_file},
        }
        return config_from_dict(data, where="sweep")

    def identity(self) -> dict:
        """What a saved point depends on; paths absolute so `pre/` and `./pre` are the same model."""
        identity = {name: getattr(self, name) for name in IDENTITY_FIELDS}
        if self.beta is not None:
            identity["beta"] = self.beta
        if self.lm_eval.given():  # the prompts scored: a point of other few-shot or chat settings is another point
            identity["lm_eval"] = self.lm_eval.given()
        if self.second is not None:  # a 2-D grid's points: the second coefficient is in each point's label
            identity.pop(self.second, None)
            identity["grid"] = self.second
        for name in PATH_FIELDS:
            if identity[name] is not None:
                identity[name] = str(Path(identity[name]).resolve())
        # the same path may hold other weights later (re-trained, re-downloaded): points of the old ones must not
        # be reused, so the models' content is part of what a point depends on
        identity["pre_content"], identity["post_content"] = content_identity(self.pre), content_identity(self.post)
        return identity

    def cell_identity(self) -> dict:
        """A saved point's identity: the sweep's, plus, in a row of a 2-D grid, the row's second coefficient."""
        identity = self.identity()
        if self.second is not None:
            identity[self.second] = getattr(self, self.second)
        return identity

    def check_inputs(self) -> None:
        """Before torch loads and any model is read: pre and post are model folders (a hub id, org/name[@revision],
        becomes its cached snapshot folder here, as `merge` reads it; a path on disk wins), and every file of the
        task folder lm-eval will read is a regular file (a FIFO there would block lm-eval for ever)."""
        self.pre, self.post = resolve_model(self.pre), resolve_model(self.post)
        check_folder_files(self.pre), check_folder_files(self.post)  # transformers reads their side files by name
        if not (Path(self.pre) / "config.json").is_file():
            raise InputError(f"{self.pre}: --pre must be a model folder with a config.json")
        if not any((Path(self.post) / name).is_file() for name in ("config.json", "adapter_config.json")):
            raise InputError(
                f"{self.post}: --post must be a model folder with a config.json, or a LoRA adapter "
                "folder (adapter_config.json) trained on pre"
            )
        if self.include_path:
            check_task_folder(self.include_path)

    def to_dict(self) -> dict:
        """Every setting; those of 2-D grids and budgets only when given (a 1-D sweep's results.json is unchanged)."""
        return {name: value for name, value in asdict(self).items() if value is not None or name not in OPTIONAL_KEYS}


SETTINGS_KEYS = tuple(name for name in SweepSettings.__dataclass_fields__ if name != "lm_eval") + LM_EVAL_KEYS


def _spec_list(value) -> list[str]:
    """Scoring specs from a string, a list, or a mapping {task: value} (YAML)."""
    if value is None:
        return []
    if isinstance(value, dict):
        return [f"{task}={item}" for task, item in value.items()]
    return [str(item) for item in ([value] if isinstance(value, (str, int, float)) else value)]


Spec = str | int | float  # a scoring spec value as YAML may write it


class SweepFile(BaseModel):
    """Every setting a sweep takes from its command line or its YAML file, declared once: the types a file may
    give (strict: a quoted "false" is not a boolean; no NaN), the bounds, and the command line's flags and help
    (cli/options.py makes the options from it). SweepSettings resolves what is given into the sweep run."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
    pre: str | None = setting(None, "Base (pre-trained) model folder: the reference for every forgetting comparison.")
    post: str | None = setting(
        None,
        "Post-trained model folder (same architecture as --pre), or a LoRA adapter trained on pre (audited first).",
    )
    method: str | None = setting(
        None,
        f"Merge method (default linear; one of {', '.join(methods.SWEEPABLE)}), see alpha below; several, "
        "comma-separated, compare them in one run (pre and post evaluated once).",
        flags=("--method", "-m"),
    )
    alphas: str | float | list[float] | None = setting(
        None, "Grid: START:STOP:STEP (STOP included) or a comma list, e.g. 0:1:0.1 or 0,0.3,0.5."
    )
    old_tasks: str | list[str] | None = setting(
        None, "lm-eval tasks of what pre could do; comma list or repeated.", repeatable=True
    )
    new_tasks: str | list[str] | None = setting(
        None, "lm-eval tasks of what post-training taught; comma list or repeated.", repeatable=True
    )
    include_path: str | None = setting(None, "Folder of local task YAMLs.", path="existing-folder")
    # docs per task (a whole number) or a share in (0, 1): parse_limit
    limit: float | None = setting(
        None,
        "Docs per task, or a share of each task's docs below 1 (e.g. 0.1), as lm-eval's --limit (default: all).",
        gt=0,
    )
    # lm-eval's evaluation settings (LmEvalSettings), as its CLI flags of the same names
    num_fewshot: int | None = setting(
        None, "Few-shot demonstrations per prompt, as lm-eval's --num_fewshot (default: the task's own).", ge=0
    )
    apply_chat_template: bool | str | None = setting(
        None,
        "Build prompts with the tokenizer's chat template (TEMPLATE: one of its named templates), as "
        "lm-eval's --apply_chat_template; pre's tokenizer, with post's template when pre has none.",
        metavar="[TEMPLATE]",
        flag_value=CHAT_TEMPLATE_DEFAULT,
    )
    fewshot_as_multiturn: bool | None = setting(
        None,
        "Few-shot demonstrations as chat turns (default: on with --apply-chat-template, as lm-eval).",
        negatable=True,
    )
    system_instruction: str | None = setting(
        None, "System instruction before every prompt, as lm-eval's --system_instruction.", metavar="TEXT"
    )
    gen_kwargs: str | None = setting(
        None,
        "Generation arguments of generative tasks, as lm-eval's --gen_kwargs (e.g. temperature=0,max_gen_toks=256).",
        metavar="NAME=VALUE,...",
    )
    model_args: str | None = setting(
        None,
        "Model arguments as lm-eval's --model_args takes them: max_length, truncation, add_bos_token, "
        "attn_implementation, trust_remote_code (runs the model folder's code), ... (hf backend).",
        metavar="NAME=VALUE,...",
    )
    batch_size: int | None = setting(None, "Evaluation batch size (default 16).", ge=1)
    device: str | None = setting(None, "Where models run: cpu (default), cuda, cuda:N.")
    out: str | None = setting(None, "Run folder (created; reused to resume).", flags=("--out", "-o"), path="folder")
    density: float | None = setting(None, "ties: share of the task vector kept by magnitude, in (0, 1].")
    drop: float | None = setting(None, "dare_*: drop probability of task-vector entries, in [0, 1).")
    beta: float | None = setting(
        None, "lines: the task vector's scale rises by beta from the first layer to the last (default 1 - alpha)."
    )
    # a 2-D grid (sweep.grid): the second coefficient's values beside alpha
    betas: str | float | list[float] | None = setting(None, "lines: a 2-D grid, alpha x beta (values as --alphas).")
    densities: str | float | list[float] | None = setting(
        None, "ties, della, breadcrumbs, dare_*: a 2-D grid, lambda x density (values as --alphas)."
    )
    drops: str | float | list[float] | None = setting(None, "dare_*: a 2-D grid, lambda x drop (values as --alphas).")
    budget: int | None = setting(
        None,
        "At most N full evaluations' worth of docs (pre and post count 1 each, a probe its share of the docs): "
        "successive halving on probe docs, then the survivors on every doc (see the README).",
        ge=3,
    )
    # a vector of coefficients (sweep.vector): per layer group and/or module type, searched with Optuna
    groups: int | None = setting(
        None,
        "Also search one coefficient per group of N contiguous decoder layers (embeddings with the first group, "
        "the final norm and head with the last) against the scalar pick, on the selection split (docs/sweep.md).",
        ge=1,
    )
    modules: str | list[str] | None = setting(
        None,
        "Also search one coefficient per module type (comma list: attn, mlp, norm, q, k, v, o, gate, up, down, "
        "...; the rest of the tensors share one more), alone or with --groups.",
    )
    vector_search: Literal[VECTOR_SEARCHES] | None = setting(
        None,
        "How --groups/--modules search: Optuna's TPE (default) or CMA-ES, or revert (each slot pre's or the "
        "scalar pick's).",
    )
    trials: int | None = setting(None, "Vectors the search scores on every doc (default 24).", ge=1)
    vector_start: Literal[VECTOR_STARTS] | None = setting(
        None, "The search's first trials: the scalar pick's vector (default), and with drift one from post's drift."
    )
    vector_prune: float | None = setting(
        None,
        "Cheap-first trials: each vector scored first on probe docs (this share of the agreeing selection docs), "
        "and Optuna's median pruner stops one clearly worse before its full evaluation.",
        gt=0,
        le=1,
    )
    trial_batch: int | None = setting(
        None,
        "Vectors asked of Optuna at once, scored in parallel with --ray (default 1; with --ray the actors Ray "
        "fits). The same batch gives the same vector with or without Ray.",
        ge=1,
    )
    # numpy's and torch's generators take seeds in [0, 2**63)
    seed: int | None = setting(None, "Seed of DARE's drop and RECALL's sample choice (default 0).", ge=0, le=2**63 - 1)
    recall_texts: str | None = setting(None, "recall: typical texts, one per line.", path="file")
    recall_samples: int | None = setting(None, "recall: how many typical samples (default 8).", ge=1)
    save_best: str | None = setting(None, "Write the picked merge to this new model folder.", path="folder")
    save_best_adapter: str | None = setting(
        None,
        f"--post a LoRA adapter, --method {' or '.join(n for n, m in methods.SWEEPABLE.items() if m.scales_task_vector)}"
        ": write the pick as this new PEFT adapter folder (the adapter with its update scaled by the picked alpha; "
        "DoRA too).",
        path="folder",
    )
    stream: bool | None = setting(
        None, "Always merge through a folder on disk (default: in memory when 3x the model fits in free RAM)."
    )
    copy_files_from: str | None = setting(
        None,
        "--save-best: model folder whose config/tokenizer files are copied "
        "(default: pre's, with post's chat template and generation config when pre has none).",
    )
    eval_dtype: str | None = setting(
        None, "dtype models are evaluated in: fp32 (default on CPU), bf16 (default on GPU), fp16."
    )
    # scoring (as `mergekit-lite forgetting`): [TASK=]METRIC, [TASK=]FILTER, TASK=K
    metric: Spec | list[Spec] | dict[str, Spec] | None = setting(
        None, "0/1 metric to score by (default: the task's first).", metavar="[TASK=]METRIC", repeatable=True
    )
    filter: Spec | list[Spec] | dict[str, Spec] | None = setting(
        None,
        "lm-eval filter to score (default: the first the task logs), e.g. gsm8k=flexible-extract.",
        metavar="[TASK=]FILTER",
        repeatable=True,
    )
    choices: Spec | list[Spec] | dict[str, Spec] | None = setting(
        None, "Options of a generative multiple-choice task.", metavar="TASK=K", repeatable=True
    )
    aggregation: Literal[AGGREGATIONS] | None = setting(None, "Group scores (default paper).")
    selection: Literal[SELECTIONS] | None = setting(
        None, "docs (default): pick alpha on a seeded doc_hash split, report on the rest; none: same docs."
    )
    selection_fraction: float | None = setting(
        None, "Share of each task's docs that picks alpha (default 0.5).", gt=0, lt=1
    )
    bootstrap: int | None = setting(None, "Bootstrap resamples for intervals (default 1000; 0: none).", ge=0)
    confidence: float | None = setting(None, "Interval confidence (default 0.95).", gt=0, lt=1)
    ray: str | None = setting(
        None,
        "Evaluate points in parallel as Ray actors (one per GPU on cuda, else per CPU): alone, a local "
        "Ray cluster; with ADDRESS (e.g. auto, ray://head:10001), that cluster. Needs mergekit-lite[ray].",
        metavar="[ADDRESS]",
        flag_value="local",
    )
    search: Literal[SEARCHES] | None = setting(
        None,
        "grid (default): every alpha; golden: golden-section search for the best harmonic mean over the "
        "grid, stopping once the points left are indistinguishable (fewer evaluations).",
    )
    backend: Literal[BACKENDS] | None = setting(
        None,
        "hf (default): the model in memory; vllm: lm-eval's vLLM backend on each merge written to a "
        "scratch folder (GPU; needs vllm installed).",
    )
    vllm_args: str | None = setting(
        None,
        "vLLM model args: tensor_parallel_size, data_parallel_size, gpu_memory_utilization, "
        "max_model_len, dtype, batch_size, seed.",
        metavar="NAME=VALUE,...",
    )
    probe: float | None = setting(
        None,
        "Probe mode: score each alpha only on the selection docs where pre and post disagree plus this "
        "share of the others (seeded), estimate its scores with standard errors, then score the pick on "
        "every doc (e.g. 0.1; default: every doc at every alpha).",
        gt=0,
        le=1,
    )
    # checked by SweepSettings (one message for a flag and a file)
    realign_shots: int | None = setting(
        None,
        "After pre and post, score post again with K demonstrations (lm-eval's few-shot docs) on the docs "
        "it forgot, and split the forgetting into spurious (K shots bring it back) and genuine.",
        metavar="K",
    )
    # sweep.reuse: lm-eval --log_samples folders of pre / post
    pre_results: str | None = setting(
        None,
        "Score pre from lm-eval --log_samples outputs already in DIR (results_*.json, samples_<task>_*.jsonl) "
        "instead of evaluating it: refused unless they hold this sweep's tasks, docs, metrics, filters and prompt "
        "settings.",
        metavar="DIR",
        path="existing-folder",
    )
    post_results: str | None = setting(
        None,
        "Score post from lm-eval --log_samples outputs already in DIR, checked as --pre-results.",
        metavar="DIR",
        path="existing-folder",
    )
    # several methods compared in one run (sweep.compare): names, or {method: NAME, alphas/density/drop: ...}
    methods: list[str | dict[str, str | int | float | list[float]]] | None = setting(
        None, "Several methods compared in one run.", command_line=False, min_length=1
    )


def load_sweep_file(path: str | Path) -> dict:
    """A YAML sweep config with SweepSettings' keys (dashes or underscores), and `methods` (several methods
    compared in one run); unknown keys are an error."""
    path = Path(path)
    data = read_yaml(path)
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a mapping of sweep settings")
    settings = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in SETTINGS_KEYS and name != "methods":
            raise InputError(
                f"{path}: unknown key {key!r}{did_you_mean(name, (*SETTINGS_KEYS, 'methods'))} "
                f"(known: {', '.join(SETTINGS_KEYS)}, methods)"
            )
        settings[name] = value
    validate(SweepFile, settings, path)
    return {name: value for name, value in settings.items() if value is not None}


def settings_from_dict(data: dict) -> SweepSettings:
    """SweepSettings from merged config-file and flag values, naming the first missing setting."""
    required = [
        name
        for name, spec in SweepSettings.__dataclass_fields__.items()
        if spec.default is MISSING and spec.default_factory is MISSING and name != "include_path"
    ]
    missing = [name for name in required if data.get(name) in (None, [], ())]
    if missing:
        flag = "--" + missing[0].replace("_", "-")
        raise InputError(f"missing setting {missing[0]!r} (give {flag} or put it in the config file)")
    for grid, fixed in SECOND_AXES.items():  # a grid's values replace the fixed value in every row: never both
        if data.get(grid) is not None and data.get(fixed) is not None:
            raise InputError(
                f"{fixed} and {grid} both set {fixed} (--{fixed}, --{grid} or the config file): give "
                "a fixed value or a grid of values, not both"
            )
    data = dict(data)
    lm_eval = LmEvalSettings(**{name: data.pop(name) for name in LM_EVAL_KEYS if data.get(name) is not None})
    try:
        return SweepSettings(**{"include_path": None, **data, "lm_eval": lm_eval})
    except TypeError as error:
        raise InputError(f"sweep settings: {error}") from None
