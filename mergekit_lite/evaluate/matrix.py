"""The example-forgetting matrix across fine-tunes of one model, its low rank, its completion, and replay chosen
by prediction, after "Demystifying Language Model Forgetting with Low-Rank Example Associations" (Jin & Ren).

Z has one row per fine-tune of PRE and one column per upstream doc (every doc of PRE's lm-eval log):
  - value "outcome": 1 where PRE was right and the fine-tune wrong, else 0 (the forgetting map's transition);
    only the docs PRE got right can be forgotten (`forgettable`), the others are 0 in every row;
  - value "logprob": the drop of the gold answer's log-likelihood (PRE's minus the fine-tune's), the paper's
    continuous Z (the increase of an example's loss, §3).
R^2 of the rank-r truncated SVD is 1 - SSE/SST with SST around the matrix's grand mean (the authors'
fit_utils.r2_score). Completion (§4) leaves one row out, observes K of its entries and predicts the rest from
the other rows; replay (§5) draws docs with weights softmax(score / T).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from threadpoolctl import threadpool_limits

from mergekit_lite.errors import InputError
from mergekit_lite.evaluate.outcomes import LoadedRun, SampleOutcomes
from mergekit_lite.evaluate.trajectory import doc_order

VALUES = ("outcome", "logprob")
METHODS = ("additive", "knn", "mf")
BASELINES = ("random", "per-doc mean")
STRATEGIES = ("sample", "top", "random")
MF_RANK = 5  # the authors' SVD rank for completion (run_matrix_completion.py)


# --- the matrix ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Docs:
    """The columns of Z: PRE's docs in task and lm-eval doc order, and what PRE scored on each."""

    tasks: np.ndarray  # str, one per doc
    keys: np.ndarray  # str: the sample key (doc_hash, else doc_id)
    doc_ids: np.ndarray  # int64, -1 where the log has none
    pre_correct: np.ndarray  # bool

    def __len__(self) -> int:
        return len(self.keys)

    def same_as(self, other: Docs) -> bool:
        return np.array_equal(self.tasks, other.tasks) and np.array_equal(self.keys, other.keys)


@dataclass
class ForgettingMatrix:
    """Z (float32, fine-tunes x docs) with its columns, row labels and value kind."""

    z: np.ndarray
    docs: Docs
    rows: list[str]
    value: str

    @property
    def binary(self) -> bool:
        return self.value == "outcome"

    @property
    def forgettable(self) -> np.ndarray:
        """The docs a fine-tune can forget: those PRE got right (outcome), every doc (logprob)."""
        return self.docs.pre_correct if self.binary else np.ones(len(self.docs), dtype=bool)


def seed_of(outcomes: dict[str, SampleOutcomes], wanted: str | None = None) -> str:
    """A matrix is one seed: the wanted one (PRE's), else the only one, else the first by label."""
    return wanted if wanted in outcomes or (wanted is not None and len(outcomes) != 1) else sorted(outcomes)[0]


def pre_docs(pre: LoadedRun) -> tuple[Docs, dict[str, SampleOutcomes]]:
    """PRE's docs (every scored task, one seed) and the per-task outcomes they came from (with its seed)."""
    if not pre.outcomes:
        raise InputError(
            "pre: no task could be scored (" + "; ".join(f"{t}: {r}" for t, r in pre.skipped.items()) + ")"
        )
    chosen = {task: pre.outcomes[task][seed_of(pre.outcomes[task])] for task in sorted(pre.outcomes)}
    tasks, keys, doc_ids, correct = [], [], [], []
    for task, outcomes in chosen.items():
        for key in doc_order(outcomes):
            tasks.append(task)
            keys.append(key)
            doc_ids.append(outcomes.doc_ids.get(key, -1))
            correct.append(outcomes.correct[key])
    return Docs(
        np.array(tasks, dtype=str),
        np.array(keys, dtype=str),
        np.array(doc_ids, dtype=np.int64),
        np.array(correct, dtype=bool),
    ), chosen


def pre_seeds(pre: LoadedRun) -> dict[str, str]:
    """The seed of each task the matrix reads from PRE (and then from every post)."""
    return {task: seed_of(runs) for task, runs in pre.outcomes.items()}


def _gold_ll(outcomes: SampleOutcomes, key: str, where: str) -> float:
    text = outcomes.texts.get(key)
    if text is None or text.gold_loglikelihood is None:
        raise InputError(
            f"{where}: task {outcomes.task!r} doc {key!r}: lm-eval logged no log-likelihood of the gold "
            "answer (a generative task?); use --value outcome"
        )
    if not math.isfinite(text.gold_loglikelihood):  # NaN never gets here (records.py reads it as not logged)
        raise InputError(
            f"{where}: task {outcomes.task!r} doc {key!r}: the gold answer's log-likelihood is "
            f"{text.gold_loglikelihood} (a drop from or to it is no number the matrix can hold); use --value outcome"
        )
    return text.gold_loglikelihood


def forgetting_row(
    pre: dict[str, SampleOutcomes],
    post: LoadedRun,
    label: str,
    value: str,
    partial: bool = False,
    pre_seeds: dict[str, str] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """One fine-tune's row over PRE's docs, and which entries its log covers. A post must cover exactly PRE's
    tasks and docs; a probe (`partial`) covers a subset of them."""
    values, covered, pre_seeds = [], [], pre_seeds or {}
    missing_tasks = sorted(set(pre) - set(post.outcomes)) if not partial else []
    extra_tasks = sorted(set(post.outcomes) - set(pre))
    if missing_tasks or extra_tasks:
        raise InputError(
            f"{label}: its tasks differ from pre's ("
            + ", ".join([f"missing {t}" for t in missing_tasks] + [f"not in pre: {t}" for t in extra_tasks])
            + ")"
        )
    for task, reference in pre.items():
        runs = post.outcomes.get(task, {})
        seed = seed_of(runs, pre_seeds.get(task)) if runs else None
        if seed is not None and seed not in runs:
            raise InputError(f"{label}: task {task!r} has no run with pre's seed {pre_seeds.get(task)!r}")
        outcomes = runs.get(seed)
        keys = doc_order(reference)
        theirs = set(outcomes.correct) if outcomes else set()
        if outcomes and (theirs - set(keys) or (not partial and theirs != set(keys))):
            raise InputError(
                f"{label}: task {task!r} holds other docs than pre's ({len(theirs - set(keys))} not in "
                f"pre, {len(set(keys) - theirs)} of pre's missing)"
            )
        for key in keys:
            seen = key in theirs
            covered.append(seen)
            if not seen:
                values.append(0.0)
            elif value == "outcome":
                values.append(float(reference.correct[key] and not outcomes.correct[key]))
            else:
                values.append(_gold_ll(reference, key, "pre") - _gold_ll(outcomes, key, label))
    return np.array(values, dtype=np.float32), np.array(covered, dtype=bool)


def build_matrix(
    pre: LoadedRun, load_post: Callable[[str], LoadedRun], posts: Sequence[str], value: str
) -> ForgettingMatrix:
    """Z from PRE and each post, one post loaded at a time (only its row is kept: 100 posts x 100k docs stay a
    float32 matrix, not 100 logs in memory)."""
    docs, chosen = pre_docs(pre)
    if value == "logprob":
        for outcomes in chosen.values():
            for key in outcomes.correct:
                _gold_ll(outcomes, key, "pre")
    z, seeds = np.empty((len(posts), len(docs)), dtype=np.float32), pre_seeds(pre)
    for index, post in enumerate(posts):
        z[index], _ = forgetting_row(chosen, load_post(post), post, value, pre_seeds=seeds)
    return ForgettingMatrix(z, docs, list(posts), value)


# --- low rank ------------------------------------------------------------------------------------------


def r2_by_rank(z: np.ndarray) -> list[float]:
    """R^2 of the rank-r truncated SVD for r = 1 .. min(M, N): 1 - SSE/SST, SST around the grand mean
    (fit_utils.r2_score); SSE of rank r is the sum of the squared singular values past r (Eckart-Young), from
    the eigenvalues of Z Z^T in float64 (M x M, cheap for 100k docs)."""
    z64 = z.astype(np.float64)
    sst = float(((z64 - z64.mean()) ** 2).sum())
    squared = np.clip(np.sort(np.linalg.eigvalsh(z64 @ z64.T))[::-1][: min(z.shape)], 0, None)
    if sst == 0:
        return [1.0] * len(squared)
    left = squared.sum() - np.cumsum(squared)
    return [float(1 - max(sse, 0.0) / sst) for sse in left]


# --- completion ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class History:
    """What some rows of Z (`rows`) say about each doc: the column means, and the top right singular vectors of
    the column-centred rows scaled so a row's loadings have unit variance (for MF), and the noise left."""

    z: np.ndarray
    rows: np.ndarray
    means: np.ndarray
    factors: np.ndarray  # rank x N
    noise: float


@dataclass(frozen=True)
class Gram:
    """Z Z^T and the column sums in float64, computed once: every leave-one-out history comes from them at
    O(M^2 + rank M N), not O(M^2 N) per held-out row."""

    z: np.ndarray
    gram: np.ndarray
    column_sums: np.ndarray

    @classmethod
    def of(cls, z: np.ndarray) -> Gram:
        return cls(z, _gram(z), z.sum(axis=0, dtype=np.float64))

    def history(self, rows: np.ndarray, rank: int = MF_RANK) -> History:
        """The history of `rows`: the Gram matrix of the centred rows is G - G1/m 1^T - 1 1^TG/m + 1^TG1/m^2,
        its eigenvectors give the left singular vectors, one product with Z the doc factors."""
        m = len(rows)
        sub = self.gram[np.ix_(rows, rows)]
        row_sums = sub.sum(axis=1) / m
        centred = sub - row_sums[:, None] - row_sums[None, :] + sub.sum() / m**2
        eigenvalues, vectors = np.linalg.eigh((centred + centred.T) / 2)
        order = np.argsort(eigenvalues)[::-1]
        eigenvalues, vectors = np.clip(eigenvalues[order], 0, None), vectors[:, order]
        left_out = np.setdiff1d(np.arange(len(self.z)), rows)
        means = (self.column_sums - self.z[left_out].sum(axis=0, dtype=np.float64)) / m
        rank = max(0, min(rank, int((eigenvalues > 1e-9 * max(eigenvalues.sum(), 1e-300)).sum())))
        weights = np.zeros((rank, len(self.z)), dtype=self.z.dtype)
        weights[:, rows] = vectors[:, :rank].T
        projected = (weights @ self.z).astype(np.float64) - vectors[:, :rank].sum(axis=0)[:, None] * means
        factors = projected / np.sqrt(m)  # (u^T C) / sqrt(m) = s v^T / sqrt(m): loadings u sqrt(m) of unit variance
        cells = m * self.z.shape[1]
        noise = float(eigenvalues[rank:].sum() / cells) if cells else 0.0
        total = float(eigenvalues.sum() / cells) if cells else 0.0
        return History(self.z, rows, means, factors, max(noise, 1e-6 * total, 1e-12))


def _gram(z: np.ndarray) -> np.ndarray:
    """Z Z^T in float64, a block of docs at a time (no float64 copy of the whole of Z)."""
    gram = np.zeros((len(z), len(z)))
    for start in range(0, z.shape[1], 16384):
        block = z[:, start : start + 16384].astype(np.float64)
        gram += block @ block.T
    return gram


def history_of(z: np.ndarray, rank: int = MF_RANK) -> History:
    """The history of all rows of `z`."""
    return Gram.of(z).history(np.arange(len(z)), rank)


def predict_additive(history: History, observed: np.ndarray, values: np.ndarray, binary: bool) -> np.ndarray:
    """Row + column effects (the authors' BaselineOnly): the doc's mean over the history plus the new row's mean
    offset on its observed docs."""
    offset = float(np.mean(values - history.means[observed]))
    scores = history.means + offset
    return np.clip(scores, 0, 1) if binary else scores


def predict_knn(history: History, observed: np.ndarray, values: np.ndarray, binary: bool) -> np.ndarray:
    """Row-based KNN: the ceil(sqrt(M)) rows closest to the new row on its observed docs (mean squared
    difference), averaged with weights 1 / (1 + msd) as surprise's KNNBasic weighs MSD similarity."""
    msd = ((history.z[np.ix_(history.rows, observed)] - values) ** 2).mean(axis=1)
    k = int(np.ceil(np.sqrt(len(history.rows))))
    nearest = np.argsort(msd, kind="stable")[:k]
    weights = 1 / (1 + msd[nearest])
    return weights @ history.z[history.rows[nearest]].astype(np.float64) / weights.sum()


def _logit(p: np.ndarray) -> np.ndarray:
    return np.log(p) - np.log1p(-p)


def predict_mf(history: History, observed: np.ndarray, values: np.ndarray, binary: bool) -> np.ndarray:
    """Matrix factorisation: the docs' factors come from the history (its truncated SVD), the new row's loadings
    from its observed docs under a unit Gaussian prior: the posterior mean (ridge) for continuous values, and
    for 0/1 values a logistic model around each doc's smoothed logit mean (Newton's method), as logistic MF
    predicts sigmoid(w . h)."""
    h = history.factors[:, observed]
    rank = len(h)
    if not binary:
        if not rank:
            return history.means.copy()
        residual = values - history.means[observed]
        loadings = np.linalg.solve(h @ h.T / history.noise + np.eye(rank), h @ residual / history.noise)
        return history.means + loadings @ history.factors
    m = len(history.rows)
    offsets = _logit((history.means * m + 0.5) / (m + 1))
    h_logit, prior = history.factors * 4, 1.0  # sigmoid's slope at 1/2 is 1/4: logit factors are 4x the 0/1 ones
    loadings = np.zeros(rank)
    for _ in range(25):
        p = 1 / (1 + np.exp(-(offsets[observed] + loadings @ h_logit[:, observed])))
        gradient = h_logit[:, observed] @ (values - p) - prior * loadings
        hessian = (h_logit[:, observed] * (p * (1 - p))) @ h_logit[:, observed].T + prior * np.eye(rank)
        step = np.linalg.solve(hessian, gradient)
        loadings += step
        if np.abs(step).max(initial=0) < 1e-8:
            break
    return 1 / (1 + np.exp(-(offsets + loadings @ h_logit)))


PREDICTORS = {"additive": predict_additive, "knn": predict_knn, "mf": predict_mf}


def auc(truth: np.ndarray, scores: np.ndarray) -> float | None:
    """ROC AUC by the Mann-Whitney rank sum, ties given their average rank; None when one class is absent."""
    positives, negatives = int(truth.sum()), int((~truth).sum())
    if not positives or not negatives:
        return None
    order = np.argsort(scores)  # equal scores are grouped below: the sort need not be stable
    ordered = scores[order]
    starts = np.concatenate(([0], np.flatnonzero(ordered[1:] != ordered[:-1]) + 1))
    ends = np.append(starts[1:], len(ordered))
    ranks = np.repeat((starts + ends + 1) / 2, ends - starts)
    return float((ranks[truth[order]].sum() - positives * (positives + 1) / 2) / (positives * negatives))


def binary_metrics(truth: np.ndarray, scores: np.ndarray, predicted: np.ndarray) -> dict:
    """F1, precision and recall of the 0/1 predictions (pooled over held-out entries, as the authors'
    compute_bin_metrics) and AUC of the scores."""
    true_positive = int((truth & predicted).sum())
    precision = true_positive / predicted.sum() if predicted.sum() else 0.0
    recall = true_positive / truth.sum() if truth.sum() else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"f1": float(f1), "precision": float(precision), "recall": float(recall), "auc": auc(truth, scores)}


@dataclass
class CompletionTable:
    """Leave-one-row-out completion at K observed docs: one metrics dict per method and baseline."""

    known: int
    seed: int
    binary: bool
    rows: int
    scores: dict[str, dict] = field(default_factory=dict)

    @property
    def best(self) -> str:
        """The method (not a baseline) that predicts best: highest F1 (0/1 values), lowest RMSE (continuous)."""
        if self.binary:
            return max(METHODS, key=lambda name: self.scores[name]["f1"])
        return min(METHODS, key=lambda name: self.scores[name]["rmse"])

    def to_dict(self) -> dict:
        return {
            "known": self.known,
            "seed": self.seed,
            "held_out_rows": self.rows,
            "best": self.best,
            "metric": "f1" if self.binary else "rmse",
            "methods": self.scores,
        }


def choose_known(candidates: np.ndarray, known: int, rng: np.random.Generator) -> np.ndarray:
    """K distinct docs of a row to observe, drawn among the docs it can forget."""
    if known > len(candidates):
        raise InputError(f"--known {known} is larger than a row: only {len(candidates)} docs can be forgotten")
    return np.sort(rng.choice(candidates, size=known, replace=False))


def _complete_row(
    matrix: ForgettingMatrix,
    gram: Gram,
    held_out: int,
    known: int,
    seed: int,
    candidates: np.ndarray,
    truths: list,
    scores: dict,
) -> None:
    """One held-out row of `completion_table`: its truths and every method's scores on its unobserved docs."""
    rng = np.random.default_rng([seed, held_out])
    observed = choose_known(candidates, known, rng)
    unobserved = np.ones(len(matrix.docs), dtype=bool)
    unobserved[observed] = False
    targets = candidates[unobserved[candidates]]
    row = matrix.z[held_out].astype(np.float64)
    history = gram.history(np.delete(np.arange(len(matrix.rows)), held_out))
    found = {name: PREDICTORS[name](history, observed, row[observed], matrix.binary)[targets] for name in METHODS}
    if matrix.binary:  # random scores, as many above 1/2 as the observed share of forgotten docs
        found["random"] = rng.random(len(targets)) + row[observed].mean() - 0.5
    else:
        found["random"] = rng.choice(row[observed], len(targets))
    found["per-doc mean"] = history.means[targets]
    for name, values in found.items():  # float32: the pooled scores of 100 rows x 100k docs stay small
        scores[name].append(values.astype(np.float32))
    truths.append(row[targets].astype(np.float32))


def completion_table(matrix: ForgettingMatrix, known: int = 30, seed: int = 0) -> CompletionTable:
    """Leave each row out in turn, observe `known` of its forgettable docs (seeded per row), predict the rest
    from the other rows with every method; pooled metrics over all held-out entries, beside a random predictor
    (random scores; as many predicted forgotten as the observed share) and the per-doc mean of the other rows."""
    if len(matrix.rows) < 3:
        raise InputError(
            f"completion leaves one fine-tune out of the others: give at least 3 posts, got {len(matrix.rows)}"
        )
    if known < 1:
        raise InputError(f"--known must be at least 1, got {known}")
    candidates = np.flatnonzero(matrix.forgettable)
    names = METHODS + BASELINES
    truths, scores = [], {name: [] for name in names}
    gram = Gram.of(matrix.z)
    with threadpool_limits(1, user_api="blas"):
        for held_out in range(len(matrix.rows)):
            _complete_row(matrix, gram, held_out, known, seed, candidates, truths, scores)
    truth = np.concatenate(truths)
    table = CompletionTable(known, seed, matrix.binary, len(matrix.rows))
    for name in names:
        predicted = np.concatenate(scores[name])
        if matrix.binary:
            table.scores[name] = binary_metrics(truth > 0.5, predicted, predicted > 0.5)
        else:
            table.scores[name] = {"rmse": float(np.sqrt(np.mean((predicted - truth) ** 2, dtype=np.float64)))}
    return table


def format_completion(table: CompletionTable) -> str:
    """The completion table as a pipe table, the best method marked."""
    columns = ["f1", "precision", "recall", "auc"] if table.binary else ["rmse"]
    lines = [
        f"completion: leave one of {table.rows} fine-tunes out, {table.known} docs observed (seed {table.seed})",
        "| method | " + " | ".join(columns) + " |",
        "|---" * (len(columns) + 1) + "|",
    ]
    for name, metrics in table.scores.items():
        cells = ["-" if metrics[c] is None else f"{metrics[c]:.3f}" for c in columns]
        lines.append(f"| {name}{' (best)' if name == table.best else ''} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --- a new fine-tune -----------------------------------------------------------------------------------


@dataclass
class Prediction:
    """A new fine-tune's row: observed entries as logged, the others predicted by `method`. `scores` is
    p_forgotten for 0/1 values (0 for docs PRE got wrong), the predicted log-likelihood drop otherwise."""

    method: str
    scores: np.ndarray
    observed: np.ndarray  # bool per doc

    @property
    def counts(self) -> dict:
        return {"observed": int(self.observed.sum()), "predicted": int((~self.observed).sum())}


def predict_row(matrix: ForgettingMatrix, values: np.ndarray, observed: np.ndarray, method: str) -> Prediction:
    """Complete a partially observed row from the whole history; observed entries keep their logged value."""
    if method not in PREDICTORS:
        raise InputError(f"--predictor must be one of {', '.join(METHODS)}, got {method!r}")
    seen = np.flatnonzero(observed & matrix.forgettable)
    if not len(seen):
        raise InputError("the new fine-tune's log covers none of the history's docs that can be forgotten")
    scores = PREDICTORS[method](history_of(matrix.z), seen, values[seen].astype(np.float64), matrix.binary)
    scores = np.where(observed, values, scores)
    if matrix.binary:
        scores = np.where(matrix.forgettable, scores, 0.0)
    return Prediction(method, scores, observed)


# --- replay --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplaySelection:
    """The chosen docs (indices into the candidates given, in the order drawn) and each candidate's weight."""

    chosen: np.ndarray
    weights: np.ndarray


def select_replay(
    scores: np.ndarray, budget: int, strategy: str = "sample", temperature: float = 0.1, seed: int = 0
) -> ReplaySelection:
    """`budget` distinct candidates: "sample" draws without replacement with weights softmax(score / T) (the
    authors' get_sampling_weights; drawn by the Gumbel top-k trick, which is successive sampling without
    replacement and never underflows), "top" takes the highest scores, "random" draws uniformly."""
    if strategy not in STRATEGIES:
        raise InputError(f"--replay-strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if budget < 1 or budget > len(scores):
        raise InputError(f"--replay-budget {budget}: choose between 1 and the {len(scores)} candidate docs")
    if not temperature > 0:
        raise InputError(f"--replay-temperature must be > 0, got {temperature}")
    rng = np.random.default_rng(seed)
    logits = np.asarray(scores, dtype=np.float64) / temperature
    if strategy == "random":
        weights = np.full(len(scores), 1 / len(scores))
        return ReplaySelection(rng.choice(len(scores), size=budget, replace=False), weights)
    weights = np.exp(logits - logits.max())
    weights /= weights.sum()
    if strategy == "top":
        return ReplaySelection(np.argsort(-logits, kind="stable")[:budget], weights)
    keys = logits + rng.gumbel(size=len(scores))
    return ReplaySelection(np.argsort(-keys, kind="stable")[:budget], weights)
