#!/usr/bin/env python3
"""Summarize a py-spy `--format raw` profile: share of samples per frame (inclusive) and per leaf line.

    benchmarks/.venv-mergekit/bin/py-spy record --format raw -r 50 -o prof.txt -- .venv/bin/python .venv/bin/mergekit-lite merge ...
    python benchmarks/pyspy_summary.py prof.txt [--filter mergekit_lite]
"""
import argparse
import collections

parser = argparse.ArgumentParser()
parser.add_argument("profile")
parser.add_argument("--filter", default="", help="only frames whose text contains this (e.g. mergekit_lite)")
parser.add_argument("--top", type=int, default=25)
args = parser.parse_args()
inclusive, leaf, total = collections.Counter(), collections.Counter(), 0
for line in open(args.profile):
    stack, _, count = line.rstrip().rpartition(" ")
    if not stack:
        continue
    count = int(count)
    frames = [f for f in stack.split(";") if "threading.py" not in f and "_monitor.py" not in f]
    if not frames or any("TMonitor" in f for f in stack.split(";")):
        continue  # tqdm's monitor thread sleeping
    total += count
    for frame in set(frames):
        if args.filter in frame:
            inclusive[frame] += count
    own = [f for f in frames if args.filter in f] or frames
    leaf[own[-1]] += count
print(f"samples (main thread): {total}")
print("inclusive:")
for frame, count in inclusive.most_common(args.top):
    print(f"  {count / total:6.1%}  {frame}")
print("self (deepest matching frame):")
for frame, count in leaf.most_common(args.top):
    print(f"  {count / total:6.1%}  {frame}")
