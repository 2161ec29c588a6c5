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
              found from the base's own tied-weight keys, as the merge does (audits/structure.py).
4. tokenizer  [paper App. I, stronger] tokenizer files and vocabulary size against the base's and the
              fingerprint's; only when there is something to compare.
5. signature  [paper App. I, stronger] the base's config, tensor table and sampled weights against the
              signature in the base fingerprint (audits/fingerprint.py); only with a v2 fingerprint.
6. spectral   [ours] the base's spectra and probes against the fingerprint; without one, whether the
              update lives in the base's top singular subspace (a warning at most) (audits/update.py).
7. delta      [paper Table 2, App. G] total norm sqrt(sum ||scaling*B@A||_F^2) >= 1.0 and its per-module
              mean; [ours] the largest relative update ||dW||/||W|| >= 1e-4; effective rank (audits/update.py).
8. behaviour  [paper App. I, stronger] only when asked: first-token KL(base || base+adapter) on probes,
              and the base's divergence from the fingerprint's recorded outputs (audits/behaviour.py).
9. leakage    [ours] only with training data and a holdout: holdout items found in the training data.

Beside the checks, each report names the adapter's LoRA variant and what combining it gives (audits/variant.py).

Verdict: REJECTED if any check fails, WARN if any warns, else VERIFIED. The thresholds are in
audits/thresholds.py; a batch opens its base once (audits/base.py).
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from contextlib import closing, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from mergekit_lite.audits.base import AuditBase
from mergekit_lite.audits.base_weights import base_confirmed, check_declared_weights
from mergekit_lite.audits.declared_base import compare, given_base_id, names_local_folder, quantised_reason, same_folder
from mergekit_lite.audits.fingerprint import FINGERPRINT_FILE, load_fingerprint, sha256_file, tokenizer_info
from mergekit_lite.audits.leakage import check_leakage
from mergekit_lite.audits.report import FAIL, PASS, REJECTED, WARN, AuditReport, CheckResult, make_report, shown_names
from mergekit_lite.audits.structure import base_names, check_structure, module_of
from mergekit_lite.audits.thresholds import AuditThresholds
from mergekit_lite.audits.update import bias_changes, check_delta, check_spectral, measure_module, replacement_changes
from mergekit_lite.audits.variant import variant_of
from mergekit_lite.devices import usable_device
from mergekit_lite.errors import InputError
from mergekit_lite.io.hub import ADAPTER_PATTERNS, is_hub_id, repo_files, resolve_model
from mergekit_lite.io.lora import PEFT_DEFAULT_ALPHA, PICKLE_FILE, SAFETENSORS_FILE, LoraAdapter
from mergekit_lite.io.quantized import QuantizedSource


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
            snapshot = Path(resolve_model(reference, ADAPTER_PATTERNS))
            if not LoraAdapter.is_adapter_dir(snapshot):
                raise InputError(no_adapter_in_repo(reference, snapshot))
            found.append(AdapterRef(reference, snapshot, hub=True))
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


def no_adapter_in_repo(reference: str, snapshot: Path) -> str:
    """Why a hub id names no adapter, with the subfolders of the repository that hold one (PEFT saves an adapter
    named other than "default" in a subfolder of that name) when its file listing shows any."""
    folders = sorted(
        name.removesuffix("/adapter_config.json")
        for name in repo_files(reference, snapshot)
        if name.endswith("/adapter_config.json")
    )
    hint = (
        f"; its adapters are in {', '.join(folders[:5])}: name one as {reference.split('@')[0]}/{folders[0]}"
        if folders
        else "; an adapter in a subfolder is named org/name/SUBFOLDER"
    )
    return f"{reference}: no adapter_config.json at its top (not a PEFT adapter){hint}"


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
        return (
            f"LoRA tensors for modules target_modules does not match: {shown_names(unmatched)}" if unmatched else None
        )
    matches = {t: [m for m in modules if m == t or m.endswith(f".{t}")] for t in targets}
    unmatched = [m for m in modules if not any(m in hits for hits in matches.values())]
    unused = [t for t, hits in matches.items() if not hits]
    if unmatched:
        return f"LoRA tensors for modules not in target_modules: {shown_names(unmatched)}"
    if unused:
        return f"target_modules {shown_names(unused)} have no LoRA tensors"
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
    biases = len(adapter.bias_targets())
    with_bias = f" ({biases} with lora_bias)" if biases else ""
    return (
        f"{text}; {len(adapter.weight_targets())} LoRA modules{with_bias}, {len(adapter.replaced())} replaced tensors"
    )


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
        return CheckResult(
            "format", FAIL, total, 0, f"NaN/Inf values in {len(bad)} tensors: {shown_names(list(bad))}"
        ), None
    overflowing = overflowing_updates(adapter)
    if overflowing:
        return CheckResult(
            "format",
            FAIL,
            len(overflowing),
            0,
            f"the update scaling*B@A overflows float32 in "
            f"{len(overflowing)} modules: {shown_names(overflowing)} ({describe_format(adapter)})",
        ), None
    warnings = []
    if adapter.weights_file.suffix == ".bin":
        warnings.append("pickle weights loaded because --allow-pickle was given (weights_only=True)")
    mismatch = target_mismatch(adapter.config, [module_of(name) for name in adapter.weight_targets()])
    if mismatch:
        warnings.append(mismatch)
    negative = sorted(name for name, scale in adapter.scaling.items() if scale < 0)
    if negative:
        warnings.append(
            f"negative lora_alpha (scaling {adapter.scaling[negative[0]]:g} on {shown_names(negative)}): "
            "the merge subtracts what the adapter learned"
        )
    detail = "; ".join(warnings + [f"no NaN/Inf; {describe_format(adapter)}"])
    return CheckResult("format", WARN if warnings else PASS, 0, 0, detail), adapter


def check_declared_base(
    adapter: LoraAdapter, audit_base: AuditBase, base_id: str | None, card_base: str | None = None
) -> CheckResult:
    """The paper's base check: the declared base_model_name_or_path (else the `base_model` of the adapter's model
    card) names the given base (aliases normalised): --base-id, else the base's hub id when it was given as one."""
    base, base_dir = audit_base.source, audit_base.path
    declared = adapter.config.get("base_model_name_or_path") or card_base
    given, given_from = given_base_id(base_dir, base_id, base.config, audit_base.hub_id)
    measurements = {
        "declared": declared,
        "declared_in": "adapter_config.json"
        if adapter.config.get("base_model_name_or_path")
        else ("README.md base_model" if card_base else None),
        "given": given,
        "given_from": given_from or None,
    }
    quantisation = (base.config or {}).get("quantization_config")
    if quantisation and not isinstance(base, QuantizedSource):  # a scheme read dequantized is the dense base
        method = quantisation.get("quant_method", "?") if isinstance(quantisation, dict) else "?"
        return CheckResult(
            "base-id",
            FAIL,
            None,
            None,
            f"the given base is quantised (quant_method {method}): a merge needs the full-precision base weights",
            measurements,
        )
    if not declared:
        return CheckResult(
            "base-id",
            WARN,
            None,
            None,
            "adapter_config.json declares no base_model_name_or_path: nothing says which base the adapter was made on",
            measurements,
        )
    if names_local_folder(declared) and same_folder(declared, base_dir):
        measurements["same_folder"] = True
        return CheckResult("base-id", PASS, None, None, f"declares this base folder ({declared})", measurements)
    if reason := quantised_reason(declared):  # fails as named, with or without an id to compare it with
        return CheckResult("base-id", FAIL, None, None, f"{reason} (declared {declared})", measurements)
    weighed = check_declared_weights(declared, audit_base, measurements)
    if weighed is not None:
        return weighed
    if given is None:
        return CheckResult(
            "base-id",
            WARN,
            None,
            None,
            f"declares {declared}, but the given base has no hub id (its "
            "config.json has no _name_or_path that is one): pass --base-id to verify",
            measurements,
        )
    reasons = compare(declared, given)
    if reasons:
        return CheckResult(
            "base-id",
            FAIL,
            None,
            None,
            f"{'; '.join(reasons)} (declared {declared}, given {given} from {given_from})",
            measurements,
        )
    return CheckResult(
        "base-id", PASS, None, None, f"declared {declared} is the given {given} ({given_from})", measurements
    )


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
    measurements = {
        "base_vocab_size": vocab,
        "base_files": base_info["files"],
        "adapter_files": shipped,
        "fingerprint": recorded,
    }
    failures = []
    warnings = (
        [f"not read: {', '.join(refused)} (not a regular file inside {adapter.path}: a link out of it?)"]
        if refused
        else []
    )
    adapter_vocab = _tokenizer_vocab(adapter.path) if "tokenizer.json" in shipped else None
    measurements["adapter_tokenizer_size"] = adapter_vocab
    if adapter_vocab and vocab and adapter_vocab > vocab:
        failures.append(
            f"the adapter's tokenizer has {adapter_vocab} tokens, the base's embeddings {vocab} rows: "
            "its added tokens need embeddings this base does not have"
        )
    differing = sorted(name for name, digest in shipped.items() if base_info["files"].get(name) != digest)
    if differing:
        warnings.append(f"the adapter ships tokenizer files that differ from the base's: {', '.join(differing)}")
    if recorded:
        if recorded.get("vocab_size") and vocab and recorded["vocab_size"] != vocab:
            failures.append(f"vocab_size {vocab} in the base, {recorded['vocab_size']} in the base fingerprint")
        changed = sorted(
            name for name, digest in recorded.get("files", {}).items() if base_info["files"].get(name) != digest
        )
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
    from mergekit_lite.audits.fingerprint import compare_samples, tensor_table_hash

    base = audit_base.source
    differing, missing = audit_base.once(
        ("signature", json.dumps(signature, sort_keys=True)), lambda: compare_samples(signature, base)
    )
    signed = len(signature["samples"])
    base_folder = base.path if base.path.is_dir() else base.path.parent
    same_config = signature.get("config_sha256") == audit_base.once(
        "config_sha256", lambda: sha256_file(base_folder / "config.json")
    )
    same_table = signature.get("tensor_table_sha256") == audit_base.once("table", lambda: tensor_table_hash(base))
    measurements = {
        "digest": signature.get("digest"),
        "signed_tensors": signed,
        "differing": differing,
        "missing": missing,
        "same_config": same_config,
        "same_tensor_table": same_table,
    }
    share = (len(differing) + len(missing)) / max(signed, 1)
    if differing or missing:
        parts = (
            [f"{len(differing)} of {signed} signed tensors hold other values ({shown_names(differing)})"]
            if differing
            else []
        )
        parts += [f"{len(missing)} signed tensors are missing ({shown_names(missing)})"] if missing else []
        return CheckResult(
            "signature",
            FAIL,
            share,
            0.0,
            f"not the base in the signature ({source}, digest {signature.get('digest')}): {'; '.join(parts)}",
            measurements,
        )
    notes = (
        []
        if same_config and same_table
        else [
            "same weights, but "
            + " and ".join(
                part for part, same in (("config.json", same_config), ("dtypes/shapes", same_table)) if not same
            )
            + " differ"
        ]
    )
    return CheckResult(
        "signature",
        PASS,
        share,
        0.0,
        "; ".join(notes + [f"all {signed} signed tensors match ({source}, digest {signature.get('digest')})"]),
        measurements,
    )


def check_behaviour(
    adapter: LoraAdapter, base: AuditBase, fingerprint: dict | None, thresholds: AuditThresholds, device: str
) -> CheckResult:
    """First-token KL(base || base+adapter) on probes (App. I, the authors' direction) and, with a recorded
    reference, the base's own KL."""
    from mergekit_lite.audits.behaviour import load_causal_lm, measure_divergence

    reference = (fingerprint or {}).get("behaviour")
    model = base.once(("model", device), lambda: load_causal_lm(base.path, device))
    divergence, probes, skipped = measure_divergence(base.path, adapter, device, reference, model=model)
    kl, agreement, base_kl = divergence.mean_kl, divergence.top1_agreement, divergence.mean_base_kl
    measurements = {
        "mean_kl": kl,
        "per_probe_kl": divergence.kl,
        "kl_direction": "KL(base || base+adapter)",
        "mean_reverse_kl": divergence.mean_reverse_kl,
        "top1_agreement": agreement,
        "base_vs_fingerprint_kl": base_kl,
        "probes": probes,
        "device": device,
        "not_applied": skipped,
        "min_kl": thresholds.min_kl,
        "min_noop_top1": thresholds.min_noop_top1,
        "max_kl": thresholds.max_kl,
        "max_base_kl": thresholds.max_base_kl,
    }
    summary = (
        f"first-token KL(base || base+adapter) {kl:.3g} nats, greedy token kept on {agreement:.0%} of "
        f"{len(divergence.kl)} probes ({probes})"
    )
    if base_kl is not None:
        summary += f"; the base's KL from the fingerprinted base's outputs {base_kl:.3g}"
    if base_kl is not None and base_kl > thresholds.max_base_kl:
        return CheckResult(
            "behaviour",
            FAIL,
            base_kl,
            thresholds.max_base_kl,
            "the base does not behave like the "
            f"base the adapter's fingerprint recorded (KL {base_kl:.3g} > {thresholds.max_base_kl:g}): "
            f"another base; {summary}",
            measurements,
        )
    if kl < thresholds.min_kl and agreement > thresholds.min_noop_top1:
        return CheckResult(
            "behaviour", FAIL, kl, thresholds.min_kl, f"no-op: {summary} (KL < {thresholds.min_kl:g})", measurements
        )
    if kl > thresholds.max_kl:
        return CheckResult(
            "behaviour",
            FAIL,
            kl,
            thresholds.max_kl,
            f"extreme divergence, likely another base: {summary} (> {thresholds.max_kl:g})",
            measurements,
        )
    if skipped:
        return CheckResult(
            "behaviour",
            WARN,
            kl,
            thresholds.min_kl,
            f"{shown_names(skipped)} not applied (no such parameter in the loaded model); {summary}",
            measurements,
        )
    return CheckResult("behaviour", PASS, kl, thresholds.min_kl, summary, measurements)


def _fingerprint_for(adapter_dir: Path, fingerprint) -> tuple[dict | None, str | None]:
    """The given fingerprint, else the one shipped in the adapter folder, else none."""
    if fingerprint is not None:
        return load_fingerprint(fingerprint), str(fingerprint)
    shipped = adapter_dir / FINGERPRINT_FILE
    if shipped.is_file():
        return load_fingerprint(shipped), f"shipped {FINGERPRINT_FILE}"
    return None, None


def audit_adapter(
    adapter_dir,
    base_dir,
    *,
    fingerprint=None,
    train_data=None,
    holdout=None,
    thresholds: AuditThresholds = AuditThresholds(),
    allow_pickle: bool = False,
    base_id: str | None = None,
    behaviour: bool = False,
    device: str = "cpu",
) -> AuditReport:
    """Run every applicable check on one adapter; unusable input (no adapter, bad base) raises InputError.

    `adapter_dir`: a folder, a hub id or an AdapterRef (find_adapters); `base_dir`: a folder, a hub id or an
    AuditBase shared by a batch. A base given as a hub id is the id the declared base is compared with (unless
    `base_id` says otherwise). A hub adapter's pickle is never downloaded or loaded, --allow-pickle or not."""
    if isinstance(adapter_dir, AdapterRef):
        ref = adapter_dir
    else:
        ref = (
            find_adapters([adapter_dir])[0]
            if is_hub_id(str(adapter_dir))
            else AdapterRef(str(adapter_dir), Path(adapter_dir))
        )
    if not LoraAdapter.is_adapter_dir(ref.path):
        raise InputError(f"{ref.name}: no adapter_config.json (not a PEFT adapter folder)")
    if (train_data is None) != (holdout is None):
        raise InputError("the leakage check needs both training data and a holdout (--train-data and --holdout)")
    if behaviour:
        usable_device(device)
    # a base opened here is closed here; a batch's shared base stays open for its next adapter
    with (
        nullcontext(base_dir)
        if isinstance(base_dir, AuditBase)
        else closing(AuditBase.open(base_dir, allow_pickle)) as audit_base
    ):
        base = audit_base.source
        fingerprint_data, fingerprint_source = _fingerprint_for(ref.path, fingerprint)
        top_k = fingerprint_data["top_k"] if fingerprint_data else thresholds.top_k
        pickle_only = ref.hub and _pickle_only(ref)
        format_check, adapter = pickle_only or check_format(ref.path, allow_pickle and not ref.hub)
        checks = [format_check]
        if adapter is not None:
            declared_base = check_declared_base(adapter, audit_base, base_id, card_base_model(ref.path))
            checks.append(declared_base)
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
                measures = [
                    measure_module(adapter, audit_base, name, on_disk[name], top_k, entries.get(on_disk[name]))
                    for name in adapter.weight_targets()
                ]
                if measures:
                    checks.append(
                        check_spectral(measures, fingerprint_source, thresholds, base_confirmed(declared_base))
                    )
                checks.append(
                    check_delta(measures, replacement_changes(adapter, base), thresholds, bias_changes(adapter, base))
                )
                if behaviour:
                    checks.append(check_behaviour(adapter, audit_base, fingerprint_data, thresholds, device))
        if train_data is not None:
            checks.append(check_leakage(train_data, holdout, thresholds.ngram, thresholds.max_contaminated_share))
        return make_report(ref.name, audit_base.reference, checks, variant_of(ref.path, adapter))


def _pickle_only(ref: AdapterRef) -> tuple[CheckResult, None] | None:
    """A hub repository with adapter_model.bin and no adapter_model.safetensors: refused by the file listing alone
    (the pickle is not in ADAPTER_PATTERNS, so it is never downloaded, and never opened)."""
    files = repo_files(ref.name, ref.path)
    if SAFETENSORS_FILE in files or PICKLE_FILE not in files:
        return None
    return CheckResult(
        "format",
        FAIL,
        None,
        None,
        f"{ref.name} ships only pickled weights ({PICKLE_FILE}), which can "
        "run code when loaded: refused without downloading or unpickling them (ask for "
        f"{SAFETENSORS_FILE})",
        {"repo_files": files},
    ), None


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


def require_verified(
    adapter_dir, base_dir, force: bool = False, *, allow_pickle: bool = False, forcible: bool = True
) -> AuditReport:
    """The gate before a merge: a REJECTED adapter stops it unless forced; WARN passes. Failed format or
    structure checks stop it even when forced, and the error does not offer --force: there is nothing to merge
    (nor where the command has no --force: `forcible` False)."""
    report = audit_adapter(adapter_dir, base_dir, allow_pickle=allow_pickle)
    failed = [check for check in report.checks if check.status == FAIL]
    unmergeable = any(check.name in UNMERGEABLE for check in failed)
    if report.verdict == REJECTED and (unmergeable or not force):
        failures = "; ".join(f"{check.name}: {check.detail}" for check in failed)
        advice = "" if unmergeable or not forcible else "; use --force to merge anyway"
        raise InputError(f"adapter {adapter_dir} is REJECTED: {failures}{advice}")
    return report
