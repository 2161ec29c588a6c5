"""Every example merge config in examples/ parses and validates, and one runs for real."""

from pathlib import Path

import pytest
import yaml

from mergekit_lite.merge.schema import load_config

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
MERGE_EXAMPLES = sorted(p for p in EXAMPLES.glob("*.yaml") if {"models", "slices"} & set(yaml.safe_load(p.read_text())))


def test_there_is_an_example_for_every_method():
    from mergekit_lite.merge.methods import NAMES

    assert {load_config(p).method for p in MERGE_EXAMPLES} == set(NAMES)


@pytest.mark.parametrize("path", MERGE_EXAMPLES, ids=lambda p: p.name)
def test_example_validates(path):
    config = load_config(path)
    assert config.models or config.slices


def test_ties_example_runs_on_tiny_models(tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from mergekit_lite.audited import run_merge

    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    data = yaml.safe_load((EXAMPLES / "ties.yaml").read_text())
    paths = {"models/pre": 0, "models/math-tune": 1, "models/chat-tune": 2}
    for name, seed in paths.items():
        torch.manual_seed(seed)
        LlamaForCausalLM(config).save_pretrained(tmp_path / name)
    data["base"] = str(tmp_path / data["base"])
    for entry in data["models"]:
        entry["model"] = str(tmp_path / entry["model"])
    example = tmp_path / "ties.yaml"
    example.write_text(yaml.safe_dump(data))
    result = run_merge(load_config(example), tmp_path / "merged")
    assert "model.safetensors" in result.files and "config.json" in result.files
