#!/usr/bin/env python3
"""TIES threshold and DARE mask alternatives on the largest tensor (32000 x 2048), single thread for stable numbers.

    OMP_NUM_THREADS=1 python benchmarks/microbench_ties_dare.py
"""
import time

import numpy as np
import torch

SHAPE = (32000, 2048)


def bench(label, fn, repeat=3):
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        value = fn()
        best = min(best, time.process_time() - start)
    print(f"{label:<66} cpu {best:6.3f} s", flush=True)
    return value


def radix_threshold(magnitudes: torch.Tensor, keep: int) -> float:
    """Exact keep-th largest of non-negative float32 values by a two-level histogram of their bit patterns
    (non-negative floats order like their int32 bits): 2 counting passes instead of a selection."""
    bits = magnitudes.reshape(-1).view(torch.int32)
    high = torch.bincount(bits >> 16, minlength=1 << 15)           # 32768 bins (sign bit is 0)
    above = torch.flip(torch.cumsum(torch.flip(high, [0]), 0), [0])  # count of entries in bins >= b
    bin_index = int(torch.nonzero(above >= keep).max())             # highest bin reaching `keep`
    rank_in_bin = keep - (int(above[bin_index + 1]) if bin_index + 1 < above.numel() else 0)
    inside = bits[(bits >> 16) == bin_index] & 0xFFFF
    low = torch.bincount(inside, minlength=1 << 16)
    low_above = torch.flip(torch.cumsum(torch.flip(low, [0]), 0), [0])
    low_index = int(torch.nonzero(low_above >= rank_in_bin).max())
    return torch.tensor([(bin_index << 16) | low_index], dtype=torch.int32).view(torch.float32).item()


def main():
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(SHAPE, generator=g) * 0.02).to(torch.bfloat16)
    model = (base.float() + torch.randn(SHAPE, generator=g) * 0.002).to(torch.bfloat16)
    delta = model.float() - base.float()
    mags = delta.abs()
    n, keep = mags.numel(), mags.numel() // 2
    print(f"{SHAPE}, torch threads {torch.get_num_threads()}")
    t1 = bench("kthvalue(|delta|)  [magnitude_threshold now]", lambda: torch.kthvalue(mags.reshape(-1), n - keep + 1).values.item())
    t2 = bench("two-level bit histogram (bincount), exact", lambda: radix_threshold(mags, keep))
    assert t1 == t2, (t1, t2)
    print(f"  same threshold: {t1}")
    bench("(model.float() - base.float()).abs_()  [trim_threshold's magnitudes]", lambda: (model.to(torch.float32) - base.to(torch.float32)).abs_())
    mask = torch.rand(SHAPE, generator=g) >= 0.5
    bench("torch.rand(shape, generator) >= drop  [random_drop now]", lambda: torch.rand(SHAPE, generator=g) >= 0.5)
    rng = np.random.Generator(np.random.PCG64(0))
    bench("numpy PCG64 random(float32) >= drop", lambda: torch.from_numpy(rng.random(n, dtype=np.float32)) >= 0.5)
    bench("numpy PCG64 integers(uint16) >= drop*65536", lambda: torch.from_numpy(rng.integers(0, 1 << 16, n, dtype=np.uint16).view(np.int16)) >= int(0.5 * 65536) - 32768)
    bench("delta.masked_fill_(~mask, 0)  [random_drop now]", lambda: delta.clone().masked_fill_(~mask, 0.0))
    bench("delta.mul_(mask)", lambda: delta.clone().mul_(mask))
    bench("clone alone (subtract from the two above)", lambda: delta.clone())
    bench("delta.masked_fill_(|delta| < thr, 0)  [TIES trim now]", lambda: delta.clone().masked_fill_(delta.abs() < t1, 0.0))
    bench("delta * (|delta| >= thr)", lambda: delta * (delta.abs() >= t1))
    d2 = -delta * 0.7
    stacked = torch.stack([delta, d2])
    bench("sign_consensus + mul_ + sum + divisor (2 models) [now]", lambda: _consensus_now(stacked.clone()))
    bench("consensus as d_i * (d_i * total > 0), divisor from the same mask", lambda: _consensus_fused([delta, d2]))


def _consensus_now(stacked):
    elected = stacked.sum(dim=0).sign()
    agree = stacked.sign() == elected
    merged = stacked.mul_(agree).sum(dim=0)
    divisor = (agree * torch.ones(2, 1, 1)).sum(dim=0)
    divisor.masked_fill_(divisor.abs() < 1e-8, 1.0)
    return merged.div_(divisor)


def _consensus_fused(deltas):
    total = deltas[0] + deltas[1]
    merged = torch.zeros_like(total)
    divisor = torch.zeros_like(total)
    for d in deltas:
        agree = (d * total) > 0
        merged.addcmul_(d, agree)
        divisor.add_(agree)
    return merged.div_(divisor.clamp_(min=1.0))


if __name__ == "__main__":
    main()
