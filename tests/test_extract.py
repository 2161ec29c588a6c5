"""LoRA extraction: a real PEFT adapter whose delta is the truncated SVD of the fine-tune's delta."""

import torch
from peft import PeftModel
from transformers import LlamaConfig, LlamaForCausalLM

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
    config = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    base = LlamaForCausalLM(config)
    base.save_pretrained(tmp_path / "base")
    tuned = LlamaForCausalLM(config)
    tuned.load_state_dict(base.state_dict())
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in (tuned.model.layers[0].self_attn.q_proj, tuned.model.layers[1].mlp.down_proj):
            out_features, in_features = module.weight.shape
            module.weight += 0.1 * torch.randn(out_features, 2, generator=generator) @ torch.randn(2, in_features, generator=generator)
    tuned.save_pretrained(tmp_path / "tuned")
    modules = extract_lora(str(tmp_path / "base"), str(tmp_path / "tuned"), str(tmp_path / "lora"), rank=2)
    assert len(modules) == 2 * 7
    merged = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "lora").merge_and_unload()
    for name, tensor in tuned.state_dict().items():
        assert torch.allclose(merged.state_dict()[name], tensor, atol=1e-5), name
