"""End to end: tiny sharded Llama checkpoints, every method, checked against independent references."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.numpy import load_file as load_numpy
from safetensors.torch import load_file as load_torch
from test_safety import cli
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from mergekit_lite.audited import merge_state_dict, run_merge
from mergekit_lite.errors import InputError
from mergekit_lite.io.direct import STAGE_BYTES
from mergekit_lite.merge import cost
from mergekit_lite.merge.config import MergeConfig
from mergekit_lite.merge.methods import REGISTRY
from mergekit_lite.merge.methods import tensor_math as methods
from mergekit_lite.merge.plan import plan_merge
from mergekit_lite.merge.schema import config_from_dict, load_config

CLI = str(Path(sys.executable).parent / "mergekit-lite")


def tiny_config(**overrides):
    settings = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    settings.update(overrides)
    return LlamaConfig(**settings)


def save_variant(base_state, folder, seed, scale=0.05, dtype=torch.float32):
    """base + seeded noise: a stand-in fine-tune whose task vector is known."""
    generator = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM(tiny_config())
    state = {
        name: tensor + scale * torch.randn(tensor.shape, generator=generator) for name, tensor in base_state.items()
    }
    model.load_state_dict(state)
    model.to(dtype).save_pretrained(folder, max_shard_size="40KB")
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    torch.manual_seed(0)
    base = LlamaForCausalLM(tiny_config())
    base.save_pretrained(root / "base", max_shard_size="40KB")
    state = base.state_dict()
    return {
        "base": root / "base",
        "a": save_variant(state, root / "a", 1),
        "b": save_variant(state, root / "b", 2),
        "root": root,
    }


def read_model(folder) -> dict[str, np.ndarray]:
    """All tensors of a saved model via safetensors itself (independent of our reader)."""
    state = {}
    for shard in sorted(Path(folder).glob("*.safetensors")):
        state.update(load_numpy(shard))
    return state


def merge(config: dict, out: Path) -> dict[str, np.ndarray]:
    run_merge(config_from_dict(config), out)
    return read_model(out)


def assert_close(merged, expected, atol=2e-6):
    assert set(merged) == set(expected)
    for name in expected:
        np.testing.assert_allclose(merged[name], expected[name], atol=atol, rtol=1e-5, err_msg=name)


def np_ties(base, deltas, density, weights, scale):
    trimmed = []
    for delta in deltas:
        keep = round(density * delta.size)
        threshold = np.sort(np.abs(delta).ravel())[::-1][keep - 1]
        trimmed.append(np.where(np.abs(delta) >= threshold, delta, 0.0) * 1.0)
    weighted = np.stack([w * d for w, d in zip(weights, trimmed, strict=True)])
    elected = np.sign(weighted.sum(axis=0))
    agree = np.sign(weighted) == elected
    divisor = (agree * np.array(weights).reshape(-1, *[1] * base.ndim)).sum(axis=0)
    divisor[np.abs(divisor) < 1e-8] = 1.0
    return base + scale * (weighted * agree).sum(axis=0) / divisor


def np_slerp(a, b, t):
    va, vb = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    cosine = np.dot(va, vb) / (np.linalg.norm(va) * np.linalg.norm(vb))
    if abs(cosine) > 0.9995:
        return (1 - t) * a + t * b
    theta = np.arccos(np.clip(cosine, -1, 1))
    return (np.sin((1 - t) * theta) * a + np.sin(t * theta) * b) / np.sin(theta)


def test_linear_matches_reference_and_is_exact_at_the_ends(models, tmp_path):
    pre, post = read_model(models["base"]), read_model(models["a"])
    merged = merge(
        {"method": "linear", "base": str(models["base"]), "models": [str(models["a"])], "parameters": {"alpha": 0.3}},
        tmp_path / "mid",
    )
    assert_close(merged, {n: 0.7 * pre[n] + 0.3 * post[n] for n in pre})
    for alpha, expected in ((0.0, pre), (1.0, post)):
        ends = merge(
            {
                "method": "linear",
                "base": str(models["base"]),
                "models": [str(models["a"])],
                "parameters": {"alpha": alpha},
            },
            tmp_path / f"end{alpha}",
        )
        for name in expected:
            assert np.array_equal(ends[name], expected[name]), name


def test_weighted_average_of_three_models(models, tmp_path):
    states = [read_model(models[k]) for k in ("base", "a", "b")]
    merged = merge(
        {
            "method": "linear",
            "models": [
                {"model": str(models["base"]), "weight": 1.0},
                {"model": str(models["a"]), "weight": 2.0},
                {"model": str(models["b"]), "weight": 1.0},
            ],
        },
        tmp_path / "avg",
    )
    assert_close(merged, {n: (states[0][n] + 2 * states[1][n] + states[2][n]) / 4 for n in states[0]})


def test_slerp_matches_reference(models, tmp_path):
    pre, post = read_model(models["base"]), read_model(models["a"])
    merged = merge(
        {"method": "slerp", "base": str(models["base"]), "models": [str(models["a"])], "parameters": {"t": 0.4}},
        tmp_path / "slerp",
    )
    assert_close(merged, {n: np_slerp(pre[n], post[n], 0.4) for n in pre}, atol=1e-5)


def test_task_arithmetic_with_a_negative_coefficient(models, tmp_path):
    base, a, b = (read_model(models[k]) for k in ("base", "a", "b"))
    merged = merge(
        {
            "method": "task_arithmetic",
            "base": str(models["base"]),
            "models": [{"model": str(models["a"]), "weight": 1.0}, {"model": str(models["b"]), "weight": -0.5}],
            "parameters": {"lambda": 0.8},
        },
        tmp_path / "ta",
    )
    assert_close(merged, {n: base[n] + 0.8 * ((a[n] - base[n]) - 0.5 * (b[n] - base[n])) for n in base})


def test_ties_matches_reference(models, tmp_path):
    base, a, b = (read_model(models[k]) for k in ("base", "a", "b"))
    merged = merge(
        {
            "method": "ties",
            "base": str(models["base"]),
            "models": [str(models["a"]), str(models["b"])],
            "parameters": {"density": 0.3, "lambda": 0.9},
        },
        tmp_path / "ties",
    )
    expected = {n: np_ties(base[n], [a[n] - base[n], b[n] - base[n]], 0.3, [1.0, 1.0], 0.9) for n in base}
    assert_close(merged, expected)


@pytest.mark.parametrize("method", ["dare_linear", "dare_ties"])
def test_dare_drops_and_rescales_and_is_seeded(models, tmp_path, method):
    base, a = read_model(models["base"]), read_model(models["a"])
    config = {
        "method": method,
        "base": str(models["base"]),
        "models": [str(models["a"])],
        "parameters": {"drop": 0.6},
        "seed": 11,
    }
    first = merge(config, tmp_path / "first")
    again = merge(config, tmp_path / "again")
    other = merge({**config, "seed": 12}, tmp_path / "other")
    kept_total = count = 0
    for name in base:
        assert np.array_equal(first[name], again[name])
        delta = a[name] - base[name]
        merged_delta = first[name] - base[name]
        kept = ~np.isclose(merged_delta, 0.0, atol=1e-7)
        np.testing.assert_allclose(merged_delta[kept], delta[kept] / 0.4, rtol=1e-4, atol=1e-6)
        kept_total, count = kept_total + kept.sum(), count + kept.size
    assert abs(kept_total / count - 0.4) < 0.02
    assert any(not np.array_equal(first[n], other[n]) for n in base)


def test_dare_merges_record_their_mask_version_and_refuse_another(models, tmp_path):
    """The provenance of a DARE merge names the mask version (docs/methods.md, "DARE's masks"); merging it again gives the
    same bytes, and a config naming another version is refused in one line instead of merged with other masks."""
    first = merge(
        {
            "method": "dare_ties",
            "base": str(models["base"]),
            "models": [str(models["a"])],
            "parameters": {"drop": 0.4},
            "seed": 5,
        },
        tmp_path / "first",
    )
    provenance = tmp_path / "first" / "mergekit_lite_config.yaml"
    assert yaml.safe_load(provenance.read_text())["dare_mask_version"] == 2
    again = merge(load_config(provenance).to_dict(), tmp_path / "again")
    assert all(np.array_equal(first[name], again[name]) for name in first)
    plain = merge({"method": "ties", "base": str(models["base"]), "models": [str(models["a"])]}, tmp_path / "ties")
    assert plain and "dare_mask_version" not in (tmp_path / "ties" / "mergekit_lite_config.yaml").read_text()
    old = tmp_path / "old.yaml"
    old.write_text(provenance.read_text().replace("dare_mask_version: 2", "dare_mask_version: 1"))
    result = cli("merge", old, "--out", tmp_path / "never", "--quiet")
    assert result.returncode == 2 and not (tmp_path / "never").exists()
    assert result.stderr.count("\n") == 1 and "dare_mask_version 1" in result.stderr, result.stderr


def test_dare_linear_without_drop_equals_task_arithmetic(models, tmp_path):
    common = {"base": str(models["base"]), "models": [str(models["a"]), str(models["b"])], "seed": 3}
    dare = merge({**common, "method": "dare_linear", "parameters": {"drop": 0.0, "lambda": 0.7}}, tmp_path / "d")
    arithmetic = merge({**common, "method": "task_arithmetic", "parameters": {"lambda": 0.7}}, tmp_path / "t")
    for name in dare:
        assert np.array_equal(dare[name], arithmetic[name])


def test_recall_uses_layer_weights_from_its_weights_file(models, tmp_path):
    from mergekit_lite.merge.recall import RecallWeights

    weights = [[0.5, 0.5], [0.6, 0.4], [0.3, 0.7], [0.1, 0.9]]  # rows: embeddings, layer 0, 1, 2
    recall = RecallWeights(
        models=[str(models["base"]), str(models["a"])],
        reference=1,
        temperature=0.5,
        similarity=weights,
        weights=weights,
        typical_samples=[0],
    )
    weights_file = tmp_path / "weights.json"
    weights_file.write_text(json.dumps(recall.to_json()))
    pre, post = read_model(models["base"]), read_model(models["a"])
    merged = merge(
        {
            "method": "recall",
            "base": str(models["base"]),
            "models": [str(models["a"])],
            "recall": {"weights_file": str(weights_file)},
        },
        tmp_path / "recall",
    )
    for name in pre:
        if ".layers." in name:
            row = weights[int(name.split(".layers.")[1].split(".")[0]) + 1]
        else:
            row = weights[0] if "embed" in name else weights[-1]
        np.testing.assert_allclose(merged[name], row[0] * pre[name] + row[1] * post[name], atol=2e-6, err_msg=name)
    assert json.loads((tmp_path / "recall" / "recall_weights.json").read_text())["weights"] == weights


@pytest.mark.slow
def test_every_method_reloads_with_transformers_and_generates(models, tmp_path):
    base, a = str(models["base"]), str(models["a"])
    configs = {
        "linear": {"parameters": {"alpha": 0.5}},
        "slerp": {"parameters": {"t": 0.5}},
        "task_arithmetic": {"parameters": {"lambda": 1.0}},
        "ties": {"parameters": {"density": 0.5}},
        "dare_linear": {"parameters": {"drop": 0.3}},
        "dare_ties": {"parameters": {"drop": 0.3}},
    }
    for method, extra in configs.items():
        out = tmp_path / method
        run_merge(
            config_from_dict(
                {"method": method, "base": base, "models": [a], "dtype": "bf16", "out_shard_size": "30KB", **extra}
            ),
            out,
        )
        index = json.loads((out / "model.safetensors.index.json").read_text())
        stored = {}
        for shard in out.glob("*.safetensors"):
            stored.update(load_torch(shard))
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in stored.values())
        model = AutoModelForCausalLM.from_pretrained(out)
        assert model.dtype == torch.bfloat16
        tokens = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False)
        assert tokens.shape == (1, 7)


def test_layer_gradient_and_name_filters(models, tmp_path):
    pre, post = read_model(models["base"]), read_model(models["a"])
    merged = merge(
        {
            "method": "task_arithmetic",
            "base": str(models["base"]),
            "models": [{"model": str(models["a"]), "weight": [{"filter": "mlp", "value": [0.0, 1.0]}, {"value": 0.5}]}],
        },
        tmp_path / "grad",
    )
    for name in pre:
        if ".mlp." in name:
            layer = int(name.split(".layers.")[1].split(".")[0])
            weight = layer / 2  # three layers: 0, 0.5, 1
        else:
            weight = 0.5
        np.testing.assert_allclose(merged[name], pre[name] + weight * (post[name] - pre[name]), atol=2e-6, err_msg=name)


def test_identical_and_skipped_tensors_are_copied_byte_for_byte(models, tmp_path):
    pre = read_model(models["base"])
    merged = merge(
        {"method": "slerp", "base": str(models["base"]), "models": [str(models["base"])], "parameters": {"t": 0.37}},
        tmp_path / "same",
    )
    assert all(np.array_equal(merged[n], pre[n]) for n in pre)
    skipped = merge(
        {
            "method": "linear",
            "base": str(models["base"]),
            "models": [str(models["a"])],
            "parameters": {"alpha": 0.5},
            "skip": ["lm_head", "norm"],
        },
        tmp_path / "skip",
    )
    assert np.array_equal(skipped["lm_head.weight"], pre["lm_head.weight"])
    assert np.array_equal(skipped["model.norm.weight"], pre["model.norm.weight"])
    assert not np.array_equal(skipped["model.embed_tokens.weight"], pre["model.embed_tokens.weight"])


def test_prefixed_names_and_tied_heads_are_mapped(models, tmp_path):
    from safetensors.numpy import save_file

    pre, post = read_model(models["base"]), read_model(models["a"])
    wrapped = tmp_path / "wrapped"
    wrapped.mkdir()
    save_file({f"module.{n}": v for n, v in post.items()}, str(wrapped / "model.safetensors"))
    merged = merge(
        {"method": "linear", "base": str(models["base"]), "models": [str(wrapped)], "parameters": {"alpha": 0.5}},
        tmp_path / "out1",
    )
    np.testing.assert_allclose(
        merged["lm_head.weight"], 0.5 * (pre["lm_head.weight"] + post["lm_head.weight"]), atol=1e-6
    )

    tied = tmp_path / "tied"
    tied.mkdir()
    save_file({n: v for n, v in post.items() if n != "lm_head.weight"}, str(tied / "model.safetensors"))
    (tied / "config.json").write_text(json.dumps({**tiny_config(tie_word_embeddings=True).to_dict()}))
    merged = merge(
        {"method": "linear", "base": str(models["base"]), "models": [str(tied)], "parameters": {"alpha": 0.5}},
        tmp_path / "out2",
    )
    expected = 0.5 * (pre["lm_head.weight"] + post["model.embed_tokens.weight"])
    np.testing.assert_allclose(merged["lm_head.weight"], expected, atol=1e-6)


@pytest.mark.slow
def test_dry_run_prints_the_plan_and_writes_nothing(models, tmp_path, calibrated_rates):
    """With the run's rates cached, a dry run reads them (prints when they were measured) and measures nothing."""
    out = tmp_path / "never"
    result = cli(
        "merge",
        "--method",
        "ties",
        "--base",
        models["base"],
        "--model",
        f"{models['a']}:0.5",
        "--density",
        "0.4",
        "--out",
        out,
        "--dry-run",
    )
    assert result.returncode == 0, result.stderr
    assert "model.layers.0.mlp.down_proj.weight" in result.stdout and "densities=[0.4]" in result.stdout
    assert f"rates: {cost.cache_file()}, measured {calibrated_rates} at load " in result.stdout
    assert not out.exists()


@pytest.mark.slow
def test_dry_run_estimates_wall_time_and_memory_for_every_method(models, tmp_path, calibrated_rates):
    """Rates are measured once per machine and cached; every registered method has them, and each plan gets a
    wall time of start-up and the longer of reads + math and writes (which overlap), and a peak memory of at least
    start-up plus the engine's ring and the writer's two direct-write stages (and for TIES and SLERP their
    statistics' working memory, computed beside the math: next to none for SLERP's compiled angle, whose sums live
    on the stack)."""
    rates, where = cost.load_rates()
    assert set(rates.math_ns_per_element) == set(REGISTRY) == set(rates.memory_bytes_per_element)
    assert set(rates.statistics_peak_bytes) == {name for name, method in REGISTRY.items() if method.slab_statistics}
    assert rates.statistics_peak_bytes["ties"] > 0, rates.statistics_peak_bytes
    compiled_angle = torch.bfloat16 in methods.ANGLE_DTYPES
    assert (
        rates.statistics_peak_bytes["slerp"] < 1 << 20 if compiled_angle else rates.statistics_peak_bytes["slerp"] > 0
    )
    assert f"measured {rates.measured_at} at load " in cost.load_rates()[1] and cost.cache_file().is_file()
    for method, declared in REGISTRY.items():
        if declared.same_math_as:  # RECALL combines layers linearly; its forward passes are not estimated
            assert rates.math_ns_per_element[method] == rates.math_ns_per_element[declared.same_math_as]
            continue
        calibration = declared.calibration
        parameters, count, with_base = calibration.parameters, calibration.models, calibration.with_base
        inputs = [str(models[name]) for name in ("base", "a", "b")]
        config = config_from_dict(
            {
                "method": method,
                "base": inputs[0] if with_base else None,
                "models": inputs[1 : count + 1] if with_base else inputs[:count],
                "parameters": parameters,
            }
        )
        plan = plan_merge(config)
        estimate = cost.estimate(plan, rates)
        parts = (estimate.startup_s, estimate.read_s, estimate.math_s, estimate.write_s)
        assert all(math.isfinite(part) and part > 0 for part in parts), (method, estimate)
        assert estimate.wall_s == pytest.approx(parts[0] + max(parts[1] + parts[2], parts[3])), method
        assert estimate.writer_bytes == 2 * STAGE_BYTES, method
        assert estimate.peak_rss >= rates.startup_rss + estimate.ring_bytes + estimate.writer_bytes, method
        if method in rates.statistics_peak_bytes:  # chunked methods: their working memory does not scale down
            assert (
                estimate.peak_rss
                >= rates.startup_rss
                + estimate.ring_bytes
                + estimate.writer_bytes
                + rates.memory_peak_bytes[method]
                + rates.statistics_peak_bytes[method]
            ), method
        assert estimate.ring_bytes > 0, method
    result = cli(
        "merge",
        "--method",
        "dare_ties",
        "--base",
        models["base"],
        "--model",
        models["a"],
        "--out",
        tmp_path / "never",
        "--dry-run",
    )
    assert result.returncode == 0, result.stderr
    assert "estimate on this machine: wall " in result.stdout and str(cost.cache_file()) in result.stdout
    refused = cli("merge", "--method", "linear", "--model", models["a"], "--calibrate", "--out", tmp_path / "never")
    assert refused.returncode == 2 and "--calibrate goes with --dry-run" in refused.stderr
    assert not (tmp_path / "never").exists()


@pytest.mark.slow
def test_dry_run_estimates_without_a_writable_cache(models, tmp_path):
    """A cache folder that cannot be made (here under a file) costs a calibration per dry run, never the dry run.
    The suite's one cold calibration through the CLI (the other dry runs share `calibrated_rates`)."""
    (tmp_path / "a-file").write_text("not a folder")
    result = subprocess.run(
        [
            CLI,
            "merge",
            "--method",
            "linear",
            "--model",
            str(models["a"]),
            "--model",
            str(models["b"]),
            "--out",
            str(tmp_path / "never"),
            "--dry-run",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "MERGEKIT_LITE_CACHE": str(tmp_path / "a-file" / "cache")},
    )
    assert result.returncode == 0, result.stderr
    assert "estimate on this machine: wall " in result.stdout and "not cached (" in result.stdout
    assert (tmp_path / "a-file").read_text() == "not a folder" and not (tmp_path / "never").exists()


def test_yaml_config_and_flags(models, tmp_path):
    config_file = tmp_path / "merge.yaml"
    config_file.write_text(
        f"method: linear\nbase: {models['base']}\nmodels:\n  - model: {models['a']}\n"
        f"parameters:\n  alpha: 0.2\ndtype: fp16\n"
    )
    out = tmp_path / "yaml-out"
    result = cli("merge", config_file, "--alpha", "0.6", "--out", out, "--quiet")
    assert result.returncode == 0, result.stderr
    pre, post, merged = read_model(models["base"]), read_model(models["a"]), read_model(out)
    name = "model.layers.1.self_attn.q_proj.weight"
    assert merged[name].dtype == np.float16
    np.testing.assert_allclose(merged[name], (0.4 * pre[name] + 0.6 * post[name]).astype(np.float16), atol=1e-3)
    assert load_config(config_file).parameters == {"alpha": 0.2}


def test_in_memory_merge_equals_the_streamed_one(models, tmp_path):
    config = config_from_dict(
        {"method": "ties", "base": str(models["base"]), "models": [str(models["a"]), str(models["b"])]}
    )
    streamed = merge(config.to_dict(), tmp_path / "streamed")
    in_memory = merge_state_dict(config)
    for name, tensor in in_memory.items():
        assert np.array_equal(tensor.numpy(), streamed[name])


def test_unknown_tensor_parameter_is_refused(models):
    with pytest.raises(InputError, match="does not apply to method linear"):
        plan_merge(config_from_dict({"method": "linear", "models": [str(models["a"])], "parameters": {"density": 0.5}}))


RSS_SCRIPT = """
import resource, subprocess, sys
subprocess.run(sys.argv[1:], check=True)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
"""
IMPORTS_ONLY = "import torch, tqdm, yaml, mergekit_lite.merge.engine, mergekit_lite.cli.merge"


def peak_rss(command: list[str]) -> int:
    """Peak RSS in bytes of `command` as a whole process (the children of a fresh wrapper)."""
    result = subprocess.run([sys.executable, "-c", RSS_SCRIPT, *command], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return int(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_peak_memory_stays_bounded_by_a_few_tensors(tmp_path):
    """Two ~320 MB models of 40 tensors each: the merge adds at most (inputs + 2) x largest + 100 MB of RSS
    to what importing torch and the package costs in the same environment, and stays under the absolute
    (inputs + 2) x largest + 300 MB budget plus that import cost's excess over 220 MB.

    The import cost is measured, not assumed: torch's shared libraries count in RSS by how many of their
    pages happen to be resident, which differed by tens of MB between two identical venvs here.
    """
    from safetensors.torch import save_file

    n_tensors, rows, cols = 40, 1024, 2048
    largest = rows * cols * 4
    for seed, name in ((0, "pre"), (1, "post")):
        folder = tmp_path / name
        folder.mkdir()
        generator = torch.Generator().manual_seed(seed)
        weight_map = {}
        for shard in range(4):
            tensors = {
                f"model.layers.{i}.mlp.weight": torch.randn(rows, cols, generator=generator)
                for i in range(shard * 10, shard * 10 + 10)
            }
            file = f"model-{shard + 1:05d}-of-00004.safetensors"
            save_file(tensors, str(folder / file))
            weight_map.update({key: file for key in tensors})
            del tensors
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    command = [
        CLI,
        "merge",
        "--method",
        "linear",
        "--base",
        str(tmp_path / "pre"),
        "--model",
        str(tmp_path / "post"),
        "--alpha",
        "0.5",
        "--out",
        str(tmp_path / "out"),
        "--out-shard-size",
        "100MB",
        "--quiet",
    ]
    peak = peak_rss(command)
    imports = peak_rss([sys.executable, "-c", IMPORTS_ONLY])
    total_input = 2 * n_tensors * largest
    streaming_budget = (2 + 2) * largest + 100 * 2**20
    assert peak - imports < streaming_budget, (
        f"merge added {(peak - imports) / 2**20:.0f} MB to {imports / 2**20:.0f} MB of imports (inputs {total_input / 2**20:.0f} MB)"
    )
    assert peak < (2 + 2) * largest + 300 * 2**20 + max(imports - 220 * 2**20, 0)
    assert math.isclose(
        sum(p.stat().st_size for p in (tmp_path / "out").glob("*.safetensors")), total_input / 2, rel_tol=0.01
    )


def test_passthrough_slices_stack_layers_exactly_and_the_config_follows(tmp_path):
    """A frankenmerge by hand: output layer j is the named source layer, byte for byte, renumbered; the
    config's layer count and per-layer attention types (Qwen2's layer_types) follow the sources."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from mergekit_lite.merge.config import Slice, SliceSource

    settings = dict(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_sliding_window=True,
        sliding_window=16,
        max_window_layers=1,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**settings)).save_pretrained(tmp_path / "a")
    Qwen2ForCausalLM(Qwen2Config(**settings)).save_pretrained(tmp_path / "b", max_shard_size="20KB")
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    layout = [(a, 0), (a, 1), (b, 0), (a, 2), (b, 2)]
    slices = [
        Slice([SliceSource(a, (0, 2))]),
        Slice([SliceSource(b, (0, 1))]),
        Slice([SliceSource(a, (2, 3))]),
        Slice([SliceSource(b, (2, 3))], parameters={"scale": 1.0}),
    ]
    run_merge(MergeConfig(method="passthrough", models=[], slices=slices), tmp_path / "out")
    merged = Qwen2ForCausalLM.from_pretrained(tmp_path / "out")
    assert merged.config.num_hidden_layers == 5
    assert merged.config.layer_types == [
        "full_attention",
        "sliding_attention",
        "full_attention",
        "sliding_attention",
        "sliding_attention",
    ]
    sources = {path: Qwen2ForCausalLM.from_pretrained(path) for path in (a, b)}
    for out_index, (path, index) in enumerate(layout):
        for name, tensor in sources[path].model.layers[index].state_dict().items():
            assert torch.equal(merged.model.layers[out_index].state_dict()[name], tensor), (out_index, name)
    assert torch.equal(merged.model.embed_tokens.weight, sources[a].model.embed_tokens.weight)
    assert torch.equal(merged.lm_head.weight, sources[b].lm_head.weight)
    assert torch.equal(merged.model.norm.weight, sources[b].model.norm.weight)


def test_slices_report_bad_layer_ranges_and_method_inputs_in_one_line(tmp_path):
    from mergekit_lite.merge.config import Slice, SliceSource

    save_variant(LlamaForCausalLM(tiny_config()).state_dict(), tmp_path / "a", seed=1)
    a = str(tmp_path / "a")
    with pytest.raises(InputError, match=r"slice 0: layer_range \[1, 5\] of .* is outside its 3 layers"):
        plan_merge(MergeConfig(method="passthrough", models=[], slices=[Slice([SliceSource(a, (1, 5))])]))
    with pytest.raises(InputError, match="slice 1: passthrough copies one model per tensor, got 2"):
        plan_merge(
            MergeConfig(
                method="passthrough",
                models=[],
                slices=[Slice([SliceSource(a, (0, 1))]), Slice([SliceSource(a, (0, 1)), SliceSource(a, (1, 2))])],
            )
        )
    with pytest.raises(InputError, match="same number of layers"):
        plan_merge(
            MergeConfig(method="linear", models=[], slices=[Slice([SliceSource(a, (0, 1)), SliceSource(a, (0, 2))])])
        )


def test_rates_are_kept_apart_with_and_without_the_compiled_kernels(monkeypatch):
    """SLERP's math runs several times faster compiled: rates measured one way are not reused the other way."""
    with_kernels = cost.machine_key()
    monkeypatch.setattr(methods, "_kernels", None)
    assert cost.machine_key() != with_kernels and cost.machine_key().endswith("|kernels torch")
