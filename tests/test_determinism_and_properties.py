"""Determinism of the real CLI (same command, same bytes; another DARE seed, other bytes) and
hypothesis properties of the pure merge math in `mergekit_lite.merge.methods.tensor_math`."""

from __future__ import annotations

import hashlib
import math
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from safetensors.torch import load_file
from tiny_models import save_tiny_llama

from mergekit_lite.cli.main import main
from mergekit_lite.merge.methods.tensor_math import lerp, linear, slerp, task_vector_merge

CLI = Path(sys.executable).parent / "mergekit-lite"
EPS32 = torch.finfo(torch.float32).eps


# ------------------------------------------------------------------------------- determinism (CLI, CPU)


@pytest.fixture(scope="module")
def trio(tmp_path_factory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("trio")
    return save_tiny_llama(0, root / "base"), save_tiny_llama(1, root / "a"), save_tiny_llama(2, root / "b")


def merge_args(method: str, trio, extra=()) -> list[str]:
    base, a, b = map(str, trio)
    if method in ("linear", "slerp"):
        models = ["--model", a]
        coefficient = ["--alpha", "0.3"] if method == "linear" else ["--t", "0.3"]
    else:
        models = ["--model", f"{a}:0.7", "--model", f"{b}:0.5"]
        coefficient = {"task_arithmetic": ["--lambda", "0.8"], "ties": ["--density", "0.4"]}.get(
            method, ["--drop", "0.3"]
        )
    return [
        "merge",
        "--method",
        method,
        "--base",
        base,
        *models,
        *coefficient,
        "--out-shard-size",
        "40KB",
        "-q",
        *extra,
    ]


def merged_hashes(out: Path) -> dict[str, str]:
    """sha256 of every weight file and the index: what "byte-identical" means for a model folder."""
    files = sorted(out.glob("*.safetensors")) + sorted(out.glob("*.index.json"))
    assert files, f"no shards in {out}"
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


def run_subprocess(args, out: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [str(CLI), *args, "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def run_in_process(args, out: Path, monkeypatch) -> None:
    """The same command through the same entry point, in this (long-lived, already used) process."""
    monkeypatch.setattr(signal, "signal", lambda *_: None)  # keep pytest's own SIGTERM handling
    result = CliRunner().invoke(main, [*args, "--out", str(out)])
    assert result.exit_code == 0 and result.exception is None, result.output


@pytest.mark.slow
@pytest.mark.parametrize("method", ["linear", "slerp", "task_arithmetic", "ties", "dare_linear", "dare_ties"])
def test_same_command_twice_gives_byte_identical_shards(method, trio, tmp_path, monkeypatch):
    """One run in a fresh process, the same command line again in this process (cheap: torch is imported)."""
    seed = ["--seed", "7"] if method.startswith("dare") else []
    process = run_subprocess(merge_args(method, trio, seed), tmp_path / "first")
    run_in_process(merge_args(method, trio, seed), tmp_path / "second", monkeypatch)
    _, stderr = process.communicate(timeout=180)
    assert process.returncode == 0, stderr
    first, second = merged_hashes(tmp_path / "first"), merged_hashes(tmp_path / "second")
    assert len(first) > 1 and first == second  # several shards, every byte equal
    base = {}
    for shard in Path(trio[0]).glob("*.safetensors"):
        base.update(load_file(shard))
    merged = {}
    for shard in (tmp_path / "first").glob("*.safetensors"):
        merged.update(load_file(shard))
    assert merged.keys() == base.keys()
    assert any(not torch.equal(merged[name], base[name]) for name in base), "the merge changed nothing"
    if method.startswith("dare"):
        run_in_process(merge_args(method, trio, ["--seed", "8"]), tmp_path / "other-seed", monkeypatch)
        assert merged_hashes(tmp_path / "other-seed") != first, "another DARE seed gave the same bytes"


# ------------------------------------------------------------------------------ properties of the math

PROPERTY_SETTINGS = settings(deadline=None, max_examples=60)
VALUES = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False, width=32)


def vectors(count: int, max_size: int = 48):
    """`count` float32 tensors of one random shape (1-D or 2-D)."""
    shapes = st.one_of(st.tuples(st.integers(1, max_size)), st.tuples(st.integers(1, 6), st.integers(1, 8)))
    return shapes.flatmap(lambda shape: st.tuples(*[hnp.arrays(np.float32, shape, elements=VALUES)] * count)).map(
        lambda arrays: [torch.from_numpy(array.copy()) for array in arrays]
    )


def rounding(*tensors: torch.Tensor) -> torch.Tensor:
    """A few fp32 ulps of the largest magnitude involved, elementwise (plus a floor for subnormals)."""
    largest = torch.stack([t.abs() for t in tensors]).amax(dim=0)
    return 4 * EPS32 * largest + 1e-30


@PROPERTY_SETTINGS
@given(pair=vectors(2), alpha=st.floats(0.0, 1.0))
def test_lerp_stays_between_its_inputs(pair, alpha):
    start, end = pair
    merged = lerp(start, end, alpha)
    slack = rounding(start, end)
    assert merged.dtype == torch.float32
    assert (merged >= torch.minimum(start, end) - slack).all()
    assert (merged <= torch.maximum(start, end) + slack).all()
    if alpha in (0.0, 1.0):
        assert torch.equal(merged, start if alpha == 0.0 else end)


@PROPERTY_SETTINGS
@given(tensors=st.integers(2, 4).flatmap(vectors), data=st.data())
def test_normalized_linear_is_a_convex_combination(tensors, data):
    weights = data.draw(
        st.lists(st.floats(0.0, 10.0), min_size=len(tensors), max_size=len(tensors)).filter(
            lambda w: math.fsum(w) > 1e-3
        )
    )
    merged = linear(tensors, weights, normalize=True)
    stacked = torch.stack(tensors)
    slack = len(tensors) * rounding(*tensors)
    assert (merged >= stacked.amin(dim=0) - slack).all()
    assert (merged <= stacked.amax(dim=0) + slack).all()


@PROPERTY_SETTINGS
@given(pair=vectors(2), flip=st.booleans())
def test_slerp_returns_its_endpoints(pair, flip):
    start, end = pair
    if flip:  # opposite vectors: the (anti)colinear fallback
        end = -start
    assert torch.equal(slerp(start, end, 0.0), start)
    assert torch.equal(slerp(start, end, 1.0), end)


@PROPERTY_SETTINGS
@given(pair=vectors(2), scale=st.floats(-2.0, 2.0))
def test_ties_with_full_density_and_one_model_is_task_arithmetic(pair, scale):
    base, model = pair
    ties = task_vector_merge(
        base, [model], [1.0], scale=scale, sparsifier="magnitude", densities=[1.0], consensus=True, normalize=True
    )
    arithmetic = task_vector_merge(base, [model], [1.0], scale=scale)
    assert torch.equal(ties, arithmetic)


DRAWS = 4000


@PROPERTY_SETTINGS
@given(tensors=st.integers(2, 3).flatmap(lambda count: vectors(count, max_size=16)), data=st.data())
def test_dare_expectation_is_task_arithmetic(tensors, data):
    """Each row of a (DRAWS, *shape) tensor is an independent drop-and-rescale of the same task vectors:
    their mean must match task arithmetic within 6 standard errors of that mean."""
    base, models = tensors[0], tensors[1:]
    count = len(models)
    weights = data.draw(st.lists(st.floats(-2.0, 2.0), min_size=count, max_size=count), label="weights")
    drops = data.draw(st.lists(st.floats(0.0, 0.9), min_size=count, max_size=count), label="drops")
    scale = data.draw(st.floats(-2.0, 2.0), label="scale")
    repeat = (DRAWS,) + (1,) * base.dim()
    dare = task_vector_merge(
        base.repeat(repeat),
        [m.repeat(repeat) for m in models],
        weights,
        scale=scale,
        sparsifier="random",
        drops=drops,
        keys=[1234 + index for index in range(count)],
    )
    expected = task_vector_merge(base, models, weights, scale=scale)

    deltas = [(m.double() - base.double()) * w * scale for m, w in zip(models, weights, strict=True)]
    variance = sum(d**2 * p / (1 - p) for d, p in zip(deltas, drops, strict=True)) / DRAWS  # of the mean over draws
    magnitude = base.double().abs() + sum(d.abs() / (1 - p) for d, p in zip(deltas, drops, strict=True))
    tolerance = 6 * variance.sqrt() + 1e-4 * magnitude + 1e-6
    error = (dare.double().mean(dim=0) - expected.double()).abs()
    assert (error <= tolerance).all(), (error - tolerance).max()
