"""The methods mergekit users pick, run side by side with mergekit 0.1.5 on the same tiny checkpoints.

mergekit runs in its own environment ($MERGEKIT_VENV; the tests skip with a
message without it), all configs in one process. Deterministic methods must agree within float32
rounding; DELLA draws random masks, so its keep rates (by magnitude rank) and norms are compared.
mergekit-lite reads the very same configs (mergekit's schema).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from mergekit_reference import run_mergekit_batch
from safetensors.torch import load_file
from tiny_models import tiny_llama
from transformers import LlamaForCausalLM

from mergekit_lite.audited import merge_state_dict, run_merge
from mergekit_lite.merge.config import MergeConfig
from mergekit_lite.merge.schema import config_from_dict

pytestmark = pytest.mark.slow

FINE_TUNES = 3

DETERMINISTIC = {
    "model_stock": {"merge_method": "model_stock", "base_model": "base", "models": ["ft1", "ft2", "ft3"]},
    "model_stock_filter_wise": {
        "merge_method": "model_stock",
        "base_model": "base",
        "models": ["ft1", "ft2", "ft3"],
        "parameters": {"filter_wise": True},
    },
    "nuslerp_base": {
        "merge_method": "nuslerp",
        "base_model": "base",
        "models": [("ft1", {"weight": 0.3}), ("ft2", {"weight": 0.7})],
    },
    "nuslerp_rows": {
        "merge_method": "nuslerp",
        "models": [("ft1", {"weight": 1.0}), ("ft3", {"weight": 3.0})],
        "parameters": {"nuslerp_flatten": False},
    },
    "nuslerp_columns": {
        "merge_method": "nuslerp",
        "base_model": "base",
        "models": [("ft2", {"weight": 2.0}), ("ft3", {"weight": 1.0})],
        "parameters": {"nuslerp_flatten": False, "nuslerp_row_wise": True},
    },
    "multislerp_base": {
        "merge_method": "multislerp",
        "base_model": "base",
        "models": [("ft1", {"weight": 1.0}), ("ft2", {"weight": 2.0}), ("ft3", {"weight": 3.0})],
    },
    "multislerp": {"merge_method": "multislerp", "models": [("ft1", {"weight": 0.5}), ("ft3", {"weight": 0.5})]},
    "karcher": {"merge_method": "karcher", "models": ["ft1", "ft2", "ft3"]},
    "karcher_base": {
        "merge_method": "karcher",
        "base_model": "base",
        "models": ["ft1", "ft2"],
        "parameters": {"max_iter": 3},
    },
    "breadcrumbs": {
        "merge_method": "breadcrumbs",
        "base_model": "base",
        "models": [
            ("ft1", {"weight": 0.6, "density": 0.7, "gamma": 0.05}),
            ("ft2", {"weight": 0.4, "density": 0.9, "gamma": 0.01}),
        ],
    },
    "breadcrumbs_ties": {
        "merge_method": "breadcrumbs_ties",
        "base_model": "base",
        "models": [("ft1", {"weight": 1.0}), ("ft2", {"weight": 0.5}), ("ft3", {"weight": 0.8})],
        "parameters": {"density": 0.6, "gamma": 0.02, "lambda": 0.9, "normalize": True, "rescale": True},
    },
    "passthrough": {"merge_method": "passthrough", "models": [("ft2", {"scale": 0.5})]},
}
SLICES = {  # mergekit's slices: (model, layer_range) sources per slice, optional slice parameters
    "passthrough_stack": {
        "merge_method": "passthrough",
        "slices": [[("base", (0, 2))], [("ft1", (1, 2))], [("ft2", (0, 1))]],
    },
    "slerp_slices": {
        "merge_method": "slerp",
        "base_model": "base",
        "parameters": {"t": [{"filter": "self_attn", "value": [0.1, 0.9]}, {"value": 0.3}]},
        "slices": [[("base", (0, 2)), ("ft1", (0, 2))], ([("base", (1, 2)), ("ft1", (0, 1))], {"t": 0.8})],
    },
    "nuslerp_slices": {
        "merge_method": "nuslerp",
        "base_model": "base",
        "slices": [
            [("base", (1, 2)), ("ft2", (0, 1), {"weight": 1.0}), ("ft3", (1, 2), {"weight": 3.0})],
            [("base", (0, 2)), ("ft1", (0, 2), {"weight": 2.0}), ("ft3", (0, 2), {"weight": 1.0})],
        ],
    },
}
RANDOM = {
    "della_linear_single": {
        "merge_method": "della_linear",
        "base_model": "base",
        "models": [("ft1", {"weight": 1.0})],
        "parameters": {"density": 0.5, "epsilon": 0.3, "rescale": False},
    },
    "della_linear_rescaled": {
        "merge_method": "della_linear",
        "base_model": "base",
        "models": [("ft1", {"weight": 1.0})],
        "parameters": {"density": 0.4},
    },
    "della": {
        "merge_method": "della",
        "base_model": "base",
        "models": [("ft1", {"weight": 1.0}), ("ft2", {"weight": 0.5})],
        "parameters": {"density": 0.6, "epsilon": 0.2, "lambda": 0.8},
    },
}


def mergekit_yaml(case: dict, models: dict[str, Path]) -> dict:
    """A mergekit config as its users write it, with the model names replaced by folders."""
    entries = []
    for entry in case.get("models", []):
        name, parameters = entry if isinstance(entry, tuple) else (entry, {})
        entries.append({"model": str(models[name]), **({"parameters": parameters} if parameters else {})})
    config = {"merge_method": case["merge_method"], "dtype": "float32"}
    if entries:
        config["models"] = entries
    slices = []
    for piece in case.get("slices", []):
        sources, parameters = piece if isinstance(piece, tuple) else (piece, {})
        entries = [
            {"model": str(models[name]), "layer_range": list(layers), **({"parameters": extra[0]} if extra else {})}
            for name, layers, *extra in sources
        ]
        slices.append({"sources": entries, **({"parameters": parameters} if parameters else {})})
    if slices:
        config["slices"] = slices
    if "base_model" in case:
        config["base_model"] = str(models[case["base_model"]])
    if "parameters" in case:
        config["parameters"] = case["parameters"]
    return config


def lite_config(mergekit: dict, seed: int = 0) -> MergeConfig:
    """The same mergekit config read by mergekit-lite as it is (its schema, mergekit_compat mode)."""
    return config_from_dict({**mergekit, "seed": seed}, where="mergekit config")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """A base and three fine-tunes: base + a shared direction + each its own noise (so the angles are
    neither 0 nor 90 degrees), every tensor touched, float32."""
    root = tmp_path_factory.mktemp("mergekit_methods")
    base = tiny_llama(0)
    base.save_pretrained(root / "base")
    generator = torch.Generator().manual_seed(11)
    state = base.state_dict()
    shared = {name: torch.randn(tensor.shape, generator=generator) for name, tensor in state.items()}
    folders = {"base": root / "base"}
    for index in range(1, FINE_TUNES + 1):
        tuned = tiny_llama(0)
        tuned.load_state_dict(
            {
                name: tensor + 0.01 * shared[name] + 0.01 * index**0.5 * torch.randn(tensor.shape, generator=generator)
                for name, tensor in state.items()
            }
        )
        tuned.save_pretrained(root / f"ft{index}")
        folders[f"ft{index}"] = root / f"ft{index}"
    return folders


@pytest.fixture(scope="module")
def mergekit_outputs(checkpoints, tmp_path_factory) -> dict[str, dict[str, torch.Tensor]]:
    """Every case merged by mergekit itself (one process, its own venv), as name -> state dict."""
    root = tmp_path_factory.mktemp("mergekit_out")
    jobs = {}
    for name, case in {**DETERMINISTIC, **SLICES, **RANDOM}.items():
        config_file = root / f"{name}.yml"
        config_file.write_text(yaml.safe_dump(mergekit_yaml(case, checkpoints)))
        jobs[config_file] = root / name
    run_mergekit_batch(jobs)
    return {config.stem: load_file(str(out / "model.safetensors")) for config, out in jobs.items()}


@pytest.mark.parametrize("case", sorted(DETERMINISTIC))
def test_deterministic_methods_equal_mergekit(case, checkpoints, mergekit_outputs):
    ours = merge_state_dict(lite_config(mergekit_yaml(DETERMINISTIC[case], checkpoints)))
    theirs = mergekit_outputs[case]
    assert set(ours) == set(theirs)
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=1e-5, atol=2e-6, msg=f"{case}: {name}")


@pytest.mark.parametrize("case", sorted(SLICES))
def test_slices_equal_mergekit_and_the_output_loads_with_its_new_depth(case, checkpoints, mergekit_outputs, tmp_path):
    """Layers stacked and renumbered as mergekit does; config.json says how many there are now."""
    config = lite_config(mergekit_yaml(SLICES[case], checkpoints))
    run_merge(config, tmp_path / "out")
    ours = load_file(str(tmp_path / "out" / "model.safetensors"))
    theirs = mergekit_outputs[case]
    assert set(ours) == set(theirs)
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=1e-5, atol=2e-6, msg=f"{case}: {name}")
    depth = sum(end - start for start, end in (s.sources[0].layer_range for s in config.slices))
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["num_hidden_layers"] == depth == mergekit_layers(theirs)
    model = LlamaForCausalLM.from_pretrained(tmp_path / "out")
    assert len(model.model.layers) == depth


def mergekit_layers(state: dict) -> int:
    return 1 + max(int(name.split(".")[2]) for name in state if name.startswith("model.layers."))


def test_the_cases_are_not_trivial(checkpoints, mergekit_outputs):
    """Each deterministic result differs from every input, so agreeing with mergekit means something."""
    inputs = [load_file(str(folder / "model.safetensors")) for folder in checkpoints.values()]
    for case in DETERMINISTIC:
        merged = mergekit_outputs[case]["model.layers.1.mlp.down_proj.weight"]
        for state in inputs:
            assert (merged - state["model.layers.1.mlp.down_proj.weight"]).abs().max() > 1e-4, case


def keep_rates_by_rank(base: dict, tuned: dict, merged: dict, bins: int = 5) -> torch.Tensor:
    """Share of delta entries kept (merged != base), by their magnitude rank within their row, in `bins` bins."""
    kept, counted = torch.zeros(bins), torch.zeros(bins)
    for name, tensor in base.items():
        delta = (
            (tuned[name] - tensor).reshape(-1, tensor.shape[-1]) if tensor.dim() > 1 else (tuned[name] - tensor)[None]
        )
        survived = (merged[name] - tensor).reshape(delta.shape) != 0
        share = delta.abs().argsort(dim=1).argsort(dim=1).float() / (delta.shape[1] - 1)
        which = (share * bins).long().clamp(max=bins - 1)
        kept += torch.zeros(bins).index_add_(0, which.reshape(-1), survived.reshape(-1).float())
        counted += torch.bincount(which.reshape(-1), minlength=bins).float()
    return kept / counted


def test_della_keep_rates_rise_with_magnitude_rank_as_in_mergekit(checkpoints, mergekit_outputs):
    """MagPrune keeps rank share r with probability density - epsilon + 2·epsilon·r: 0.2 -> 0.8 here.
    ~30k entries, 5 bins: a binomial standard deviation near 0.006 per bin."""
    base, tuned = (load_file(str(checkpoints[n] / "model.safetensors")) for n in ("base", "ft1"))
    ours = merge_state_dict(lite_config(mergekit_yaml(RANDOM["della_linear_single"], checkpoints)))
    expected = 0.2 + 0.6 * (torch.arange(5) + 0.5) / 5
    ours_rates = keep_rates_by_rank(base, tuned, ours)
    theirs_rates = keep_rates_by_rank(base, tuned, mergekit_outputs["della_linear_single"])
    torch.testing.assert_close(ours_rates, expected, atol=0.03, rtol=0)
    torch.testing.assert_close(theirs_rates, expected, atol=0.03, rtol=0)
    for name, tensor in base.items():  # without rescale the survivors are the delta itself
        survived = ours[name] != tensor
        torch.testing.assert_close(ours[name][survived], tuned[name][survived])


def test_della_rescale_keeps_the_l1_norm_of_each_delta_as_mergekit_does(checkpoints, mergekit_outputs):
    base, tuned = (load_file(str(checkpoints[n] / "model.safetensors")) for n in ("base", "ft1"))
    ours = merge_state_dict(lite_config(mergekit_yaml(RANDOM["della_linear_rescaled"], checkpoints)))
    theirs = mergekit_outputs["della_linear_rescaled"]
    for name, tensor in base.items():
        dense = (tuned[name] - tensor).abs().sum()
        for merged in (ours, theirs):
            assert torch.isclose((merged[name] - tensor).abs().sum(), dense, rtol=1e-4), name
    kept = [
        sum(int((m[n] != t).sum()) for n, t in base.items()) / sum(t.numel() for t in base.values())
        for m in (ours, theirs)
    ]
    assert abs(kept[0] - 0.4) < 0.02 and abs(kept[1] - 0.4) < 0.02, kept


def test_della_with_sign_consensus_matches_mergekit_in_distribution(checkpoints, mergekit_outputs):
    """Two models, consensus and the disjoint mean: kept share and mean |delta| agree with mergekit's
    within a few binomial standard deviations, tensor group by tensor group."""
    base = load_file(str(checkpoints["base"] / "model.safetensors"))
    ours = merge_state_dict(lite_config(mergekit_yaml(RANDOM["della"], checkpoints), seed=3))
    theirs = mergekit_outputs["della"]
    for part in ("embed_tokens", "self_attn", "mlp", "lm_head"):
        names = [name for name in base if part in name]
        stats = []
        for merged in (ours, theirs):
            deltas = torch.cat([(merged[n] - base[n]).reshape(-1) for n in names])
            stats.append(((deltas != 0).float().mean().item(), deltas.abs().mean().item()))
        (our_kept, our_size), (their_kept, their_size) = stats
        assert abs(our_kept - their_kept) < 0.03, (part, stats)
        assert abs(our_size - their_size) < 0.1 * their_size, (part, stats)


def test_della_masks_are_seeded_per_tensor_and_model(checkpoints):
    """Same seed, same bytes; another seed, other masks (DARE's rule, via the same per-tensor generators)."""
    case = mergekit_yaml(RANDOM["della"], checkpoints)
    first, again, other = (merge_state_dict(lite_config(case, seed=seed)) for seed in (5, 5, 6))
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert any(not torch.equal(first[name], other[name]) for name in first)
