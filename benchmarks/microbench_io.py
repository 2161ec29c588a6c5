#!/usr/bin/env python3
"""Reading tensors the way ModelSource.load does (fresh torch.empty + readinto per tensor) vs into one reused
buffer, and writing from fresh vs reused memory: the cost of first-touch page faults. Inputs: a checkpoint's
shards, already in the page cache.

    python benchmarks/microbench_io.py benchmarks/work/ckpt-1gb/base benchmarks/work/ckpt-1gb/ft1
"""
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mergekit_lite.io.safetensors import open_model  # noqa: E402


def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def run(label, fn):
    fn()  # warm
    best = None
    for _ in range(3):
        f0, c0, w0 = faults(), time.process_time(), time.perf_counter()
        fn()
        row = (time.perf_counter() - w0, time.process_time() - c0, faults() - f0)
        best = row if best is None or row[0] < best[0] else best
    print(f"{label:<58} wall {best[0]:6.3f} s  cpu {best[1]:6.3f} s  minor faults {best[2]:>8}", flush=True)


def main():
    sources = [open_model(p) for p in sys.argv[1:]]
    entries = [(s, s.entry(n)) for s in sources for n in s.names]
    total = sum(e.nbytes for _, e in entries)
    print(f"{len(entries)} tensors, {total / 1e9:.2f} GB, torch threads {torch.get_num_threads()}")
    run("fresh buffer per tensor (ModelSource.load)", lambda: [s.load(e.name) for s, e in entries])
    scratch = torch.empty(max(e.nbytes for _, e in entries), dtype=torch.uint8)
    view = memoryview(scratch.numpy())

    def reused():
        for s, e in entries:
            h = s._handle(e.file)
            h.seek(e.offset)
            h.readinto(view[:e.nbytes])
    run("one reused buffer (readinto into the same memory)", reused)
    out = Path(os.environ.get("TMPDIR", "/tmp")) / "microbench_io.bin"
    fresh_out = [s.load(e.name) for s, e in entries[: len(entries) // 2]]

    def write_fresh():
        with open(out, "wb") as f:
            for s, e in entries[: len(entries) // 2]:
                t = torch.empty(e.nbytes, dtype=torch.uint8).copy_(scratch[: e.nbytes])  # a new output tensor each time
                f.write(memoryview(t.numpy()))

    def write_reused():
        with open(out, "wb") as f:
            for s, e in entries[: len(entries) // 2]:
                f.write(view[: e.nbytes])
    run("write: fresh output tensor per tensor (copy + write)", write_fresh)
    run("write: from one reused buffer", write_reused)
    del fresh_out
    out.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
