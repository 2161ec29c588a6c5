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

What alpha is depends on the method (its main coefficient, `Method.main_coefficient` in merge/methods/):
linear -> weight of post (0 = pre, 1 = post); slerp -> t; task_arithmetic, ties, dare_* -> lambda,
the scale of post's task vector (post - pre) added to pre; recall -> the softmax temperature of its
layer weights; recall_lerp -> the global weight of post its per-layer profile centres on (for both, the
similarities are computed once per sweep).

One concern per module, imports pointing down this list only: `search` (pure: golden-section search on indices,
probe plans and their estimator), `settings` (SweepSettings, the sweep file), `scoring` (per-task outcomes,
splits, group scores, bootstrap), `result` (SweepResult, the pick, Pareto front, intervals), `store` (the run
folder: point files, identities, lock), `models` (merge config per alpha, model loading, the resident pair),
`evaluator` (one point evaluated and saved), `adaptive` (golden search and probe mode), `grid` (2-D grids: one row
per value of a second coefficient, the heat map), `budget` (--budget: successive halving on probe docs), `samples`
(what the pick did to each doc: samples.jsonl, --replay), `report`
and `distributed` (read results, run evaluators on Ray), `compare` (several methods' picks against a baseline's:
comparison.json/.md, pareto.png), `run` (run_sweep and run_comparison, the orchestration; nothing imports it but
this package's entry point and its callers).
"""

from mergekit_lite.sweep.compare import Comparison, method_settings
from mergekit_lite.sweep.result import PointResult, SweepResult
from mergekit_lite.sweep.run import run_comparison, run_sweep
from mergekit_lite.sweep.settings import SweepSettings, load_sweep_file, settings_from_dict

__all__ = [
    "Comparison",
    "PointResult",
    "SweepResult",
    "SweepSettings",
    "load_sweep_file",
    "method_settings",
    "run_comparison",
    "run_sweep",
    "settings_from_dict",
]
