"""mergekit's `model+lora` references (the model with that LoRA adapter merged in), as a model and as the base:
mergekit 0.1.5 run side by side (it merges the adapter with PEFT's merge_and_unload into its --lora-merge-cache),
mergekit-lite streaming base + scaling*B@A; hub ids for both parts from a cache laid out here; the audit, output
safety and a '+' that is part of a folder's name."""

import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants
from mergekit_reference import _environment, mergekit_cli
from peft import LoraConfig, get_peft_model
from test_hub_audit import lay_out
from test_merge_adapters import train_adapter
from test_mergekit_compat import read_state
from test_safety import cli, one_error_line
from tiny_models import save_tiny_llama
from transformers import LlamaForCausalLM

from mergekit_lite.threads import torch_threads

pytestmark = pytest.mark.slow

AS_MODEL = """merge_method: task_arithmetic
base_model: {base}
models:
  - model: {model}+{lora}
    parameters: {{weight: 1.0}}
  - model: {other}
    parameters: {{weight: 0.5}}
dtype: float32
"""
AS_BASE = """merge_method: slerp
base_model: {model}+{lora}
models:
  - model: {model}+{lora}
  - model: {other}
parameters: {{t: 0.3}}
dtype: float32
"""
IN_SLICES = """merge_method: passthrough
slices:
  - sources:
      - model: {model}+{lora}
        layer_range: [0, 2]
  - sources:
      - model: {other}
        layer_range: [1, 2]
dtype: float32
"""


def write_config(template: str, folder: Path, name: str, **references) -> Path:
    path = folder / f"{name}.yml"
    path.write_text(template.format(**{key: str(value) for key, value in references.items()}))
    return path


def run_mergekit_with_loras(config: Path, out: Path, cache: Path) -> Path:
    """mergekit-yaml CONFIG OUT --lora-merge-cache CACHE, offline, in its own environment."""
    result = subprocess.run(
        [str(mergekit_cli()), str(config), str(out), "--lora-merge-cache", str(cache), "--quiet"],
        capture_output=True,
        text=True,
        env=_environment(),
        timeout=600,
    )
    assert result.returncode == 0, f"mergekit failed on {config}:\n{result.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """A base, an unrelated model, a trained adapter of the base and a no-op one (B = 0: the audit rejects it)."""
    root = tmp_path_factory.mktemp("lora-refs")
    with torch_threads(1):
        save_tiny_llama(0, root / "base")
        save_tiny_llama(1, root / "other")
        train_adapter(root / "base", root / "lora", 1, ["q_proj", "v_proj", "down_proj"])
        get_peft_model(
            LlamaForCausalLM.from_pretrained(root / "base"), LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj"])
        ).save_pretrained(root / "noop")
    return {
        "root": root,
        "model": root / "base",
        "base": root / "base",
        "lora": root / "lora",
        "other": root / "other",
        "noop": root / "noop",
    }


@pytest.fixture(scope="module")
def theirs(zoo):
    """mergekit's outputs for X+L as a model, as the base and in a slice."""
    mergekit_cli()
    root = zoo["root"]
    configs = {
        name: write_config(template, root, name, **zoo)
        for name, template in (("as_model", AS_MODEL), ("as_base", AS_BASE), ("in_slices", IN_SLICES))
    }
    with ThreadPoolExecutor(max_workers=2) as pool:
        outputs = {
            name: pool.submit(run_mergekit_with_loras, config, root / f"mk-{name}", root / f"cache-{name}")
            for name, config in configs.items()
        }
        return {name: (configs[name], future.result()) for name, future in outputs.items()}


def assert_same_tensors(ours: Path, expected: Path) -> None:
    merged, reference = read_state(ours), read_state(expected)
    assert sorted(merged) == sorted(reference)
    for name, tensor in reference.items():
        assert merged[name].dtype == tensor.dtype, name
        torch.testing.assert_close(merged[name], tensor, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("name", ["as_model", "as_base", "in_slices"])
def test_model_plus_lora_matches_mergekit(zoo, theirs, tmp_path, name):
    config, expected = theirs[name]
    result = cli("merge", config, "--out", tmp_path / "out", "--quiet")
    assert result.returncode == 0, result.stderr
    assert_same_tensors(tmp_path / "out", expected)
    card = (tmp_path / "out" / "README.md").read_text()
    assert "VERIFIED" in card or "WARN" in card  # the adapter was audited against its model
    assert f"{zoo['base'].name}+{zoo['lora'].name}" in card and str(zoo["root"]) not in card


def test_hub_ids_on_both_sides_of_the_plus(zoo, theirs, tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    lay_out(cache, "tiny-org/base", zoo["base"])
    lay_out(cache, "tiny-org/lora", zoo["lora"])
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    config = write_config(AS_MODEL, tmp_path, "hub", **{**zoo, "model": "tiny-org/base", "lora": "tiny-org/lora"})
    result = cli("merge", config, "--out", tmp_path / "out", "--quiet")
    assert result.returncode == 0, result.stderr
    assert_same_tensors(tmp_path / "out", theirs["as_model"][1])


def test_a_plus_in_an_existing_folder_name_is_a_path(zoo, theirs, tmp_path):
    plus = tmp_path / "other+copy"
    shutil.copytree(zoo["other"], plus)
    config = write_config(AS_BASE, tmp_path, "plus", **{**zoo, "other": plus})
    result = cli("merge", config, "--out", tmp_path / "out", "--quiet")
    assert result.returncode == 0, result.stderr
    assert_same_tensors(tmp_path / "out", theirs["as_base"][1])


def test_a_plus_whose_right_part_is_not_an_adapter_is_one_error_line(zoo, tmp_path):
    config = write_config(AS_MODEL, tmp_path, "bad", **{**zoo, "lora": zoo["other"]})
    result = cli("merge", config, "--out", tmp_path / "out", "--quiet")
    assert "is not a LoRA adapter" in one_error_line(result)
    assert not (tmp_path / "out").exists()


def test_the_adapter_is_audited_against_its_model(zoo, tmp_path):
    config = write_config(AS_MODEL, tmp_path, "noop", **{**zoo, "lora": zoo["noop"]})
    refused = cli("merge", config, "--out", tmp_path / "refused", "--quiet")
    assert "REJECTED" in one_error_line(refused) and not (tmp_path / "refused").exists()
    forced = cli("merge", config, "--out", tmp_path / "forced", "--force", "--quiet")
    assert forced.returncode == 0, forced.stderr


def test_an_adapter_folder_on_a_model_plus_lora_base_is_refused(zoo, tmp_path):
    """An adapter folder is audited against the base, which a model+lora reference is not (one model folder)."""
    result = cli(
        "merge",
        "--method",
        "linear",
        "--base",
        f"{zoo['base']}+{zoo['lora']}",
        "--model",
        zoo["lora"],
        "--alpha",
        "0.5",
        "--out",
        tmp_path / "out",
        "--quiet",
    )
    assert "is a model+lora reference" in one_error_line(result) and not (tmp_path / "out").exists()


@pytest.mark.parametrize("part", ["model", "lora"])
def test_the_output_may_not_sit_inside_either_part(zoo, tmp_path, part):
    config = write_config(AS_MODEL, tmp_path, "inside", **zoo)
    out = zoo[part] / "merged"
    one_error_line(cli("merge", config, "--out", out, "--quiet"))
    assert not out.exists()
