"""Merging with the adapter audit gate: the Python API's `run_merge` and `merge_state_dict`.

The engine (merge/engine.py) sits below the audits and knows nothing of them: it asks the gate it is given
about every adapter before anything else reads one. This module, above both, gives it `audit_gate`: every
LoRA adapter is audited against the model it is applied to, and a REJECTED one stops the merge unless the config
says force (see audits.adapter.require_verified). The CLI, the sweep and the demo merge through here."""

from __future__ import annotations

from pathlib import Path

import torch

from audits.report import AuditReport
from mergekit_lite.errors import InputError
from mergekit_lite.io.hub import split_lora_reference
from mergekit_lite.io.sources import TensorSource
from mergekit_lite.merge import engine
from mergekit_lite.merge.config import MergeConfig


def audit_gate(adapter: str, config: MergeConfig) -> AuditReport:
    """The audit of one adapter of `config` against the model it is applied to (the model of a model+lora
    reference, else the base); raises InputError when it may not be merged."""
    from audits.adapter import require_verified  # read only when an adapter is merged

    host, adapter = split_lora_reference(adapter) or (config.base, adapter)
    if split_lora_reference(host):
        raise InputError(f"{adapter}: adapter folders apply to the base, and the base {host} is a model+lora "
                         "reference, which the audit cannot check an adapter against; give a model folder or hub id")
    return require_verified(adapter, host, force=config.force, allow_pickle=config.allow_pickle)


def run_merge(config: MergeConfig, out: str | Path, overwrite: bool = False, progress: bool = False,
              card_sections: list[tuple[str, str]] = (), **files) -> engine.MergeResult:
    """Plan and stream a merge into `out` (engine.run_merge), adapters audited first; `card_sections` are added
    to its model card; `files`: engine.run_merge's copy_tokenizer and model_card."""
    return engine.run_merge(config, out, overwrite=overwrite, progress=progress, gate=audit_gate,
                            card_sections=card_sections, **files)


def merge_state_dict(config: MergeConfig, sources: list[TensorSource] | None = None) -> dict[str, torch.Tensor]:
    """The same merge kept in memory (engine.merge_state_dict), adapters audited first."""
    return engine.merge_state_dict(config, sources, gate=audit_gate)
