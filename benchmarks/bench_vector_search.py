"""The per-layer-group search (`--groups`) against a grid over the same space, on a toy whose forgetting sits in
chosen layers.

    . .venv/bin/activate && python benchmarks/bench_vector_search.py

The toy (mergekit_lite.toy, four decoder layers): layers 2-3 learn the new skill beside the old one, then layers 0-1
alone learn wrong old answers, so a vector that keeps post's layers 2-3 and puts 0-1 back to pre beats any single
alpha. The space: `--groups 2`, each slot's alpha over the sweep's grid (0, 0.25, ..., 1), 25 vectors. The scalar
sweep runs once; each search then resumes its points (its run folder copied), so its wall time is the vector
search's alone. Searches: TPE (10 trials), TPE cheap first (`--vector-prune 0.2`, 10 trials), selective revert
(each slot pre's, the scalar pick's or post's: 9 trials; a vector met again is not scored again), and the grid:
all 25 vectors, each merged and scored on every doc by the sweep's own evaluator, the best on the selection split
picked (ties to the first). Every pick is set against the scalar pick on the report split with the sweep's paired
bootstrap (1000 draws, 95%). Writes benchmarks/work/vector-search.json (git-ignored) and prints a Markdown table
for RESULTS.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import time
from contextlib import closing
from pathlib import Path

import numpy as np

from mergekit_lite.sweep import SweepSettings, run_sweep
from mergekit_lite.sweep.evaluator import PointEvaluator
from mergekit_lite.sweep.grid import cells, rows
from mergekit_lite.sweep.scoring import paired_bootstrap, summarise
from mergekit_lite.sweep.vector import vector_config, vector_space
from mergekit_lite.toy import build_toy_pair

WORK = Path(__file__).resolve().parent / "work"
ALPHAS = [0.0, 0.25, 0.5, 0.75, 1.0]
SEARCHES = {
    "tpe": {"trials": 10},
    "tpe, cheap first": {"trials": 10, "vector_prune": 0.2},
    "revert": {"trials": 9, "vector_search": "revert"},
}


def settings(pair, out: Path, **options) -> SweepSettings:
    return SweepSettings(
        pair.pre_dir,
        pair.post_dir,
        "linear",
        ALPHAS,
        pair.old_tasks,
        pair.new_tasks,
        pair.task_dir,
        str(out),
        limit=None,
        **options,
    )


def scalar_folder(scalar) -> Path:
    return Path(scalar.settings.out)


def against_scalar(result, point) -> tuple[float, list[float]]:
    """HM(point) - HM(scalar pick) on the report split, and its paired-bootstrap interval (the sweep's settings)."""
    chosen = result.settings
    draws = paired_bootstrap([result.best, point], result.splits, chosen.aggregation, chosen.bootstrap, chosen.seed)
    tail = (1 - chosen.confidence) / 2 * 100
    interval = np.percentile(draws[:, 1, 2] - draws[:, 0, 2], [tail, 100 - tail]).tolist()
    return point.harmonic_mean - result.best.harmonic_mean, interval


def grid_search(pair, scalar, out: Path) -> dict:
    """Every vector of the grid merged and scored on every doc; the best selection-split harmonic mean."""
    shutil.copytree(scalar_folder(scalar), out)
    chosen = settings(pair, out, groups=2)
    space = vector_space(chosen)
    base = cells(rows(chosen), out)[scalar.best.label].config()
    started = time.perf_counter()
    points = []
    from tqdm import tqdm

    with tqdm(disable=True) as bar, closing(PointEvaluator(chosen, out, bar)) as evaluator:
        for vector in itertools.product(ALPHAS, repeat=len(space.slots)):
            runs = evaluator.merged(vector_config(base, chosen.coefficient, space.spec(list(vector))))
            point = summarise(str(vector), None, runs, scalar.pre.tasks, scalar.splits, chosen.aggregation)
            points.append((vector, point))
    seconds = time.perf_counter() - started
    docs = sum(len(run.outcomes.correct) for run in scalar.pre.tasks if run.outcomes is not None)
    top = max(point.selection.harmonic_mean for _, point in points)
    vector, best = next((vector, point) for vector, point in points if point.selection.harmonic_mean == top)
    gain, interval = against_scalar(scalar, best)
    return {
        "search": "grid",
        "evaluations": len(points),
        "docs": len(points) * docs,
        "seconds": seconds,
        "pick": dict(zip(space.slots, vector, strict=True)),
        "harmonic_mean": best.harmonic_mean,
        "gain": gain,
        "interval": interval,
    }


def vector_run(pair, scalar, name: str, out: Path, options: dict) -> dict:
    """One search in a copy of the scalar sweep's run folder (its own folder again when rerun: all resumed)."""
    if not out.exists():
        shutil.copytree(scalar_folder(scalar), out)
    started = time.perf_counter()
    result = run_sweep(settings(pair, out, groups=2, **options))
    seconds = time.perf_counter() - started
    vector, search = result.vector, result.vector["search"]
    return {
        "search": name,
        "evaluated_here": search["evaluated"] + search.get("prune", {}).get("probed", 0),
        "evaluations": search["evaluations"],
        "docs": search["docs"],
        "pruned": search.get("prune", {}).get("pruned"),
        "seconds": seconds,
        "pick": vector["pick"]["coefficients"],
        "chosen": vector["chosen"],
        "harmonic_mean": vector["pick"]["harmonic_mean"],
        "gain": vector["difference"]["harmonic_mean"],
        "interval": vector["intervals"]["harmonic_mean"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args()
    shutil.rmtree(WORK / "vector-search", ignore_errors=True)
    root = WORK / "vector-search"
    pair = build_toy_pair(root / "pair", seed=0, n_layers=4, post_layers=[2, 3], forget_layers=[0, 1])
    started = time.perf_counter()
    scalar = run_sweep(settings(pair, root / "scalar"))
    scalar_seconds = time.perf_counter() - started
    rows_out = [
        vector_run(pair, scalar, name, root / name.replace(", ", "-"), options) for name, options in SEARCHES.items()
    ]
    # the same command again: every trial resumed, so its time is what a search costs besides its evaluations
    rows_out.append({**vector_run(pair, scalar, "tpe", root / "tpe", SEARCHES["tpe"]), "search": "tpe, rerun"})
    rows_out.append({**grid_search(pair, scalar, root / "grid"), "evaluated_here": 25})
    summary = {
        "scalar": {"alpha": scalar.best.alpha, "harmonic_mean": scalar.best.harmonic_mean, "seconds": scalar_seconds},
        "searches": rows_out,
    }
    (WORK / "vector-search.json").write_text(json.dumps(summary, indent=2))
    print(
        f"scalar pick: alpha {scalar.best.alpha} (report HM {scalar.best.harmonic_mean:.4f}), "
        f"sweep {scalar_seconds:.1f} s\n"
    )
    print(
        "| search | evaluations | evaluated by this run | docs scored | s | pick (g1, g2) | report HM "
        "| gain over scalar [95%] |"
    )
    print("|---|---:|---:|---:|---:|---|---:|---|")
    for row in rows_out:
        pick = ", ".join(f"{value:.2f}" for value in row["pick"].values())
        pruned = f" ({row['pruned']} pruned)" if row.get("pruned") is not None else ""
        low, high = row["interval"]
        print(
            f"| {row['search']} | {row['evaluations']}{pruned} | {row['evaluated_here']} | {row['docs']} "
            f"| {row['seconds']:.1f} | {pick} "
            f"| {row['harmonic_mean']:.4f} | {row['gain']:+.4f} [{low:+.4f}, {high:+.4f}] |"
        )


if __name__ == "__main__":
    main()
