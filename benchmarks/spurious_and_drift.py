"""On the demo's toy pair: how much of post's forgetting is spurious, where the weights moved, and whether the
layers that moved most are the ones recall_lerp takes back towards pre most.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/spurious_and_drift.py --out /tmp/spurious-drift [--shots 3]

Steps: build the toy pair (mergekit_lite/toy.py, as `mergekit-lite demo` does); lm-eval's own CLI scores pre and
post zero-shot on both toy tasks and post again with --num_fewshot SHOTS on the old task (the re-alignment);
`mergekit-lite forgetting pre post --realigned` splits the forgetting; `mergekit-lite drift --texts` measures
per-layer drift and CKA; recall_lerp's layer coefficients come from the toy's typical texts (the demo's RECALL
settings). Prints a markdown report (the numbers in benchmarks/RESULTS.md). A few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def lm_eval(model: Path, tasks: str, include: Path, out: Path, shots: int | None = None) -> Path:
    """lm-eval's CLI with --log_samples; the folder it wrote the samples into."""
    command = [
        sys.executable,
        "-m",
        "lm_eval",
        "run",
        "--model",
        "hf",
        "--model_args",
        f"pretrained={model},dtype=float32",
        "--tasks",
        tasks,
        "--include_path",
        str(include),
        "--device",
        "cpu",
        "--batch_size",
        "32",
        "--log_samples",
        "--output_path",
        str(out),
        "--seed",
        "0",
    ]
    subprocess.run(
        command + (["--num_fewshot", str(shots)] if shots is not None else []), check=True, capture_output=True
    )
    return next(out.rglob("samples_*.jsonl")).parent


def mergekit_lite(*args: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", "-m", "mergekit_lite.cli", *args, "--json", "-q"],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(result.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="a new folder for the pair and the logs")
    parser.add_argument("--shots", type=int, default=3, help="demonstrations of the re-alignment")
    parser.add_argument("--alpha", type=float, default=0.5, help="recall_lerp's global coefficient to show")
    options = parser.parse_args()
    from mergekit_lite.merge.recall import compute_recall_weights, layer_alphas, read_texts
    from mergekit_lite.toy import build_toy_pair

    pair = build_toy_pair(options.out / "models", seed=0, max_shard_size="100KB")
    tasks = ",".join(pair.old_tasks + pair.new_tasks)
    pre = lm_eval(pair.pre_dir, tasks, pair.task_dir, options.out / "pre")
    post = lm_eval(pair.post_dir, tasks, pair.task_dir, options.out / "post")
    realigned = lm_eval(
        pair.post_dir, ",".join(pair.old_tasks), pair.task_dir, options.out / "realigned", options.shots
    )
    split = mergekit_lite("forgetting", str(pre), str(post), "--realigned", str(realigned))
    drift = mergekit_lite("drift", str(pair.pre_dir), str(pair.post_dir), "--texts", str(pair.typical_texts))
    weights = compute_recall_weights([str(pair.pre_dir), str(pair.post_dir)], read_texts(pair.typical_texts))
    alphas = layer_alphas(weights.similarity, options.alpha)[1:]  # decoder layers (row 0: the embeddings)

    print(f"## Spurious forgetting (re-alignment: {options.shots}-shot on {', '.join(pair.old_tasks)})\n")
    print("| task | k | F | F_true | forgotten | spurious | genuine | spurious_share | spurious_share_true |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in split["tasks"]:
        if "spurious" in row:
            print(
                f"| {row['task']} | {row['k']} | {row['F']:.3f} | {row['F_true']:.3f} | {row['forgotten']:.0f} | "
                f"{row['spurious']:.0f} | {row['genuine']:.0f} | {row['spurious_share']:.3f} | "
                f"{row['spurious_share_true']:.3f} |"
            )
    columns = [c for c in ("q", "k", "v", "o", "gate", "up", "down", "norm") if c in drift["layers"][0]["modules"]]
    print("\n## Drift per decoder layer and module type (relative Frobenius), CKA and recall_lerp\n")
    print(f"| layer | all | {' | '.join(columns)} | CKA | recall_lerp post weight (alpha {options.alpha}) |")
    print("|---|" + "---:|" * (len(columns) + 3))
    for row, alpha in zip(drift["layers"], alphas, strict=True):
        cells = " | ".join(f"{row['modules'][c]:.3f}" for c in columns)
        print(f"| {row['layer']} | {row['relative_drift']:.3f} | {cells} | {row['cka']:.3f} | {alpha:.3f} |")
    outside = drift["outside_layers"]
    print("\noutside the layers: " + ", ".join(f"{name} {value:.3f}" for name, value in outside.items()))
    moved = max(drift["layers"], key=lambda row: row["relative_drift"])["layer"]
    represented = min(drift["layers"], key=lambda row: row["cka"])["layer"]
    held_back = min(range(len(alphas)), key=lambda layer: alphas[layer])
    print(
        f"\nlayer with the largest weight drift: {moved}; with the lowest CKA: {represented}; "
        f"where recall_lerp keeps least of post (moves its weights least from pre): {held_back}"
    )


if __name__ == "__main__":
    main()
