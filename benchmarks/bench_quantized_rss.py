#!/usr/bin/env python3
"""Peak memory of `merge --method linear` over an FP8 block-scaled pair, against the checkpoints' size.

Writes synthetic Llama-shaped FP8 checkpoints (DeepSeek-V3's layout: float8_e4m3fn linear weights with a float32
`weight_scale_inv` per 128x128 block, embeddings, head and norms in bf16, `quantization_config` in config.json)
at several depths with the same tensor shapes, merges each pair in a fresh process and reports that process's
peak RSS (resource.getrusage(RUSAGE_CHILDREN) of an intermediate process that only waits on it). The inputs are
read dequantized one tensor at a time, so the peak should follow the largest tensor, not the model: flat across
depths. Scratch space: benchmarks/work/quantized-rss/ (git-ignored), deleted at the end unless --keep.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_quantized_rss.py --layers 2,8,16
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from make_checkpoints import llama_config, llama_tensors
from safetensors.torch import save_file

SHAPE = dict(hidden=2048, intermediate=5632, vocab=32000, heads=16, kv_heads=4)
BLOCK = 128
SHARD_BYTES = 300 << 20
WORK = Path(__file__).parent / "work" / "quantized-rss"
MEASURE = (
    "import resource, subprocess, sys; run = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL); "
    "print(run.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
)


def fp8_tensors(name: str, shape: tuple[int, ...], seed: int) -> dict[str, torch.Tensor]:
    """One tensor as an FP8 checkpoint stores it: linear weights as random e4m3 codes and block scales, the rest
    (embeddings, head, norms) in bf16."""
    generator = torch.Generator().manual_seed(seed)
    if len(shape) == 2 and "embed" not in name and "lm_head" not in name:
        codes = (torch.randn(shape, generator=generator) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        grid = (math.ceil(shape[0] / BLOCK), math.ceil(shape[1] / BLOCK))
        scales = torch.rand(grid, generator=generator) * 1e-4 + 1e-5
        return {name: codes, name + "_scale_inv": scales}
    if len(shape) == 1:
        return {name: torch.ones(shape, dtype=torch.bfloat16)}
    return {name: (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)}


def write_checkpoint(folder: Path, layers: int, seed: int) -> int:
    """An FP8 checkpoint in shards of at most SHARD_BYTES (one shard in memory at a time); its bytes on disk."""
    folder.mkdir(parents=True, exist_ok=True)
    shards, shard, filled = [], {}, 0
    for index, (name, shape) in enumerate(llama_tensors(layers=layers, **SHAPE)):
        for stored, tensor in fp8_tensors(name, shape, seed * 100_003 + index).items():
            size = tensor.numel() * tensor.element_size()
            if shard and filled + size > SHARD_BYTES:
                shards.append(shard)
                save_file(shard, folder / f"shard-{len(shards):05d}.safetensors", {"format": "pt"})
                shard, filled = {}, 0
            shard[stored], filled = tensor, filled + size
    shards.append(shard)
    save_file(shard, folder / f"shard-{len(shards):05d}.safetensors", {"format": "pt"})
    weight_map = {name: f"shard-{i + 1:05d}.safetensors" for i, part in enumerate(shards) for name in part}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = llama_config(layers=layers, **SHAPE)
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [BLOCK, BLOCK],
    }
    (folder / "config.json").write_text(json.dumps(config))
    return sum(path.stat().st_size for path in folder.glob("*.safetensors"))


def merge_peak(pre: Path, post: Path, out: Path) -> tuple[float, int, int]:
    """(seconds, peak RSS in MiB, exit status) of one `merge --method linear` in a fresh process."""
    cli = str(Path(sys.executable).parent / "mergekit-lite")
    args = [cli, "merge", "--method", "linear", "--alpha", "0.5", "--base", str(pre), "--model", str(post)]
    started = time.perf_counter()
    run = subprocess.run(
        [sys.executable, "-c", MEASURE, *args, "--out", str(out), "-q"], capture_output=True, text=True, check=True
    )
    status, peak_kib = map(int, run.stdout.split())
    return time.perf_counter() - started, peak_kib // 1024, status


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="2,8,16", help="decoder depths to measure, comma-separated")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints and outputs")
    options = parser.parse_args()
    rows = []
    try:
        for layers in map(int, options.layers.split(",")):
            root = WORK / f"layers-{layers}"
            pre_bytes = write_checkpoint(root / "pre", layers, 1)
            write_checkpoint(root / "post", layers, 2)
            seconds, peak, status = merge_peak(root / "pre", root / "post", root / "merged")
            out_bytes = sum(path.stat().st_size for path in (root / "merged").glob("*.safetensors"))
            rows.append((layers, pre_bytes, out_bytes, seconds, peak, status))
            if not options.keep:
                shutil.rmtree(root)
    finally:
        if not options.keep:
            shutil.rmtree(WORK, ignore_errors=True)
    print("| layers | FP8 checkpoint MB | bf16 output MB | wall s | peak RSS MiB | exit |")
    print("| --- | --- | --- | --- | --- | --- |")
    for layers, pre_bytes, out_bytes, seconds, peak, status in rows:
        print(f"| {layers} | {pre_bytes / 1e6:.0f} | {out_bytes / 1e6:.0f} | {seconds:.1f} | {peak} | {status} |")


if __name__ == "__main__":
    main()
