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

Version 2 adds what Aharon et al. (App. I) sketch as a base signature and tokenizer check, made to work
offline and across re-sharding and dtype changes (ours):

* `signature`: sha256 of config.json, sha256 of the tensor table the shard headers describe (name,
  dtype, shape; not the byte offsets, which change with sharding), and SAMPLES_PER_TENSOR values of every
  tensor at positions seeded by its name. The samples are compared as numbers, so a bf16 copy of the same
  base still matches while any other weights do not.
* `tokenizer`: vocabulary size and sha256 of each tokenizer file.
* `behaviour`: the base's first-token distribution on fixed probes (audits/behaviour.py), optional.
"""

from __future__ import annotations

import hashlib
import json
import os
from contextlib import closing
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field

from mergekit_lite.audits.thresholds import DEFAULT_TOP_K
from mergekit_lite.errors import InputError

FORMAT = "mergekit-lite/base-fingerprint"
VERSION = 2
SUPPORTED_VERSIONS = (1, 2)
SAMPLES_PER_TENSOR = 16
SAMPLE_TOLERANCE = 1e-2  # relative to the sample's norm: a bf16 copy differs by ~4e-3, other weights by ~1
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
)
FINGERPRINT_FILE = "base_fingerprint.json"
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


def sha256_file(path: Path) -> str | None:
    if not path.is_file():
        return None
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def tensor_sample(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """SAMPLES_PER_TENSOR float32 values at positions seeded by the tensor's name (all of them if fewer)."""
    flat = tensor.reshape(-1).to(torch.float32)
    if flat.numel() <= SAMPLES_PER_TENSOR:
        return flat
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") & (2**63 - 1)
    positions = torch.randint(0, flat.numel(), (SAMPLES_PER_TENSOR,), generator=torch.Generator().manual_seed(seed))
    return flat[positions]


def tensor_table_hash(source) -> str:
    table = [
        [name, str(source.dtype(name)).removeprefix("torch."), list(source.shape(name))]
        for name in sorted(source.names)
    ]
    return hashlib.sha256(json.dumps(table).encode()).hexdigest()


def tokenizer_info(base_dir: Path, config: dict | None) -> dict:
    """Vocabulary size and the hashes of the tokenizer files; a file that is not a regular file inside the folder (a
    link out of it, a FIFO) is never opened: it is listed under `refused` instead."""
    from mergekit_lite.io.validation import is_regular_inside

    text_config = (config or {}).get("text_config") or config or {}
    present = [name for name in TOKENIZER_FILES if os.path.lexists(base_dir / name)]
    inside = [name for name in present if is_regular_inside(base_dir / name, base_dir)]
    return {
        "vocab_size": text_config.get("vocab_size"),
        "files": {name: sha256_file(base_dir / name) for name in inside},
        "refused": [name for name in present if name not in inside],
    }


def compute_fingerprint(base_dir, top_k: int = DEFAULT_TOP_K, behaviour: bool = True, device: str = "cpu") -> dict:
    """Fingerprint a base: spectra and probes of every 2-D floating tensor, its signature, tokenizer and behaviour.

    One tensor in memory at a time for the weights; `behaviour` loads the model once to record its outputs.
    """
    from mergekit_lite.io.quantized import open_dense

    if top_k < 1:
        raise InputError(f"--top-k must be at least 1 (got {top_k})")
    base_dir = Path(base_dir)
    modules, samples = {}, {}
    with closing(open_dense(base_dir)) as source:
        for name in source.names:
            weight = source.load(name)
            if weight.is_floating_point():
                samples[name] = _rounded(tensor_sample(weight, name))
            if not is_weight_matrix(source, name):
                continue
            modules[name] = {
                "shape": list(weight.shape),
                "singular_values": _rounded(top_singular(weight, top_k)[1]),
                "probe": _rounded(probe(weight)),
            }
    if not modules:
        raise InputError(f"{base_dir}: no 2-D weight matrices to fingerprint")
    folder = base_dir if base_dir.is_dir() else base_dir.parent
    signature = {
        "config_sha256": sha256_file(folder / "config.json"),
        "tensor_table_sha256": tensor_table_hash(source),
        "samples": samples,
    }
    signature["digest"] = hashlib.sha256(json.dumps(signature, sort_keys=True).encode()).hexdigest()[:16]
    fingerprint = {
        "format": FORMAT,
        "version": VERSION,
        "base": base_dir.name,
        "top_k": top_k,
        "probe_seed": PROBE_SEED,
        "probe_dim": PROBE_DIM,
        "modules": modules,
        "signature": signature,
        "tokenizer": tokenizer_info(folder, source.config),
    }
    if behaviour and base_dir.is_dir():
        from mergekit_lite.audits.behaviour import record_reference

        fingerprint["behaviour"] = record_reference(base_dir, device)
    return fingerprint


def compare_samples(signature: dict, source) -> tuple[list[str], list[str]]:
    """(tensors whose sampled values differ from the signature's, signed tensors the base lacks)."""
    differing, missing = [], []
    for name, recorded in signature["samples"].items():
        if name not in source.names:
            missing.append(name)
            continue
        measured = tensor_sample(source.load(name), name)
        recorded = torch.tensor(recorded, dtype=torch.float32)
        if measured.shape != recorded.shape or float((measured - recorded).norm()) > SAMPLE_TOLERANCE * max(
            float(recorded.norm()), 1e-6
        ):
            differing.append(name)
    return differing, missing


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
    signature: dict | None = None  # version 2: base signature, tokenizer, recorded first-token outputs
    tokenizer: dict | None = None
    behaviour: dict | None = None


def fingerprint_destination(path, base_dir=None) -> Path:
    """Where a fingerprint may go: not inside the base, not over a file that is not a fingerprint of ours.
    Checked before the (slow) fingerprint is computed, and again when it is written."""
    from mergekit_lite.io.outputs import check_output_file

    return check_output_file(path, [base_dir], recognise=_is_our_fingerprint)


def write_fingerprint(fingerprint: dict, path, base_dir=None) -> None:
    """Write where asked, unless that is inside the base or replaces a file that is not a fingerprint of ours."""
    from mergekit_lite.io.outputs import write_atomic

    write_atomic(fingerprint_destination(path, base_dir), json.dumps(fingerprint, indent=1) + "\n")


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
        raise InputError(
            f"{path}: not a mergekit-lite base fingerprint (write one with `mergekit-lite audit fingerprint BASE`)"
        )
    if fingerprint.get("version") not in SUPPORTED_VERSIONS:
        raise InputError(
            f"{path}: fingerprint version {str(fingerprint.get('version'))[:20]} is not supported "
            f"(expected one of {SUPPORTED_VERSIONS})"
        )
    validate(FingerprintFile, fingerprint, path)
    return fingerprint


def cosine(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    if a.shape != b.shape:
        return 0.0
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def module_similarity(
    entry: dict, shape: tuple[int, ...], singular_values: torch.Tensor, probe_vector: torch.Tensor
) -> tuple[float, float]:
    """(spectrum cosine, probe cosine) of one base matrix against its fingerprint entry; 0 if shapes differ."""
    if tuple(entry.get("shape", ())) != tuple(shape):
        return 0.0, 0.0
    return cosine(singular_values, entry["singular_values"]), cosine(probe_vector, entry["probe"])
