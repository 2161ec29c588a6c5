"""Several methods compared in one sweep against the same sweeps run one by one, on the toy pairs.

    python benchmarks/bench_method_comparison.py --out benchmarks/work/compare

Pairs (mergekit_lite.toy, as benchmarks/recall_lerp_vs_linear.py): "demo" is the demo's pair; "conc" has 4 layers
and only decoder layer 2 post-trained. For each pair: one `run_comparison` over --methods (pre and post evaluated
once), then each method's sweep alone in its own folder (pre and post evaluated again each time), both timed and
their evaluations counted (after an untimed one-point warm-up sweep). Prints the comparison table and writes
<out>/results.json. The two runs must agree on every pick and score (the same docs, the same grid); the script
stops if they do not.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from mergekit_lite.sweep import method_settings, run_comparison, run_sweep
from mergekit_lite.toy import build_toy_pair

PAIRS = {
    "demo": {"max_shard_size": "100KB"},
    "conc": {"n_layers": 4, "post_layers": [2], "post_steps": 300},
}
METHODS = "linear,task_arithmetic,ties,dare_ties,recall_lerp,lines"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/work/compare")
    parser.add_argument("--alphas", default="0:1:0.1")
    parser.add_argument("--methods", default=METHODS)
    parser.add_argument("--pairs", default=",".join(PAIRS))
    args = parser.parse_args()
    methods = args.methods.split(",")
    results = {}
    for name in args.pairs.split(","):
        options = PAIRS[name]
        folder = Path(args.out).resolve() / name
        pair = build_toy_pair(folder / "pair", seed=0, **options)
        shared = {
            "pre": str(pair.pre_dir),
            "post": str(pair.post_dir),
            "alphas": args.alphas,
            "old_tasks": pair.old_tasks,
            "new_tasks": pair.new_tasks,
            "include_path": str(pair.task_dir),
            "recall_texts": str(pair.typical_texts),
        }
        # warm-up, untimed: imports, lm-eval's task index and the first model load, which the first run would pay
        run_sweep(method_settings({**shared, "alphas": [0.5], "out": str(folder / "warmup")}, ["linear"])[0])
        start = time.perf_counter()
        comparison = run_comparison(method_settings({**shared, "out": str(folder / "together")}, methods))
        together = time.perf_counter() - start
        start, alone_evaluations = time.perf_counter(), 0
        for method in methods:
            alone = run_sweep(method_settings({**shared, "out": str(folder / "alone" / method)}, [method])[0])
            alone_evaluations += len(alone.evaluated)
            row = next(row for row in comparison.rows if row.method == method)
            if (alone.best.alpha, alone.best.harmonic_mean) != (row.pick.alpha, row.pick.harmonic_mean):
                raise SystemExit(f"{name} {method}: alone picks {alone.best.alpha}, together {row.pick.alpha}")
        one_by_one = time.perf_counter() - start
        rows = [
            {
                "method": row.method,
                "pick": row.pick.alpha,
                "old": row.pick.old,
                "new": row.pick.new,
                "harmonic_mean": row.pick.harmonic_mean,
                "interval": row.pick.intervals.get("harmonic_mean"),
                "diff_to_baseline": row.diff_to_baseline,
                "indistinguishable": row.indistinguishable,
            }
            for row in comparison.rows
        ]
        results[name] = {
            "toy_options": options,
            "pre": [comparison.pre.old, comparison.pre.new],
            "post": [comparison.post.old, comparison.post.new],
            "rows": rows,
            "together": {"evaluations": comparison.evaluations, "seconds": round(together, 1)},
            "one_by_one": {"evaluations": alone_evaluations, "seconds": round(one_by_one, 1)},
        }
        print(
            f"{name}: pre old/new {comparison.pre.old:.3f}/{comparison.pre.new:.3f}, "
            f"post {comparison.post.old:.3f}/{comparison.post.new:.3f}"
        )
        for row in rows:
            low, high = row["diff_to_baseline"]
            print(
                f"  {row['method']:<16} pick {row['pick']:<5g} old {row['old']:.3f} new {row['new']:.3f} "
                f"HM {row['harmonic_mean']:.3f} vs linear [{low:+.3f}, {high:+.3f}]"
                + (" indistinguishable" if row["indistinguishable"] else "")
            )
        print(
            f"  together: {comparison.evaluations} evaluations, {together:.0f} s; "
            f"one by one: {alone_evaluations} evaluations, {one_by_one:.0f} s",
            flush=True,
        )
    (Path(args.out) / "results.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
