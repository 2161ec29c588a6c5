"""The per-group search as one more sweep strategy: the scalar search first (its pick is the baseline every vector is
judged against), then Optuna over the vector space (sweep.vector) on the selection split only, then the vector's
pick set against the scalar pick on the report split with the paired bootstrap.

- Samplers (`--vector-search`): TPE (`tpe`, the default), CMA-ES (`cmaes`, started at the first start point) and
  selective revert (`revert`: each slot pre's (coefficient 0), the scalar pick's, or coefficient 1 (post itself for
  linear, slerp and task arithmetic): Layer Swapping, arXiv 2410.01335, puts chosen layers of post back to a
  reference, SafeMERGE, arXiv 2503.17239, chooses per layer between the fine-tuned and the merged model; TPE
  searches the combinations, and a combination met again is its saved point, scored once).
- Starts (`--vector-start`): the scalar pick's own vector is always the first trial, so the vector's selection
  score is never below the scalar pick's; `drift` adds one from post's drift profile (sweep.vector.drift_start).
- Storage: Optuna's SQLite file in the run folder (`search.db`), one study per scalar pick and space, and each
  trial's point in `vectors/`: a killed run resumes, its finished trials are not evaluated again and a trial cut
  off mid-way is scored and told from its stored parameters. A fresh sampler per trial, seeded by the sweep's seed
  and the number of trials done, makes the same command give the same vector, killed or not.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from mergekit_lite.errors import InputError
from mergekit_lite.merge import methods
from mergekit_lite.sweep.power import docs_needed
from mergekit_lite.sweep.result import TIE_TOLERANCE, pick
from mergekit_lite.sweep.scoring import PointResult, TaskRun, doc_splits, paired_bootstrap, summarise
from mergekit_lite.sweep.store import load_points, point_file, save_point
from mergekit_lite.sweep.strategies import Searched, SearchStrategy, SweepRun
from mergekit_lite.sweep.vector import (
    DEFAULT_TRIALS,
    STUDY_FILE,
    VECTORS_DIR,
    VectorSpace,
    drift_start,
    vector_config,
    vector_label,
    vector_space,
)

REVERT_CHOICES = {"pre": 0.0, "pick": None, "post": 1.0}  # None: the scalar pick's coefficient


@dataclass
class VectorOutcome:
    """What the search did: the space, every trial, the pick (best selection-split harmonic mean, ties to the
    earliest trial: the scalar pick's own vector first), its runs and config, and what it cost."""

    space: VectorSpace
    sampler: str
    scalar_label: str
    scalar_alpha: float
    trials: list[dict]
    pick: dict
    runs: list[TaskRun]
    config: object  # the pick's MergeConfig
    evaluated: int  # trials scored by this call (the others were resumed)
    docs_per_trial: int
    judged: dict = field(default_factory=dict)

    @property
    def chosen(self) -> bool:
        """Whether the vector is the pick: its selection-split harmonic mean beats the scalar pick's."""
        return bool(self.judged.get("chosen"))


class VectorSearch:
    """The scalar strategy, then the vector search from its pick."""

    def __init__(self, scalar: SearchStrategy):
        self.scalar = scalar

    def bar_points(self, sweep: SweepRun) -> int:
        return self.scalar.bar_points(sweep) + trial_count(sweep.settings)

    def run(self, sweep: SweepRun) -> Searched:
        searched = self.scalar.run(sweep)
        settings, runs = sweep.settings, sweep.runs
        baseline = runs["pre"]
        splits = doc_splits(settings, baseline)
        points = [
            summarise(label, alpha, runs[label], baseline, splits, settings.aggregation)
            for label, alpha in searched.plan
            if alpha is not None and label in runs
        ]
        best, _ = pick(points)  # the rule build_result applies: the scalar pick
        searched.vector = search(sweep, best, splits)
        return searched


def with_vector(strategy: SearchStrategy, settings) -> SearchStrategy:
    """The strategy itself, or, with --groups/--modules, the vector search after it."""
    return VectorSearch(strategy) if settings.groups or settings.modules else strategy


def trial_count(settings) -> int:
    return settings.trials or DEFAULT_TRIALS


def search(sweep: SweepRun, scalar: PointResult, splits) -> VectorOutcome:
    """Optuna's study over the vector space from the scalar pick, every trial scored on every doc and ranked on the
    selection split only."""
    import optuna

    settings, folder = sweep.settings, sweep.folder
    cell = sweep.found[scalar.label]
    space, coefficient = vector_space(settings), settings.coefficient
    low, high = min(settings.alphas), max(settings.alphas)
    sampler_name = settings.vector_search or "tpe"
    if sampler_name == "revert" and not methods.method(settings.method).pre_at_zero:
        raise InputError(f"--vector-search revert puts slots back to pre: {settings.method} at 0 is not pre")
    slots = space.slots
    starts = [[scalar.alpha] * len(slots)]
    if settings.vector_start == "drift":
        starts.append(drift_start(space, settings, scalar.alpha, low, high))
    if sampler_name == "revert":
        distributions = {slot: optuna.distributions.CategoricalDistribution(tuple(REVERT_CHOICES)) for slot in slots}
        first = [{slot: "pick" for slot in slots}]
    else:
        distributions = {slot: optuna.distributions.FloatDistribution(low, high) for slot in slots}
        first = [dict(zip(slots, start, strict=True)) for start in starts]

    def vector_of(params: dict) -> list[float]:
        if sampler_name == "revert":
            return [
                scalar.alpha if REVERT_CHOICES[params[slot]] is None else REVERT_CHOICES[params[slot]] for slot in slots
            ]
        return [float(params[slot]) for slot in slots]

    identity = settings.identity()
    (folder / VECTORS_DIR).mkdir(exist_ok=True)
    saved = load_points(folder, identity, VECTORS_DIR)
    baseline = sweep.runs["pre"]
    evaluated = []

    docs = sum(len(run.outcomes.correct) for run in baseline if run.outcomes is not None)

    def trial_point(params: dict) -> tuple[str, list[float], PointResult | None]:
        """A trial's label, vector and point (None when not saved yet)."""
        vector = vector_of(params)
        label = vector_label(vector_config(cell.config(), coefficient, space.spec(vector)))
        runs = saved.get(label)
        return label, vector, runs and summarise(label, None, runs, baseline, splits, settings.aggregation)

    def score(params: dict) -> float:
        label, vector, point = trial_point(params)
        if point is None:
            sweep.bar.set_postfix_str(f"vector trial {len(evaluated) + 1}: every doc ({docs})")
            config = vector_config(cell.config(), coefficient, space.spec(vector))
            runs = sweep.point_evaluator().merged(config)
            save_point(point_file(folder, label, VECTORS_DIR), identity, label, sum(vector) / len(vector), runs)
            saved[label] = runs
            evaluated.append(label)
            point = trial_point(params)[2]
        else:
            sweep.bar.update(sweep.n_tasks)
        return 0.0 if point.nonfinite else point.selection.harmonic_mean

    wanted = trial_count(settings)
    if sampler_name == "revert":
        wanted = min(wanted, len(REVERT_CHOICES) ** len(slots))
    sweep.bar.total = sweep.bar.n + wanted * sweep.n_tasks  # the scalar search may have resized it
    sweep.bar.refresh()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = f"sqlite:///{folder / STUDY_FILE}"
    name = study_name(settings, space, scalar, sampler_name, starts)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study = optuna.create_study(study_name=name, storage=storage, direction="maximize", load_if_exists=True)
        if not study.trials:
            for params in first:
                study.enqueue_trial(params)
        for stale in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            study.tell(stale.number, score(stale.params))  # cut off by a kill: scored from its stored parameters
        while True:
            done = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
            if len(done) >= wanted:
                break
            study = optuna.load_study(
                study_name=name, storage=storage, sampler=sampler(sampler_name, settings.seed, len(done), first[0])
            )
            trial = study.ask(distributions)
            study.tell(trial, score(trial.params))
    done = sorted(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)), key=lambda t: t.number)[
        :wanted
    ]
    trials = []
    for trial in done:
        label, vector, point = trial_point(trial.params)
        trials.append(
            {
                "number": trial.number,
                "label": label,
                "vector": dict(zip(slots, vector, strict=True)),
                "selection_harmonic_mean": trial.value,
                "nonfinite": point.nonfinite,
            }
        )
    finite = [trial for trial in trials if not trial["nonfinite"]] or trials
    top = max(trial["selection_harmonic_mean"] for trial in finite)
    best = next(trial for trial in finite if top - trial["selection_harmonic_mean"] <= TIE_TOLERANCE)
    config = vector_config(cell.config(), coefficient, space.spec(list(best["vector"].values())))
    return VectorOutcome(
        space,
        sampler_name,
        scalar.label,
        scalar.alpha,
        trials,
        best,
        saved[best["label"]],
        config,
        len(evaluated),
        docs,
    )


def sampler(name: str, seed: int, done: int, start: dict):
    """A fresh sampler for the next trial: TPE (over the slots' values, or revert's choices) seeded by the trials done
    (their history is in the storage), CMA-ES by the sweep's seed (its state is in the storage's trials)."""
    import optuna

    if name == "cmaes":
        return optuna.samplers.CmaEsSampler(x0=start, seed=seed, n_startup_trials=0, warn_independent_sampling=False)
    return optuna.samplers.TPESampler(seed=seed * 100003 + done, n_startup_trials=8, multivariate=True)


def study_name(settings, space: VectorSpace, scalar: PointResult, sampler_name: str, starts) -> str:
    """One study per scalar pick, space, sampler and start (a sweep with more points may pick another alpha)."""
    import hashlib
    import json

    key = json.dumps(
        {
            "scalar": scalar.label,
            "space": space.to_json(),
            "sampler": sampler_name,
            "starts": starts,
            "seed": settings.seed,
            "bounds": [min(settings.alphas), max(settings.alphas)],
        },
        sort_keys=True,
    )
    return "vector-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def judge(outcome: VectorOutcome, result) -> dict:
    """The vector's pick against the scalar pick: chosen on the selection split (the vector is the pick only when its
    selection-split harmonic mean beats the scalar pick's), then both on the report split with the paired bootstrap
    of the difference (vector - scalar). results.json's `vector`."""
    import numpy as np

    settings = result.settings
    point = summarise(outcome.pick["label"], None, outcome.runs, result.pre.tasks, result.splits, settings.aggregation)
    scalar = result.best
    chosen = not point.nonfinite and point.selection.harmonic_mean > scalar.selection.harmonic_mean + TIE_TOLERANCE
    difference = {name: getattr(point.report, name) - getattr(scalar.report, name) for name in ("old", "new")}
    difference["harmonic_mean"] = point.harmonic_mean - scalar.harmonic_mean
    intervals = {}
    if settings.bootstrap:
        draws = paired_bootstrap(
            [scalar, point], result.splits, settings.aggregation, settings.bootstrap, settings.seed
        )
        tail = (1 - settings.confidence) / 2 * 100
        for position, name in enumerate(("old", "new", "harmonic_mean")):
            spread = draws[:, 1, position] - draws[:, 0, position]
            intervals[name] = np.percentile(spread, [tail, 100 - tail]).tolist()
    separation = docs_needed(point, scalar, result.splits, settings.aggregation) if intervals else None
    low = intervals.get("harmonic_mean", [None])[0]
    beat = chosen and (low > 0 if low is not None else difference["harmonic_mean"] > 0)
    if not chosen:
        verdict = (
            "no vector beat the scalar pick on the selection split: the pick stays one coefficient "
            f"({settings.coefficient} {scalar.alpha!r})"
        )
    elif beat:
        verdict = (
            f"the vector beat the scalar pick on the report split: harmonic mean {difference['harmonic_mean']:+.4f}"
            + (f", interval [{low:+.4f}, {intervals['harmonic_mean'][1]:+.4f}] above 0" if low is not None else "")
        )
    else:
        shown = intervals.get("harmonic_mean")
        verdict = (
            "the vector did not beat one coefficient: on the report split its harmonic mean differs from the scalar "
            f"pick's by {difference['harmonic_mean']:+.4f}"
        )
        if shown and shown[1] < 0:
            verdict += (
                f" (interval [{shown[0]:+.4f}, {shown[1]:+.4f}] below 0): the extra capacity fit the selection docs"
            )
        elif shown:
            verdict += (
                f" (interval [{shown[0]:+.4f}, {shown[1]:+.4f}] holds 0: the report docs cannot tell them apart; "
                f"{separation.text('the scalar pick', 'the vector')})"
            )
    outcome.judged = {
        "chosen": chosen,
        "beat_scalar": beat,
        "verdict": verdict,
        "space": outcome.space.to_json(),
        "coefficient": settings.coefficient,
        "search": {
            "sampler": outcome.sampler,
            "start": settings.vector_start or "scalar",
            "trials": len(outcome.trials),
            "evaluated": outcome.evaluated,
            "docs_per_trial": outcome.docs_per_trial,
            "selection_only": True,
        },
        "scalar": {
            "label": scalar.label,
            "alpha": scalar.alpha,
            "selection_harmonic_mean": scalar.selection.harmonic_mean,
            "old": scalar.old,
            "new": scalar.new,
            "harmonic_mean": scalar.harmonic_mean,
        },
        "pick": {
            "label": outcome.pick["label"],
            "coefficients": outcome.pick["vector"],
            "selection_harmonic_mean": point.selection.harmonic_mean,
            "old": point.old,
            "new": point.new,
            "harmonic_mean": point.harmonic_mean,
        },
        "difference": difference,
        "intervals": intervals,
        "docs_to_separate": separation.to_json() if separation else None,
        "trials": outcome.trials,
    }
    return outcome.judged


def chosen_merge(outcome: VectorOutcome, settings, folder) -> tuple[object, list[tuple[str, str]]]:
    """The merge the sweep picked (the vector when chosen on the selection split, else the scalar pick's uniform
    vector, the same merge), written as a mergekit config in the run folder; and the model card's section."""
    import yaml

    from mergekit_lite.io.outputs import write_atomic
    from mergekit_lite.sweep.vector import MERGEKIT_FILE, mergekit_config, vector_card

    config = outcome.config
    if not outcome.chosen:
        uniform = [outcome.scalar_alpha] * len(outcome.space.slots)
        config = vector_config(config, settings.coefficient, outcome.space.spec(uniform))
    text = yaml.safe_dump(mergekit_config(config, settings), sort_keys=False)
    write_atomic(folder / MERGEKIT_FILE, text)
    return config, [vector_card({"vector": outcome.judged})]
