#!/usr/bin/env python3
"""Explain where mergekit-lite and mergekit disagree (slerp, ties), on a few tensors, with both libraries' own math.

Runs in the mergekit venv (it imports mergekit; mergekit_lite.merge.methods needs only torch):

    benchmarks/.venv-mergekit/bin/python benchmarks/check_semantics.py benchmarks/work/ckpt-1gb

- slerp: mergekit 0.1.5 interpolates each output row (leading axis) with its own angle; mergekit-lite uses
  one angle for the whole flattened tensor. Both are checked against float64 references of either rule.
- ties: mergekit keeps exactly k = int(density * n) entries (argsort order breaks ties at the threshold);
  mergekit-lite keeps every entry whose magnitude reaches the k-th largest, so more than k where values tie
  (bf16 task vectors are quantized, so ties are common). Feeding mergekit's trimmed deltas into
  mergekit-lite's consensus + disjoint mean shows whether the trim is the only difference.
"""

import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mergekit_lite.merge import methods  # noqa: E402
from mergekit.merge_methods.slerp import slerp as mk_slerp  # noqa: E402
from mergekit.sparsify import SparsificationMethod, sparsify  # noqa: E402
from mergekit.merge_methods.generalized_task_arithmetic import get_mask  # noqa: E402

NAMES = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.input_layernorm.weight", "lm_head.weight"]


def load(folder: Path, name: str) -> torch.Tensor:
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(folder / index[name]), "pt") as handle:
        return handle.get_tensor(name)


def slerp64(a, b, t, rowwise):
    a64, b64 = a.double(), b.double()
    if rowwise:
        a64, b64 = a64.reshape(a.shape[0], -1), b64.reshape(b.shape[0], -1)
        na, nb = a64.norm(dim=1, keepdim=True), b64.norm(dim=1, keepdim=True)
        dot = ((a64 / na) * (b64 / nb)).sum(dim=1, keepdim=True).clamp(-1, 1)
    else:
        dot = (a64.reshape(-1) @ b64.reshape(-1) / (a64.norm() * b64.norm())).clamp(-1, 1)
    theta = torch.acos(dot)
    lin = dot.abs() > 0.9995
    ca = torch.where(lin, torch.full_like(dot, 1 - t), torch.sin((1 - t) * theta) / torch.sin(theta))
    cb = torch.where(lin, torch.full_like(dot, t), torch.sin(t * theta) / torch.sin(theta))
    return (ca * a64 + cb * b64).reshape(a.shape)


def frac_diff(x, y):
    return float((x.float() != y.float()).double().mean())


def main(ckpt: Path):
    report = {}
    for name in NAMES:
        base, ft1, ft2 = (load(ckpt / m, name) for m in ("base", "ft1", "ft2"))
        row = {}
        # --- slerp
        lite = methods.slerp(base, ft1, 0.5).to(torch.bfloat16)
        mk = mk_slerp(torch.tensor(0.5), base, ft1).to(torch.bfloat16)
        whole, rows = slerp64(base, ft1, 0.5, False).to(torch.bfloat16), slerp64(base, ft1, 0.5, True).to(torch.bfloat16)
        row["slerp"] = {"lite_vs_mergekit_frac_differing": frac_diff(lite, mk),
                        "lite_vs_mergekit_max_abs": float((lite.float() - mk.float()).abs().max()),
                        "lite_vs_float64_whole_tensor_frac_differing": frac_diff(lite, whole),
                        "mergekit_vs_float64_per_row_frac_differing": frac_diff(mk, rows)}
        # --- ties
        b32 = base.float()
        deltas = [m.float() - b32 for m in (ft1, ft2)]
        n = b32.numel()
        lite_kept, at_threshold = [], []
        for d in deltas:
            keep = round(0.5 * n)
            thr = methods.magnitude_threshold(d.abs(), keep)
            lite_kept.append(float((d.abs() >= thr).double().mean()))
            at_threshold.append(float((d.abs() == thr).double().mean()))
        lite_ties = methods.task_vector_merge(b32, [ft1, ft2], [1.0, 1.0], sparsifier="magnitude", densities=[0.5, 0.5],
                                              consensus=True, normalize=True).to(torch.bfloat16)
        mk_trimmed = [sparsify(d.clone(), density=0.5, method=SparsificationMethod.magnitude) for d in deltas]
        stacked = torch.stack(mk_trimmed)
        mask = get_mask(stacked, method="sum", mask_dtype=stacked.dtype)
        divisor = mask.to(stacked.dtype).sum(dim=0)
        divisor[divisor == 0] = 1
        mk_ties = (b32 + (stacked * mask).sum(dim=0) / divisor).to(torch.bfloat16)
        # mergekit-lite's consensus + disjoint mean on mergekit's trimmed deltas
        lite_on_mk_trim = methods.task_vector_merge(b32, [b32 + d for d in mk_trimmed], [1.0, 1.0], consensus=True,
                                                    normalize=True).to(torch.bfloat16)
        row["ties"] = {"lite_vs_mergekit_frac_differing": frac_diff(lite_ties, mk_ties),
                       "lite_kept_fraction_per_model": lite_kept,
                       "mergekit_kept_fraction_per_model": [float((t != 0).double().mean()) for t in mk_trimmed],
                       "fraction_at_threshold_per_model": at_threshold,
                       "lite_math_on_mergekit_trim_vs_mergekit_frac_differing": frac_diff(lite_on_mk_trim, mk_ties)}
        report[name] = row
        print(name, json.dumps(row, indent=1), flush=True)
    return report


if __name__ == "__main__":
    out = main(Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/work/ckpt-1gb"))
    if len(sys.argv) > 2:
        Path(sys.argv[2]).write_text(json.dumps(out, indent=2) + "\n")
