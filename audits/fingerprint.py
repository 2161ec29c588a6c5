"""Spectral fingerprints of a base model, shipped with an adapter so an audit can tell which base it was made on.

Per weight matrix a fingerprint keeps two small vectors:

* `singular_values`: the top-k singular values. They catch a different architecture, scale or training
  state, but on their own they cannot tell two bases apart that share a recipe: matrices drawn alike
  have near-identical spectra (two random inits give cosine ~0.999), so a spectrum match is necessary,
  not sufficient.
* `probe`: the matrix's response to one fixed, seeded random input, seen through a fixed random
  16-dimensional projection. Identical weights give identical probes (cosine 1; a bf16 copy or a light
  fine-tune of the same base stays above 0.999), while unrelated weights give cosine ~0 +- 0.25, so
  this is what identifies the base.

A module's similarity is the smaller of the two cosines.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field

from mergekit_lite.errors import InputError

FORMAT = "mergekit-lite/base-fingerprint"
VERSION = 1
FINGERPRINT_FILE = "base_fingerprint.json"
DEFAULT_TOP_K = 8
PROBE_DIM = 16
PROBE_SEED = 0
EXACT_SVD_MAX_DIM = 512  # above this, exact SVD costs seconds per matrix; a seeded randomized one does not
OVERSAMPLE = 8
POWER_ITERATIONS = 4


def top_singular(matrix: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k left singular vectors and singular values, float32, deterministic.

    Exact for matrices up to EXACT_SVD_MAX_DIM on their short side; beyond that a seeded randomized
    subspace iteration, accurate for the top values and identical on every run.
    """
    matrix = matrix.to(torch.float32)
    k = min(k, *matrix.shape)
    if min(matrix.shape) <= EXACT_SVD_MAX_DIM:
        left, values, _ = torch.linalg.svd(matrix, full_matrices=False)
        return left[:, :k], values[:k]
    generator = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(matrix @ torch.randn(matrix.shape[1], k + OVERSAMPLE, generator=generator)).Q
    for _ in range(POWER_ITERATIONS):
        basis = torch.linalg.qr(matrix @ torch.linalg.qr(matrix.T @ basis).Q).Q
    small_left, values, _ = torch.linalg.svd(basis.T @ matrix, full_matrices=False)
    return (basis @ small_left)[:, :k], values[:k]


def probe(matrix: torch.Tensor) -> torch.Tensor:
    """The matrix applied to a seeded random input, projected to PROBE_DIM numbers (same seed for every file)."""
    generator = torch.Generator().manual_seed(PROBE_SEED)
    rows, columns = matrix.shape
    direction = torch.randn(columns, generator=generator)
    projection = torch.randn(PROBE_DIM, rows, generator=generator)
    return projection @ (matrix.to(torch.float32) @ direction)


def is_weight_matrix(source, name: str) -> bool:
    return len(source.shape(name)) == 2 and source.dtype(name).is_floating_point


def _rounded(values: torch.Tensor) -> list[float]:
    return [float(f"{value:.7g}") for value in values.tolist()]


def compute_fingerprint(base_dir, top_k: int = DEFAULT_TOP_K) -> dict:
    """Fingerprint every 2-D floating tensor of a base model, one tensor in memory at a time."""
    from mergekit_lite.io.safetensors import open_model

    if top_k < 1:
        raise InputError(f"--top-k must be at least 1 (got {top_k})")
    source = open_model(base_dir)
    modules = {}
    for name in source.names:
        if not is_weight_matrix(source, name):
            continue
        weight = source.load(name)
        modules[name] = {
            "shape": list(weight.shape),
            "singular_values": _rounded(top_singular(weight, top_k)[1]),
            "probe": _rounded(probe(weight)),
        }
    if not modules:
        raise InputError(f"{base_dir}: no 2-D weight matrices to fingerprint")
    return {"format": FORMAT, "version": VERSION, "base": Path(base_dir).name, "top_k": top_k,
            "probe_seed": PROBE_SEED, "probe_dim": PROBE_DIM, "modules": modules}


class FingerprintModule(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    shape: list[int]
    singular_values: list[float]
    probe: list[float]


class FingerprintFile(BaseModel):
    """The fingerprint file `compute_fingerprint` writes, typed."""

    model_config = ConfigDict(strict=True, extra="forbid")
    format: str
    version: int
    base: str
    top_k: int = Field(ge=1)
    probe_seed: int
    probe_dim: int
    modules: dict[str, FingerprintModule]


def write_fingerprint(fingerprint: dict, path, base_dir=None) -> None:
    """Write where asked, unless that is inside the base or replaces a file that is not a fingerprint of ours."""
    from mergekit_lite.io.outputs import check_output_file, write_atomic

    path = check_output_file(path, [base_dir], recognise=_is_our_fingerprint)
    write_atomic(path, json.dumps(fingerprint, indent=1) + "\n")


def _is_our_fingerprint(path: Path) -> bool:
    try:
        load_fingerprint(path)
    except InputError:
        return False
    return True


def load_fingerprint(path) -> dict:
    """Read a fingerprint file; anything that is not one of ours is unusable input."""
    from mergekit_lite.io.validation import read_json, validate

    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such fingerprint file")
    fingerprint = read_json(path)
    if not isinstance(fingerprint, dict) or fingerprint.get("format") != FORMAT:
        raise InputError(f"{path}: not a mergekit-lite base fingerprint (write one with `mergekit-lite audit fingerprint BASE`)")
    if fingerprint.get("version") != VERSION:
        raise InputError(f"{path}: fingerprint version {str(fingerprint.get('version'))[:20]} is not supported "
                         f"(expected {VERSION})")
    validate(FingerprintFile, fingerprint, path)
    return fingerprint


def cosine(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    if a.shape != b.shape:
        return 0.0
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def module_similarity(entry: dict, shape: tuple[int, ...], singular_values: torch.Tensor,
                      probe_vector: torch.Tensor) -> tuple[float, float]:
    """(spectrum cosine, probe cosine) of one base matrix against its fingerprint entry; 0 if shapes differ."""
    if tuple(entry.get("shape", ())) != tuple(shape):
        return 0.0, 0.0
    return cosine(singular_values, entry["singular_values"]), cosine(probe_vector, entry["probe"])
