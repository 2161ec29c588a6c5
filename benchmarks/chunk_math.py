#!/usr/bin/env python3
"""The merge math alone: nanoseconds per output element for each method, with its inputs already in memory.

Separates the engine's arithmetic from its I/O (benchmarks/RESULTS.md, "How far from memory bandwidth"). The
tensors of one decoder layer of the benchmark's checkpoints (`make_checkpoints.py`; 44.6 M parameters, the
attention and MLP projections that make up 95 % of the model) are read into memory once; then each merge of
`bench_vs_mergekit.py`, with its exact config, is applied by the engine's own `merge_tensor` into preallocated
outputs, `--repeat` times, keeping the fastest. The floor beside it is a memory copy of the same bytes (each input
read once, the output written once), timed the same way. Both run at the thread counts and with the allocator
settings a merge uses.

    PYTHONPATH=$PWD python benchmarks/chunk_math.py [--ckpt benchmarks/work/ckpt-1gb] [--repeat 3] [--json FILE]
        [--elementwise-chunk 18]   # log2 of the elements per chunk of the compute-bound methods' passes
        [--dense-chunk 16]         # the same for the memory-bound methods (linear, slerp, task arithmetic)
        [--chunk-threads 2]        # intra-op threads of every method's chunk loop instead of the engine's choice
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open

from mergekit_lite.io.buffers import reuse_freed_memory
from mergekit_lite.merge import engine
from mergekit_lite.merge.methods import tensor_math as methods
from mergekit_lite.merge.plan import plan_merge
from mergekit_lite.merge.schema import config_from_dict

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_vs_mergekit import METHODS, merge_inputs, mergekit_config, timed  # noqa: E402  (the benchmark's own merges)

LAYER = "model.layers.0."


def layer_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys() if name.startswith(LAYER)})
    return tensors


def fastest(run, repeat: int) -> float:
    """Unrounded, unlike bench_vs_mergekit.best_of: a layer's linear merge takes a few tens of milliseconds."""
    return min(timed(run) for _ in range(repeat))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", type=Path, default=HERE / "work" / "ckpt-1gb")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--elementwise-chunk", type=int, help="log2 of methods.ELEMENTWISE_CHUNK for this run")
    parser.add_argument("--dense-chunk", type=int, help="log2 of methods.DENSE_CHUNK for this run")
    parser.add_argument("--chunk-threads", type=int, help="intra-op threads of the chunk loops (engine.chunk_threads)")
    args = parser.parse_args()
    if args.elementwise_chunk is not None:
        methods.ELEMENTWISE_CHUNK = 1 << args.elementwise_chunk
    if args.dense_chunk is not None:
        methods.DENSE_CHUNK = 1 << args.dense_chunk
    if args.chunk_threads is not None:
        engine.chunk_threads = lambda method: args.chunk_threads
    if not (args.ckpt / "base").is_dir():
        raise SystemExit(
            f"error: no checkpoints in {args.ckpt}; run benchmarks/make_checkpoints.py --size 1gb --out {args.ckpt}"
        )
    reuse_freed_memory()  # as the engine does before its chunk loops
    loaded = {name: layer_tensors(args.ckpt / name) for name in ("base", "ft1", "ft2")}
    rows = []
    for method in args.methods.split(","):
        config = config_from_dict(mergekit_config(method, args.ckpt, "bfloat16"))
        steps = [step for step in plan_merge(config).steps if step.name.startswith(LAYER) and len(step.shape) == 2]
        inputs = {
            step.name: [loaded[path.name][step.name] for path in merge_inputs(method, args.ckpt)] for step in steps
        }
        outputs = {step.name: torch.empty(step.shape, dtype=step.out_dtype) for step in steps}
        elements = sum(output.numel() for output in outputs.values())
        merge_s = fastest(
            lambda: [engine.merge_tensor(config, step, inputs[step.name], out=outputs[step.name]) for step in steps],
            args.repeat,
        )
        moved = sum(t.nbytes for tensors in inputs.values() for t in tensors) + sum(o.nbytes for o in outputs.values())
        source, target = torch.empty(moved // 2, dtype=torch.uint8), torch.empty(moved // 2, dtype=torch.uint8)
        source.fill_(1)
        copy_s = fastest(lambda: target.copy_(source), args.repeat)
        row = {
            "method": method,
            "inputs": len(merge_inputs(method, args.ckpt)),
            "elements": elements,
            "merge_ns_per_element": round(merge_s / elements * 1e9, 2),
            "copy_ns_per_element": round(copy_s / elements * 1e9, 3),
            "times_copy": round(merge_s / copy_s, 1),
        }
        rows.append(row)
        print(
            f"{method:>16}: {row['merge_ns_per_element']:6.2f} ns per element, copy of the same bytes "
            f"{row['copy_ns_per_element']:.3f} ns ({row['times_copy']}x)",
            flush=True,
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "threads": torch.get_num_threads(),
                    "elementwise_chunk": methods.ELEMENTWISE_CHUNK,
                    "dense_chunk": methods.DENSE_CHUNK,
                    "rows": rows,
                },
                indent=1,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
