"""Time the forgetting matrix's math at the paper's scale: R^2 by rank and leave-one-row-out completion (additive,
KNN, MF) of a fine-tunes x docs matrix, 0/1 and continuous, plus one prediction and one replay draw.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/forgetting_matrix_scale.py --rows 100 --docs 100000

The matrix is synthetic (rank 5 plus noise; the 0/1 one thresholded from it), built in memory: this times the
math, not the reading of lm-eval logs (one post is read at a time; its row is all that is kept).
"""

import argparse
import json
import os
import resource
import time

import numpy as np

from mergekit_lite.evaluate.matrix import (
    Docs,
    ForgettingMatrix,
    completion_table,
    predict_row,
    r2_by_rank,
    select_replay,
)


def synthetic(rows: int, docs: int, value: str, seed: int = 0) -> ForgettingMatrix:
    """Rank-5 structure plus noise; 0/1: the top 10 % of each row's scores among the 80 % of docs PRE got right."""
    rng = np.random.default_rng(seed)
    scores = rng.normal(size=(rows, 5)) @ rng.normal(size=(5, docs)) + rng.normal(size=(rows, docs))
    pre_correct = rng.random(docs) < 0.8
    if value == "outcome":
        z = (scores > np.quantile(scores, 0.9, axis=1, keepdims=True)) & pre_correct
    else:
        z = scores
    names = np.array([f"h{i}" for i in range(docs)])
    return ForgettingMatrix(
        z.astype(np.float32),
        Docs(np.full(docs, "task"), names, np.arange(docs), pre_correct),
        [f"ft{i}" for i in range(rows)],
        value,
    )


def timed(function, *args, **kwargs):
    """The result, and wall and CPU seconds (the machine is shared: CPU seconds move less with its load)."""
    start, cpu = time.perf_counter(), time.process_time()
    result = function(*args, **kwargs)
    return result, {"wall": round(time.perf_counter() - start, 2), "cpu": round(time.process_time() - cpu, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100)
    parser.add_argument("--docs", type=int, default=100_000)
    parser.add_argument("--known", type=int, default=30)
    args = parser.parse_args()
    report = {
        "rows": args.rows,
        "docs": args.docs,
        "known": args.known,
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg()[0],
    }
    for value in ("outcome", "logprob"):
        matrix = synthetic(args.rows, args.docs, value)
        r2, r2_seconds = timed(r2_by_rank, matrix.z)
        table, completion_seconds = timed(completion_table, matrix, args.known)
        observed = np.zeros(args.docs, dtype=bool)
        observed[np.flatnonzero(matrix.forgettable)[:1000]] = True
        prediction, predict_seconds = timed(predict_row, matrix, matrix.z[0], observed, table.best)
        _, replay_seconds = timed(select_replay, prediction.scores, 1000, "sample", 0.1)
        metric = "f1" if matrix.binary else "rmse"
        report[value] = {
            "matrix_mb": matrix.z.nbytes / 2**20,
            "r2_rank_1_3_5": [r2[0], r2[2], r2[4]],
            "r2_seconds": r2_seconds,
            "completion_seconds": completion_seconds,
            "predict_seconds": predict_seconds,
            "replay_seconds": replay_seconds,
            metric: {name: row[metric] for name, row in table.scores.items()},
        }
    report["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
