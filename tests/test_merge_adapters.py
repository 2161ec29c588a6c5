"""A LoRA adapter takes part in a merge as a task vector: streamed base + scaling*B@A, audited first."""

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.numpy import load_file, save_file
from test_safety import cli
from tiny_models import save_tiny_llama, train_lora
from transformers import LlamaForCausalLM

from mergekit_lite.audited import run_merge
from mergekit_lite.errors import InputError
from mergekit_lite.merge.schema import config_from_dict
from mergekit_lite.threads import torch_threads


def train_adapter(base_dir, adapter_dir, seed, targets):
    """A real PEFT adapter: a few optimizer steps so B is non-zero."""
    model = get_peft_model(
        LlamaForCausalLM.from_pretrained(base_dir),
        LoraConfig(r=4, lora_alpha=32, target_modules=targets, lora_dropout=0.0),
    )
    train_lora(model, steps=4, seed=seed).save_pretrained(adapter_dir)
    return adapter_dir


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    with torch_threads(1):
        save_tiny_llama(0, root / "base", max_shard_size="40KB")
        first = train_adapter(root / "base", root / "lora-a", 1, ["q_proj", "v_proj", "down_proj"])
        second = train_adapter(root / "base", root / "lora-b", 2, ["q_proj", "up_proj"])
    return root, first, second


def peft_merged(base_dir, adapter_dir) -> dict[str, np.ndarray]:
    merged = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base_dir), adapter_dir).merge_and_unload()
    return {name: tensor.numpy() for name, tensor in merged.state_dict().items()}


def read(folder):
    state = {}
    for shard in Path(folder).glob("*.safetensors"):
        state.update(load_file(shard))
    return state


def test_adapter_merged_alone_equals_peft_merge_and_unload(setup, tmp_path):
    root, first, _ = setup
    result = cli(
        "merge",
        "--method",
        "linear",
        "--base",
        root / "base",
        "--model",
        first,
        "--alpha",
        "1",
        "--out",
        tmp_path / "out",
        "--quiet",
    )
    assert result.returncode == 0, result.stderr
    merged, expected = read(tmp_path / "out"), peft_merged(root / "base", first)
    assert set(merged) == set(expected)
    for name in expected:
        np.testing.assert_allclose(merged[name], expected[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_dora_adapter_merges_as_peft_merge_and_unload(setup, tmp_path):
    """DoRA is folded (each row of W + scaling*B@A rescaled to its trained magnitude), not refused: the merge at
    alpha 1 is PEFT's merge_and_unload, and at alpha 0.5 halfway between the base and it."""
    root, _, _ = setup
    with torch_threads(1):
        model = get_peft_model(
            LlamaForCausalLM.from_pretrained(root / "base"),
            LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "down_proj"], use_dora=True),
        )
        train_lora(model, steps=4, seed=5).save_pretrained(tmp_path / "dora")
    base, expected = read(root / "base"), peft_merged(root / "base", tmp_path / "dora")
    for alpha in ("1", "0.5"):
        result = cli(
            "merge", "--method", "linear", "--base", root / "base", "--model", tmp_path / "dora",
            "--alpha", alpha, "--out", tmp_path / alpha, "--quiet",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        merged = read(tmp_path / alpha)
        for name in expected:
            want = base[name] + float(alpha) * (expected[name] - base[name])
            np.testing.assert_allclose(merged[name], want, rtol=1e-5, atol=1e-6, err_msg=name)


def test_two_adapters_as_task_vectors(setup, tmp_path):
    root, first, second = setup
    base = read(root / "base")
    deltas = [{n: v - base[n] for n, v in peft_merged(root / "base", a).items()} for a in (first, second)]
    run_merge(
        config_from_dict(
            {
                "method": "task_arithmetic",
                "base": str(root / "base"),
                "models": [{"model": str(first), "weight": 0.5}, {"model": str(second), "weight": -1.0}],
            }
        ),
        tmp_path / "ta",
    )
    merged = read(tmp_path / "ta")
    for name in base:
        np.testing.assert_allclose(
            merged[name], base[name] + 0.5 * deltas[0][name] - deltas[1][name], rtol=1e-5, atol=1e-6, err_msg=name
        )


def test_rejected_adapter_stops_the_merge_unless_forced(setup, tmp_path):
    root, first, _ = setup
    (first / "adapter_model.safetensors").rename(first / "saved.safetensors")
    try:
        from safetensors.torch import load_file as load_torch
        from safetensors.torch import save_file

        tensors = load_torch(first / "saved.safetensors")
        save_file(
            {n: torch.zeros_like(t) if "lora_B" in n else t for n, t in tensors.items()},
            str(first / "adapter_model.safetensors"),
        )
        config = {"method": "linear", "base": str(root / "base"), "models": [str(first)], "parameters": {"alpha": 1.0}}
        with pytest.raises(InputError, match="REJECTED"):
            run_merge(config_from_dict(config), tmp_path / "refused")
        assert not (tmp_path / "refused").exists()
        run_merge(config_from_dict({**config, "force": True}), tmp_path / "forced")
        assert (tmp_path / "forced" / "model.safetensors").is_file()
    finally:
        (first / "adapter_model.safetensors").unlink()
        (first / "saved.safetensors").rename(first / "adapter_model.safetensors")


def test_an_unreadable_adapter_is_not_offered_force(setup, tmp_path):
    """A failed format check (NaN weights here) leaves nothing to merge: --force would fail on it again."""
    from safetensors.torch import load_file as load_torch
    from safetensors.torch import save_file

    root, first, _ = setup
    broken = tmp_path / "nan-adapter"
    shutil.copytree(first, broken)
    tensors = load_torch(broken / "adapter_model.safetensors")
    save_file(
        {n: torch.full_like(t, float("nan")) if "lora_B" in n else t for n, t in tensors.items()},
        str(broken / "adapter_model.safetensors"),
    )
    config = {"method": "linear", "base": str(root / "base"), "models": [str(broken)], "parameters": {"alpha": 1.0}}
    for force in (False, True):
        with pytest.raises(InputError, match=r"REJECTED: format: NaN/Inf values") as refused:
            run_merge(config_from_dict({**config, "force": force}), tmp_path / f"out-{force}")
        assert "--force" not in str(refused.value) and not (tmp_path / f"out-{force}").exists()


def test_the_engine_merges_no_adapter_without_a_gate(setup, tmp_path):
    """The engine sits below the audits: given no gate it refuses an adapter before reading it; given the audit
    gate it writes what the Python API (mergekit_lite.audited) writes, byte for byte."""
    from mergekit_lite.audited import audit_gate
    from mergekit_lite.merge import engine

    root, first, _ = setup
    config = {"method": "linear", "base": str(root / "base"), "models": [str(first)], "parameters": {"alpha": 0.5}}
    with pytest.raises(InputError, match=f"adapter {first} is merged only after its audit"):
        engine.run_merge(config_from_dict(config), tmp_path / "ungated")
    with pytest.raises(InputError, match="is merged only after its audit"):
        engine.merge_state_dict(config_from_dict(config))
    assert not (tmp_path / "ungated").exists()
    engine.run_merge(config_from_dict(config), tmp_path / "gated", gate=audit_gate)
    run_merge(config_from_dict(config), tmp_path / "api")
    assert (tmp_path / "gated" / "model.safetensors").read_bytes() == (
        tmp_path / "api" / "model.safetensors"
    ).read_bytes()


def test_adapter_needs_a_base(setup, tmp_path):
    _, first, _ = setup
    with pytest.raises(InputError, match="needs the base model"):
        run_merge(config_from_dict({"method": "linear", "models": [str(first), str(first)]}), tmp_path / "x")


def test_modules_to_save_head_on_a_tied_base_merges_untied(tmp_path):
    """Qwen2.5 / Llama-3.2-1B style: the base ties lm_head to the embeddings and stores none; the adapter trains its
    own head copy (modules_to_save). The merge writes that head, untied, and the model matches PEFT's merge."""
    with torch_threads(1):
        save_tiny_llama(0, tmp_path / "tied", tie_word_embeddings=True)
        model = get_peft_model(
            LlamaForCausalLM.from_pretrained(tmp_path / "tied"),
            LoraConfig(r=4, lora_alpha=32, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]),
        )
        train_lora(model, steps=4, seed=3).save_pretrained(tmp_path / "head-lora")
    assert "lm_head.weight" not in read(tmp_path / "tied")
    result = cli(
        "merge",
        "--method",
        "linear",
        "--base",
        tmp_path / "tied",
        "--model",
        tmp_path / "head-lora",
        "--alpha",
        "1",
        "--out",
        tmp_path / "out",
        "--quiet",
    )
    assert result.returncode == 0, result.stderr
    merged = LlamaForCausalLM.from_pretrained(tmp_path / "out")
    assert merged.config.tie_word_embeddings is False
    assert merged.lm_head.weight.data_ptr() != merged.model.embed_tokens.weight.data_ptr()
    reference = PeftModel.from_pretrained(
        LlamaForCausalLM.from_pretrained(tmp_path / "tied"), tmp_path / "head-lora"
    ).merge_and_unload()
    tokens = torch.randint(0, 100, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(
            merged(input_ids=tokens).logits, reference(input_ids=tokens).logits, rtol=1e-5, atol=1e-5
        )
        assert not torch.allclose(reference.lm_head.weight, reference.model.embed_tokens.weight)


def test_a_refused_merge_names_the_real_cause(setup, tmp_path):
    """An adapter saved from a vision-language model's text tower: the merge says so, not 'not in the base'."""
    root, first, _ = setup
    vlm = tmp_path / "vlm-lora"
    vlm.mkdir()
    (vlm / "adapter_config.json").write_text((first / "adapter_config.json").read_text())
    tensors = load_file(first / "adapter_model.safetensors")
    save_file(
        {k.replace("base_model.model.model.", "base_model.model.model.language_model."): v for k, v in tensors.items()},
        str(vlm / "adapter_model.safetensors"),
    )
    config = {"method": "linear", "base": str(root / "base"), "models": [str(vlm)], "parameters": {"alpha": 1.0}}
    with pytest.raises(InputError, match="REJECTED: structure: .*different vision-language layouts"):
        run_merge(config_from_dict(config), tmp_path / "out")
