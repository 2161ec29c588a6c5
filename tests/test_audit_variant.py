"""The audit's variant report on adapters PEFT itself made: which LoRA each is, whether PEFT's add_weighted_adapter of
it is right (checked against PEFT: one adapter combined alone at weight 1 must give it back), and what merge-adapters
does with it (checked by running merge-adapters on it)."""

import json
import re
import shutil

import pytest
import torch
from peft import LoraConfig, PeftModel
from test_peft_adapters_wild import ANY_NORM, save_adapter, tiny_model_class
from test_safety import cli

from mergekit_lite.audited import merge_adapters
from mergekit_lite.audits.adapter import audit_adapter
from mergekit_lite.errors import InputError
from mergekit_lite.merge.adapters import AdapterMergeSettings
from mergekit_lite.threads import torch_threads


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with torch_threads(1):
        yield


VARIANTS = {  # id: (architecture, LoraConfig options, the variant's label)
    "plain": ("llama", dict(target_modules=["q_proj", "v_proj"]), "plain LoRA"),
    "rslora": ("llama", dict(target_modules=["q_proj", "v_proj"], use_rslora=True), "rsLoRA"),
    "patterns": (
        "llama",
        dict(target_modules=["q_proj", "v_proj"], rank_pattern={"v_proj": 2}, alpha_pattern={"v_proj": 3}),
        "rank_pattern+alpha_pattern",
    ),
    "rslora-patterns": (
        "llama",
        dict(target_modules=["q_proj", "v_proj"], use_rslora=True, rank_pattern={"v_proj": 2}),
        "rsLoRA+rank_pattern",
    ),
    "dora": ("llama", dict(target_modules=["q_proj", "v_proj"], use_dora=True), "DoRA"),
    "lora-bias": ("qwen2_tied", dict(target_modules=["q_proj", "v_proj"], lora_bias=True), "lora_bias"),
    "bias-all": ("qwen2_tied", dict(target_modules=["q_proj"], bias="all"), "bias=all"),
    "modules-to-save": ("llama", dict(target_modules=["q_proj"], modules_to_save=["lm_head"]), "modules_to_save"),
    "embedding-conv1d": ("gpt2", dict(target_modules=["wte", "c_attn"], fan_in_fan_out=True), "plain LoRA"),
}


def peft_gives_it_back(base, adapter) -> str:
    """PEFT's add_weighted_adapter of the adapter alone at weight 1 against the adapter itself: right (every merged
    tensor the same), wrong, or refused (PEFT raises)."""
    model_class = tiny_model_class(base)
    want = PeftModel.from_pretrained(model_class.from_pretrained(base), adapter).merge_and_unload().state_dict()
    model = PeftModel.from_pretrained(model_class.from_pretrained(base), adapter, adapter_name="a")
    try:
        model.add_weighted_adapter(["a"], [1.0], "mix", combination_type="linear")
    except ValueError:
        return "refused"
    model.set_adapter("mix")
    model.delete_adapter("a")
    got = model.merge_and_unload().state_dict()
    error = max(float((got[name] - want[name]).abs().max()) for name in want)
    return "right" if error < 1e-5 else "wrong"


def merge_adapters_does(adapter, tmp_path) -> str:
    """merge-adapters on the adapter and a copy of it (weights 0.5, 0.5): cat, else an svd type, else refused; a
    refusal must be one for what the adapter is (DoRA, full tensors), nothing else."""
    copy = tmp_path / "copy"
    shutil.copytree(adapter, copy)
    for combination in ("cat", "svd"):
        out = tmp_path / f"mixed-{combination}"
        try:
            merge_adapters(
                [adapter, copy], out, AdapterMergeSettings(combination=combination, weights=(0.5, 0.5)), force=True
            )
        except InputError as error:
            assert re.search("is a DoRA adapter|holds full tensors", str(error)), error
            assert not out.exists()
            continue
        return "yes" if combination == "cat" else "svd types only"
    return "refused"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_variant_and_what_combining_it_gives_are_what_peft_and_merge_adapters_do(tmp_path, variant):
    architecture, options, label = VARIANTS[variant]
    base, adapter = save_adapter(tmp_path, architecture, LoraConfig(r=4, lora_alpha=8, **options))
    report = audit_adapter(adapter, base, thresholds=ANY_NORM)
    found = report.variant
    assert found.label == label
    assert found.peft_weighted == peft_gives_it_back(base, adapter), found.peft_weighted_why
    assert found.merge_adapters == merge_adapters_does(adapter, tmp_path), found.merge_adapters_why
    assert (found.use_rslora, found.use_dora, found.lora_bias) == tuple(
        bool(options.get(name)) for name in ("use_rslora", "use_dora", "lora_bias")
    )
    assert found.magnitude_vectors == (2 * len(options["target_modules"]) if options.get("use_dora") else 0)
    assert found.ranks == sorted({4, *options.get("rank_pattern", {}).values()})


@pytest.mark.parametrize("init, label", [("pissa", "PiSSA"), ("olora", "OLoRA")])
def test_a_residual_init_is_named_though_the_adapter_is_refused(tmp_path, init, label):
    """PiSSA and OLoRA rewrite the base at init: the reader refuses the adapter (format fails), and the variant still
    says what it is and that neither PEFT's combination nor merge-adapters gives a right result on the base."""
    base, adapter = save_adapter(
        tmp_path, "llama", LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], init_lora_weights=init)
    )
    report = audit_adapter(adapter, base, thresholds=ANY_NORM)
    assert report.verdict == "REJECTED" and "residual base" in report.reasons[0]
    found = report.variant
    assert (found.label, found.residual_init, found.peft_weighted, found.merge_adapters) == (
        label,
        True,
        "wrong",
        "refused",
    )
    assert found.magnitude_vectors is None  # the tensors were not read


def test_the_table_csv_and_json_carry_the_variant(tmp_path):
    base, adapter = save_adapter(
        tmp_path, "llama", LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], use_dora=True, use_rslora=True)
    )
    table = cli("audit", adapter, "--base", base, "--min-total-norm", "0", "-v")
    header, row = table.stdout.splitlines()[:2]
    assert "VARIANT" in header and "PEFT-WEIGHTED" in header and "MERGE-ADAPTERS" in header
    assert "rsLoRA+DoRA" in row and "wrong" in row and "svd types only" in row
    assert "PEFT add_weighted_adapter wrong (it keeps use_rslora" in table.stdout
    data = json.loads(cli("audit", adapter, "--base", base, "--min-total-norm", "0", "--json").stdout)
    variant = data["reports"][0]["variant"]
    assert variant["label"] == "rsLoRA+DoRA" and variant["magnitude_vectors"] == 2
    assert "DoRA magnitudes" in variant["peft_weighted_why"]
    csv = cli("audit", adapter, "--base", base, "--min-total-norm", "0", "--csv").stdout.splitlines()
    assert (
        csv[0].endswith("variant,peft_weighted,merge_adapters,reasons") and "rsLoRA+DoRA,wrong,svd types only" in csv[1]
    )
    torch.testing.assert_close(torch.tensor(variant["ranks"]), torch.tensor([4]))
