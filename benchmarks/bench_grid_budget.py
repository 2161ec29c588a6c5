"""2-D sweeps on the toy pairs: the budgeted search's pick (--budget, successive halving on probe docs) against
the full grid's, with the cost of each.

    python benchmarks/bench_grid_budget.py --out benchmarks/work/grid

Pairs as benchmarks/bench_method_comparison.py ("demo": the demo's pair; "conc": 4 layers, only decoder layer 2
post-trained). For each pair and each grid (TIES lambda x density, LiNeS alpha x beta): the full grid in one run
folder, then the budgeted search in another (pre and post evaluated again, so both runs pay the same), both timed
after an untimed one-point warm-up sweep. "same / indistinguishable" says whether the budgeted pick is the full
grid's or one of the cells the full grid's report split cannot tell from it (its HM - pick interval holds 0).
Prints a table and writes <out>/results.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from mergekit_lite.sweep import method_settings, run_sweep
from mergekit_lite.toy import build_toy_pair

PAIRS = {
    "demo": {"max_shard_size": "100KB"},
    "conc": {"n_layers": 4, "post_layers": [2], "post_steps": 300},
}
GRIDS = {"ties": {"method": "ties", "densities": "0.1:0.9:0.2"}, "lines": {"method": "lines", "betas": "0:1:0.25"}}


def cell(point) -> str:
    return f"{point.alpha:g} x {point.second[1]:g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/work/grid")
    parser.add_argument("--alphas", default="0:1:0.1")
    parser.add_argument("--budget", type=int, default=32)
    parser.add_argument("--probe", type=float, default=0.1)
    parser.add_argument("--pairs", default=",".join(PAIRS))
    parser.add_argument("--grids", default=",".join(GRIDS))
    args = parser.parse_args()
    results = {}
    for name in args.pairs.split(","):
        folder = Path(args.out).resolve() / name
        pair = build_toy_pair(folder / "pair", seed=0, **PAIRS[name])
        shared = {
            "pre": str(pair.pre_dir),
            "post": str(pair.post_dir),
            "alphas": args.alphas,
            "old_tasks": pair.old_tasks,
            "new_tasks": pair.new_tasks,
            "include_path": str(pair.task_dir),
        }
        run_sweep(method_settings({**shared, "alphas": [0.5], "out": str(folder / "warmup")}, ["linear"])[0])
        for grid in args.grids.split(","):
            options = dict(GRIDS[grid])
            method = options.pop("method")
            runs = {}
            for kind, extra in (("full", {}), ("budget", {"budget": args.budget, "probe": args.probe})):
                data = {**shared, **options, **extra, "out": str(folder / grid / kind)}
                settings = method_settings(data, [method])[0]
                start = time.perf_counter()
                result = run_sweep(settings)
                runs[kind] = (result, time.perf_counter() - start)
            (full, full_s), (budgeted, budget_s) = runs["full"], runs["budget"]
            same = budgeted.best.key == full.best.key
            close = same or budgeted.best.key in full.indistinguishable + full.ties
            in_full = next(point for point in full.points if point.key == budgeted.best.key)
            row = {
                "cells": len(full.points),
                "full_pick": cell(full.best),
                "full_hm": full.best.harmonic_mean,
                "full_interval": full.best.intervals.get("harmonic_mean"),
                "full_evaluations": len(full.evaluated),
                "full_seconds": round(full_s, 1),
                "budget_pick": cell(budgeted.best),
                "budget_pick_hm_in_full_grid": in_full.harmonic_mean,
                "same": same,
                "indistinguishable": close,
                "budget": args.budget,
                "budget_cost": round(budgeted.budget["cost"], 2),
                "budget_evaluations": budgeted.budget["evaluations"],
                "budget_seconds": round(budget_s, 1),
                "rounds": [len(entry["estimates"]) for entry in budgeted.budget["rounds"]],
                "survivors": len(budgeted.budget["full"]),
            }
            results[f"{name}/{grid}"] = row
            print(
                f"{name} {grid}: {row['cells']} cells; full pick {row['full_pick']} HM {row['full_hm']:.3f} "
                f"({row['full_evaluations']} evaluations, {full_s:.0f} s); budget {args.budget} pick "
                f"{row['budget_pick']} HM in the full grid {in_full.harmonic_mean:.3f} "
                f"({'same' if same else 'indistinguishable' if close else 'distinguishable'}; cost "
                f"{row['budget_cost']}, {row['budget_evaluations']} evaluations, rounds {row['rounds']}, "
                f"{row['survivors']} in full, {budget_s:.0f} s)",
                flush=True,
            )
    (Path(args.out) / "results.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
