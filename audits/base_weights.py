"""The base an adapter declares, read where it can be: a local folder, or a hub id's snapshot already in the Hugging
Face cache (never downloaded), compared with the given base tensor by tensor.

A name can only be compared with a name; weights at hand settle the question. An adapter whose config declares the
folder it was trained from is checked against that folder's weights: the same weights are positive evidence that
the adapter was made on the given base, other weights prove it was not (ours: the paper compares names only).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mergekit_lite.audits.base import AuditBase
from mergekit_lite.audits.declared_base import names_local_folder, same_folder
from mergekit_lite.audits.report import FAIL, PASS, WARN, CheckResult, shown_names
from mergekit_lite.errors import InputError
from mergekit_lite.io.hub import check_ref, checked_snapshot, hub_errors, hub_subfolder, is_hub_id, split_hub_id
from mergekit_lite.io.quantized import open_dense

LOCAL, MISSING, CACHED, UNCACHED = "local", "missing", "cached", "uncached"


@dataclass(frozen=True)
class DeclaredLocation:
    """Where the declared base's weights are here: a local path, a cached snapshot, or nowhere."""

    kind: str  # LOCAL, MISSING (a local path that does not exist), CACHED, UNCACHED (a hub id not in the cache)
    path: Path | None


@dataclass
class WeightComparison:
    """Tensors of the declared base against the given base's, by name, shape and content."""

    compared: int = 0
    differing: list[str] = field(default_factory=list)  # same name and shape, other values
    reshaped: list[str] = field(default_factory=list)
    only_declared: list[str] = field(default_factory=list)
    only_given: list[str] = field(default_factory=list)

    @property
    def different(self) -> list[str]:
        return self.differing + self.reshaped + self.only_declared + self.only_given

    @property
    def same(self) -> bool:
        return not self.different


def cached_snapshot(declared: str) -> Path | None:
    """The cached snapshot folder of a declared hub id, read from the cache alone (never the network), under the
    same cache-escape checks as every hub id a command is given; None when the cache does not hold it."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    repo, revision = split_hub_id(declared)
    check_ref(declared, repo, revision)
    try:
        with hub_errors(declared, revision):
            snapshot = snapshot_download(repo, revision=revision, local_files_only=True)
    except (InputError, LocalEntryNotFoundError):
        return None
    folder = checked_snapshot(declared, repo, snapshot) / hub_subfolder(declared)
    return folder if folder.is_dir() else None


def locate_declared(declared: str) -> DeclaredLocation:
    """A local path (PEFT records the string from_pretrained was given) is looked for here; a hub id in the cache."""
    if names_local_folder(declared):
        path = Path(os.path.expanduser(declared))
        return DeclaredLocation(LOCAL if os.path.lexists(path) else MISSING, path)
    if is_hub_id(declared):
        snapshot = cached_snapshot(declared)
        return DeclaredLocation(CACHED if snapshot else UNCACHED, snapshot)
    return DeclaredLocation(UNCACHED, None)


def _same_values(declared: torch.Tensor, given: torch.Tensor) -> bool:
    """Bit for bit, after casting the declared tensor to the given one's dtype (a bf16 copy of an fp32 base holds
    the same weights)."""
    if declared.dtype != given.dtype:
        declared = declared.to(given.dtype)
    return torch.equal(declared.reshape(-1).view(torch.uint8), given.reshape(-1).view(torch.uint8))


def compare_weights(declared_path: Path, given_source) -> WeightComparison:
    """Stream both bases tensor by tensor (one pair in memory at a time) and count what differs. The declared base
    is opened as any model a command is given (safetensors only, its files inside its folder)."""
    declared_source = open_dense(declared_path)
    result = WeightComparison()
    try:
        declared_names, given_names = set(declared_source.names), set(given_source.names)
        result.only_declared = sorted(declared_names - given_names)
        result.only_given = sorted(given_names - declared_names)
        for name in declared_source.names:
            if name not in given_names:
                continue
            result.compared += 1
            if declared_source.shape(name) != given_source.shape(name):
                result.reshaped.append(name)
            elif not _same_values(declared_source.load(name), given_source.load(name)):
                result.differing.append(name)
    finally:
        declared_source.close()
    return result


def check_declared_weights(declared: str, audit_base: AuditBase, measurements: dict) -> CheckResult | None:
    """The declared base's weights against the given base's, where they are here (a local folder, or a hub id's
    cached snapshot; nothing else is read): the same weights pass, other weights fail, naming how many tensors
    differ; a declared local folder that does not exist warns. None: no weights to compare (a hub id not cached)."""
    try:
        location = locate_declared(declared)
    except InputError as error:
        return CheckResult(
            "base-id", WARN, None, None, f"the declared base {declared} cannot be read: {error}", measurements
        )
    measurements["declared_location"] = location.kind
    if location.kind == UNCACHED:
        return None
    if location.kind == MISSING:
        return CheckResult(
            "base-id",
            WARN,
            None,
            None,
            f"declares the local folder {declared}, which does not exist "
            "here: its weights cannot be compared with the given base's",
            measurements,
        )
    where = "cached snapshot of " if location.kind == "cached" else "folder "
    if same_folder(str(location.path), audit_base.path):
        measurements["same_folder"] = True
        return CheckResult(
            "base-id", PASS, None, None, f"the declared {where}{declared} is the given base", measurements
        )
    key = ("declared-weights", os.path.realpath(location.path))
    try:
        comparison = audit_base.once(key, lambda: compare_weights(location.path, audit_base.source))
    except InputError as error:
        return CheckResult(
            "base-id",
            WARN,
            None,
            None,
            f"the declared base {declared} cannot be read as a model, so "
            f"its weights cannot be compared with the given base's: {error}",
            measurements,
        )
    total = comparison.compared + len(comparison.only_declared) + len(comparison.only_given)
    measurements.update(
        weights_compared=total, weights_differing=len(comparison.different), weights_same=comparison.same
    )
    if comparison.same:
        return CheckResult(
            "base-id",
            PASS,
            0,
            0,
            f"the declared {where}{declared} holds the given base's weights (all {total} tensors equal)",
            measurements,
        )
    parts = [
        f"{count} {what}"
        for count, what in (
            (len(comparison.differing), "hold other values"),
            (len(comparison.reshaped), "have other shapes"),
            (len(comparison.only_declared), "only in the declared base"),
            (len(comparison.only_given), "only in the given base"),
        )
        if count
    ]
    return CheckResult(
        "base-id",
        FAIL,
        len(comparison.different),
        0,
        f"made on another base: the declared "
        f"{where}{declared} holds other weights than the given base ({len(comparison.different)} of "
        f"{total} tensors differ: {', '.join(parts)}; e.g. {shown_names(comparison.different)})",
        measurements,
    )


def base_confirmed(check: CheckResult) -> bool:
    """The base-id check found the declared base to be the given one by its weights or its folder, not by name."""
    return check.status == PASS and bool(
        check.measurements.get("weights_same") or check.measurements.get("same_folder")
    )
