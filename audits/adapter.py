"""Audit a LoRA adapter against the base it claims, before anything is merged.

Checks, in order; one that cannot run because an earlier one failed is left out of the report:

1. format     safetensors (a pickle only when allowed, and then a warning); config, rank, alpha,
              target_modules and scaling read and consistent with the tensors; no NaN/Inf.
2. structure  every adapted tensor exists in the base with the same shape; copies of base tensors the
              adapter carries (targeted embeddings) equal the base's.
3. spectral   the base is the one the adapter was made on: its fingerprint matches (fail if not). With no
              fingerprint, whether the update lives in the base's top singular subspace: a warning at most.
4. delta      the update is not a no-op; its size relative to the base and its effective rank.
5. leakage    only with training data and a holdout: holdout items found in the training data.

Verdict: REJECTED if any check fails, WARN if any warns, else VERIFIED.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from audits.fingerprint import (
    DEFAULT_TOP_K,
    FINGERPRINT_FILE,
    is_weight_matrix,
    load_fingerprint,
    module_similarity,
    probe,
    top_singular,
)
from audits.leakage import check_leakage
from audits.report import (
    FAIL,
    PASS,
    REJECTED,
    WARN,
    AuditReport,
    CheckResult,
    make_report,
)
from mergekit_lite.errors import InputError
from mergekit_lite.io.lora import PEFT_DEFAULT_ALPHA, LoraAdapter

BASE_COPY_TOLERANCE = 1e-2  # relative; a bf16 copy of the same tensor differs by ~4e-3, another base by ~1
SHOWN_NAMES = 3


@dataclass(frozen=True)
class AuditThresholds:
    """What each check's measured value is held to, and why these defaults.

    min_fingerprint_similarity 0.95: per module, the smaller of the spectrum and probe cosines against
        the fingerprint. The same base scores 1.0 (bf16 copies and light fine-tunes stay above 0.999);
        unrelated weights score ~0 on the probe. 0.95 leaves room for dtype noise only.
    min_alignment 1.5: with no fingerprint, the share of the update's energy inside the base's top left
        singular subspace, over the share a random matrix has there (k/rows), median over modules.
        Unrelated weights give ~1.0 (0.9-1.15 measured on same-recipe tiny bases); updates trained on a
        base that has learned structure reuse its directions (LoRA paper, section 7): 1.7-2.8 measured
        on tiny pretrained Llamas. A randomly initialised base has no such geometry (~1.0 even for its
        own adapters). It only ever warns: a genuine update may live outside the top directions.
    top_k 8: singular directions per matrix (a fingerprint's own top_k wins). The alignment subspace is
        min(top_k, short side / 4), so it never spans more than a quarter of the space.
    min_delta 1e-4: the largest ||dW||_F / ||W||_F over modules below this is a no-op: storing the merge
        in bf16 rounds every weight by ~4e-3 relative, which swallows an update 40x smaller.
    ngram 13, max_contaminated_share 0.01: the usual decontamination n-gram length; more than 1% of the
        holdout seen in training makes scores on it untrustworthy (any contamination warns).
    """

    min_fingerprint_similarity: float = 0.95
    min_alignment: float = 1.5
    top_k: int = DEFAULT_TOP_K
    min_delta: float = 1e-4
    ngram: int = 13
    max_contaminated_share: float = 0.01


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


def find_adapters(paths) -> list[Path]:
    """Each path is an adapter folder, or a folder whose immediate subfolders are adapters."""
    found = []
    for path in map(Path, paths):
        if not path.exists():
            raise InputError(f"{path}: no such adapter folder")
        if LoraAdapter.is_adapter_dir(path):
            found.append(path)
            continue
        children = sorted(c for c in path.iterdir() if LoraAdapter.is_adapter_dir(c)) if path.is_dir() else []
        if not children:
            raise InputError(f"{path}: no adapter_config.json (neither a PEFT adapter folder nor a folder of them)")
        found.extend(children)
    return found


def _names(names: list[str]) -> str:
    return ", ".join(names[:SHOWN_NAMES]) + (f" (+{len(names) - SHOWN_NAMES} more)" if len(names) > SHOWN_NAMES else "")


def _module(base_name: str) -> str:
    return base_name.removesuffix(".weight")


def non_finite_counts(adapter: LoraAdapter) -> dict[str, int]:
    """NaN/Inf values per adapted tensor, over every tensor the adapter stores."""
    counts = {}
    for name in adapter.targets():
        counts[name] = sum(int((~torch.isfinite(t)).sum()) for t in adapter.factors(name))
    for name in adapter.replaced():
        counts[name] = int((~torch.isfinite(adapter.replacement(name))).sum())
    for name in adapter.copied_base():
        counts[f"{name} (base copy)"] = int((~torch.isfinite(adapter.base_copy(name))).sum())
    return {name: count for name, count in counts.items() if count}


def target_mismatch(config: dict, modules: list[str]) -> str | None:
    """Why config target_modules and the modules that have LoRA tensors disagree, if they do."""
    targets = config.get("target_modules")
    if not targets:
        return "config lists no target_modules"
    if isinstance(targets, str):
        if targets == "all-linear":
            return None
        unmatched = [m for m in modules if not re.fullmatch(targets, m)]
        return f"LoRA tensors for modules target_modules does not match: {_names(unmatched)}" if unmatched else None
    matches = {t: [m for m in modules if m == t or m.endswith(f".{t}")] for t in targets}
    unmatched = [m for m in modules if not any(m in hits for hits in matches.values())]
    unused = [t for t, hits in matches.items() if not hits]
    if unmatched:
        return f"LoRA tensors for modules not in target_modules: {_names(unmatched)}"
    if unused:
        return f"target_modules {_names(unused)} have no LoRA tensors"
    return None


def describe_format(adapter: LoraAdapter) -> str:
    config = adapter.config
    kind = "pickle" if adapter.weights_file.suffix == ".bin" else "safetensors"
    rule = "alpha/sqrt(r), rsLoRA" if config.get("use_rslora") else "alpha/r"
    scalings = sorted(set(adapter.scaling.values()))
    scaling = f"{scalings[0]:g}" if len(scalings) == 1 else f"{scalings[0]:g}..{scalings[-1]:g} (patterns)"
    text = f"{kind}; r={config['r']}, lora_alpha={config.get('lora_alpha', PEFT_DEFAULT_ALPHA)}"
    if scalings:
        text += f", scaling {scaling} ({rule})"
    return f"{text}; {len(adapter.targets())} LoRA modules, {len(adapter.replaced())} replaced tensors"


def check_format(adapter_dir: Path, allow_pickle: bool) -> tuple[CheckResult, LoraAdapter | None]:
    """The adapter opens cleanly and holds finite numbers; the adapter comes back only if it does."""
    try:
        adapter = LoraAdapter.open(adapter_dir, allow_pickle=allow_pickle)
    except InputError as error:
        return CheckResult("format", FAIL, None, None, str(error)), None
    if not adapter.targets() and not adapter.replaced():
        return CheckResult("format", FAIL, None, None, f"{adapter.weights_file}: no LoRA or replacement tensors"), None
    bad = non_finite_counts(adapter)
    total = sum(bad.values())
    if bad:
        return CheckResult("format", FAIL, total, 0, f"NaN/Inf values in {len(bad)} tensors: {_names(list(bad))}"), None
    warnings = []
    if adapter.weights_file.suffix == ".bin":
        warnings.append("pickle weights loaded because --allow-pickle was given (weights_only=True)")
    mismatch = target_mismatch(adapter.config, [_module(name) for name in adapter.targets()])
    if mismatch:
        warnings.append(mismatch)
    detail = "; ".join(warnings + [f"no NaN/Inf; {describe_format(adapter)}"])
    return CheckResult("format", WARN if warnings else PASS, 0, 0, detail), adapter


def check_structure(adapter: LoraAdapter, base) -> CheckResult:
    """Every adapted tensor maps onto a base tensor of the same shape; value = share of base matrices targeted."""
    problems = []
    for name in adapter.targets() + adapter.replaced() + adapter.copied_base():
        if name not in base:
            problems.append(f"{name} is not in the base")
        elif tuple(base.shape(name)) != tuple(adapter.shape(name)):
            problems.append(f"{name} is {list(adapter.shape(name))} in the adapter, {list(base.shape(name))} in the base")
    for name in adapter.copied_base():
        if name in base and tuple(base.shape(name)) == tuple(adapter.shape(name)):
            weight = base.load(name).to(torch.float32)
            difference = float((adapter.base_copy(name).to(torch.float32) - weight).norm() / weight.norm().clamp_min(1e-12))
            if difference > BASE_COPY_TOLERANCE:
                problems.append(f"the adapter's copy of {name} differs from the base's (relative {difference:.2g})")
    matrices = [name for name in base.names if is_weight_matrix(base, name)]
    coverage = len(set(adapter.targets()) & set(matrices)) / len(matrices) if matrices else 0.0
    measurements = {"targeted": adapter.targets(), "replaced": adapter.replaced(), "base_matrices": len(matrices)}
    if problems:
        return CheckResult("structure", FAIL, coverage, None, f"does not fit the base ({len(problems)} problems): {'; '.join(problems[:SHOWN_NAMES])}",
                           measurements)
    detail = (f"all {len(adapter.targets())} LoRA modules and {len(adapter.replaced())} replaced tensors match the base; "
              f"{len(adapter.targets())} of {len(matrices)} base weight matrices targeted ({coverage:.0%})")
    return CheckResult("structure", PASS, coverage, None, detail, measurements)


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


def measure_module(adapter: LoraAdapter, base, name: str, top_k: int, fingerprint_entry: dict | None) -> ModuleMeasure:
    """Size, rank and placement of one module's update relative to its base weight (one base tensor read)."""
    weight = base.load(name).to(torch.float32)
    left_vectors, singular_values = top_singular(weight, top_k)
    left, right = adapter.factors(name)
    delta_values = lowrank_singular_values(left, right)
    delta_norm = float(delta_values.norm())
    subspace = max(1, min(top_k, min(weight.shape) // 4))
    inside = float(((left_vectors[:, :subspace].T @ left) @ right).norm())
    spectrum_cosine = probe_cosine = None
    if fingerprint_entry is not None:
        spectrum_cosine, probe_cosine = module_similarity(fingerprint_entry, tuple(weight.shape), singular_values, probe(weight))
    return ModuleMeasure(
        name=name,
        rank=adapter.rank(name),
        delta_norm=delta_norm,
        relative_norm=delta_norm / max(float(weight.norm()), 1e-12),
        effective_rank=effective_rank(delta_values),
        energy_share=(inside / delta_norm) ** 2 if delta_norm > 0 else 0.0,
        random_share=subspace / weight.shape[0],
        spectrum_cosine=spectrum_cosine,
        probe_cosine=probe_cosine,
    )


def replacement_changes(adapter: LoraAdapter, base) -> dict[str, float]:
    """||replacement - base|| / ||base|| per replaced tensor."""
    changes = {}
    for name in adapter.replaced():
        weight = base.load(name).to(torch.float32)
        change = (adapter.replacement(name).to(torch.float32) - weight).norm()
        changes[name] = float(change / weight.norm().clamp_min(1e-12))
    return changes


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def check_spectral(measures: list[ModuleMeasure], fingerprint_source: str | None, thresholds: AuditThresholds) -> CheckResult:
    """Fingerprint match decides when there is one; otherwise subspace alignment, which can only warn."""
    updated = [m for m in measures if m.delta_norm > 0]
    alignment = _median([m.enrichment for m in updated])
    alignment_text = (f"update energy in the base's top singular subspace: median {alignment:.2f}x random"
                      if alignment is not None else "no non-zero update to place")
    measurements = {m.name: {"spectrum_cosine": m.spectrum_cosine, "probe_cosine": m.probe_cosine,
                             "energy_share": m.energy_share, "random_share": m.random_share} for m in measures}
    if fingerprint_source is not None:
        compared = [m for m in measures if m.similarity is not None]
        if not compared:
            return CheckResult("spectral", FAIL, 0.0, thresholds.min_fingerprint_similarity,
                               f"fingerprint ({fingerprint_source}) covers none of the adapter's modules", measurements)
        worst = min(compared, key=lambda m: m.similarity)
        below = [m.name for m in compared if m.similarity < thresholds.min_fingerprint_similarity]
        uncovered = [m.name for m in measures if m.similarity is None]
        if below:
            detail = (f"the base does not match the adapter's base fingerprint ({fingerprint_source}): "
                      f"{len(below)} of {len(compared)} modules below {thresholds.min_fingerprint_similarity}, worst "
                      f"{worst.name} (spectrum cosine {worst.spectrum_cosine:.3f}, probe cosine {worst.probe_cosine:.3f})")
            return CheckResult("spectral", FAIL, worst.similarity, thresholds.min_fingerprint_similarity, detail, measurements)
        detail = f"matches the base fingerprint ({fingerprint_source}) on {len(compared)} modules, worst similarity {worst.similarity:.4f}; {alignment_text}"
        if uncovered:
            return CheckResult("spectral", WARN, worst.similarity, thresholds.min_fingerprint_similarity,
                               f"fingerprint lacks {_names(uncovered)}; {detail}", measurements)
        return CheckResult("spectral", PASS, worst.similarity, thresholds.min_fingerprint_similarity, detail, measurements)
    if alignment is not None and alignment >= thresholds.min_alignment:
        return CheckResult("spectral", PASS, alignment, thresholds.min_alignment,
                           f"no base fingerprint; {alignment_text} (>= {thresholds.min_alignment}x)", measurements)
    return CheckResult("spectral", WARN, alignment, thresholds.min_alignment,
                       f"no base fingerprint (ship {FINGERPRINT_FILE} or pass --fingerprint) and {alignment_text} "
                       f"(< {thresholds.min_alignment}x): nothing shows the adapter was made on this base", measurements)


def check_delta(measures: list[ModuleMeasure], replaced: dict[str, float], thresholds: AuditThresholds) -> CheckResult:
    """The adapter must change something: fail if its largest relative update is below min_delta."""
    sizes = [m.relative_norm for m in measures] + list(replaced.values())
    largest = max(sizes)
    measurements = {m.name: {"delta_norm": m.delta_norm, "relative_norm": m.relative_norm,
                             "effective_rank": m.effective_rank, "rank": m.rank} for m in measures}
    measurements.update({name: {"relative_change": change} for name, change in replaced.items()})
    if largest < thresholds.min_delta:
        return CheckResult("delta", FAIL, largest, thresholds.min_delta,
                           f"no-op: largest relative update ||dW||/||W|| is {largest:.2g} (< {thresholds.min_delta:g})", measurements)
    summary = f"largest relative update ||dW||/||W|| {largest:.2g}"
    if measures:
        summary += (f", median {_median([m.relative_norm for m in measures]):.2g}; effective rank (entropy of singular values) "
                    f"median {_median([m.effective_rank for m in measures]):.1f} of r={_median([m.rank for m in measures]):g}")
    idle = [m.name for m in measures if m.relative_norm < thresholds.min_delta]
    if idle:
        return CheckResult("delta", WARN, largest, thresholds.min_delta,
                           f"{len(idle)} of {len(measures)} LoRA modules have no effective update: {_names(idle)}; {summary}",
                           measurements)
    return CheckResult("delta", PASS, largest, thresholds.min_delta, summary, measurements)


def _fingerprint_for(adapter_dir: Path, fingerprint) -> tuple[dict | None, str | None]:
    """The given fingerprint, else the one shipped in the adapter folder, else none."""
    if fingerprint is not None:
        return load_fingerprint(fingerprint), str(fingerprint)
    shipped = adapter_dir / FINGERPRINT_FILE
    if shipped.is_file():
        return load_fingerprint(shipped), f"shipped {FINGERPRINT_FILE}"
    return None, None


def audit_adapter(adapter_dir, base_dir, *, fingerprint=None, train_data=None, holdout=None,
                  thresholds: AuditThresholds = AuditThresholds(), allow_pickle: bool = False) -> AuditReport:
    """Run every applicable check on one adapter; unusable input (no adapter, bad base) raises InputError."""
    from mergekit_lite.io.safetensors import open_model

    adapter_dir = Path(adapter_dir)
    if not LoraAdapter.is_adapter_dir(adapter_dir):
        raise InputError(f"{adapter_dir}: no adapter_config.json (not a PEFT adapter folder)")
    if (train_data is None) != (holdout is None):
        raise InputError("the leakage check needs both training data and a holdout (--train-data and --holdout)")
    base = open_model(base_dir, allow_pickle=allow_pickle)
    fingerprint_data, fingerprint_source = _fingerprint_for(adapter_dir, fingerprint)
    top_k = fingerprint_data["top_k"] if fingerprint_data else thresholds.top_k
    format_check, adapter = check_format(adapter_dir, allow_pickle)
    checks = [format_check]
    if adapter is not None:
        structure = check_structure(adapter, base)
        checks.append(structure)
        if structure.status != FAIL:
            entries = fingerprint_data["modules"] if fingerprint_data else {}
            measures = [measure_module(adapter, base, name, top_k, entries.get(name)) for name in adapter.targets()]
            if measures:
                checks.append(check_spectral(measures, fingerprint_source, thresholds))
            checks.append(check_delta(measures, replacement_changes(adapter, base), thresholds))
    if train_data is not None:
        checks.append(check_leakage(train_data, holdout, thresholds.ngram, thresholds.max_contaminated_share))
    return make_report(str(adapter_dir), str(base_dir), checks)


def require_verified(adapter_dir, base_dir, force: bool = False, *, allow_pickle: bool = False) -> AuditReport:
    """The gate before a merge: a REJECTED adapter stops it unless forced; WARN passes."""
    report = audit_adapter(adapter_dir, base_dir, allow_pickle=allow_pickle)
    if report.verdict == REJECTED and not force:
        failures = "; ".join(f"{c.name}: {c.detail}" for c in report.checks if c.status == FAIL)
        raise InputError(f"adapter {adapter_dir} is REJECTED: {failures}; use --force to merge anyway")
    return report
