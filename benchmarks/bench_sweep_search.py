"""Fewer evaluations per sweep: the golden-section search and probe mode against the full grid.

    . .venv/bin/activate && python benchmarks/bench_sweep_search.py            # demo pair and a larger pair

For each toy pair (the demo's, and one with more entities and a wider model) and each method, the full grid,
the golden-section search, probe mode (--probe 0.2) and probe mode with the golden search run into separate
run folders. The table shows the models scored on every doc, the alphas scored on probes, the doc evaluations
in all (lm-eval requests scale with them), wall time, and whether the pick is the grid's or one the grid's
paired bootstrap cannot tell from it. For probe mode it also checks the estimates against the truth the grid
measured: at every probed alpha, is the grid's selection-split harmonic mean inside the estimate's interval?
Writes benchmarks/work/sweep-search.json (git-ignored) and prints a Markdown table for RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from statistics import NormalDist

from mergekit_lite.sweep import SweepSettings, run_sweep
from mergekit_lite.toy import build_toy_pair

WORK = Path(__file__).resolve().parent / "work"
PAIRS = {"demo": {}, "larger": {"n_entities": 128, "hidden_size": 96}}
GRIDS = {"linear": [round(i / 20, 4) for i in range(21)], "task_arithmetic": [round(i / 10, 4) for i in range(16)]}
MODES = {
    "grid": {},
    "golden": {"search": "golden"},
    "probe": {"probe": 0.2},
    "probe+golden": {"probe": 0.2, "search": "golden"},
}


def timed_sweep(pair, method: str, grid: list[float], out: Path, limit: int | None, **options):
    started = time.perf_counter()
    result = run_sweep(
        SweepSettings(
            pair.pre_dir,
            pair.post_dir,
            method,
            grid,
            pair.old_tasks,
            pair.new_tasks,
            pair.task_dir,
            str(out),
            limit=limit,
            **options,
        )
    )
    return result, time.perf_counter() - started


def doc_evaluations(result) -> int:
    """Docs scored by this call: every doc for each full model, the probe docs for each probed alpha."""
    docs = sum(len(run.outcomes.correct) for run in result.pre.tasks if run.outcomes is not None)
    probes = len(result.probe.estimates) * result.probe.samples_probed if result.probe else 0
    return len(result.evaluated) * docs + probes


def estimate_coverage(result, grid_result) -> tuple[int, int]:
    """(probed alphas whose interval holds the grid's selection HM, probed alphas)."""
    z = NormalDist().inv_cdf((1 + result.settings.confidence) / 2)
    truth = {point.alpha: point.selection.harmonic_mean for point in grid_result.points}
    held = sum(
        abs(estimate.harmonic_mean - truth[alpha]) <= z * estimate.harmonic_mean_se + 1e-12
        for alpha, estimate in result.probe.estimates.items()
    )
    return held, len(result.probe.estimates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=int, default=None, help="samples per task (default: all)")
    parser.add_argument("--pairs", nargs="+", default=list(PAIRS), choices=list(PAIRS))
    args = parser.parse_args()
    rows = []
    for pair_name in args.pairs:
        pair = build_toy_pair(WORK / f"pair-{pair_name}", seed=0, **PAIRS[pair_name])
        for method, grid in GRIDS.items():
            runs = WORK / f"sweep-{pair_name}-{method}"
            results = {
                mode: timed_sweep(pair, method, grid, runs / mode.replace("+", "-"), args.limit, **options)
                for mode, options in MODES.items()
            }
            grid_result = results["grid"][0]
            agreeing = [grid_result.best.alpha, *grid_result.ties, *grid_result.indistinguishable]
            for mode, (result, seconds) in results.items():
                row = {
                    "pair": pair_name,
                    "method": method,
                    "mode": mode,
                    "grid_points": len(grid),
                    "full_models": len(result.evaluated),
                    "probed_alphas": len(result.probe.estimates) if result.probe else 0,
                    "doc_evaluations": doc_evaluations(result),
                    "seconds": round(seconds, 1),
                    "pick": result.best.alpha,
                    "pick_hm": round(result.best.harmonic_mean, 4),
                    "pick_agrees_with_grid": result.best.alpha in agreeing,
                }
                if result.probe:
                    row["estimates_covering_grid"] = list(estimate_coverage(result, grid_result))
                rows.append(row)
    WORK.mkdir(exist_ok=True)
    (WORK / "sweep-search.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(
        "| pair | method | mode | models in full + alphas probed | doc evaluations | s | pick (report HM) | "
        "pick = grid's or indistinguishable | probe intervals holding the grid's HM |"
    )
    print("|---|---|---|---|---:|---:|---|---|---|")
    for row in rows:
        coverage = "{}/{}".format(*row["estimates_covering_grid"]) if "estimates_covering_grid" in row else "-"
        print(
            f"| {row['pair']} | {row['method']} | {row['mode']} | {row['full_models']} + {row['probed_alphas']} | "
            f"{row['doc_evaluations']} | {row['seconds']} | {row['pick']} ({row['pick_hm']}) | "
            f"{row['pick_agrees_with_grid']} | {coverage} |"
        )


if __name__ == "__main__":
    main()
