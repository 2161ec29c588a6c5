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
from test_safety import cli, one_error_line

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


def toy_adapter(toy_pair, folder: Path, **options) -> Path:
    """A PEFT adapter on the toy pre whose factors all moved (seeded), so the sweep's post differs from pre."""
    model = tiny_model_class(toy_pair.pre_dir).from_pretrained(toy_pair.pre_dir)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], **options)
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter in peft_model.parameters():
            if parameter.requires_grad:
                parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    peft_model.save_pretrained(folder)
    return folder


def sweep_args(toy_pair, post, out, *extra) -> list:
    return [
        "sweep",
        "--pre",
        toy_pair.pre_dir,
        "--post",
        post,
        "--include-path",
        toy_pair.task_dir,
        "--old-tasks",
        ",".join(toy_pair.old_tasks),
        "--new-tasks",
        ",".join(toy_pair.new_tasks),
        "--limit",
        "16",
        "--bootstrap",
        "0",
        "--out",
        out,
        "--quiet",
        *extra,
    ]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["linear", "task_arithmetic"])
@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_the_saved_adapter_is_the_sweeps_saved_pick(toy_pair, tmp_path, method, dora):
    """The sweep's picked merge written twice, as a model (--save-best) and as an adapter (--save-best-adapter): PEFT's
    merge_and_unload of the adapter on pre is the model, tensor for tensor; the card names the base, the recipe and
    the pick with its scores; the same command run again writes the adapter again."""
    adapter = toy_adapter(toy_pair, tmp_path / "adapter", use_dora=dora)
    best, best_adapter = tmp_path / "best", tmp_path / "best-adapter"
    args = sweep_args(toy_pair, adapter, tmp_path / "run", "--method", method, "--alphas", "0.25,0.5,0.75")
    args += ["--save-best", best, "--save-best-adapter", best_adapter]
    done = cli(*args)
    assert done.returncode == 0, done.stderr
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    alpha = results["pick"]["alpha"]
    assert f"as a LoRA adapter folder: {best_adapter}" in done.stdout
    expected = tiny_model_class(toy_pair.pre_dir).from_pretrained(best).state_dict()
    got = merged_state(toy_pair.pre_dir, best_adapter)
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    card = (best_adapter / "README.md").read_text()
    assert read_card_metadata(best_adapter)["base_model_relation"] == "adapter"
    assert "# LoRA adapter of a sweep's pick made with mergekit-lite" in card
    assert f"alpha = {alpha:g}" in card and "| pre |" in card and f"method: {method}" in card
    again = cli(*args)
    assert again.returncode == 0, again.stderr


@pytest.mark.parametrize(
    "post, extra, message",
    [
        ("model", [], r"--post \S+ is a model, not a PEFT adapter folder: use --save-best"),
        ("adapter", ["--method", "ties"], r"ties's merge is not pre \+ lambda \* \(post - pre\).*linear, task_arith"),
        ("adapter", ["--method", "slerp"], r"slerp's merge is not pre \+ t \* \(post - pre\)"),
        ("adapter", ["--method", "lines"], r"lines's merge is not pre \+ alpha"),
        ("adapter", ["--groups", "2"], r"one coefficient's pick; --groups/--modules pick one per slot"),
        ("adapter", ["--save-best", "{out}"], r"--save-best and --save-best-adapter name the same folder"),
        ("adapter", ["--method", "linear,task_arithmetic"], r"writes one sweep's pick: run that method's sweep alone"),
        ("adapter", ["--replay", "{out}/replay.jsonl"], r"is inside --save-best-adapter \S+; write the replay set"),
    ],
    ids=["model-post", "ties", "slerp", "lines", "vector", "same-folder", "comparison", "replay-inside"],
)
def test_refusals_are_one_line_and_write_nothing(toy_pair, tmp_path, post, extra, message):
    """Only a LoRA post with a method whose registry declaration says its merge scales the task vector: the pick is
    then the scaled adapter; anything else is refused before the run folder is made."""
    adapter = toy_adapter(toy_pair, tmp_path / "adapter") if post == "adapter" else toy_pair.post_dir
    out = tmp_path / "best-adapter"
    extra = [value.replace("{out}", str(out)) for value in extra]
    args = sweep_args(toy_pair, adapter, tmp_path / "run", "--alphas", "0.5", *extra, "--save-best-adapter", out)
    one_error_line(cli(*args), 2, message)
    assert not out.exists() and not (tmp_path / "run").exists()


@pytest.mark.parametrize("where", ["run/best", "taken"])
def test_the_adapter_folder_is_new_and_outside_the_run_folder(toy_pair, tmp_path, where):
    """--save-best's rules: never inside the run folder, never over a folder the sweep did not write."""
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    args = sweep_args(toy_pair, toy_adapter(toy_pair, tmp_path / "adapter"), tmp_path / "run", "--alphas", "0.5")
    message = "must lie outside the run folder" if where == "run/best" else "already exists and is not the adapter"
    one_error_line(cli(*args, "--save-best-adapter", tmp_path / where), 2, message)
    assert not (tmp_path / "run").exists() and (tmp_path / "taken" / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_a_bf16_base_matches_within_bf16_rounding(tmp_path, dora):
    """On a bf16 base (PEFT keeps the factors in float32) the written adapter's merge is the interpolation up to
    bf16's rounding of the merged weights: one unit in the last place of the larger of pre and post."""
    from tiny_models import tiny_model

    tiny_model("llama").to(torch.bfloat16).save_pretrained(tmp_path / "base")
    base, adapter = tmp_path / "base", tmp_path / "adapter"
    model = tiny_model_class(base).from_pretrained(base)
    options = dict(target_modules=["q_proj", "down_proj"], use_dora=dora)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, **options))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in peft_model.parameters():
            if parameter.requires_grad:
                parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))
    peft_model.save_pretrained(adapter)
    write_scaled(base, adapter, 0.4, tmp_path / "scaled")
    pre = tiny_model_class(base).from_pretrained(base).state_dict()
    post, got = merged_state(base, adapter), merged_state(base, tmp_path / "scaled")
    for name, tensor in post.items():
        assert got[name].dtype == torch.bfloat16
        expected = pre[name].float() + 0.4 * (tensor.float() - pre[name].float())
        ulp = torch.maximum(pre[name].float().abs(), tensor.float().abs()) * 2**-7
        assert bool(((got[name].float() - expected).abs() <= ulp + 1e-30).all()), name
