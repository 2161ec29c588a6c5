"""`sweep --save-best-adapter`: the pick pre + alpha * (post - pre) of a LoRA post, written as a PEFT adapter that PEFT
loads as it is. Measured against PEFT itself: the written adapter, loaded on pre and merge_and_unload'ed, is the
interpolation of pre and PEFT's own merge of the original adapter, and the sweep's --save-best model; every refusal
is one line, exit 2, and writes nothing."""

import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from test_peft_adapters_wild import peft_model_of, save_adapter, tiny_model_class

from mergekit_lite.io.lora import LoraAdapter
from mergekit_lite.io.model_card import ModelCard, read_card_metadata
from mergekit_lite.io.sources import open_inputs
from mergekit_lite.merge.scaled_adapter import write_scaled_adapter
from mergekit_lite.threads import torch_threads


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with torch_threads(1):
        yield


def merged_state(base: Path, adapter: Path) -> dict[str, torch.Tensor]:
    """PEFT's merge_and_unload of `adapter` on `base`, as a state dict."""
    return peft_model_of(base, adapter).merge_and_unload().state_dict()


def write_scaled(base: Path, adapter: Path, c: float, out: Path):
    sources = open_inputs([str(base), str(adapter)], str(base), allow_pickle=False)
    try:
        card = ModelCard(bases=["base"], relation="adapter", method="test", parameters={"alpha": c})
        return write_scaled_adapter(LoraAdapter.open(adapter), c, sources[1].base_tensor, out, card)
    finally:
        for source in sources:
            source.close()


VARIANTS = {
    "plain": ("llama", dict(target_modules=["q_proj", "v_proj", "down_proj"])),
    "rslora-rank-pattern": (
        "llama",
        dict(target_modules=["q_proj", "up_proj"], use_rslora=True, rank_pattern={"up_proj": 2}, alpha_pattern={}),
    ),
    "lora-bias-bias-all": ("qwen2_tied", dict(target_modules=["q_proj", "v_proj"], lora_bias=True, bias="all")),
    "dora": ("llama", dict(target_modules=["q_proj", "o_proj", "gate_proj"], use_dora=True)),
    "dora-conv1d": ("gpt2", dict(target_modules=["c_attn", "c_fc"], use_dora=True, fan_in_fan_out=True)),
    "dora-embedding": ("llama", dict(target_modules=["embed_tokens", "k_proj"], use_dora=True)),
    "modules-to-save": ("llama", dict(target_modules=["q_proj"], modules_to_save=["lm_head"])),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("c", [0.35, 1.5])
def test_the_scaled_adapter_is_the_interpolation_peft_merges(tmp_path, variant, c):
    """PEFT's merge of the written adapter on pre equals pre + c * (PEFT's merge of the adapter - pre), every tensor,
    for every variant PEFT writes (DoRA's magnitude and B rows rewritten, full tensors interpolated)."""
    architecture, options = VARIANTS[variant]
    base, adapter = save_adapter(tmp_path, architecture, LoraConfig(r=4, lora_alpha=8, **options))
    written = write_scaled(base, adapter, c, tmp_path / "scaled")
    pre = tiny_model_class(base).from_pretrained(base).state_dict()
    post = merged_state(base, adapter)
    got = merged_state(base, tmp_path / "scaled")
    assert set(got) == set(post)
    for name, tensor in post.items():
        expected = pre[name] + c * (tensor - pre[name])
        torch.testing.assert_close(got[name], expected, rtol=1e-5, atol=1e-6, msg=name)
    assert json.loads((tmp_path / "scaled" / "adapter_config.json").read_text()) == LoraAdapter.open(adapter).config
    assert written.dora == (written.modules if options.get("use_dora") else 0)
    changed = [name for name in post if not torch.equal(post[name], pre[name])]
    assert changed and all(not torch.equal(got[name], post[name]) for name in changed)


def test_a_peft_model_loads_the_folder_as_it_is(tmp_path):
    """The folder is what PEFT's from_pretrained takes, with its card's base_model: no conversion step."""
    base, adapter = save_adapter(tmp_path, "llama", LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    write_scaled(base, adapter, 0.5, tmp_path / "scaled")
    model = PeftModel.from_pretrained(tiny_model_class(base).from_pretrained(base), tmp_path / "scaled")
    assert model.peft_config["default"].r == 4
    assert read_card_metadata(tmp_path / "scaled")["base_model"] == ["base"]
    fresh = get_peft_model(tiny_model_class(base).from_pretrained(base), LoraConfig(r=4, target_modules=["q_proj"]))
    assert set(model.state_dict()) == set(fresh.state_dict())
