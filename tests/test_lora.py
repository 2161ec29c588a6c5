"""LoRA adapter reader: base + delta must equal PEFT's own merge_and_unload(), and bad adapters are refused."""

import json
import os
import re
import shutil

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from tiny_models import VOCAB, tiny_llama, train_lora
from transformers import GPT2Config, GPT2LMHeadModel

from mergekit_lite.errors import InputError
from mergekit_lite.io.lora import LoraAdapter, refusal_reason
from mergekit_lite.threads import torch_threads


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models train several times faster on one thread than on shared cores."""
    with torch_threads(1):
        yield


def tiny_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32))


def train_and_merge(model, lora_config: LoraConfig, adapter_dir, steps: int = 4):
    """Train a real adapter a few steps (so B is non-zero), save it, and return (base state, PEFT-merged state)."""
    base_state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    peft_model = get_peft_model(model, lora_config)
    train_lora(peft_model, steps, seed=1)
    peft_model.save_pretrained(adapter_dir)
    merged = peft_model.merge_and_unload().state_dict()
    return base_state, merged


def assert_matches_peft(adapter: LoraAdapter, base_state: dict, merged: dict) -> None:
    assert adapter.targets(), "no LoRA targets read"
    for name in adapter.targets():
        assert adapter.delta(name).dtype == torch.float32
        torch.testing.assert_close(base_state[name] + adapter.delta(name), merged[name], rtol=1e-5, atol=1e-6)
    for name in adapter.replaced():
        torch.testing.assert_close(adapter.replacement(name), merged[name])
    untouched = set(base_state) - set(adapter.targets()) - set(adapter.replaced())
    for name in untouched:
        torch.testing.assert_close(base_state[name], merged[name])


def test_plain_lora_matches_merge_and_unload(tmp_path):
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    base_state, merged = train_and_merge(tiny_llama(), config, tmp_path / "adapter")
    adapter = LoraAdapter.open(tmp_path / "adapter")
    assert len(adapter.targets()) == 6
    assert set(adapter.scaling.values()) == {2.0}
    assert adapter.replaced() == []
    assert_matches_peft(adapter, base_state, merged)


def test_rslora_scales_by_square_root_of_rank(tmp_path):
    config = LoraConfig(r=4, lora_alpha=6, target_modules=["q_proj", "up_proj"], use_rslora=True)
    base_state, merged = train_and_merge(tiny_llama(), config, tmp_path / "adapter")
    adapter = LoraAdapter.open(tmp_path / "adapter")
    assert set(adapter.scaling.values()) == {3.0}
    assert_matches_peft(adapter, base_state, merged)


def test_rank_and_alpha_patterns(tmp_path):
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "o_proj"],
        rank_pattern={"v_proj": 2, "layers.1.self_attn.o_proj": 8},
        alpha_pattern={"o_proj": 4},
    )
    base_state, merged = train_and_merge(tiny_llama(), config, tmp_path / "adapter")
    adapter = LoraAdapter.open(tmp_path / "adapter")
    assert adapter.rank("model.layers.0.self_attn.v_proj.weight") == 2
    assert adapter.rank("model.layers.1.self_attn.o_proj.weight") == 8
    assert adapter.scaling["model.layers.0.self_attn.q_proj.weight"] == 2.0
    assert adapter.scaling["model.layers.0.self_attn.v_proj.weight"] == 4.0
    assert adapter.scaling["model.layers.0.self_attn.o_proj.weight"] == 1.0
    assert adapter.scaling["model.layers.1.self_attn.o_proj.weight"] == 0.5
    assert_matches_peft(adapter, base_state, merged)


def test_embedding_lora_and_modules_to_save(tmp_path):
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["embed_tokens", "k_proj"], modules_to_save=["lm_head"])
    base_state, merged = train_and_merge(tiny_llama(), config, tmp_path / "adapter")
    adapter = LoraAdapter.open(tmp_path / "adapter")
    assert "model.embed_tokens.weight" in adapter.targets()
    assert adapter.replaced() == ["lm_head.weight"]
    assert adapter.copied_base() == ["model.embed_tokens.weight"]
    torch.testing.assert_close(adapter.base_copy("model.embed_tokens.weight"), base_state["model.embed_tokens.weight"])
    assert_matches_peft(adapter, base_state, merged)


def test_fan_in_fan_out_conv1d(tmp_path):
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True)
    base_state, merged = train_and_merge(tiny_gpt2(), config, tmp_path / "adapter")
    adapter = LoraAdapter.open(tmp_path / "adapter")
    assert (
        adapter.delta("transformer.h.0.attn.c_attn.weight").shape
        == base_state["transformer.h.0.attn.c_attn.weight"].shape
    )
    assert_matches_peft(adapter, base_state, merged)


def assert_apply_matches_peft(adapter: LoraAdapter, base_state: dict, merged: dict) -> None:
    """Every target's merged weight from `apply` is PEFT's merge_and_unload's; the rest are untouched."""
    for name in adapter.targets():
        torch.testing.assert_close(adapter.apply(name, base_state[name]), merged[name], rtol=1e-5, atol=1e-6)
    for name in set(base_state) - set(adapter.targets()) - set(adapter.replaced()):
        torch.testing.assert_close(base_state[name], merged[name])


@pytest.mark.parametrize(
    "model, config",
    [
        (tiny_llama, dict(target_modules=["q_proj", "down_proj", "embed_tokens"])),
        (tiny_llama, dict(target_modules=["q_proj", "v_proj"], use_rslora=True)),
        (tiny_gpt2, dict(target_modules=["c_attn", "c_proj"], fan_in_fan_out=True)),
    ],
    ids=["linear+embedding", "rslora", "conv1d"],
)
def test_dora_folds_as_merge_and_unload(tmp_path, model, config):
    """DoRA's row-normalised merge, against PEFT's own merge_and_unload after real training steps (so m moved)."""
    base_state, merged = train_and_merge(model(), LoraConfig(r=4, lora_alpha=8, use_dora=True, **config), tmp_path)
    adapter = LoraAdapter.open(tmp_path)
    assert any(adapter.is_dora(name) for name in adapter.weight_targets())
    plain = next(name for name in adapter.weight_targets() if adapter.is_dora(name))
    assert not torch.allclose(base_state[plain] + adapter.delta(plain), merged[plain], atol=1e-4), "DoRA is not +dW"
    assert_apply_matches_peft(adapter, base_state, merged)


def test_dora_magnitude_without_use_dora_is_refused(tmp_path):
    train_and_merge(tiny_llama(), LoraConfig(r=4, target_modules=["q_proj"], use_dora=True), tmp_path / "dora", 1)
    folder = copy_adapter(tmp_path / "dora", tmp_path / "edited", lambda c: {**c, "use_dora": False})
    with pytest.raises(InputError, match="DoRA magnitude vector but the config does not set use_dora"):
        LoraAdapter.open(folder)


@pytest.fixture(scope="module")
def saved_adapter(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora") / "adapter"
    train_and_merge(tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]), folder, steps=2)
    return folder


def copy_adapter(source, target, edit_config=None, edit_weights=None, as_pickle=False):
    """A copy of the saved adapter with its config and/or tensors changed."""
    target.mkdir()
    config = json.loads((source / "adapter_config.json").read_text())
    (target / "adapter_config.json").write_text(json.dumps(edit_config(config) if edit_config else config))
    tensors = load_file(source / "adapter_model.safetensors")
    tensors = edit_weights(tensors) if edit_weights else tensors
    if as_pickle:
        torch.save(tensors, target / "adapter_model.bin")
    else:
        save_file(tensors, target / "adapter_model.safetensors")
    return target


def test_pickle_only_when_allowed(saved_adapter, tmp_path):
    folder = copy_adapter(saved_adapter, tmp_path / "pickled", as_pickle=True)
    with pytest.raises(InputError, match="--allow-pickle"):
        LoraAdapter.open(folder)
    adapter = LoraAdapter.open(folder, allow_pickle=True)
    reference = LoraAdapter.open(saved_adapter)
    assert adapter.weights_file.name == "adapter_model.bin"
    for name in reference.targets():
        torch.testing.assert_close(adapter.delta(name), reference.delta(name))


def drop_lora_b(tensors):
    return {key: value for key, value in tensors.items() if "layers.1.self_attn.q_proj.lora_B" not in key}


@pytest.mark.parametrize(
    "edit_config, edit_weights, message",
    [
        (lambda c: {**c, "use_dora": True}, None, "no lora_magnitude_vector, which use_dora \\(DoRA\\) needs"),
        (lambda c: {k: v for k, v in c.items() if k != "r"}, None, "no r \\(required\\)"),
        (lambda c: {**c, "r": 8}, None, "config says r=8"),
        (None, drop_lora_b, "layers.1.self_attn.q_proj has no lora_B"),
    ],
)
def test_refuses_what_it_cannot_merge(saved_adapter, tmp_path, edit_config, edit_weights, message):
    folder = copy_adapter(saved_adapter, tmp_path / "edited", edit_config, edit_weights)
    with pytest.raises(InputError, match=message):
        LoraAdapter.open(folder)


@pytest.mark.parametrize("name", ["adapter_model.safetensors", "adapter_config.json"])
def test_adapter_files_linking_out_of_the_folder_are_refused(saved_adapter, tmp_path, name):
    """Reads stay inside the adapter folder the user named: a link to a file elsewhere is not followed."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.copy(saved_adapter / name, outside / name)
    folder = copy_adapter(saved_adapter, tmp_path / "linked")
    (folder / name).unlink()
    (folder / name).symlink_to(outside / name)
    with pytest.raises(InputError, match="not a regular file inside"):
        LoraAdapter.open(folder)


def test_a_fifo_as_adapter_weights_is_refused_without_blocking(saved_adapter, tmp_path):
    folder = copy_adapter(saved_adapter, tmp_path / "fifo")
    (folder / "adapter_model.safetensors").unlink()
    os.mkfifo(folder / "adapter_model.safetensors")
    with pytest.raises(InputError, match="not a regular file inside"):
        LoraAdapter.open(folder)


def test_not_an_adapter_folder(tmp_path):
    assert not LoraAdapter.is_adapter_dir(tmp_path)
    with pytest.raises(InputError, match="no adapter_config.json"):
        LoraAdapter.open(tmp_path)
    with pytest.raises(InputError, match="no such adapter folder"):
        LoraAdapter.open(tmp_path / "missing")


def test_schema_knows_every_option_of_installed_peft():
    """The typed schema is checked against PEFT's own LoraConfig, so a new PEFT option shows up here first."""
    import dataclasses

    from mergekit_lite.io.lora import AdapterConfigSchema

    peft_options = {f.name for f in dataclasses.fields(LoraConfig)}
    assert peft_options <= set(AdapterConfigSchema.model_fields), peft_options - set(AdapterConfigSchema.model_fields)
    saved = LoraConfig(r=4, target_modules=["q_proj"]).to_dict()
    assert refusal_reason(json.loads(json.dumps(saved, default=str))) is None, "PEFT's defaults are all accepted"


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"r": "4"}, "r must be int (got '4')"),
        ({"lora_alpha": "16"}, "lora_alpha must be int | float (got '16')"),
        ({"use_rslora": 1}, "use_rslora must be bool (got 1)"),
        ({"target_modules": 7}, "target_modules must be list[str] | str | None (got 7)"),
        ({"rank_pattern": {"q_proj": 2.5}}, "rank_pattern must be dict[str, int] | None"),
        ({"bias": "some"}, "bias must be Literal['none', 'all', 'lora_only'] (got 'some')"),
    ],
)
def test_wrong_types_are_one_line_naming_key_and_type(saved_adapter, tmp_path, edit, message):
    folder = copy_adapter(saved_adapter, tmp_path / "typed", lambda c: {**c, **edit})
    with pytest.raises(InputError) as error:
        LoraAdapter.open(folder)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"target_parameters": ["experts.gate_up_proj"]}, "target_parameters adapts raw parameters"),
        ({"trainable_token_indices": [1, 2]}, "sparse token rows"),
        ({"layer_replication": [[0, 2], [1, 2]]}, "duplicates base layers"),
        ({"use_qalora": True}, "QALoRA"),
        ({"alora_invocation_tokens": [5, 6]}, "cannot be merged into the weights"),
        ({"megatron_config": {"tensor_model_parallel_size": 2}}, "tensor-parallel"),
        ({"use_bdlora": {"block": 2}}, "block-diagonal"),
        ({"arrow_config": {"top_k": 2}}, "routes each token"),
        ({"kasa_config": {"k": 1}}, "KaSA"),
        ({"monteclora_config": {"n": 1}}, "MonteCLoRA"),
        ({"velora_config": {"n": 1}}, "VeLoRA"),
        ({"init_lora_weights": "pissa"}, "residual base"),
        ({"init_lora_weights": "pissa_niter_4"}, "residual base"),
        ({"init_lora_weights": "olora"}, "residual base"),
        ({"init_lora_weights": "corda"}, "residual base"),
        ({"init_lora_weights": "loftq"}, "residual base"),
        ({"init_lora_weights": "lora_ga"}, "residual base"),
        ({"init_lora_weights": "mica"}, "not a plain LoRA initialisation"),
        ({"some_future_option": 0.5}, "unknown option some_future_option=0.5"),
    ],
)
def test_each_refused_option_says_why(saved_adapter, tmp_path, edit, message):
    folder = copy_adapter(saved_adapter, tmp_path / "refused", lambda c: {**c, **edit})
    with pytest.raises(InputError, match="unsupported: ") as error:
        LoraAdapter.open(folder)
    assert message in str(error.value)


@pytest.mark.parametrize(
    "edit",
    [
        {"some_future_option": None},
        {"some_future_option": False},
        {"init_lora_weights": "eva"},
        {"init_lora_weights": "gaussian"},
        {"init_lora_weights": False},
        {"lora_alpha": -8},
    ],
)
def test_options_that_leave_plain_lora_are_accepted(saved_adapter, tmp_path, edit):
    """EVA only initialises A from activations (peft/tuners/lora/eva.py leaves the base alone)."""
    LoraAdapter.open(copy_adapter(saved_adapter, tmp_path / "accepted", lambda c: {**c, **edit}))


def test_pissa_really_rewrites_the_base(tmp_path):
    """Why init_lora_weights='pissa' is refused: PEFT changes the base weight at init (the adapter is on W - B0@A0)."""
    model = tiny_llama()
    original = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    peft_model = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=4, target_modules=["q_proj"], init_lora_weights="pissa")
    )
    assert not torch.allclose(peft_model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight, original)
    peft_model.save_pretrained(tmp_path / "pissa")
    with pytest.raises(InputError, match="residual base"):
        LoraAdapter.open(tmp_path / "pissa")


def test_alora_is_refused_as_peft_refuses_to_merge_it(tmp_path):
    peft_model = get_peft_model(
        tiny_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], alora_invocation_tokens=[5, 6])
    )
    peft_model.save_pretrained(tmp_path / "alora")
    with pytest.raises(NotImplementedError, match="aLoRA does not support merging"):
        peft_model.merge_and_unload()
    with pytest.raises(InputError, match="aLoRA"):
        LoraAdapter.open(tmp_path / "alora")


def test_zero3_empty_factors_say_so(saved_adapter, tmp_path):
    folder = copy_adapter(
        saved_adapter, tmp_path / "zero3", edit_weights=lambda tensors: {k: torch.empty(0) for k in tensors}
    )
    with pytest.raises(InputError, match="DeepSpeed ZeRO-3 without gathering"):
        LoraAdapter.open(folder)


@pytest.mark.parametrize(
    "edit",
    [
        {"layers_to_transform": [1]},
        {"layers_to_transform": 0},
        {"layers_to_transform": [0], "layers_pattern": "layers"},
        {"layers_to_transform": [1], "layers_pattern": ["h", "layers"]},
    ],
    ids=["list", "int", "pattern", "pattern-list"],
)
def test_layers_to_transform_as_peft_loads_it(tmp_path, edit):
    """PEFT trained on the listed layers only: the adapter holds their factors, and merges as PEFT merges it.
    The same factors under a config listing fewer layers disagree with it: PEFT would load the adapter without
    the other layers' factors (its merge_and_unload leaves those layers untouched), so the adapter is refused."""
    from peft import PeftModel

    model = tiny_llama()
    base_state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    layers = edit["layers_to_transform"]
    peft_model = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False, **edit)
    )
    peft_model.save_pretrained(tmp_path / "adapter")
    merged = PeftModel.from_pretrained(tiny_llama(), tmp_path / "adapter").merge_and_unload().state_dict()
    adapter = LoraAdapter.open(tmp_path / "adapter")
    assert len(adapter.targets()) == 2  # q_proj and v_proj of the one listed layer, not of both
    assert_matches_peft(adapter, base_state, merged)

    every = get_peft_model(
        tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    every.save_pretrained(tmp_path / "every")
    config_file = tmp_path / "every" / "adapter_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **edit}))
    untouched = 1 - (layers[0] if isinstance(layers, list) else layers)
    loaded = PeftModel.from_pretrained(tiny_llama(), tmp_path / "every").merge_and_unload().state_dict()
    name = f"model.layers.{untouched}.self_attn.q_proj.weight"
    assert torch.equal(loaded[name], base_state[name]), "PEFT leaves the unlisted layer's factors out"
    expected = (
        f"2 modules in layers that layers_to_transform {layers!r} leaves out (PEFT would not load them): "
        f"model.layers.{untouched}.self_attn.q_proj"
    )
    with pytest.raises(InputError, match=re.escape(expected)):
        LoraAdapter.open(tmp_path / "every")
