"""Audit a LoRA adapter against the base it claims, before anything is merged.

Checks, in order (source in brackets: the paper is Aharon et al., "Audit Before You Merge", OpenReview
vgsNcwf81w; sections as its authors' code maps them). A check that cannot run because an earlier one
failed is left out of the report:

1. format     [ours] safetensors (a pickle only when allowed, then a warning); config typed and every
              option known (mergekit_lite/io/lora.py); no NaN/Inf; a negative lora_alpha warns.
2. base-id    [paper Table 2, App. F] the declared base_model_name_or_path against the given base's id
              (--base-id or its config's _name_or_path), aliases normalised (audits/declared_base.py).
3. structure  [ours] every adapted tensor exists in the base with the same shape, with the real cause when
              not (vision-language layout, module names of another revision, tied head, vocabulary size).
              PEFT's in-memory module names are mapped to the base's on-disk names and the tied head is
              found from the base's own tied-weight keys, as the merge does (mergekit_lite/io/sources.py).
4. tokenizer  [paper App. I, stronger] tokenizer files and vocabulary size against the base's and the
              fingerprint's; only when there is something to compare.
5. signature  [paper App. I, stronger] the base's config, tensor table and sampled weights against the
              signature in the base fingerprint (audits/fingerprint.py); only with a v2 fingerprint.
6. spectral   [ours] the base's spectra and probes against the fingerprint; without one, whether the
              update lives in the base's top singular subspace (a warning at most).
7. delta      [paper Table 2, App. G] total norm sqrt(sum ||scaling*B@A||_F^2) >= 1.0 and its per-module
              mean; [ours] the largest relative update ||dW||/||W|| >= 1e-4; effective rank.
8. behaviour  [paper App. I, stronger] only when asked: first-token KL(base || base+adapter) on probes,
              and the base's divergence from the fingerprint's recorded outputs (audits/behaviour.py).
9. leakage    [ours] only with training data and a holdout: holdout items found in the training data.

Verdict: REJECTED if any check fails, WARN if any warns, else VERIFIED.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import torch

from audits.declared_base import compare, given_base_id, names_local_folder, quantised_reason, same_folder
from audits.fingerprint import (
    DEFAULT_TOP_K,
    FINGERPRINT_FILE,
    is_weight_matrix,
    load_fingerprint,
    module_similarity,
    probe,
    sha256_file,
    tokenizer_info,
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
from mergekit_lite.devices import usable_device
from mergekit_lite.errors import InputError
from mergekit_lite.io.architecture import checkpoint_names
from mergekit_lite.io.hub import ADAPTER_PATTERNS, hub_id_of, is_hub_id, repo_files, resolve_model, split_hub_id
from mergekit_lite.io.lora import PEFT_DEFAULT_ALPHA, PICKLE_FILE, SAFETENSORS_FILE, LoraAdapter
from mergekit_lite.io.safetensors import open_model
from mergekit_lite.io.sources import tied_head
from mergekit_lite.merge.plan import layer_index

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
    min_total_norm 1.0: the paper's no-op rule (Table 2; calibrated in App. G, where audited Llama-3.1
        adapters measured 1.07-16.6 and the excluded no-op 0.016). An absolute Frobenius norm: it grows
        with model width and the number of adapted modules, so it is the paper's rule for 7-8B models
        and can be lowered (--min-total-norm) for small ones.
    min_kl 1e-3, min_noop_top1 0.95, max_kl 20: the paper's reading of the output divergence (App. I):
        KL below 1e-3 with the greedy token kept on more than 95% of probes is a no-op, KL above 20 nats
        is "likely wrong base".
    max_base_kl 1e-3 (ours): the given base's KL from the fingerprinted base's recorded outputs, held to the
        paper's no-op scale: a base that far from the recorded one is not behaviourally the same. Measured on
        tiny pretrained Llamas: the same weights 3e-8, a bf16 copy 2e-6, a twin pretrained alike from another
        seed 1.8e-2.
    ngram 13, max_contaminated_share 0.01: the usual decontamination n-gram length; more than 1% of the
        holdout seen in training makes scores on it untrustworthy (any contamination warns).
    """

    min_fingerprint_similarity: float = 0.95
    min_alignment: float = 1.5
    top_k: int = DEFAULT_TOP_K
    min_delta: float = 1e-4
    min_total_norm: float = 1.0
    min_kl: float = 1e-3
    min_noop_top1: float = 0.95
    max_kl: float = 20.0
    max_base_kl: float = 1e-3
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


@dataclass(frozen=True)
class AdapterRef:
    """An adapter as the user named it (a folder, or a hub id `org/name[@revision]`) and the folder read for it."""

    name: str
    path: Path
    hub: bool = False


def find_adapters(paths) -> list[AdapterRef]:
    """Each path is an adapter folder, a folder whose immediate subfolders are adapters, or a hub id (a local path
    always wins) fetched into the Hugging Face cache: only ADAPTER_PATTERNS, never a pickle. A subfolder that
    links out of the named folder is refused, not followed: reads stay inside the paths the user named (name
    the linked adapter itself to audit it)."""
    found = []
    for reference in map(str, paths):
        path = Path(reference)
        if is_hub_id(reference):
            found.append(AdapterRef(reference, Path(resolve_model(reference, ADAPTER_PATTERNS)), hub=True))
            continue
        if not path.exists():
            raise InputError(f"{path}: no such adapter folder")
        if LoraAdapter.is_adapter_dir(path):
            found.append(AdapterRef(str(path), path))
            continue
        children = sorted(c for c in path.iterdir() if LoraAdapter.is_adapter_dir(c)) if path.is_dir() else []
        if not children:
            raise InputError(f"{path}: no adapter_config.json (neither a PEFT adapter folder nor a folder of them)")
        root = Path(os.path.realpath(path))
        for child in children:
            if root not in Path(os.path.realpath(child)).parents:
                raise InputError(f"{child}: links out of {path}; name the adapter itself to audit it")
        found.extend(AdapterRef(str(child), child) for child in children)
    return found


MAX_LIST_BYTES = 1 << 20


def read_adapter_list(path) -> list[str]:
    """`--from-file`: one adapter folder or hub id per line; blank lines and `#` comments skipped. The file is a user
    input: a regular file (a FIFO is refused, not waited on), at most 1 MiB, UTF-8."""
    from mergekit_lite.io.validation import read_text

    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except OSError as error:
        raise InputError(f"{path}: cannot read ({error.strerror})") from None
    if not stat.S_ISREG(mode):
        raise InputError(f"{path}: not a regular file")
    entries = [re.sub(r"(^|\s)#.*$", "", line).strip() for line in read_text(path, limit=MAX_LIST_BYTES).splitlines()]
    entries = [entry for entry in entries if entry]
    if not entries:
        raise InputError(f"{path}: lists no adapters")
    return entries


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


def overflowing_updates(adapter: LoraAdapter) -> list[str]:
    """Modules whose dense update, or its squared norm (what the delta and spectral checks measure), is not finite
    in float32 although the factors are (a huge lora_alpha): no check could measure it, and no merge should use it."""
    overflowing = []
    for name in adapter.targets():
        delta = adapter.delta(name)
        if not bool(torch.isfinite(delta).all()) or not math.isfinite(delta.square().sum().item()):
            overflowing.append(name)
    return overflowing


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
    overflowing = overflowing_updates(adapter)
    if overflowing:
        return CheckResult("format", FAIL, len(overflowing), 0, f"the update scaling*B@A overflows float32 in "
                           f"{len(overflowing)} modules: {_names(overflowing)} ({describe_format(adapter)})"), None
    warnings = []
    if adapter.weights_file.suffix == ".bin":
        warnings.append("pickle weights loaded because --allow-pickle was given (weights_only=True)")
    mismatch = target_mismatch(adapter.config, [_module(name) for name in adapter.targets()])
    if mismatch:
        warnings.append(mismatch)
    negative = sorted(name for name, scale in adapter.scaling.items() if scale < 0)
    if negative:
        warnings.append(f"negative lora_alpha (scaling {adapter.scaling[negative[0]]:g} on {_names(negative)}): "
                        "the merge subtracts what the adapter learned")
    detail = "; ".join(warnings + [f"no NaN/Inf; {describe_format(adapter)}"])
    return CheckResult("format", WARN if warnings else PASS, 0, 0, detail), adapter


# Where vision-language checkpoints put the text model, and the text-only name each stands for.
VLM_LAYOUTS = (("model.language_model.", "model."), ("language_model.model.", "model."), ("language_model.", ""),
               ("model.text_model.", "model."), ("text_model.", ""))


def _text_model_name(name: str) -> str:
    for segment, text_only in VLM_LAYOUTS:
        if name.startswith(segment):
            return text_only + name[len(segment):]
    return name


def stored_tied_head(base) -> tuple[str, str] | None:
    """(head, embeddings) on disk when the base ties its head to its embeddings (transformers' own tied keys
    for its architecture, e.g. GPT2's transformer.wte) and stores the embeddings only; else None."""
    pair = tied_head(base.config)
    return pair if pair is not None and pair[0] not in base and pair[1] in base else None


def base_names(adapter: LoraAdapter, base) -> dict[str, str]:
    """Each tensor the adapter holds -> the base's on-disk name for it. PEFT names modules as they are in memory
    (a multimodal Gemma3's model.language_model...), the base as it is stored: mapped as the merge maps them."""
    names = adapter.targets() + adapter.replaced() + adapter.copied_base()
    unknown = [name for name in names if name not in base]
    on_disk = checkpoint_names(base.config, unknown) if unknown else {}
    return {name: on_disk.get(name, name) for name in names}


def why_absent(name: str, base, replaced: bool) -> str | None:
    """The real reason a base name the adapter adapts is not in the base (None: it is fine, a tied head replaced)."""
    tied = stored_tied_head(base)
    if tied and name == tied[0]:
        if replaced:
            return None
        return (f"{name}: the base ties {_module(name)} to {tied[1]} (tie_word_embeddings) and stores no {name}; "
                "a LoRA on a tied head would change the input embeddings too")
    bare = _text_model_name(name)
    if any(_text_model_name(other) == bare for other in base.names):
        return (f"{name}: the adapter and the base use different vision-language layouts (language_model. inside or "
                "outside model.): it was made for the VLM checkpoint, or for its text model, not this one")
    leaf = _module(name).rsplit(".", 1)[-1]
    base_leaves = sorted({_module(other).rsplit(".", 1)[-1] for other in base.names if layer_index(other) is not None})
    if layer_index(name) is not None and leaf not in base_leaves:
        return (f"{name}: this base has no module named {leaf} (its layer modules: {', '.join(base_leaves[:8])}): "
                "module names of another architecture or of an older revision of this model's code")
    return f"{name} is not in the base"


def why_shapes_differ(name: str, adapter_shape, base_shape, base) -> str:
    vocab = (base.config or {}).get("vocab_size")
    vocabulary_rows = name in (tied_head(base.config) or ()) or "embed" in name or "lm_head" in name
    if vocabulary_rows and adapter_shape[1:] == base_shape[1:]:
        return (f"{name}: vocabulary of {adapter_shape[0]} rows in the adapter, {base_shape[0]} in the base"
                f"{f' (vocab_size {vocab})' if vocab else ''}: made with another tokenizer or resized embeddings")
    return f"{name} is {list(adapter_shape)} in the adapter, {list(base_shape)} in the base (another model size?)"


def check_structure(adapter: LoraAdapter, base) -> CheckResult:
    """Every adapted tensor maps onto a base tensor of the same shape; value = share of base matrices targeted."""
    problems, notes = [], []
    on_disk = base_names(adapter, base)
    for name, base_name in on_disk.items():
        if base_name not in base:
            problem = why_absent(base_name, base, replaced=name in adapter.replaced())
            if problem:
                problems.append(problem)
                continue
            head, base_name = stored_tied_head(base)
            notes.append(f"{name} (modules_to_save) replaces the head the base ties to {base_name}: "
                         f"the merge writes an untied {head} (tie_word_embeddings false)")
        if tuple(base.shape(base_name)) != tuple(adapter.shape(name)):
            problems.append(why_shapes_differ(base_name, adapter.shape(name), base.shape(base_name), base))
    for name in adapter.copied_base():
        base_name = on_disk[name]
        if base_name in base and tuple(base.shape(base_name)) == tuple(adapter.shape(name)):
            weight = base.load(base_name).to(torch.float32)
            difference = float((adapter.base_copy(name).to(torch.float32) - weight).norm() / weight.norm().clamp_min(1e-12))
            if difference > BASE_COPY_TOLERANCE:
                problems.append(f"the adapter's copy of {name} differs from the base's (relative {difference:.2g})")
    matrices = [name for name in base.names if is_weight_matrix(base, name)]
    coverage = len({on_disk[name] for name in adapter.targets()} & set(matrices)) / len(matrices) if matrices else 0.0
    measurements = {"targeted": adapter.targets(), "replaced": adapter.replaced(), "base_matrices": len(matrices),
                    "merge_notes": notes}
    if problems:
        return CheckResult("structure", FAIL, coverage, None, f"does not fit the base ({len(problems)} problems): {'; '.join(problems[:SHOWN_NAMES])}",
                           measurements)
    detail = (f"all {len(adapter.targets())} LoRA modules and {len(adapter.replaced())} replaced tensors match the base; "
              f"{len(adapter.targets())} of {len(matrices)} base weight matrices targeted ({coverage:.0%})")
    return CheckResult("structure", PASS, coverage, None, "; ".join(notes + [detail]), measurements)


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


@dataclass(frozen=True)
class BaseMatrix:
    """What the checks need of one base weight matrix: its norm, top singular directions and probe."""

    shape: tuple[int, ...]
    norm: float
    left_vectors: torch.Tensor
    singular_values: torch.Tensor
    probe: torch.Tensor


@dataclass
class AuditBase:
    """The base of an audit, opened and measured once for a whole batch: a base matrix's SVD is computed the first
    time an adapter adapts it and reused for every other adapter (kept: rows x top_k numbers per matrix, not the
    matrix), and so are the tokenizer files' hashes, signature comparisons and, with --behaviour, the loaded model."""

    reference: str
    path: Path
    source: object
    hub_id: str | None
    matrices: dict = field(default_factory=dict)
    cache: dict = field(default_factory=dict)

    @classmethod
    def open(cls, reference, allow_pickle: bool = False) -> "AuditBase":
        """A base folder or file, or a hub id (the snapshot of it in the Hugging Face cache, weights and config)."""
        reference = str(reference)
        hub_id = split_hub_id(reference)[0] if is_hub_id(reference) else None
        path = Path(resolve_model(reference))
        return cls(reference, path, open_model(path, allow_pickle=allow_pickle), hub_id or hub_id_of(path))

    def matrix(self, name: str, top_k: int) -> BaseMatrix:
        key = (name, top_k)
        if key not in self.matrices:
            weight = self.source.load(name).to(torch.float32)
            left_vectors, singular_values = top_singular(weight, top_k)
            self.matrices[key] = BaseMatrix(tuple(weight.shape), float(weight.norm()), left_vectors, singular_values,
                                            probe(weight))
        return self.matrices[key]

    def once(self, key, compute):
        """`compute()` the first time `key` is asked for; the same answer after that."""
        if key not in self.cache:
            self.cache[key] = compute()
        return self.cache[key]


def measure_module(adapter: LoraAdapter, base: AuditBase, name: str, base_name: str, top_k: int,
                   fingerprint_entry: dict | None) -> ModuleMeasure:
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
        spectrum_cosine, probe_cosine = module_similarity(fingerprint_entry, matrix.shape, singular_values, matrix.probe)
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


def paper_norms(measures: list[ModuleMeasure]) -> tuple[float, float]:
    """The paper's total norm sqrt(sum ||scaling*B@A||_F^2) over LoRA modules and its per-module mean (App. G's
    norm_per_layer: total / number of modules). Two deliberate differences from the authors' audit_one
    (src/experiments/audit_pool.py), both to measure the update PEFT applies: the scaling is per module (rank_pattern,
    alpha_pattern; theirs is the global alpha/r or alpha/sqrt(r)), and LoRA on embeddings counts (PEFT merges it;
    their `"lora_A" in key` filter does not see PEFT's lora_embedding_A/B keys)."""
    total = math.sqrt(sum(m.delta_norm ** 2 for m in measures))
    return total, total / len(measures) if measures else 0.0


def check_delta(measures: list[ModuleMeasure], replaced: dict[str, float], thresholds: AuditThresholds) -> CheckResult:
    """The adapter must change something: the paper's total norm (>= min_total_norm) and, ours, the largest
    relative update (>= min_delta: one live module is enough for it, none is enough for the paper's rule)."""
    sizes = [m.relative_norm for m in measures] + list(replaced.values())
    largest = max(sizes)
    total, per_module = paper_norms(measures)
    measurements = {
        "total_norm": total, "min_total_norm": thresholds.min_total_norm, "per_module_mean_norm": per_module,
        "lora_modules": len(measures), "largest_relative": largest, "min_relative": thresholds.min_delta,
        "modules": {m.name: {"delta_norm": m.delta_norm, "relative_norm": m.relative_norm,
                             "effective_rank": m.effective_rank, "rank": m.rank} for m in measures},
        "replaced": {name: {"relative_change": change} for name, change in replaced.items()},
    }
    paper = (f"total norm {total:.4g} (paper: >= {thresholds.min_total_norm:g}), per-module mean {per_module:.3g} "
             f"over {len(measures)} modules")
    summary = f"{paper}; largest relative update ||dW||/||W|| {largest:.2g}"
    if measures:
        summary += (f", median {_median([m.relative_norm for m in measures]):.2g}; effective rank (entropy of singular values) "
                    f"median {_median([m.effective_rank for m in measures]):.1f} of r={_median([m.rank for m in measures]):g}")
    if largest < thresholds.min_delta:
        return CheckResult("delta", FAIL, total, thresholds.min_total_norm,
                           f"no-op: largest relative update ||dW||/||W|| is {largest:.2g} (< {thresholds.min_delta:g}); {paper}",
                           measurements)
    if measures and total < thresholds.min_total_norm:
        return CheckResult("delta", FAIL, total, thresholds.min_total_norm,
                           f"no-op by the paper's rule: {paper} is below {thresholds.min_total_norm:g}; largest relative "
                           f"update {largest:.2g}", measurements)
    idle = [m.name for m in measures if m.relative_norm < thresholds.min_delta]
    if idle:
        return CheckResult("delta", WARN, total, thresholds.min_total_norm,
                           f"{len(idle)} of {len(measures)} LoRA modules have no effective update: {_names(idle)}; {summary}",
                           measurements)
    return CheckResult("delta", PASS, total, thresholds.min_total_norm, summary, measurements)


def check_declared_base(adapter: LoraAdapter, audit_base: AuditBase, base_id: str | None,
                        card_base: str | None = None) -> CheckResult:
    """The paper's base check: the declared base_model_name_or_path (else the `base_model` of the adapter's model
    card) names the given base (aliases normalised): --base-id, else the base's hub id when it was given as one."""
    base, base_dir = audit_base.source, audit_base.path
    declared = adapter.config.get("base_model_name_or_path") or card_base
    given, given_from = given_base_id(base_dir, base_id, base.config, audit_base.hub_id)
    measurements = {"declared": declared, "declared_in": "adapter_config.json" if adapter.config.get(
        "base_model_name_or_path") else ("README.md base_model" if card_base else None),
                    "given": given, "given_from": given_from or None}
    quantisation = (base.config or {}).get("quantization_config")
    if quantisation:
        method = quantisation.get("quant_method", "?") if isinstance(quantisation, dict) else "?"
        return CheckResult("base-id", FAIL, None, None, f"the given base is quantised (quant_method {method}): "
                           "a merge needs the full-precision base weights", measurements)
    if not declared:
        return CheckResult("base-id", WARN, None, None, "adapter_config.json declares no base_model_name_or_path: "
                           "nothing says which base the adapter was made on", measurements)
    if names_local_folder(declared) and same_folder(declared, base_dir):
        return CheckResult("base-id", PASS, None, None, f"declares this base folder ({declared})", measurements)
    if reason := quantised_reason(declared):  # fails as named, with or without an id to compare it with
        return CheckResult("base-id", FAIL, None, None, f"{reason} (declared {declared})", measurements)
    if names_local_folder(declared):
        return CheckResult("base-id", WARN, None, None, f"declares a local path ({declared}), not a hub id: cannot "
                           "verify it by name (pass --base-id to name the given base)", measurements)
    if given is None:
        return CheckResult("base-id", WARN, None, None, f"declares {declared}, but the given base has no hub id (its "
                           "config.json has no _name_or_path that is one): pass --base-id to verify", measurements)
    reasons = compare(declared, given)
    if reasons:
        return CheckResult("base-id", FAIL, None, None, f"{'; '.join(reasons)} (declared {declared}, given {given} "
                           f"from {given_from})", measurements)
    return CheckResult("base-id", PASS, None, None, f"declared {declared} is the given {given} ({given_from})", measurements)


def _tokenizer_vocab(folder: Path) -> int | None:
    """Tokens in a folder's tokenizer.json, added tokens included (tokenizers reads it; nothing runs)."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    except Exception:  # not a tokenizers file; the file hashes still compare
        return None


def check_tokenizer(adapter: LoraAdapter, audit_base: AuditBase, fingerprint: dict | None) -> CheckResult | None:
    """Tokenizer files and vocabulary size against the base (App. I); None when there is nothing to compare."""
    base = audit_base.source
    base_folder = base.path if base.path.is_dir() else base.path.parent
    base_info = audit_base.once("tokenizer", lambda: tokenizer_info(base_folder, base.config))
    adapter_info = tokenizer_info(adapter.path, None)
    shipped, refused = adapter_info["files"], adapter_info["refused"]
    recorded = (fingerprint or {}).get("tokenizer")
    if not shipped and not recorded and not refused:
        return None
    vocab = base_info["vocab_size"]
    measurements = {"base_vocab_size": vocab, "base_files": base_info["files"], "adapter_files": shipped,
                    "fingerprint": recorded}
    failures = []
    warnings = [f"not read: {', '.join(refused)} (not a regular file inside {adapter.path}: a link out of it?)"] if refused else []
    adapter_vocab = _tokenizer_vocab(adapter.path) if "tokenizer.json" in shipped else None
    measurements["adapter_tokenizer_size"] = adapter_vocab
    if adapter_vocab and vocab and adapter_vocab > vocab:
        failures.append(f"the adapter's tokenizer has {adapter_vocab} tokens, the base's embeddings {vocab} rows: "
                        "its added tokens need embeddings this base does not have")
    differing = sorted(name for name, digest in shipped.items() if base_info["files"].get(name) != digest)
    if differing:
        warnings.append(f"the adapter ships tokenizer files that differ from the base's: {', '.join(differing)}")
    if recorded:
        if recorded.get("vocab_size") and vocab and recorded["vocab_size"] != vocab:
            failures.append(f"vocab_size {vocab} in the base, {recorded['vocab_size']} in the base fingerprint")
        changed = sorted(name for name, digest in recorded.get("files", {}).items() if base_info["files"].get(name) != digest)
        if changed:
            warnings.append(f"tokenizer files differ from the fingerprinted base's: {', '.join(changed)}")
    if failures:
        return CheckResult("tokenizer", FAIL, vocab, None, "; ".join(failures + warnings), measurements)
    if warnings:
        return CheckResult("tokenizer", WARN, vocab, None, "; ".join(warnings), measurements)
    return CheckResult("tokenizer", PASS, vocab, None, f"vocab_size {vocab}; tokenizer files match", measurements)


def check_signature(signature: dict, audit_base: AuditBase, source: str) -> CheckResult:
    """The base holds the weights the signature was taken from (sampled values compared as numbers; once per
    distinct signature in a batch)."""
    from audits.fingerprint import compare_samples, tensor_table_hash

    base = audit_base.source
    differing, missing = audit_base.once(("signature", json.dumps(signature, sort_keys=True)),
                                         lambda: compare_samples(signature, base))
    signed = len(signature["samples"])
    base_folder = base.path if base.path.is_dir() else base.path.parent
    same_config = signature.get("config_sha256") == audit_base.once(
        "config_sha256", lambda: sha256_file(base_folder / "config.json"))
    same_table = signature.get("tensor_table_sha256") == audit_base.once("table", lambda: tensor_table_hash(base))
    measurements = {"digest": signature.get("digest"), "signed_tensors": signed, "differing": differing,
                    "missing": missing, "same_config": same_config, "same_tensor_table": same_table}
    share = (len(differing) + len(missing)) / max(signed, 1)
    if differing or missing:
        parts = [f"{len(differing)} of {signed} signed tensors hold other values ({_names(differing)})"] if differing else []
        parts += [f"{len(missing)} signed tensors are missing ({_names(missing)})"] if missing else []
        return CheckResult("signature", FAIL, share, 0.0, f"not the base in the signature ({source}, digest "
                           f"{signature.get('digest')}): {'; '.join(parts)}", measurements)
    notes = [] if same_config and same_table else [
        "same weights, but " + " and ".join(part for part, same in (("config.json", same_config),
                                                                     ("dtypes/shapes", same_table)) if not same) + " differ"]
    return CheckResult("signature", PASS, share, 0.0, "; ".join(notes + [f"all {signed} signed tensors match "
                       f"({source}, digest {signature.get('digest')})"]), measurements)


def check_behaviour(adapter: LoraAdapter, base: AuditBase, fingerprint: dict | None, thresholds: AuditThresholds,
                    device: str) -> CheckResult:
    """First-token KL(base || base+adapter) on probes (App. I, the authors' direction) and, with a recorded
    reference, the base's own KL."""
    from audits.behaviour import load_causal_lm, measure_divergence

    reference = (fingerprint or {}).get("behaviour")
    model = base.once(("model", device), lambda: load_causal_lm(base.path, device))
    divergence, probes, skipped = measure_divergence(base.path, adapter, device, reference, model=model)
    kl, agreement, base_kl = divergence.mean_kl, divergence.top1_agreement, divergence.mean_base_kl
    measurements = {"mean_kl": kl, "per_probe_kl": divergence.kl, "kl_direction": "KL(base || base+adapter)",
                    "mean_reverse_kl": divergence.mean_reverse_kl, "top1_agreement": agreement,
                    "base_vs_fingerprint_kl": base_kl, "probes": probes, "device": device, "not_applied": skipped,
                    "min_kl": thresholds.min_kl, "min_noop_top1": thresholds.min_noop_top1,
                    "max_kl": thresholds.max_kl, "max_base_kl": thresholds.max_base_kl}
    summary = (f"first-token KL(base || base+adapter) {kl:.3g} nats, greedy token kept on {agreement:.0%} of "
               f"{len(divergence.kl)} probes ({probes})")
    if base_kl is not None:
        summary += f"; the base's KL from the fingerprinted base's outputs {base_kl:.3g}"
    if base_kl is not None and base_kl > thresholds.max_base_kl:
        return CheckResult("behaviour", FAIL, base_kl, thresholds.max_base_kl, "the base does not behave like the "
                           f"base the adapter's fingerprint recorded (KL {base_kl:.3g} > {thresholds.max_base_kl:g}): "
                           f"another base; {summary}", measurements)
    if kl < thresholds.min_kl and agreement > thresholds.min_noop_top1:
        return CheckResult("behaviour", FAIL, kl, thresholds.min_kl, f"no-op: {summary} (KL < {thresholds.min_kl:g})",
                           measurements)
    if kl > thresholds.max_kl:
        return CheckResult("behaviour", FAIL, kl, thresholds.max_kl, f"extreme divergence, likely another base: "
                           f"{summary} (> {thresholds.max_kl:g})", measurements)
    if skipped:
        return CheckResult("behaviour", WARN, kl, thresholds.min_kl, f"{_names(skipped)} not applied (no such "
                           f"parameter in the loaded model); {summary}", measurements)
    return CheckResult("behaviour", PASS, kl, thresholds.min_kl, summary, measurements)


def _fingerprint_for(adapter_dir: Path, fingerprint) -> tuple[dict | None, str | None]:
    """The given fingerprint, else the one shipped in the adapter folder, else none."""
    if fingerprint is not None:
        return load_fingerprint(fingerprint), str(fingerprint)
    shipped = adapter_dir / FINGERPRINT_FILE
    if shipped.is_file():
        return load_fingerprint(shipped), f"shipped {FINGERPRINT_FILE}"
    return None, None


def audit_adapter(adapter_dir, base_dir, *, fingerprint=None, train_data=None, holdout=None,
                  thresholds: AuditThresholds = AuditThresholds(), allow_pickle: bool = False,
                  base_id: str | None = None, behaviour: bool = False, device: str = "cpu") -> AuditReport:
    """Run every applicable check on one adapter; unusable input (no adapter, bad base) raises InputError.

    `adapter_dir`: a folder, a hub id or an AdapterRef (find_adapters); `base_dir`: a folder, a hub id or an
    AuditBase shared by a batch. A base given as a hub id is the id the declared base is compared with (unless
    `base_id` says otherwise). A hub adapter's pickle is never downloaded or loaded, --allow-pickle or not."""
    if isinstance(adapter_dir, AdapterRef):
        ref = adapter_dir
    else:
        ref = find_adapters([adapter_dir])[0] if is_hub_id(str(adapter_dir)) else AdapterRef(str(adapter_dir), Path(adapter_dir))
    if not LoraAdapter.is_adapter_dir(ref.path):
        raise InputError(f"{ref.name}: no adapter_config.json (not a PEFT adapter folder)")
    if (train_data is None) != (holdout is None):
        raise InputError("the leakage check needs both training data and a holdout (--train-data and --holdout)")
    if behaviour:
        usable_device(device)
    audit_base = base_dir if isinstance(base_dir, AuditBase) else AuditBase.open(base_dir, allow_pickle)
    base = audit_base.source
    fingerprint_data, fingerprint_source = _fingerprint_for(ref.path, fingerprint)
    top_k = fingerprint_data["top_k"] if fingerprint_data else thresholds.top_k
    pickle_only = ref.hub and _pickle_only(ref)
    format_check, adapter = pickle_only or check_format(ref.path, allow_pickle and not ref.hub)
    checks = [format_check]
    if adapter is not None:
        checks.append(check_declared_base(adapter, audit_base, base_id, card_base_model(ref.path)))
        structure = check_structure(adapter, base)
        checks.append(structure)
        tokenizer = check_tokenizer(adapter, audit_base, fingerprint_data)
        if tokenizer is not None:
            checks.append(tokenizer)
        if fingerprint_data and fingerprint_data.get("signature"):
            checks.append(check_signature(fingerprint_data["signature"], audit_base, fingerprint_source))
        if structure.status != FAIL:
            entries = fingerprint_data["modules"] if fingerprint_data else {}
            on_disk = base_names(adapter, base)
            measures = [measure_module(adapter, audit_base, name, on_disk[name], top_k, entries.get(on_disk[name]))
                        for name in adapter.targets()]
            if measures:
                checks.append(check_spectral(measures, fingerprint_source, thresholds))
            checks.append(check_delta(measures, replacement_changes(adapter, base), thresholds))
            if behaviour:
                checks.append(check_behaviour(adapter, audit_base, fingerprint_data, thresholds, device))
    if train_data is not None:
        checks.append(check_leakage(train_data, holdout, thresholds.ngram, thresholds.max_contaminated_share))
    return make_report(ref.name, audit_base.reference, checks)


def _pickle_only(ref: AdapterRef) -> tuple[CheckResult, None] | None:
    """A hub repository with adapter_model.bin and no adapter_model.safetensors: refused by the file listing alone
    (the pickle is not in ADAPTER_PATTERNS, so it is never downloaded, and never opened)."""
    files = repo_files(ref.name, ref.path)
    if SAFETENSORS_FILE in files or PICKLE_FILE not in files:
        return None
    return CheckResult("format", FAIL, None, None, f"{ref.name} ships only pickled weights ({PICKLE_FILE}), which can "
                       "run code when loaded: refused without downloading or unpickling them (ask for "
                       f"{SAFETENSORS_FILE})", {"repo_files": files}), None


def card_base_model(folder: Path) -> str | None:
    """The `base_model` an adapter's model card declares (the first, when it lists several), or None."""
    from mergekit_lite.io.model_card import read_card_metadata

    declared = read_card_metadata(folder).get("base_model")
    if isinstance(declared, list):
        declared = declared[0] if declared else None
    return declared if isinstance(declared, str) else None


def audit_batch(adapters: list[AdapterRef], base: AuditBase, **options):
    """Audit each adapter against one base, opened once: reports one at a time, as each finishes (nothing of an
    adapter stays in memory after its report)."""
    for ref in adapters:
        yield audit_adapter(ref, base, **options)


UNMERGEABLE = ("format", "structure")  # an adapter that cannot be read, or does not fit the base, cannot be merged


def require_verified(adapter_dir, base_dir, force: bool = False, *, allow_pickle: bool = False) -> AuditReport:
    """The gate before a merge: a REJECTED adapter stops it unless forced; WARN passes. Failed format or
    structure checks stop it even when forced, and the error does not offer --force: there is nothing to merge."""
    report = audit_adapter(adapter_dir, base_dir, allow_pickle=allow_pickle)
    failed = [check for check in report.checks if check.status == FAIL]
    unmergeable = any(check.name in UNMERGEABLE for check in failed)
    if report.verdict == REJECTED and (unmergeable or not force):
        failures = "; ".join(f"{check.name}: {check.detail}" for check in failed)
        advice = "" if unmergeable else "; use --force to merge anyway"
        raise InputError(f"adapter {adapter_dir} is REJECTED: {failures}{advice}")
    return report
