"""Merging with the adapter audit gate: the Python API's `run_merge` and `merge_state_dict`.

The engine (merge/engine.py) sits below the audits and knows nothing of them: it asks the gate it is given
about every adapter before anything else reads one. This module, above both, gives it `audit_gate`: every
LoRA adapter is audited against the base, and a REJECTED one stops the merge unless the config says force
(see audits.adapter.require_verified). The CLI, the sweep and the demo merge through here."""

from __future__ import annotations

from pathlib import Path

import torch

from audits.report import AuditReport
from mergekit_lite.io.sources import TensorSource
from mergekit_lite.merge import engine
from mergekit_lite.merge.config import MergeConfig


def audit_gate(adapter: str, config: MergeConfig) -> AuditReport:
    """The audit of one adapter of `config` against its base; raises InputError when it may not be merged."""
    from audits.adapter import require_verified  # read only when an adapter is merged

    return require_verified(adapter, config.base, force=config.force, allow_pickle=config.allow_pickle)


def run_merge(config: MergeConfig, out: str | Path, overwrite: bool = False, progress: bool = False,
              card_sections: list[tuple[str, str]] = ()) -> engine.MergeResult:
    """Plan and stream a merge into `out` (engine.run_merge), adapters audited first; `card_sections` are added
    to its model card."""
    return engine.run_merge(config, out, overwrite=overwrite, progress=progress, gate=audit_gate,
                            card_sections=card_sections)


def merge_state_dict(config: MergeConfig, sources: list[TensorSource] | None = None) -> dict[str, torch.Tensor]:
    """The same merge kept in memory (engine.merge_state_dict), adapters audited first."""
    return engine.merge_state_dict(config, sources, gate=audit_gate)
