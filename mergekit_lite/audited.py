"""Merging with the adapter audit gate: the Python API's `run_merge` and `merge_state_dict`.

The engine (merge/engine.py) sits below the audits and knows nothing of them: it asks the gate it is given
about every adapter before anything else reads one. This module, above both, gives it `audit_gate`: every
LoRA adapter is audited against the model it is applied to, and a REJECTED one stops the merge unless the config
says force (see audits.adapter.require_verified). Every verdict is also one line on stderr (`announce`), so an
adapter that only WARNs is never merged in silence; `require_verified` refuses it. The CLI, the sweep and the demo
merge through here."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from mergekit_lite.audits.report import VERIFIED, AuditReport, announce
from mergekit_lite.errors import InputError
from mergekit_lite.io.hub import split_lora_reference
from mergekit_lite.io.sources import TensorSource
from mergekit_lite.merge import engine, extract
from mergekit_lite.merge.config import MergeConfig
from mergekit_lite.merge.extract import Extraction
from mergekit_lite.merge.lora_settings import ExtractSettings


class UnverifiedAdapter(InputError):
    """An adapter refused by --require-verified because its audit only WARNs: exit 1, as `audit` exits when it
    refuses an adapter (a script asked for VERIFIED and did not get it)."""

    exit_code = 1


def gate_adapter(
    adapter: str,
    host: str,
    *,
    force: bool = False,
    allow_pickle: bool = False,
    forcible: bool = True,
    require_verified: bool = False,
) -> AuditReport:
    """Audit `adapter` against `host`, the model it is applied to: REJECTED stops it (see
    audits.adapter.require_verified), the verdict line goes to stderr, and with `require_verified` anything short
    of VERIFIED stops it too (UnverifiedAdapter, exit 1)."""
    # imported here: the audit's modules are read only when an adapter is merged
    from mergekit_lite.audits.adapter import require_verified as audited_or_refused

    report = audited_or_refused(adapter, host, force, allow_pickle=allow_pickle, forcible=forcible)
    announce(report)
    if require_verified and report.verdict != VERIFIED:
        raise UnverifiedAdapter(
            f"adapter {adapter} is {report.verdict}, not VERIFIED, and --require-verified was "
            f"given: {'; '.join(report.reasons)}"
        )
    return report


def audit_gate(adapter: str, config: MergeConfig, require_verified: bool = False) -> AuditReport:
    """The audit of one adapter of `config` against the model it is applied to (the model of a model+lora
    reference, else the base); raises InputError when it may not be merged."""
    host, adapter = split_lora_reference(adapter) or (config.base, adapter)
    if split_lora_reference(host):
        raise InputError(
            f"{adapter}: adapter folders apply to the base, and the base {host} is a model+lora "
            "reference, which the audit cannot check an adapter against; give a model folder or hub id"
        )
    return gate_adapter(
        adapter, host, force=config.force, allow_pickle=config.allow_pickle, require_verified=require_verified
    )


def require_verified_inputs(pre: str, references: list[str]) -> None:
    """--require-verified for a sweep, before anything is evaluated: every adapter it applies (an adapter folder
    given as a model, applied to `pre`, or the adapter of a model+lora reference) must be VERIFIED."""
    from mergekit_lite.io.lora import LoraAdapter

    for reference in (str(reference) for reference in references if reference):
        if split_lora_reference(reference):
            host, adapter = split_lora_reference(reference)
            gate_adapter(adapter, host, forcible=False, require_verified=True)
        elif LoraAdapter.is_adapter_dir(reference):
            gate_adapter(reference, pre, forcible=False, require_verified=True)


def run_merge(
    config: MergeConfig,
    out: str | Path,
    overwrite: bool = False,
    progress: bool = False,
    card_sections: list[tuple[str, str]] = (),
    require_verified: bool = False,
    **files,
) -> engine.MergeResult:
    """Plan and stream a merge into `out` (engine.run_merge), adapters audited first (with `require_verified`, only
    VERIFIED ones merge); `card_sections` are added to its model card; `files`: engine.run_merge's copy_tokenizer
    and model_card."""
    return engine.run_merge(
        config,
        out,
        overwrite=overwrite,
        progress=progress,
        gate=partial(audit_gate, require_verified=require_verified),
        card_sections=card_sections,
        **files,
    )


def extract_lora(
    base_dir: str, tuned_dir: str, out_dir: str, settings: ExtractSettings | None = None, **options
) -> Extraction:
    """merge.extract.extract_lora, with the base's fingerprint shipped in the adapter folder (base_fingerprint.json,
    written before the folder appears): whoever audits the adapter later can check their base is the one it was
    factored against, wherever the adapter has moved. The weights are fingerprinted without running the model."""
    from mergekit_lite.audits.fingerprint import FINGERPRINT_FILE, compute_fingerprint, write_fingerprint

    def ship_fingerprint(folder: Path, base: str) -> None:
        write_fingerprint(compute_fingerprint(base, behaviour=False), folder / FINGERPRINT_FILE, base_dir=base)

    return extract.extract_lora(base_dir, tuned_dir, out_dir, settings, side_files=ship_fingerprint, **options)


def merge_state_dict(config: MergeConfig, sources: list[TensorSource] | None = None) -> dict[str, torch.Tensor]:
    """The same merge kept in memory (engine.merge_state_dict), adapters audited first."""
    return engine.merge_state_dict(config, sources, gate=audit_gate)


def declared_bases(adapters: list[str]) -> dict[str, str | None]:
    """The base each adapter declares: adapter_config.json's base_model_name_or_path, else its card's base_model."""
    from mergekit_lite.audits.adapter import card_base_model
    from mergekit_lite.io.validation import read_json

    declared = {}
    for adapter in adapters:
        config = read_json(Path(adapter) / "adapter_config.json")
        named = config.get("base_model_name_or_path") if isinstance(config, dict) else None
        declared[adapter] = named or card_base_model(Path(adapter))
    return declared


def common_base(adapters: list[str], base: str | None) -> tuple[str, str]:
    """(the base to audit against and read, the base the merged adapter declares): `base` when given, else the one
    base every adapter declares; adapters declaring different bases (aliases normalised) are refused."""
    from mergekit_lite.audits.declared_base import compare

    declared = declared_bases(adapters)
    named = {adapter: value for adapter, value in declared.items() if value}
    first = next(iter(named.items()), None)
    for adapter, value in named.items():
        if first and value != first[1] and compare(first[1], value):
            raise InputError(
                f"the adapters are on different bases: {first[0]} declares {first[1]}, {adapter} declares {value}; "
                "an adapter merge needs one base"
            )
    if base is None and first is None:
        raise InputError(f"{adapters[0]}: declares no base (base_model_name_or_path); pass --base")
    if base is None and len(named) < len(adapters):
        missing = next(adapter for adapter in adapters if adapter not in named)
        raise InputError(f"{missing}: declares no base (base_model_name_or_path); pass --base")
    return (base or first[1]), (first[1] if first else base)


def merge_adapters(
    adapters: list[str],
    out: str | Path,
    settings,
    *,
    base: str | None = None,
    force: bool = False,
    allow_pickle: bool = False,
    overwrite: bool = False,
    require_verified: bool = False,
):
    """merge.adapters.merge_adapters from adapter folders: each audited first against the base (`base`, else the one
    the adapters declare), which is then read for DoRA updates and module names."""
    from mergekit_lite.io.hub import resolve_model
    from mergekit_lite.io.lora import LoraAdapter
    from mergekit_lite.io.quantized import open_dense
    from mergekit_lite.merge.adapters import merge_adapters as write_merged

    if len(set(map(str, adapters))) != len(adapters):
        raise InputError("an adapter is named twice; give each once, with its weight")
    adapters = [str(adapter) for adapter in adapters]
    for adapter in adapters:
        if not LoraAdapter.is_adapter_dir(adapter):
            raise InputError(f"{adapter}: no adapter_config.json (not a PEFT adapter folder)")
    settings.check(len(adapters))
    host, declared = common_base(adapters, base)
    reports = [
        gate_adapter(adapter, host, force=force, allow_pickle=allow_pickle, require_verified=require_verified)
        for adapter in adapters
    ]
    opened = [LoraAdapter.open(adapter, allow_pickle=allow_pickle) for adapter in adapters]
    source = open_dense(resolve_model(host), allow_pickle=allow_pickle)
    try:
        return write_merged(
            opened,
            source,
            out,
            settings,
            declared_base=declared,
            overwrite=overwrite,
            inputs=adapters,
            audits=[{"adapter": r.adapter, "verdict": r.verdict, "reasons": r.reasons} for r in reports],
        )
    finally:
        source.close()
