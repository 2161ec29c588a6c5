"""LoRA extraction: a real PEFT adapter whose delta is the truncated SVD of the fine-tune's delta,
checked by PEFT itself and against mergekit-extract-lora run side by side."""

import json
import subprocess

import pytest
import torch
from mergekit_reference import mergekit_cli
from peft import PeftModel
from safetensors.torch import load_file
from test_safety import cli
from tiny_models import tiny_llama
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from mergekit_lite.merge.extract import extract_lora, low_rank_factors


def test_low_rank_factors_are_the_best_rank_r_approximation():
    generator = torch.Generator().manual_seed(0)
    exact = torch.randn(12, 3, generator=generator) @ torch.randn(3, 20, generator=generator)
    lora_b, lora_a = low_rank_factors(exact, 3)
    assert lora_b.shape == (12, 3) and lora_a.shape == (3, 20)
    assert torch.allclose(lora_b @ lora_a, exact, atol=1e-4)
    one_b, one_a = low_rank_factors(exact, 1)
    top = torch.linalg.svdvals(exact)
    assert torch.isclose(torch.linalg.matrix_norm(exact - one_b @ one_a), top[1:].norm(), rtol=1e-4)


def test_extracted_adapter_loads_in_peft_and_reproduces_a_low_rank_fine_tune(tmp_path):
    config = LlamaConfig(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    base = LlamaForCausalLM(config)
    base.save_pretrained(tmp_path / "base")
    tuned = LlamaForCausalLM(config)
    tuned.load_state_dict(base.state_dict())
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in (tuned.model.layers[0].self_attn.q_proj, tuned.model.layers[1].mlp.down_proj):
            out_features, in_features = module.weight.shape
            module.weight += (
                0.1
                * torch.randn(out_features, 2, generator=generator)
                @ torch.randn(2, in_features, generator=generator)
            )
    tuned.save_pretrained(tmp_path / "tuned")
    modules = extract_lora(str(tmp_path / "base"), str(tmp_path / "tuned"), str(tmp_path / "lora"), rank=2).factored
    assert len(modules) == 2 * 7
    merged = PeftModel.from_pretrained(
        LlamaForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "lora"
    ).merge_and_unload()
    for name, tensor in tuned.state_dict().items():
        assert torch.allclose(merged.state_dict()[name], tensor, atol=1e-5), name


def perturbed_copy(model, seed: int, scale: float = 0.02):
    """A "full fine-tune": every tensor moved (embeddings, norms, biases, head included)."""
    generator = torch.Generator().manual_seed(seed)
    tuned = type(model)(model.config)
    tuned.load_state_dict(
        {
            name: tensor + scale * torch.randn(tensor.shape, generator=generator)
            for name, tensor in model.state_dict().items()
        }
    )
    return tuned


@pytest.fixture(scope="module")
def full_fine_tunes(tmp_path_factory):
    """(base, tuned) folders for a Llama and a Qwen2 (linear biases) where every tensor changed."""
    root = tmp_path_factory.mktemp("full_fine_tunes")
    torch.manual_seed(0)
    qwen = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=50,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
        )
    )
    pairs = {}
    for label, model in (("llama", tiny_llama(3)), ("qwen2", qwen)):
        model.save_pretrained(root / f"{label}-base", max_shard_size="20KB")
        perturbed_copy(model, seed=5).save_pretrained(root / f"{label}-tuned")
        pairs[label] = (root / f"{label}-base", root / f"{label}-tuned")
    return pairs


@pytest.mark.parametrize(
    ("label", "extra", "lora_bias"),
    [
        ("llama", [], False),
        ("qwen2", [], False),  # o_proj and the MLP have no bias: q/k/v (changed biases) are stored whole
        ("qwen2", ["--include", r"self_attn\.[qkv]_proj"], True),  # every factored layer has a bias: lora_bias
    ],
)
def test_full_rank_cli_adapter_merges_back_to_the_fine_tune_in_peft(label, extra, lora_bias, full_fine_tunes, tmp_path):
    base, tuned = full_fine_tunes[label]
    result = cli("extract", "--base", base, "--model", tuned, "--rank", "64", "--out", tmp_path / "lora", *extra)
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "lora" / "adapter_config.json").read_text())["lora_bias"] is lora_bias
    auto = Qwen2ForCausalLM if label == "qwen2" else LlamaForCausalLM
    merged = PeftModel.from_pretrained(auto.from_pretrained(base), tmp_path / "lora").merge_and_unload()
    expected = auto.from_pretrained(tuned).state_dict()
    assert set(merged.state_dict()) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(merged.state_dict()[name], tensor, atol=2e-6, rtol=1e-5, msg=name)


def test_low_rank_adapter_is_the_truncated_svd_and_only_linear_layers_with_linear_only(full_fine_tunes, tmp_path):
    base, tuned = full_fine_tunes["llama"]
    result = extract_lora(str(base), str(tuned), str(tmp_path / "lora"), rank=4, linear_only=True)
    modules = result.factored
    tensors = load_file(tmp_path / "lora" / "adapter_model.safetensors")
    assert len(modules) == 2 * 7 and len(tensors) == 2 * len(modules) and not result.saved
    assert set(result.dropped) == {"model.embed_tokens", "lm_head", "model.norm"} | {
        f"model.layers.{i}.{norm}" for i in range(2) for norm in ("input_layernorm", "post_attention_layernorm")
    }
    base_state, tuned_state = (LlamaForCausalLM.from_pretrained(folder).state_dict() for folder in (base, tuned))
    for module in modules:
        product = (
            tensors[f"base_model.model.{module}.lora_B.weight"] @ tensors[f"base_model.model.{module}.lora_A.weight"]
        )
        delta = tuned_state[f"{module}.weight"] - base_state[f"{module}.weight"]
        singular = torch.linalg.svdvals(delta)
        assert torch.isclose(torch.linalg.matrix_norm(delta - product), singular[4:].norm(), rtol=1e-4), module


@pytest.mark.slow
def test_factors_agree_with_mergekit_extract_lora(full_fine_tunes, tmp_path):
    """mergekit-extract-lora on the same pair: the same rank-r products B @ A, module by module."""
    script = mergekit_cli().parent / "mergekit-extract-lora"
    base, tuned = full_fine_tunes["llama"]
    result = subprocess.run(
        [
            str(script),
            "--model",
            str(tuned),
            "--base-model",
            str(base),
            "--out-path",
            str(tmp_path / "theirs"),
            "--max-rank",
            "6",
            "--no-copy-tokenizer",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ours = cli("extract", "--base-model", base, "--model", tuned, "--out-path", tmp_path / "ours", "--max-rank", "6")
    assert ours.returncode == 0, ours.stderr
    theirs_tensors = load_file(tmp_path / "theirs" / "adapter_model.safetensors")
    ours_tensors = load_file(tmp_path / "ours" / "adapter_model.safetensors")
    factored = [name.removesuffix(".lora_A.weight") for name in theirs_tensors if name.endswith(".lora_A.weight")]
    assert sorted(factored) == sorted(
        n.removesuffix(".lora_A.weight") for n in ours_tensors if n.endswith(".lora_A.weight")
    )
    for module in factored:
        products = [t[f"{module}.lora_B.weight"] @ t[f"{module}.lora_A.weight"] for t in (ours_tensors, theirs_tensors)]
        torch.testing.assert_close(*products, atol=1e-5, rtol=1e-4, msg=module)
    for name, tensor in ours_tensors.items():  # full-rank modules: the fine-tune's own tensors, as in mergekit
        if "lora_" not in name:
            torch.testing.assert_close(tensor, theirs_tensors[name], msg=name)
