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
  and the number of trials asked before, makes the same command give the same vector, killed or not.
- Cheap first (`--vector-prune SHARE`): each trial scored first on probe docs (probe mode's plans and estimator,
  sweep.adaptive), its estimate reported to Optuna's median pruner at step 0; a pruned trial is never scored on
  every doc and never the pick. The decision is stored with the trial (a resumed batch keeps it), the probe in
  `probes/`.
- Batches (`--trial-batch B`, `--ray`): B trials asked at once, their merges scored here one after another or in
  parallel on Ray actors (sweep.distributed), told in trial order once the batch is done; a batch sees only the
  trials told before it, so the same seed and B give the same vector with or without Ray.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace

from mergekit_lite import interrupts
from mergekit_lite.errors import InputError
from mergekit_lite.merge import methods
from mergekit_lite.sweep.adaptive import on_pre_keys, probe_plans, probe_samples
from mergekit_lite.sweep.power import docs_needed
from mergekit_lite.sweep.result import TIE_TOLERANCE, pick
from mergekit_lite.sweep.scoring import PointResult, TaskRun, doc_splits, paired_bootstrap, summarise
from mergekit_lite.sweep.search import estimate_scores
from mergekit_lite.sweep.store import PROBES_DIR, load_points, point_file, probe_identity, save_point
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
PRUNED_ATTR = "pruned_after_probe"  # the pruner's decision on a trial, stored so a resumed batch keeps it
PRUNE_STARTUP = 4  # trials finished on every doc before the pruner stops any (the starts among them)


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
    evaluated: int  # trials scored on every doc by this call (the others were resumed)
    docs_per_trial: int  # every doc
    judged: dict = field(default_factory=dict)
    probed: int = 0  # trials scored on probe docs by this call (--vector-prune)
    probe_docs: int = 0  # probe docs a trial (--vector-prune)
    batch: int = 1  # trials asked at once
    ray: bool = False

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
    """Optuna's study over the vector space from the scalar pick, every trial kept scored on every doc and ranked on
    the selection split only; with --ray, each batch's merges on the actors."""
    settings = sweep.settings
    wanted = trial_count(settings)
    if settings.ray is None:
        return run_search(sweep, scalar, splits, SerialTrials(sweep), settings.trial_batch or 1)
    from mergekit_lite.sweep.distributed import ray_actors

    with ray_actors(settings, settings.trial_batch or wanted, settings.ray) as actors:
        return run_search(sweep, scalar, splits, RayTrials(sweep, actors), settings.trial_batch or len(actors))


class SerialTrials:
    """Trials' merges scored here, one after another (the evaluator moves the progress bar)."""

    def __init__(self, sweep: SweepRun):
        self.sweep = sweep

    def merged(self, jobs: list[tuple[object, dict | None]]) -> list[list[TaskRun]]:
        return [self.sweep.point_evaluator().merged(config, samples) for config, samples in jobs]


class RayTrials:
    """Trials' merges scored in parallel on the sweep's Ray actors, their runs returned in the order asked."""

    def __init__(self, sweep: SweepRun, actors: list):
        self.sweep, self.actors = sweep, actors

    def merged(self, jobs: list[tuple[object, dict | None]]) -> list[list[TaskRun]]:
        from ray.util import ActorPool

        interrupts.check()
        pool, runs = ActorPool(self.actors), []
        for done in pool.map(lambda actor, job: actor.merged.remote(job[0].to_dict(), job[1]), jobs):
            self.sweep.bar.update(self.sweep.n_tasks)
            runs.append(done)
        return runs


@dataclass
class CheapFirst:
    """--vector-prune: the probe docs every trial is scored on first (probe mode's plans: where pre and post disagree
    on the selection split, plus this seeded share of the rest), and Optuna's median pruner over their estimate of the
    selection harmonic mean. [Optuna's MedianPruner: a trial below the median of the finished trials at the same step
    stops; successive halving (Jamieson & Talwalkar 2016) with one rung of docs]"""

    rate: float
    plans: dict
    samples: dict
    groups: dict
    pre: dict
    docs: int  # probe docs a trial

    def estimate(self, runs: list[TaskRun], aggregation: str) -> float:
        observed = {run.task: run.outcomes.correct for run in runs}
        return estimate_scores(self.plans, self.groups, observed, aggregation).harmonic_mean

    def keyed(self, runs: list[TaskRun]) -> list[TaskRun]:
        """A probe's runs keyed as pre's full runs, marked when their logits were not finite."""
        return [
            replace(on_pre_keys(run, self.samples[run.group][run.task], self.pre[run.task]), nonfinite=run.nonfinite)
            for run in runs
            if run.task in self.plans
        ]


def cheap_first(settings, runs: dict, splits) -> CheapFirst | None:
    if settings.vector_prune is None:
        return None
    plans = probe_plans(settings, runs, splits, settings.vector_prune)
    baseline = runs["pre"]
    return CheapFirst(
        settings.vector_prune,
        plans,
        probe_samples(plans, baseline),
        {run.task: run.group for run in baseline},
        {run.task: run.outcomes for run in baseline},
        sum(len(plan.scored) for plan in plans.values()),
    )


def run_search(sweep: SweepRun, scalar: PointResult, splits, trials_on, batch: int) -> VectorOutcome:
    """The study, asked `batch` trials at a time: each batch probed (with --vector-prune), the pruner's decisions
    made and stored, the kept ones scored on every doc, then told in trial order. A batch's trials see only the
    trials told before it, so the same seed and batch give the same vector here or on Ray, killed or not."""
    study = VectorStudy(sweep, scalar, splits, trials_on, batch)
    return study.outcome(study.run())


def _score(point: PointResult) -> float:
    """What Optuna maximises: the selection split's harmonic mean; a merge with non-finite logits scores 0."""
    return 0.0 if point.nonfinite else point.selection.harmonic_mean


class VectorStudy:
    """One run's Optuna study of coefficient vectors and what it has scored: the vectors saved on every doc
    (vectors/), the probes of cheap-first trials (probes/), and the evaluations this process ran."""

    def __init__(self, sweep: SweepRun, scalar: PointResult, splits, trials_on, batch: int):
        import optuna

        settings = sweep.settings
        self.sweep, self.scalar, self.splits, self.trials_on, self.batch = sweep, scalar, splits, trials_on, batch
        self.settings, self.folder = settings, sweep.folder
        self.cell = sweep.found[scalar.label]
        self.space, self.coefficient = vector_space(settings), settings.coefficient
        low, high = min(settings.alphas), max(settings.alphas)
        self.sampler_name = settings.vector_search or "tpe"
        if self.sampler_name == "revert" and not methods.method(settings.method).pre_at_zero:
            raise InputError(f"--vector-search revert puts slots back to pre: {settings.method} at 0 is not pre")
        self.slots = slots = self.space.slots
        self.starts = [[scalar.alpha] * len(slots)]
        if settings.vector_start == "drift":
            self.starts.append(drift_start(self.space, settings, scalar.alpha, low, high))
        if self.sampler_name == "revert":
            self.distributions = {
                slot: optuna.distributions.CategoricalDistribution(tuple(REVERT_CHOICES)) for slot in slots
            }
            self.first = [{slot: "pick" for slot in slots}]
        else:
            self.distributions = {slot: optuna.distributions.FloatDistribution(low, high) for slot in slots}
            self.first = [dict(zip(slots, start, strict=True)) for start in self.starts]
        self.identity = settings.identity()
        (self.folder / VECTORS_DIR).mkdir(exist_ok=True)
        self.saved = load_points(self.folder, self.identity, VECTORS_DIR)
        self.baseline = sweep.runs["pre"]
        self.cheap = cheap_first(settings, sweep.runs, splits)
        self.probe_id = {**probe_identity(settings), "vector_prune": settings.vector_prune}
        if self.cheap is not None:
            (self.folder / PROBES_DIR).mkdir(exist_ok=True)
        self.probed = load_points(self.folder, self.probe_id, PROBES_DIR) if self.cheap is not None else {}
        self.evaluated, self.probes_run = [], []
        self.docs = sum(len(run.outcomes.correct) for run in self.baseline if run.outcomes is not None)
        if self.sampler_name == "revert":
            self.wanted = min(trial_count(settings), len(REVERT_CHOICES) ** len(slots))
        else:
            self.wanted = trial_count(settings)

    def vector_of(self, params: dict) -> list[float]:
        if self.sampler_name == "revert":
            return [
                self.scalar.alpha if REVERT_CHOICES[params[slot]] is None else REVERT_CHOICES[params[slot]]
                for slot in self.slots
            ]
        return [float(params[slot]) for slot in self.slots]

    def config_of(self, params: dict):
        return vector_config(self.cell.config(), self.coefficient, self.space.spec(self.vector_of(params)))

    def trial_point(self, params: dict) -> tuple[str, list[float], PointResult | None]:
        """A trial's label, vector and point (None when not saved yet)."""
        vector = self.vector_of(params)
        label = vector_label(self.config_of(params))
        runs = self.saved.get(label)
        return (
            label,
            vector,
            runs and summarise(label, None, runs, self.baseline, self.splits, self.settings.aggregation),
        )

    def evaluate(self, batch_trials: list, store: dict, samples, save) -> None:
        """The batch's merges not saved yet in `store`, scored (on `samples`, or every doc) and saved."""
        todo = {}
        for trial in batch_trials:
            label = self.trial_point(trial.params)[0]
            if label in store or label in todo:
                self.sweep.bar.update(self.sweep.n_tasks)
            else:
                todo[label] = trial
        if not todo:
            return
        what = "every doc" if samples is None else "probe docs"
        numbers = ", ".join(str(trial.number + 1) for trial in todo.values())
        named = f"vector trial{'s' * (len(todo) > 1)} {numbers}"
        self.sweep.bar.set_postfix_str(f"{named}: {what} ({self.docs if samples is None else self.cheap.docs})")
        jobs = [(self.config_of(trial.params), samples) for trial in todo.values()]
        for (label, trial), runs in zip(todo.items(), self.trials_on.merged(jobs), strict=True):
            save(label, trial, runs)

    def save_full(self, label: str, trial, runs: list[TaskRun]) -> None:
        vector = self.vector_of(trial.params)
        path = point_file(self.folder, label, VECTORS_DIR)
        save_point(path, self.identity, label, sum(vector) / len(vector), runs)
        self.saved[label] = runs
        self.evaluated.append(label)

    def save_probe(self, label: str, trial, runs: list[TaskRun]) -> None:
        scored = self.cheap.keyed(runs)
        vector = self.vector_of(trial.params)
        path = point_file(self.folder, label, PROBES_DIR)
        save_point(path, self.probe_id, label, sum(vector) / len(vector), scored)
        self.probed[label] = scored
        self.probes_run.append(label)

    def decide(self, study, frozen) -> bool:
        """Whether the pruner stops this trial after its probe: reported and stored once, so a rerun keeps it."""
        import optuna

        if PRUNED_ATTR in frozen.user_attrs:
            return frozen.user_attrs[PRUNED_ATTR]
        trial = optuna.trial.Trial(study, frozen._trial_id)
        runs = self.probed[self.trial_point(frozen.params)[0]]
        if 0 not in frozen.intermediate_values:
            nonfinite = any(run.nonfinite for run in runs)
            trial.report(0.0 if nonfinite else self.cheap.estimate(runs, self.settings.aggregation), 0)
        stop = bool(trial.should_prune())
        trial.set_user_attr(PRUNED_ATTR, stop)
        return stop

    def run_batch(self, study, batch_trials: list) -> None:
        """One batch: probed and pruned (cheap-first), the kept trials scored on every doc, all told in order."""
        import optuna

        cheap, bar = self.cheap, self.sweep.bar
        batch_trials = sorted(batch_trials, key=lambda trial: trial.number)
        kept = batch_trials
        if cheap is not None:
            self.evaluate(batch_trials, self.probed, cheap.samples, self.save_probe)
            fresh = {trial.number: trial for trial in study.get_trials(deepcopy=False)}
            stops = {trial.number: self.decide(study, fresh[trial.number]) for trial in batch_trials}
            kept = [trial for trial in batch_trials if not stops[trial.number]]
            bar.update(self.sweep.n_tasks * (len(batch_trials) - len(kept)))  # no full evaluation for these
        self.evaluate(kept, self.saved, None, self.save_full)
        kept_numbers = {trial.number for trial in kept}
        for trial in batch_trials:
            if trial.number in kept_numbers:
                study.tell(trial.number, _score(self.trial_point(trial.params)[2]))
            else:
                study.tell(trial.number, state=optuna.trial.TrialState.PRUNED)
            probe = f"{cheap.docs} probe docs" if cheap else ""
            full = "" if trial.number not in kept_numbers else f"{' + ' if probe else ''}{self.docs} docs"
            evaluations = (cheap is not None) + (trial.number in kept_numbers)
            bar.set_postfix_str(
                f"vector trial {trial.number + 1}: {probe}{full}, {evaluations} evaluation{'s' * (evaluations > 1)}"
                + ("" if trial.number in kept_numbers else " (pruned)")
            )

    def run(self):
        """The study from its storage in the run folder, asked and told until `wanted` trials are finished (a
        batch a kill cut off is finished first)."""
        import optuna

        settings, sweep, batch = self.settings, self.sweep, self.batch
        stages = 2 if self.cheap is not None else 1
        sweep.bar.total = sweep.bar.n + self.wanted * sweep.n_tasks * stages  # the scalar search may have resized it
        sweep.bar.refresh()
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        storage = f"sqlite:///{self.folder / STUDY_FILE}"
        name = study_name(settings, self.space, self.scalar, self.sampler_name, self.starts, batch)
        pruner = optuna.pruners.MedianPruner(n_startup_trials=max(len(self.first), PRUNE_STARTUP), n_warmup_steps=0)
        waiting, running = optuna.trial.TrialState.WAITING, optuna.trial.TrialState.RUNNING
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            study = optuna.create_study(
                study_name=name, storage=storage, direction="maximize", load_if_exists=True, pruner=pruner
            )
            if not study.trials:
                for params in self.first:
                    study.enqueue_trial(params)
            while True:
                trials = study.get_trials(deepcopy=False)
                asked = sum(trial.state != waiting for trial in trials)
                pending = [trial for trial in trials if trial.state == running]  # a batch cut off by a kill
                if not pending and asked >= self.wanted:
                    return study
                while asked < self.wanted and (not pending or asked % batch):
                    study = optuna.load_study(
                        study_name=name,
                        storage=storage,
                        sampler=sampler(self.sampler_name, settings.seed, asked, self.first[0]),
                        pruner=pruner,
                    )
                    with interrupts.deferred():  # a trial asked whole: a Ctrl-C never leaves one without its params
                        pending.append(study.ask(self.distributions))
                    asked += 1
                    if asked % batch == 0:
                        break
                self.run_batch(study, pending)

    def outcome(self, study) -> VectorOutcome:
        """The finished trials as a table (each one's docs and evaluations spent), and the best on the selection
        split (ties to the earliest)."""
        import optuna

        cheap = self.cheap
        finished = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
        done = sorted(study.get_trials(deepcopy=False, states=finished), key=lambda t: t.number)[: self.wanted]
        trials, scored, probed_before = [], set(), set()
        for trial in done:
            label, vector, point = self.trial_point(trial.params)
            pruned = trial.state == optuna.trial.TrialState.PRUNED
            probe_cost = int(cheap is not None and label not in probed_before)  # a vector met again is not scored
            full_cost = int(not pruned and label not in scored)
            probed_before.add(label)
            scored |= set() if pruned else {label}
            trials.append(
                {
                    "number": trial.number,
                    "label": label,
                    "vector": dict(zip(self.slots, vector, strict=True)),
                    "selection_harmonic_mean": None if pruned else trial.value,
                    "probe_harmonic_mean": trial.intermediate_values.get(0),
                    "pruned": pruned,
                    "docs": probe_cost * (cheap.docs if cheap else 0) + full_cost * self.docs,
                    "evaluations": probe_cost + full_cost,
                    "nonfinite": None if pruned else point.nonfinite,
                }
            )
        complete = [trial for trial in trials if not trial["pruned"]]
        finite = [trial for trial in complete if not trial["nonfinite"]] or complete
        top = max(trial["selection_harmonic_mean"] for trial in finite)
        best = next(trial for trial in finite if top - trial["selection_harmonic_mean"] <= TIE_TOLERANCE)
        config = vector_config(self.cell.config(), self.coefficient, self.space.spec(list(best["vector"].values())))
        return VectorOutcome(
            self.space,
            self.sampler_name,
            self.scalar.label,
            self.scalar.alpha,
            trials,
            best,
            self.saved[best["label"]],
            config,
            len(self.evaluated),
            self.docs,
            probed=len(self.probes_run),
            probe_docs=cheap.docs if cheap else 0,
            batch=self.batch,
            ray=self.settings.ray is not None,
        )


def sampler(name: str, seed: int, done: int, start: dict):
    """A fresh sampler for the next trial: TPE (over the slots' values, or revert's choices) seeded by the trials
    asked before it (their history is in the storage), CMA-ES by the sweep's seed (its state is in the storage's
    trials)."""
    import optuna

    if name == "cmaes":
        return optuna.samplers.CmaEsSampler(x0=start, seed=seed, n_startup_trials=0, warn_independent_sampling=False)
    return optuna.samplers.TPESampler(seed=seed * 100003 + done, n_startup_trials=8, multivariate=True)


def study_name(settings, space: VectorSpace, scalar: PointResult, sampler_name: str, starts, batch: int) -> str:
    """One study per scalar pick, space, sampler, start, batch and probe share (a sweep with more points may pick
    another alpha)."""
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
            **({"batch": batch} if batch > 1 else {}),
            **({"vector_prune": settings.vector_prune} if settings.vector_prune is not None else {}),
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
            "batch": outcome.batch,
            "ray": outcome.ray,
            **spent(outcome, settings),
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


def spent(outcome: VectorOutcome, settings) -> dict:
    """What the trials cost, in docs scored and evaluations (a merge scored on probe docs is one, on every doc one),
    against every trial on every doc; with --vector-prune, the probe and the pruner's count."""
    trials = outcome.trials
    docs = sum(trial["docs"] for trial in trials)
    cost = {
        "docs": docs,
        "evaluations": sum(trial["evaluations"] for trial in trials),
        "docs_without_pruning": len({trial["label"] for trial in trials}) * outcome.docs_per_trial,
    }
    if settings.vector_prune is None:
        return cost
    return {
        **cost,
        "prune": {
            "pruner": "median",
            "probe": settings.vector_prune,
            "probe_docs": outcome.probe_docs,
            "pruned": sum(trial["pruned"] for trial in trials),
            "startup_trials": PRUNE_STARTUP,
            "probed": outcome.probed,
        },
    }


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
