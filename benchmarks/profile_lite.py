#!/usr/bin/env python3
"""Where mergekit-lite's merge time goes, phase by phase (read, finite check, identity check, math, cast, write).

Runs the library's own plan and per-tensor functions (plan_merge, merge_tensor, _check_finite,
_all_identical, ShardedWriter) in the same order as `mergekit_lite.merge.execute`, with a timer around
each phase. Wall and CPU (process) seconds are both recorded: on a shared machine CPU seconds are the
steadier number. Run with the project venv:

    python benchmarks/profile_lite.py --ckpt benchmarks/work/ckpt-1gb --method ties
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from mergekit_lite.merge import engine as M
from mergekit_lite.merge.config import MergeConfig
from mergekit_lite.io.safetensors import PlannedTensor, ShardedWriter

CONFIGS = {
    "linear": lambda c: dict(method="linear", models=[{"model": f"{c}/base", "weight": 0.5}, {"model": f"{c}/ft1", "weight": 0.5}]),
    "slerp": lambda c: dict(method="slerp", base=f"{c}/base", models=[f"{c}/ft1"], parameters={"t": 0.5}),
    "task_arithmetic": lambda c: dict(method="task_arithmetic", base=f"{c}/base", models=[f"{c}/ft1", f"{c}/ft2"],
                                      parameters={"lambda": 1.0}),
    "ties": lambda c: dict(method="ties", base=f"{c}/base", models=[f"{c}/ft1", f"{c}/ft2"],
                           parameters={"density": 0.5, "normalize": True}),
    "dare_ties": lambda c: dict(method="dare_ties", base=f"{c}/base", models=[f"{c}/ft1", f"{c}/ft2"],
                                parameters={"drop": 0.5, "normalize": True}),
}


class Timer:
    def __init__(self):
        self.wall = defaultdict(float)
        self.cpu = defaultdict(float)

    def __call__(self, phase):
        timer = self

        class _Phase:
            def __enter__(self):
                self.w, self.c = time.perf_counter(), time.process_time()

            def __exit__(self, *exc):
                timer.wall[phase] += time.perf_counter() - self.w
                timer.cpu[phase] += time.process_time() - self.c

        return _Phase()


def profile(ckpt: str, method: str, out_dir: Path) -> dict:
    config = MergeConfig.from_dict({**CONFIGS[method](ckpt), "out_shard_size": "500MB"})
    timer = Timer()
    started_w, started_c = time.perf_counter(), time.process_time()
    with timer("plan"):
        plan = M.plan_merge(config)
    writer = ShardedWriter(out_dir, [PlannedTensor(s.name, s.shape, s.out_dtype) for s in plan.steps], config.out_shard_size)
    for step in plan.steps:
        with timer("read"):
            tensors = [plan.sources[0].load(step.name)] if step.action == "copy" else \
                [source.load(step.name) for source in plan.sources]
        with timer("check_finite"):
            M._check_finite(step.name, tensors, plan.sources)
        with timer("all_identical"):
            identical = step.action == "copy" or M._all_identical(tensors)
        with timer("math"):
            merged = tensors[0] if identical else M.merge_tensor(config, step, tensors)
        with timer("cast_out"):
            merged = merged.to(step.out_dtype).cpu()
        with timer("write"):
            writer.write(step.name, merged)
        with timer("free"):
            del tensors, merged
    with timer("close_fsync"):
        writer.close()
    total_w, total_c = time.perf_counter() - started_w, time.process_time() - started_c
    return {"method": method, "wall_s": round(total_w, 2), "cpu_s": round(total_c, 2),
            "phases_wall_s": {k: round(v, 2) for k, v in timer.wall.items()},
            "phases_cpu_s": {k: round(v, 2) for k, v in timer.cpu.items()},
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", required=True, help="folder made by make_checkpoints.py")
    parser.add_argument("--method", choices=sorted(CONFIGS), required=True)
    parser.add_argument("--work", default="benchmarks/work", help="where the scratch output goes")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.work, prefix="profile-") as out:
        result = profile(args.ckpt, args.method, Path(out))
    result["torch_threads"] = torch.get_num_threads()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
