#!/usr/bin/env python3
"""`--dry-run`'s predictions against measured runs: for each size and method, the dry run's wall time and peak RSS
beside the same merge run as a fresh process under /usr/bin/time -v (median of `--repeat`), and whether each lies
within `--tolerance` (25 %) of the measurement.

The merges are those of bench_vs_mergekit.py (its checkpoints and command lines). The rates are this machine's
cached ones (`--calibrate` measures them first, as `--dry-run --calibrate` does).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/predict_vs_measured.py --sizes 1gb,4gb --calibrate
        [--methods linear,ties] [--repeat 3] [--json benchmarks/predictions.json] [--keep-checkpoints]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_vs_mergekit import METHODS, WORK, lite_command, load_average, log, predicted, timed_run  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1gb,4gb", help="make_checkpoints.py presets, comma-separated")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated (bench_vs_mergekit's merges)")
    parser.add_argument("--repeat", type=int, default=3, help="measured runs per merge (median)")
    parser.add_argument("--tolerance", type=float, default=0.25, help="relative error counted as a hit")
    parser.add_argument("--calibrate", action="store_true", help="measure the rates again before the first dry run")
    parser.add_argument("--keep-checkpoints", action="store_true")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    results, calibrate = {"load_at_start": load_average(), "sizes": {}}, args.calibrate
    for size in args.sizes.split(","):
        ckpt = WORK / f"ckpt-{size}"
        subprocess.check_call([sys.executable, str(HERE / "make_checkpoints.py"), "--size", size, "--out", str(ckpt)])
        rows = results["sizes"][size] = {}
        for method in args.methods.split(","):
            guess = predicted(method, ckpt, calibrate)
            calibrate = False
            runs = []
            for _attempt in range(args.repeat):
                out = WORK / f"predict-{size}-{method}"
                run = timed_run(lite_command(method, ckpt, out), WORK / f"predict-{size}-{method}.log")
                shutil.rmtree(out, ignore_errors=True)
                if run["rc"]:
                    raise SystemExit(f"{size} {method}: the merge failed:\n{run.get('error', '')}")
                runs.append(run)
            wall = statistics.median(run["wall_s"] for run in runs)
            rss = statistics.median(run["rss_mb"] for run in runs)
            rows[method] = {
                "predicted": guess,
                "measured": {"wall_s": wall, "rss_mb": rss, "runs": runs},
                "wall_error": round(guess["wall_s"] / wall - 1, 3),
                "rss_error": round(guess["rss_mb"] / rss - 1, 3),
            }
            log(
                f"{size} {method}: wall {guess['wall_s']:.1f} predicted / {wall:.1f} s measured, "
                f"RSS {guess['rss_mb']} / {rss:.0f} MB"
            )
        if not args.keep_checkpoints:
            shutil.rmtree(ckpt, ignore_errors=True)
    print("\n| size | method | wall s: predicted / measured (error) | peak RSS MB: predicted / measured (error) |")
    print("|---|---|---|---|")
    hits = total = 0
    for size, rows in results["sizes"].items():
        for method, row in rows.items():
            wall_hit, rss_hit = (abs(row[key]) <= args.tolerance for key in ("wall_error", "rss_error"))
            hits, total = hits + wall_hit + rss_hit, total + 2
            print(
                f"| {size} | {method} | {row['predicted']['wall_s']:.1f} / {row['measured']['wall_s']:.1f} "
                f"({row['wall_error']:+.0%}{'' if wall_hit else ', missed'}) | {row['predicted']['rss_mb']} / "
                f"{row['measured']['rss_mb']:.0f} ({row['rss_error']:+.0%}{'' if rss_hit else ', missed'}) |"
            )
    print(f"\n{hits} of {total} predictions within {args.tolerance:.0%}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
