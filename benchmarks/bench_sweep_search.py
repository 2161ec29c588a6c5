"""Golden-section search vs the full grid: evaluations run, wall time, and whether the pick agrees.

    . .venv/bin/activate && python benchmarks/bench_sweep_search.py            # demo pair and a larger pair

For each toy pair (the demo's, and one with more entities and a wider model) and each method, the full
grid and the golden-section search run into separate run folders; the table shows how many models each
evaluated, their wall time, and whether the search's pick is the grid's pick or one the grid's paired
bootstrap cannot tell from it. Writes benchmarks/work/sweep-search.json (git-ignored) and prints a
Markdown table for RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from mergekit_lite.evaluate.sweep import SweepSettings, run_sweep
from mergekit_lite.toy import build_toy_pair

WORK = Path(__file__).resolve().parent / "work"
PAIRS = {"demo": {}, "larger": {"n_entities": 128, "hidden_size": 96}}
GRIDS = {"linear": [round(i / 20, 4) for i in range(21)], "task_arithmetic": [round(i / 10, 4) for i in range(16)]}


def timed_sweep(pair, method: str, grid: list[float], search: str, out: Path, limit: int | None):
    started = time.perf_counter()
    result = run_sweep(SweepSettings(pair.pre_dir, pair.post_dir, method, grid, pair.old_tasks, pair.new_tasks,
                                     pair.task_dir, str(out), limit=limit, search=search))
    return result, time.perf_counter() - started


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
            grid_result, grid_seconds = timed_sweep(pair, method, grid, "grid", runs / "grid", args.limit)
            golden_result, golden_seconds = timed_sweep(pair, method, grid, "golden", runs / "golden", args.limit)
            agreeing = [grid_result.best.alpha, *grid_result.ties, *grid_result.indistinguishable]
            rows.append({
                "pair": pair_name, "method": method, "grid_points": len(grid),
                "grid_evaluated": len(grid_result.evaluated) - 2, "grid_seconds": round(grid_seconds, 1),
                "golden_evaluated": len(golden_result.evaluated) - 2, "golden_seconds": round(golden_seconds, 1),
                "grid_pick": grid_result.best.alpha, "golden_pick": golden_result.best.alpha,
                "grid_pick_hm": round(grid_result.best.harmonic_mean, 4),
                "golden_pick_hm": round(golden_result.best.harmonic_mean, 4),
                "golden_pick_within_grid_interval": golden_result.best.alpha in agreeing,
                "stopped": golden_result.search.reason,
            })
    WORK.mkdir(exist_ok=True)
    (WORK / "sweep-search.json").write_text(json.dumps(rows, indent=2) + "\n")
    print("| pair | method | grid: models / s | golden: models / s | pick grid -> golden (report HM) | "
          "golden pick indistinguishable from grid's |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['pair']} | {row['method']} | {row['grid_evaluated']} / {row['grid_seconds']} | "
              f"{row['golden_evaluated']} / {row['golden_seconds']} | {row['grid_pick']} ({row['grid_pick_hm']}) -> "
              f"{row['golden_pick']} ({row['golden_pick_hm']}) | {row['golden_pick_within_grid_interval']} |")


if __name__ == "__main__":
    main()
