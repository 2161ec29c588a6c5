"""Several LoRA adapters into one LoRA adapter, with PEFT's `add_weighted_adapter` combination types and meanings.

The truth every type is measured against is the dense weighted update `sum_i w_i * dW_i`, with `dW_i` each
adapter's own merged update (`scaling_i * B_i @ A_i`; DoRA's row-rescaled `W + scaling*B@A` minus `W`). Each
adapter's scaling (`alpha/r`, `alpha/sqrt(r)` under rsLoRA, any rank/alpha pattern) is carried into its factors, and
the written adapter has scaling 1 on every module (`lora_alpha = r`, patterns alike, no rsLoRA), so what PEFT
applies when it loads it is what was computed here. Where PEFT keeps the first adapter's `use_rslora` with
`lora_alpha = r` (scaling sqrt(r), not 1), drops `lora_B.bias` and keeps DoRA magnitudes initialised afresh, the
result here is the one above.

- `cat`: exact. The factors side by side: B = [w_1 s_1 B_1, ...], A = [A_1; ...]; rank the sum of the ranks.
- `svd`, `*_svd`: the best rank-K approximation (Eckart-Young) of the combined dense update (`svd`: the weighted sum;
  `ties_svd`, `dare_*_svd`, `magnitude_prune_svd`: the sum after that sparsifier). DoRA adapters are folded against
  the base weight first, so the result is a plain LoRA.
- `linear`, `ties`, `dare_*`, `magnitude_prune`: PEFT's combination of the factors themselves (A's and B's each
  combined with weights sign(w s) sqrt(|w s|) and sqrt(|w s|)), which is not the sum of the deltas: approximate.

Sparsifiers (PEFT's merge_utils, after Yadav et al. 2023 for TIES and Yu et al. 2024 for DARE): magnitude keeps the
`density` share with the largest |value|; DARE keeps each value with probability `density` and divides by it, drawn
from a generator seeded by (seed, module, adapter, factor), so a merge is the same run to run.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mergekit_lite.errors import InputError
from mergekit_lite.merge.adapter_combinations import RULES
from mergekit_lite.merge.extract import low_rank_factors
from mergekit_lite.merge.methods.variants import Sparsifier

EXACT = ("cat",)


def generator_for(seed: int, module: str, index: int, part: str) -> torch.Generator:
    """A generator for one DARE draw, seeded by what it is drawn for: the same draw run to run, any order."""
    digest = hashlib.sha256(f"{seed}\0{module}\0{index}\0{part}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def magnitude_pruned(tensor: torch.Tensor, density: float) -> torch.Tensor:
    """The int(density * n) largest |values| kept, the rest zero (PEFT's magnitude_based_pruning)."""
    if density >= 1:
        return tensor
    keep = int(density * tensor.numel())
    mask = torch.zeros(tensor.numel(), dtype=tensor.dtype)
    mask[torch.topk(tensor.abs().reshape(-1), k=keep).indices] = 1
    return tensor * mask.reshape(tensor.shape)


def randomly_pruned(tensor: torch.Tensor, density: float, generator: torch.Generator) -> torch.Tensor:
    """DARE: each value kept with probability `density`, then divided by it (PEFT's random_pruning, rescaled)."""
    if density >= 1:
        return tensor
    mask = torch.bernoulli(torch.full_like(tensor, density), generator=generator)
    return tensor * mask / density


def majority_agreement(stacked: torch.Tensor) -> torch.Tensor:
    """Where each task tensor's sign is the sign of their sum (TIES' elected sign, PEFT's "total" method)."""
    elected = torch.where(stacked.sum(dim=0) >= 0, 1.0, -1.0)
    return stacked.sign() == elected


def combine(
    rule: str,
    tensors: Sequence[torch.Tensor],
    weights: Sequence[float],
    density: float,
    generators: Sequence[torch.Generator] | None = None,
) -> torch.Tensor:
    """PEFT's merge_utils rules: linear (weighted sum), magnitude_prune, dare_linear (sparsify, weighted sum), ties,
    dare_ties (sparsify, elect signs on the unweighted tensors, weighted mean of those that agree)."""
    sparsifier, elect = RULES[rule]
    if sparsifier is Sparsifier.RANDOM:
        tensors = [randomly_pruned(t, density, g) for t, g in zip(tensors, generators, strict=True)]
    elif sparsifier is Sparsifier.MAGNITUDE:
        tensors = [magnitude_pruned(t, density) for t in tensors]
    stacked = torch.stack(list(tensors))
    weighted = stacked * torch.tensor(weights, dtype=stacked.dtype).view(-1, *[1] * (stacked.dim() - 1))
    if not elect:
        return weighted.sum(dim=0)
    agree = majority_agreement(stacked)
    return (weighted * agree).sum(dim=0) / agree.sum(dim=0).clamp(min=1)


@dataclass(frozen=True)
class ModuleInput:
    """One adapter's part in one module: its factors as stored (factor layout), its scaling and weight, and the
    dense update it makes there (DoRA's included)."""

    b: torch.Tensor  # B, [out, r]
    a: torch.Tensor  # A, [r, in]
    scaling: float
    weight: float
    delta: torch.Tensor  # [out, in]

    @property
    def factor(self) -> float:
        """What multiplies B @ A in the weighted sum: w * s."""
        return self.weight * self.scaling


def concatenated(inputs: Sequence[ModuleInput]) -> tuple[torch.Tensor, torch.Tensor]:
    """`cat`: B @ A = sum_i w_i s_i B_i @ A_i exactly (w s on B, as the sign must go somewhere)."""
    return torch.cat([item.b * item.factor for item in inputs], dim=1), torch.cat([item.a for item in inputs], dim=0)


def factor_combined(
    rule: str, inputs: Sequence[ModuleInput], density: float, seed: int, module: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's factor-space types: the B's combined with weights sqrt(|w s|), the A's with sign(w s) sqrt(|w s|), the
    scaling so carried into the factors. All ranks must agree (entries are combined position by position)."""
    ranks = sorted({item.a.shape[0] for item in inputs})
    if len(ranks) > 1:
        raise InputError(
            f"{module}: --combination {rule} combines the factors entry by entry, which needs one rank, and the "
            f"adapters have ranks {', '.join(map(str, ranks))} there; use cat (exact) or svd"
        )
    roots = [math.sqrt(abs(item.factor)) for item in inputs]
    signed = [math.copysign(root, item.factor) for root, item in zip(roots, inputs, strict=True)]
    count = range(len(inputs))
    return (
        combine(
            rule, [item.b for item in inputs], roots, density, [generator_for(seed, module, i, "B") for i in count]
        ),
        combine(
            rule, [item.a for item in inputs], signed, density, [generator_for(seed, module, i, "A") for i in count]
        ),
    )


def svd_combined(
    rule: str, inputs: Sequence[ModuleInput], density: float, seed: int, module: str, rank: int, device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The `*svd` types: the rule on the dense updates, then its best rank-`rank` factors (SVD on `device`)."""
    generators = [generator_for(seed, module, index, "delta") for index in range(len(inputs))]
    combined = combine(rule, [item.delta for item in inputs], [item.weight for item in inputs], density, generators)
    return low_rank_factors(combined, min(rank, *combined.shape), distribute_scale=True, device=device)


def dense_truth(inputs: Sequence[ModuleInput]) -> torch.Tensor:
    """sum_i w_i dW_i, what every type is measured against."""
    return sum((item.delta * item.weight for item in inputs), torch.zeros_like(inputs[0].delta))


def best_rank_error(truth: torch.Tensor, rank: int, device: str = "cpu") -> float:
    """||truth - best rank-`rank` approximation||_F^2 (Eckart-Young: the tail of the squared singular values)."""
    values = torch.linalg.svdvals(truth.to(device, torch.float32)).cpu()
    return float(values[rank:].square().sum())
