#!/usr/bin/env python3
"""Micro-benchmarks behind the recommendations in RESULTS.md: the per-tensor operations that
dominate mergekit-lite's profile, on the largest Llama tensor of the 1 GB checkpoint (32000 x 2048 bf16),
and cheaper equivalents. CPU seconds (process_time) and wall seconds, best of --repeat.

    python benchmarks/microbench.py
"""
import json
import sys
import time

import numpy as np
import torch

SHAPE = (32000, 2048)


def bench(label, fn, repeat):
    best_w = best_c = float("inf")
    for _ in range(repeat):
        w, c = time.perf_counter(), time.process_time()
        fn()
        best_w, best_c = min(best_w, time.perf_counter() - w), min(best_c, time.process_time() - c)
    print(f"{label:<58} wall {best_w:7.3f} s   cpu {best_c:7.3f} s", flush=True)
    return {"label": label, "wall_s": round(best_w, 4), "cpu_s": round(best_c, 4)}


def main():
    repeat = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(SHAPE, generator=g) * 0.02).to(torch.bfloat16)
    model = (base.float() + torch.randn(SHAPE, generator=g) * 0.002).to(torch.bfloat16)
    delta = model.float() - base.float()
    n = base.numel()
    out = []
    print(f"tensor {SHAPE} bf16 ({base.numel() * 2 / 1e6:.0f} MB), torch threads {torch.get_num_threads()}")
    # finite check (done on every input of every tensor)
    out.append(bench("isfinite(bf16).all()  [current _check_finite]", lambda: torch.isfinite(base).all().item(), repeat))
    out.append(bench("bf16.sum(dtype=float32).isfinite() [overflow-safe fallback]", lambda: torch.isfinite(base.sum(dtype=torch.float32)).item(), repeat))
    out.append(bench("bf16.view(int16) exponent check via amax", lambda: ((base.view(torch.int16) & 0x7F80).amax() == 0x7F80).item(), repeat))
    out.append(bench("isfinite(fp32 merged).all()  [check output once]", lambda: torch.isfinite(delta).all().item(), repeat))
    out.append(bench("fp32.sum().isfinite()  [check output once]", lambda: torch.isfinite(delta.sum()).item(), repeat))
    # identity check
    out.append(bench("torch.equal(base, model)  [_all_identical, differing]", lambda: torch.equal(base, model), repeat))
    # casts and math
    out.append(bench("bf16 -> fp32 (.to(float32))", lambda: base.to(torch.float32), repeat))
    out.append(bench("fp32 -> bf16 (.to(bfloat16))", lambda: delta.to(torch.bfloat16), repeat))
    out.append(bench("linear: base.float()*w0 ; add_(model, alpha=w1)  [current]", lambda: (base.to(torch.float32) * 0.5).add_(model, alpha=0.5), repeat))
    buf = torch.empty(SHAPE, dtype=torch.float32)
    out.append(bench("linear: copy_ into reused fp32 buffer, mul_, add_", lambda: buf.copy_(base).mul_(0.5).add_(model, alpha=0.5), repeat))
    out.append(bench("torch.lerp(bf16, bf16, 0.5) (fp32 opmath, one rounding)", lambda: torch.lerp(base, model, 0.5), repeat))
    out.append(bench("model.float() - base.float()  [task vector]", lambda: model.to(torch.float32) - base.to(torch.float32), repeat))
    # TIES trim
    out.append(bench("kthvalue(|delta|)  [current magnitude_threshold]", lambda: torch.kthvalue(delta.reshape(-1).abs(), n // 2 + 1), repeat))
    out.append(bench("masked_fill_(|delta| < thr)", lambda: delta.clone().masked_fill_(delta.abs() < 0.001, 0.0), repeat))

    def sampled_threshold(keep):
        flat = delta.reshape(-1).abs()
        # exact k-th largest via a sampled band: quantiles of a 1M sample bracket the threshold,
        # count above the band, kthvalue only inside it (a few MB instead of 262 MB)
        idx = torch.randint(0, n, (1 << 20,), generator=torch.Generator().manual_seed(1))
        sample = flat[idx]
        q = 1 - keep / n
        lo, hi = torch.quantile(sample, torch.tensor([max(q - 0.002, 0.0), min(q + 0.002, 1.0)])).tolist()
        above = int((flat > hi).sum())
        band = flat[(flat >= lo) & (flat <= hi)]
        need = keep - above
        if 0 < need <= band.numel():
            return torch.kthvalue(band, band.numel() - need + 1).values.item()
        return torch.kthvalue(flat, n - keep + 1).values.item()

    exact = torch.kthvalue(delta.reshape(-1).abs(), n - n // 2 + 1).values.item()
    assert sampled_threshold(n // 2) == exact
    out.append(bench("sampled-band exact threshold (same value as kthvalue)", lambda: sampled_threshold(n // 2), repeat))
    # DARE mask
    out.append(bench("torch.rand(generator) >= p  [current random_drop]", lambda: torch.rand(SHAPE, generator=g) >= 0.5, repeat))
    rng = np.random.Generator(np.random.Philox(0))
    out.append(bench("numpy Philox random(float32) >= p", lambda: torch.from_numpy(rng.random(n, dtype=np.float32)) >= 0.5, repeat))
    rng2 = np.random.Generator(np.random.PCG64(0))
    out.append(bench("numpy PCG64 random(float32) >= p", lambda: torch.from_numpy(rng2.random(n, dtype=np.float32)) >= 0.5, repeat))
    out.append(bench("numpy PCG64 uint16 bits < p*65536 (bytes)", lambda: torch.from_numpy(np.frombuffer(rng2.bytes(2 * n), dtype=np.uint16).view(np.int16)) >= int(0.5 * 65536) - 32768, repeat))
    out.append(bench("torch.bernoulli_ on uint8 (generator)", lambda: torch.empty(SHAPE, dtype=torch.bool).bernoulli_(0.5, generator=g), repeat))
    # TIES/DARE consensus
    stacked = torch.stack([delta, -delta * 0.5])
    out.append(bench("sign_consensus + mul_ + sum (2 models) [current]", lambda: stacked.clone().mul_(stacked.sign() == stacked.sum(0).sign()).sum(0), repeat))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
