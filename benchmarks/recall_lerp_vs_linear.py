"""recall_lerp (our layer-wise LERP) against linear, swept on the same grid in the same run, on two toy pairs.

    python benchmarks/recall_lerp_vs_linear.py --out benchmarks/work/recall_lerp

Pairs (mergekit_lite.toy): "demo" is the demo's pair (2 layers, the whole model post-trained); "conc" has
4 layers and only decoder layer 2 post-trained, so the forgetting sits in one layer. For each pair both
methods are swept over --alphas with lm-eval on the toy tasks; the script prints every point, each method's
pick, and the per-layer coefficients of recall_lerp's pick, and writes <out>/results.json. Finished points
are reused by a rerun (the sweep's resume). About 6 minutes on 2 idle cores.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mergekit_lite.merge.recall import RecallWeights, layer_alphas
from mergekit_lite.sweep import SweepSettings, run_sweep
from mergekit_lite.sweep.store import RECALL_DIR, SIMILARITY_FILE
from mergekit_lite.toy import build_toy_pair

PAIRS = {
    "demo": {"max_shard_size": "100KB"},
    "conc": {"n_layers": 4, "post_layers": [2], "post_steps": 300},
}
METHODS = ("linear", "recall_lerp")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/work/recall_lerp")
    parser.add_argument("--alphas", default="0:1:0.05")
    args = parser.parse_args()
    results = {}
    for name, options in PAIRS.items():
        folder = Path(args.out).resolve() / name
        pair = build_toy_pair(folder, seed=0, **options)
        results[name] = {"toy_options": options}
        for method in METHODS:
            settings = SweepSettings(
                pre=str(pair.pre_dir),
                post=str(pair.post_dir),
                method=method,
                alphas=args.alphas,
                old_tasks=pair.old_tasks,
                new_tasks=pair.new_tasks,
                include_path=str(pair.task_dir),
                out=str(folder / f"sw_{method}"),
                recall_texts=str(pair.typical_texts),
            )
            sweep = run_sweep(settings)
            entry = {
                "pick": sweep.best.alpha,
                "old": sweep.best.old,
                "new": sweep.best.new,
                "harmonic_mean": sweep.best.harmonic_mean,
                "recovered": sweep.recovered,
                "points": {p.alpha: round(p.harmonic_mean, 4) for p in sweep.points},
            }
            if method == "recall_lerp":
                similarity = RecallWeights.from_json(
                    json.loads((folder / f"sw_{method}" / RECALL_DIR / SIMILARITY_FILE).read_text())
                ).similarity
                entry["layer_alphas_at_pick"] = [round(a, 4) for a in layer_alphas(similarity, sweep.best.alpha)]
            results[name][method] = entry
            results[name]["pre"] = {"old": sweep.pre.old, "new": sweep.pre.new}
            results[name]["post"] = {"old": sweep.post.old, "new": sweep.post.new}
            print(
                f"{name:<5} {method:<12} pick alpha {sweep.best.alpha:<5g} old {sweep.best.old:.3f} "
                f"new {sweep.best.new:.3f} HM {sweep.best.harmonic_mean:.4f}"
                + (f"  layers {entry['layer_alphas_at_pick']}" if "layer_alphas_at_pick" in entry else ""),
                flush=True,
            )
        linear, lerp = results[name]["linear"]["harmonic_mean"], results[name]["recall_lerp"]["harmonic_mean"]
        print(f"{name:<5} recall_lerp best HM - linear best HM = {lerp - linear:+.4f}", flush=True)
    (Path(args.out) / "results.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
