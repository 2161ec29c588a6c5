"""The base of an audit, opened once for a batch of adapters: each base matrix it is asked for is decomposed
once and kept as the few numbers the checks need."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from mergekit_lite.audits.fingerprint import probe, top_singular
from mergekit_lite.io.hub import hub_id_of, is_hub_id, resolve_model, split_hub_id
from mergekit_lite.io.quantized import open_dense


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
    def open(cls, reference, allow_pickle: bool = False) -> AuditBase:
        """A base folder or file, or a hub id (the snapshot of it in the Hugging Face cache, weights and config)."""
        reference = str(reference)
        hub_id = split_hub_id(reference)[0] if is_hub_id(reference) else None
        path = Path(resolve_model(reference))
        # a quantized base is read dequantized; one quantized in a scheme not read is left to the base-id check
        source = open_dense(path, allow_pickle=allow_pickle, refuse_unread=False)
        return cls(reference, path, source, hub_id or hub_id_of(path))

    def close(self) -> None:
        """Close the base's weight files (the measured matrices stay usable)."""
        self.source.close()

    def matrix(self, name: str, top_k: int) -> BaseMatrix:
        key = (name, top_k)
        if key not in self.matrices:
            weight = self.source.load(name).to(torch.float32)
            left_vectors, singular_values = top_singular(weight, top_k)
            self.matrices[key] = BaseMatrix(
                tuple(weight.shape), float(weight.norm()), left_vectors, singular_values, probe(weight)
            )
        return self.matrices[key]

    def once(self, key, compute):
        """`compute()` the first time `key` is asked for; the same answer after that."""
        if key not in self.cache:
            self.cache[key] = compute()
        return self.cache[key]
