#!/usr/bin/env python3
"""Every method merged with `--device cuda` and on the CPU, both in float32 math: the bytes compared tensor by
tensor, and both wall times (fresh processes, as a user runs them).

The inputs are bench_vs_mergekit.py's checkpoints (make_checkpoints.py: a bf16 base and two fine-tunes). Each
method merges them with its default parameters (the base and models of its calibration merge, merge/cost.py),
stores bf16, and seed 0 for the random ones: DARE's masks are drawn on the CPU, so they are the same on both
devices. A method whose output differs prints the share of differing entries and the largest difference in bf16
steps (reductions may round differently on the GPU). RECALL's methods need texts and a tokenizer and are left out.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/gpu_merge_check.py --size 4gb [--methods ties,dare_ties]
        [--json benchmarks/gpu_check.json] [--keep-checkpoints]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml
from safetensors import safe_open

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_vs_mergekit import REPO, WORK, log  # noqa: E402

from mergekit_lite.merge.methods import REGISTRY  # noqa: E402


def merge_config(method: str, ckpt: Path) -> dict:
    calibration = REGISTRY[method].calibration
    parameters, count, with_base = calibration.parameters, calibration.models, calibration.with_base
    models = [str(ckpt / f"ft{index}") for index in range(1, count + 1)]
    if not with_base:
        models = [str(ckpt / "base"), *models][:count]
    return {
        "method": method,
        "base": str(ckpt / "base") if with_base else None,
        "models": models,
        "parameters": parameters,
        "out_shard_size": "500MB",
    }


def run(config_file: Path, out: Path, device: str) -> float:
    started = time.perf_counter()
    result = subprocess.run(
        [
            str(Path(sys.executable).parent / "mergekit-lite"),
            "merge",
            str(config_file),
            "--out",
            str(out),
            "--device",
            device,
            "--quiet",
            "--overwrite",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    if result.returncode:
        raise SystemExit(f"{config_file.stem} on {device} failed: {result.stderr.strip()}")
    return time.perf_counter() - started


def tensors(folder: Path) -> dict[str, tuple[Path, str]]:
    found = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(shard, "pt") as handle:
            found.update({name: (shard, name) for name in handle.keys()})
    return found


def compare(cpu: Path, cuda: Path) -> dict:
    """Identical bytes, or how far apart: entries that differ, and the largest difference in bf16 steps."""
    left, right = tensors(cpu), tensors(cuda)
    if left.keys() != right.keys():
        return {"identical": False, "error": "different tensor names"}
    differing = total = largest = 0
    for name in left:
        with safe_open(left[name][0], "pt") as a, safe_open(right[name][0], "pt") as b:
            x, y = a.get_tensor(name), b.get_tensor(name)
        total += x.numel()
        if x.dtype != y.dtype or x.shape != y.shape:
            return {"identical": False, "error": f"{name}: {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}"}
        if torch.equal(x.view(torch.int16), y.view(torch.int16)):
            continue
        steps = (x.view(torch.int16).to(torch.int32) - y.view(torch.int16).to(torch.int32)).abs()
        differing += int((steps > 0).sum())
        largest = max(largest, int(steps.max()))
    return {"identical": differing == 0, "differing_share": differing / max(total, 1), "largest_bf16_steps": largest}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="4gb", help="make_checkpoints.py preset (default 4gb)")
    parser.add_argument(
        "--methods", default=",".join(name for name, m in REGISTRY.items() if not m.reads_recall_weights)
    )
    parser.add_argument("--keep-checkpoints", action="store_true")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device here: nothing to check", file=sys.stderr)
        return 2
    ckpt = WORK / f"ckpt-{args.size}"
    subprocess.check_call([sys.executable, str(HERE / "make_checkpoints.py"), "--size", args.size, "--out", str(ckpt)])
    results = {"size": args.size, "device": torch.cuda.get_device_name(0), "methods": {}}
    print("| method | cpu wall s | cuda wall s | bytes |\n|---|---|---|---|")
    for method in args.methods.split(","):
        config_file = WORK / f"gpu-check-{method}.yaml"
        config_file.write_text(yaml.safe_dump(merge_config(method, ckpt)))
        outs = {device: WORK / f"gpu-check-{method}-{device}" for device in ("cpu", "cuda")}
        walls = {device: run(config_file, out, device) for device, out in outs.items()}
        agreement = compare(outs["cpu"], outs["cuda"])
        for out in outs.values():
            shutil.rmtree(out)
        config_file.unlink()
        results["methods"][method] = {"wall_s": walls, **agreement}
        same = (
            "identical"
            if agreement["identical"]
            else (
                agreement.get("error")
                or f"{agreement['differing_share']:.2e} differ, at most {agreement['largest_bf16_steps']} bf16 steps"
            )
        )
        print(f"| {method} | {walls['cpu']:.1f} | {walls['cuda']:.1f} | {same} |", flush=True)
        log(f"{method} done")
    if not args.keep_checkpoints:
        shutil.rmtree(ckpt)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
