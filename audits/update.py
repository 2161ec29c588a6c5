"""What an adapter's update is, measured against its base: size, rank and placement of each module's
scaling*B@A (without forming it), and the two checks that read those measures: spectral (does the update live
where this base's directions are, or match the base fingerprint) and delta (does it change anything, by the
paper's total-norm rule, App. G, and by ours)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch

from mergekit_lite.audits.base import AuditBase
from mergekit_lite.audits.fingerprint import FINGERPRINT_FILE, module_similarity
from mergekit_lite.audits.report import FAIL, PASS, WARN, CheckResult, shown_names
from mergekit_lite.audits.structure import base_names, stored_tied_head
from mergekit_lite.audits.thresholds import AuditThresholds
from mergekit_lite.io.lora import LoraAdapter


@dataclass
class ModuleMeasure:
    """One LoRA module measured against its base weight."""

    name: str
    rank: int
    delta_norm: float
    relative_norm: float
    effective_rank: float
    energy_share: float
    random_share: float
    spectrum_cosine: float | None
    probe_cosine: float | None

    @property
    def enrichment(self) -> float:
        return self.energy_share / self.random_share

    @property
    def similarity(self) -> float | None:
        return None if self.spectrum_cosine is None else min(self.spectrum_cosine, self.probe_cosine)


def lowrank_singular_values(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """Singular values of left @ right from two thin QRs: r x r work, not an SVD of the full matrix."""
    left_r = torch.linalg.qr(left).R
    right_r = torch.linalg.qr(right.T).R
    return torch.linalg.svdvals(left_r @ right_r.T)


def effective_rank(singular_values: torch.Tensor) -> float:
    """Roy & Vetterli's entropy effective rank exp(H(s / sum s)): 1 for one direction, r for r equal ones."""
    total = singular_values.sum()
    if total <= 0:
        return 0.0
    shares = singular_values[singular_values > 0] / total
    return float(torch.exp(-(shares * shares.log()).sum()))


def measure_module(
    adapter: LoraAdapter, base: AuditBase, name: str, base_name: str, top_k: int, fingerprint_entry: dict | None
) -> ModuleMeasure:
    """Size, rank and placement of one module's update (adapter name) relative to its base weight (on-disk name;
    measured once per batch)."""
    matrix = base.matrix(base_name, top_k)
    left_vectors, singular_values = matrix.left_vectors, matrix.singular_values
    left, right = adapter.factors(name)
    delta_values = lowrank_singular_values(left, right)
    delta_norm = float(delta_values.norm())
    subspace = max(1, min(top_k, min(matrix.shape) // 4))
    inside = float(((left_vectors[:, :subspace].T @ left) @ right).norm())
    spectrum_cosine = probe_cosine = None
    if fingerprint_entry is not None:
        spectrum_cosine, probe_cosine = module_similarity(
            fingerprint_entry, matrix.shape, singular_values, matrix.probe
        )
    return ModuleMeasure(
        name=name,
        rank=adapter.rank(name),
        delta_norm=delta_norm,
        relative_norm=delta_norm / max(matrix.norm, 1e-12),
        effective_rank=effective_rank(delta_values),
        energy_share=(inside / delta_norm) ** 2 if delta_norm > 0 else 0.0,
        random_share=subspace / matrix.shape[0],
        spectrum_cosine=spectrum_cosine,
        probe_cosine=probe_cosine,
    )


def replacement_changes(adapter: LoraAdapter, base) -> dict[str, float]:
    """||replacement - base|| / ||base|| per replaced tensor (a replaced tied head against the embeddings it was)."""
    changes, on_disk = {}, base_names(adapter, base)
    for name in adapter.replaced():
        base_name = on_disk[name]
        weight = base.load(base_name if base_name in base else stored_tied_head(base)[1]).to(torch.float32)
        change = (adapter.replacement(name).to(torch.float32) - weight).norm()
        changes[name] = float(change / weight.norm().clamp_min(1e-12))
    return changes


def bias_changes(adapter: LoraAdapter, base) -> dict[str, float]:
    """||scaling * lora_B.bias|| / ||bias|| per bias a lora_bias adapter updates (not a matrix: no spectral measure)."""
    changes, on_disk = {}, base_names(adapter, base)
    for name in adapter.bias_targets():
        bias = base.load(on_disk[name]).to(torch.float32)
        changes[name] = float(adapter.delta(name).norm() / bias.norm().clamp_min(1e-12))
    return changes


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def check_spectral(
    measures: list[ModuleMeasure],
    fingerprint_source: str | None,
    thresholds: AuditThresholds,
    base_confirmed: bool = False,
) -> CheckResult:
    """Fingerprint match decides when there is one; else a declared base whose weights (or folder) are the given
    base's passes it; otherwise subspace alignment, which can only warn."""
    updated = [m for m in measures if m.delta_norm > 0]
    alignment = _median([m.enrichment for m in updated])
    alignment_text = (
        f"update energy in the base's top singular subspace: median {alignment:.2f}x random"
        if alignment is not None
        else "no non-zero update to place"
    )
    measurements = {
        m.name: {
            "spectrum_cosine": m.spectrum_cosine,
            "probe_cosine": m.probe_cosine,
            "energy_share": m.energy_share,
            "random_share": m.random_share,
        }
        for m in measures
    }
    if fingerprint_source is not None:
        compared = [m for m in measures if m.similarity is not None]
        if not compared:
            return CheckResult(
                "spectral",
                FAIL,
                0.0,
                thresholds.min_fingerprint_similarity,
                f"fingerprint ({fingerprint_source}) covers none of the adapter's modules",
                measurements,
            )
        worst = min(compared, key=lambda m: m.similarity)
        below = [m.name for m in compared if m.similarity < thresholds.min_fingerprint_similarity]
        uncovered = [m.name for m in measures if m.similarity is None]
        if below:
            detail = (
                f"the base does not match the adapter's base fingerprint ({fingerprint_source}): "
                f"{len(below)} of {len(compared)} modules below {thresholds.min_fingerprint_similarity}, worst "
                f"{worst.name} (spectrum cosine {worst.spectrum_cosine:.3f}, probe cosine {worst.probe_cosine:.3f})"
            )
            return CheckResult(
                "spectral", FAIL, worst.similarity, thresholds.min_fingerprint_similarity, detail, measurements
            )
        detail = f"matches the base fingerprint ({fingerprint_source}) on {len(compared)} modules, worst similarity {worst.similarity:.4f}; {alignment_text}"
        if uncovered:
            return CheckResult(
                "spectral",
                WARN,
                worst.similarity,
                thresholds.min_fingerprint_similarity,
                f"fingerprint lacks {shown_names(uncovered)}; {detail}",
                measurements,
            )
        return CheckResult(
            "spectral", PASS, worst.similarity, thresholds.min_fingerprint_similarity, detail, measurements
        )
    if base_confirmed:
        return CheckResult(
            "spectral",
            PASS,
            alignment,
            thresholds.min_alignment,
            f"no base fingerprint needed: the declared base is the given base (base-id); {alignment_text}",
            measurements,
        )
    if alignment is not None and alignment >= thresholds.min_alignment:
        return CheckResult(
            "spectral",
            PASS,
            alignment,
            thresholds.min_alignment,
            f"no base fingerprint; {alignment_text} (>= {thresholds.min_alignment}x)",
            measurements,
        )
    return CheckResult(
        "spectral",
        WARN,
        alignment,
        thresholds.min_alignment,
        f"no base fingerprint (ship {FINGERPRINT_FILE} or pass --fingerprint) and {alignment_text} "
        f"(< {thresholds.min_alignment}x): nothing shows the adapter was made on this base",
        measurements,
    )


def paper_norms(measures: list[ModuleMeasure]) -> tuple[float, float]:
    """The paper's total norm sqrt(sum ||scaling*B@A||_F^2) over LoRA modules and its per-module mean (App. G's
    norm_per_layer: total / number of modules). Two deliberate differences from the authors' audit_one
    (src/experiments/audit_pool.py), both to measure the update PEFT applies: the scaling is per module (rank_pattern,
    alpha_pattern; theirs is the global alpha/r or alpha/sqrt(r)), and LoRA on embeddings counts (PEFT merges it;
    their `"lora_A" in key` filter does not see PEFT's lora_embedding_A/B keys)."""
    total = math.sqrt(sum(m.delta_norm**2 for m in measures))
    return total, total / len(measures) if measures else 0.0


def check_delta(
    measures: list[ModuleMeasure], replaced: dict[str, float], thresholds: AuditThresholds, biases: dict[str, float]
) -> CheckResult:
    """The adapter must change something: the paper's total norm (>= min_total_norm) and, ours, the largest
    relative update (>= min_delta: one live module is enough for it, none is enough for the paper's rule).
    `replaced` and `biases` (lora_bias updates) are relative changes that count for the latter only."""
    sizes = [m.relative_norm for m in measures] + list(replaced.values()) + list(biases.values())
    largest = max(sizes)
    total, per_module = paper_norms(measures)
    measurements = {
        "total_norm": total,
        "min_total_norm": thresholds.min_total_norm,
        "per_module_mean_norm": per_module,
        "lora_modules": len(measures),
        "largest_relative": largest,
        "min_relative": thresholds.min_delta,
        "modules": {
            m.name: {
                "delta_norm": m.delta_norm,
                "relative_norm": m.relative_norm,
                "effective_rank": m.effective_rank,
                "rank": m.rank,
            }
            for m in measures
        },
        "replaced": {name: {"relative_change": change} for name, change in replaced.items()},
        "lora_bias": {name: {"relative_change": change} for name, change in biases.items()},
    }
    paper = (
        f"total norm {total:.4g} (paper: >= {thresholds.min_total_norm:g}), per-module mean {per_module:.3g} "
        f"over {len(measures)} modules"
    )
    summary = f"{paper}; largest relative update ||dW||/||W|| {largest:.2g}"
    if measures:
        summary += (
            f", median {_median([m.relative_norm for m in measures]):.2g}; effective rank (entropy of singular values) "
            f"median {_median([m.effective_rank for m in measures]):.1f} of r={_median([m.rank for m in measures]):g}"
        )
    if largest < thresholds.min_delta:
        return CheckResult(
            "delta",
            FAIL,
            total,
            thresholds.min_total_norm,
            f"no-op: largest relative update ||dW||/||W|| is {largest:.2g} (< {thresholds.min_delta:g}); {paper}",
            measurements,
        )
    if measures and total < thresholds.min_total_norm:
        return CheckResult(
            "delta",
            FAIL,
            total,
            thresholds.min_total_norm,
            f"no-op by the paper's rule: {paper} is below {thresholds.min_total_norm:g}; largest relative "
            f"update {largest:.2g}",
            measurements,
        )
    idle = [m.name for m in measures if m.relative_norm < thresholds.min_delta]
    if idle:
        return CheckResult(
            "delta",
            WARN,
            total,
            thresholds.min_total_norm,
            f"{len(idle)} of {len(measures)} LoRA modules have no effective update: {shown_names(idle)}; {summary}",
            measurements,
        )
    return CheckResult("delta", PASS, total, thresholds.min_total_norm, summary, measurements)
