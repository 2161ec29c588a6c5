"""Adapters as PEFT really writes them, with the options users set: each is merged by `mergekit-lite merge` and
compared with PEFT's own merge_and_unload of the same saved folder, or refused in one line where PEFT's merged
model is not what the adapter does (never silently another model)."""

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from peft import AdaLoraConfig, IA3Config, LoHaConfig, LoraConfig, PeftModel, get_peft_model
from test_hub_audit import COMMIT, lay_out
from test_safety import cli, one_error_line
from tiny_models import tiny_model

from mergekit_lite.audits.adapter import audit_adapter
from mergekit_lite.audits.behaviour import adapted
from mergekit_lite.audits.thresholds import AuditThresholds
from mergekit_lite.errors import InputError
from mergekit_lite.io.lora import LoraAdapter
from mergekit_lite.threads import torch_threads

PROBE = torch.tensor([[3, 5, 7, 9, 11, 13]])
ANY_NORM = AuditThresholds(min_total_norm=0.0)  # tiny models: the paper's 7-8B norm calibration does not apply


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with torch_threads(1):
        yield


def save_adapter(root: Path, architecture: str, config, adapter_name: str = "default") -> tuple[Path, Path]:
    """A tiny base saved as a model folder and a PEFT adapter on it whose trainable tensors (factors, lora_B biases,
    modules_to_save copies) all moved, so every part of the update is real."""
    model = tiny_model(architecture)
    model.save_pretrained(root / "base")
    peft_model = get_peft_model(type(model).from_pretrained(root / "base"), config, adapter_name=adapter_name)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in peft_model.parameters():
            if parameter.requires_grad:
                parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator))
    peft_model.save_pretrained(root / "adapter")
    return root / "base", root / "adapter"


def peft_model_of(base: Path, adapter: Path) -> PeftModel:
    model = tiny_model_class(base).from_pretrained(base)
    return PeftModel.from_pretrained(model, adapter)


def tiny_model_class(base: Path):
    import transformers

    return getattr(transformers, json.loads((base / "config.json").read_text())["architectures"][0])


def merge(base: Path, adapter, out: Path, method: str = "task_arithmetic"):
    extra = ["--alpha", "1"] if method == "linear" else []
    return cli(
        "merge", "--method", method, "--base", base, "--model", adapter, *extra, "--out", out, "--quiet", "--force"
    )


def assert_merge_is_peft_merge(base: Path, adapter: Path, merged: Path, peft_adapter: Path | None = None) -> None:
    """Every tensor of the merged folder, loaded as transformers loads it (tied heads included), equals PEFT's
    merge_and_unload of the adapter folder."""
    expected = peft_model_of(base, peft_adapter or adapter).merge_and_unload().state_dict()
    got = tiny_model_class(base).from_pretrained(merged).state_dict()
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("method", ["linear", "task_arithmetic"])
@pytest.mark.parametrize(
    "architecture, options",
    [
        ("qwen2_tied", dict(target_modules=["q_proj", "k_proj"], lora_bias=True)),
        ("qwen2_tied", dict(target_modules=["q_proj", "v_proj"], lora_bias=True, bias="all")),
        ("gpt2", dict(target_modules=["c_attn", "c_fc"], lora_bias=True, fan_in_fan_out=True, use_rslora=True)),
    ],
    ids=["qwen2", "qwen2-bias-all", "gpt2-conv1d"],
)
def test_lora_bias_merges_as_peft_merges_it(tmp_path, architecture, options, method):
    """lora_bias (and what mergekit-lite extract writes for layers with biases): PEFT adds scaling * lora_B.bias to the
    layer's bias, after loading a saved trained bias (bias="all")."""
    base, adapter = save_adapter(tmp_path, architecture, LoraConfig(r=4, lora_alpha=8, **options))
    result = merge(base, adapter, tmp_path / "merged", method)
    assert result.returncode == 0, result.stderr
    assert_merge_is_peft_merge(base, adapter, tmp_path / "merged")
    report = audit_adapter(adapter, base, thresholds=ANY_NORM)
    assert report.verdict != "REJECTED", report.reasons
    delta = {c.name: c for c in report.checks}["delta"].measurements
    assert any(name.endswith(".bias") for name in [*delta["lora_bias"], *delta["replaced"]])


def test_lora_bias_on_layers_without_bias_is_refused_as_peft_refuses_it(tmp_path):
    base, adapter = save_adapter(
        tmp_path, "llama", LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], lora_bias=True)
    )
    with pytest.raises(RuntimeError, match="base layer has no bias"):
        peft_model_of(base, adapter).merge_and_unload()
    one_error_line(merge(base, adapter, tmp_path / "merged"), 2, "lora_bias", "whose base layer has no bias")
    assert not (tmp_path / "merged").exists()


def test_modules_to_save_on_tied_embeddings_never_ties_the_head_to_the_trained_copy(tmp_path):
    """Without ensure_weight_tying PEFT trains a copy of the embeddings and keeps the base's head (the tied base's
    lm_head stays the old embeddings in the PEFT model and in its merge_and_unload). Writing the new embeddings alone
    would tie the head to them on load: the merge must write PEFT's model, or refuse in one line."""
    base, adapter = save_adapter(
        tmp_path,
        "qwen2_tied",
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["embed_tokens"]),
    )
    peft_model = peft_model_of(base, adapter)
    assert not torch.equal(peft_model.get_input_embeddings().weight, peft_model.get_output_embeddings().weight)
    result = merge(base, adapter, tmp_path / "merged")
    if result.returncode == 0:  # the merge writes the head PEFT keeps, untied
        assert json.loads((tmp_path / "merged" / "config.json").read_text())["tie_word_embeddings"] is False
        assert_merge_is_peft_merge(base, adapter, tmp_path / "merged")
    else:
        one_error_line(result, 2, "ties lm_head.weight to", "ensure_weight_tying")
        assert not (tmp_path / "merged").exists()


def test_the_behaviour_check_runs_tied_embeddings_replaced_as_peft_runs_them(tmp_path):
    base, adapter = save_adapter(
        tmp_path,
        "qwen2_tied",
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["embed_tokens"]),
    )
    with torch.no_grad():
        expected = peft_model_of(base, adapter)(input_ids=PROBE).logits
        model = tiny_model_class(base).from_pretrained(base)
        with adapted(model, LoraAdapter.open(adapter)):
            torch.testing.assert_close(model(input_ids=PROBE).logits, expected, rtol=1e-5, atol=1e-5)
        untouched = tiny_model_class(base).from_pretrained(base)
        torch.testing.assert_close(model(input_ids=PROBE).logits, untouched(input_ids=PROBE).logits)


def test_tied_embedding_lora_with_ensure_weight_tying_is_refused(tmp_path):
    """With ensure_weight_tying PEFT ties a LoRA on lm_head to the embeddings' LoRA, and its merge_and_unload adds
    the update twice to the shared weight: the merged model is not the model PEFT ran. Refused, said why."""
    base, adapter = save_adapter(
        tmp_path, "qwen2_tied", LoraConfig(r=4, lora_alpha=8, target_modules=["embed_tokens"], ensure_weight_tying=True)
    )
    peft_model = peft_model_of(base, adapter)
    with torch.no_grad():
        running = peft_model(input_ids=PROBE).logits
        assert not torch.allclose(peft_model.merge_and_unload()(input_ids=PROBE).logits, running, atol=1e-3)
    one_error_line(merge(base, adapter, tmp_path / "merged"), 2, "ensure_weight_tying", "adds that update twice")


def peft_0_2_config(adapter: Path, **old_options) -> None:
    """adapter_config.json as PEFT 0.1-0.2 wrote it (its LoraConfig fields, git history of peft/tuners/lora.py)."""
    config = json.loads((adapter / "adapter_config.json").read_text())
    kept = [
        "base_model_name_or_path",
        "bias",
        "fan_in_fan_out",
        "inference_mode",
        "lora_alpha",
        "lora_dropout",
        "modules_to_save",
        "peft_type",
        "r",
        "target_modules",
        "task_type",
    ]
    (adapter / "adapter_config.json").write_text(json.dumps({**{key: config[key] for key in kept}, **old_options}))


def test_an_adapter_config_written_by_peft_0_2_merges(tmp_path):
    """merge_weights (merge in eval mode) and a null enable_lora leave a plain LoRA; PEFT 0.21 loads it the same."""
    base, adapter = save_adapter(tmp_path, "llama", LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    peft_0_2_config(adapter, merge_weights=True, enable_lora=None)
    result = merge(base, adapter, tmp_path / "merged")
    assert result.returncode == 0, result.stderr
    assert_merge_is_peft_merge(base, adapter, tmp_path / "merged")
    peft_0_2_config(adapter, merge_weights=False, enable_lora=[True, False, True])
    with pytest.raises(InputError, match="enable_lora .*MergedLinear"):
        LoraAdapter.open(adapter)


@pytest.mark.parametrize(
    "config, peft_type",
    [
        (AdaLoraConfig(r=4, target_modules=["q_proj"], total_step=10), "ADALORA"),
        (LoHaConfig(r=4, target_modules=["q_proj"]), "LOHA"),
        (IA3Config(target_modules=["q_proj", "down_proj"], feedforward_modules=["down_proj"]), "IA3"),
    ],
)
def test_other_peft_types_are_refused_in_one_line(tmp_path, config, peft_type):
    base, adapter = save_adapter(tmp_path, "llama", config)
    peft_model_of(base, adapter).merge_and_unload()  # PEFT merges them; their updates are not scaling * B @ A
    one_error_line(merge(base, adapter, tmp_path / "merged"), 2, f"peft_type {peft_type} is not LoRA")
    assert audit_adapter(adapter, base).verdict == "REJECTED"


def lay_out_subfolder(snapshot: Path, folder: Path, subfolder: str) -> None:
    """Add `folder`'s files to a laid-out snapshot under `subfolder`, linked into the repository's blobs/."""
    blobs = snapshot.parent.parent / "blobs"
    (snapshot / subfolder).mkdir()
    for file in folder.iterdir():
        blob = blobs / hashlib.sha256(file.read_bytes()).hexdigest()
        blob.write_bytes(file.read_bytes())
        (snapshot / subfolder / file.name).symlink_to(os.path.relpath(blob, snapshot / subfolder))


@pytest.fixture
def hub_subfolder(tmp_path, monkeypatch):
    """An adapter saved under adapter_name "math" (PEFT writes it in adapter/math/), published as tiny-org/adapters with
    the tiny base as tiny-org/base, in an offline cache laid out as huggingface_hub lays it out."""
    from huggingface_hub import constants

    base, adapter = save_adapter(
        tmp_path, "llama", LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]), adapter_name="math"
    )
    (tmp_path / "card").mkdir()
    (tmp_path / "card" / "README.md").write_text("# two adapters\n")
    cache = tmp_path / "cache"
    lay_out(cache, "tiny-org/base", base)
    lay_out_subfolder(
        lay_out(cache, "tiny-org/adapters", tmp_path / "card", refs=("main", "v1")), adapter / "math", "math"
    )
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return base, adapter


def test_an_adapter_in_a_hub_subfolder_is_named_org_name_subfolder(hub_subfolder, tmp_path):
    base, adapter = hub_subfolder
    by_id = audit_adapter("tiny-org/adapters/math", "tiny-org/base", thresholds=ANY_NORM)
    by_folder = audit_adapter(adapter / "math", base, thresholds=ANY_NORM)
    assert [(c.name, c.status) for c in by_id.checks if c.name != "base-id"] == [
        (c.name, c.status) for c in by_folder.checks if c.name != "base-id"
    ]
    result = merge("tiny-org/base", f"tiny-org/adapters/math@{COMMIT}", tmp_path / "merged")
    assert result.returncode == 0, result.stderr
    assert_merge_is_peft_merge(base, adapter, tmp_path / "merged", peft_adapter=adapter / "math")


@pytest.mark.parametrize(
    "reference, message",
    [
        (
            "tiny-org/adapters",
            "no adapter_config.json at its top .* its adapters are in math: name one as tiny-org/adapters/math",
        ),
        ("tiny-org/adapters/math@v2", "revision 'v2' is not in the Hugging Face cache \\(which holds main, v1\\)"),
        ("tiny-org/adapters/physics", "tiny-org/adapters has no folder 'physics'"),
        ("tiny-org/adapters/../base", "'\\.\\.'; refused"),
    ],
)
def test_hub_adapter_errors_name_what_is_missing(hub_subfolder, reference, message):
    one_error_line(cli("audit", reference, "--base", "tiny-org/base"), 2, message)
