"""`mergekit-lite drift`: every tensor's relative drift against a float64 reference computed here from the files
transformers (and PEFT) wrote, layers and module types regrouped from that reference, linear CKA against the
kernel form of Kornblith et al. (2019, eq. 2: HSIC of centred Gram matrices) on hidden states taken here with
transformers, and bad input as one line, exit 2."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from test_safety import cli, one_error_line
from tiny_models import save_tiny_llama, tiny_model, train_lora
from transformers import AutoModelForCausalLM, AutoTokenizer

from mergekit_lite.evaluate.drift import linear_cka, model_drift, summarise, weight_drift
from mergekit_lite.merge.recall import read_texts


def stored(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a saved model, in float64."""
    tensors = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        tensors.update({name: tensor.to(torch.float64) for name, tensor in load_file(file).items()})
    return tensors


def reference_drift(pre: dict, post: dict, names) -> tuple[float, float]:
    """(sum of squared differences, sum of squared pre weights) over `names`, in float64."""
    return (
        math.fsum(float(((post[n] - pre[n]) ** 2).sum()) for n in names),
        math.fsum(float((pre[n] ** 2).sum()) for n in names),
    )


def check_against_reference(report_tensors, pre: dict, post: dict) -> None:
    assert [t.name for t in report_tensors] and {t.name for t in report_tensors} == set(pre)
    for tensor in report_tensors:
        diff_sq, pre_sq = reference_drift(pre, post, [tensor.name])
        if pre_sq == 0:  # a zero-initialised tensor (a bias): no scale to measure a relative drift against
            assert tensor.relative_drift is None and diff_sq > 0, tensor.name
            continue
        assert tensor.relative_drift == pytest.approx(math.sqrt(diff_sq / pre_sq), rel=1e-6), tensor.name
    report = summarise("pre", "post", report_tensors)
    for row in report.layers:
        members = [t for t in report_tensors if t.layer == row.layer]
        assert row.relative_drift == expected(pre, post, members)
        for module, value in row.modules.items():
            assert value == expected(pre, post, [t for t in members if t.module == module]), (row.layer, module)
    assert report.total == expected(pre, post, report_tensors)


def expected(pre, post, tensors):
    """A group's drift from the reference sums: approx the root of their ratio; None where pre is all zeros
    (Gemma's norms store their offset from 1) and post is not."""
    diff_sq, pre_sq = reference_drift(pre, post, [t.name for t in tensors])
    return None if pre_sq == 0 and diff_sq > 0 else pytest.approx(math.sqrt(diff_sq / pre_sq), rel=1e-6)


@pytest.mark.parametrize("architecture", ["llama", "qwen2_tied", "gpt2", "mixtral", "qwen2_moe", "gemma3_multimodal"])
def test_drift_matches_a_float64_reference_on_every_tensor(tmp_path, architecture):
    tiny_model(architecture).save_pretrained(tmp_path / "pre")
    tiny_model(architecture, seed=1, shift=0.02).save_pretrained(tmp_path / "post")
    pre, post = stored(tmp_path / "pre"), stored(tmp_path / "post")
    tensors = weight_drift(str(tmp_path / "pre"), str(tmp_path / "post"))
    check_against_reference(tensors, pre, post)
    modules = {t.name: t.module for t in tensors}
    layers = {t.layer for t in tensors}
    assert layers == {0, 1, None}  # every tiny architecture has 2 decoder layers; vision layers are not among them
    if architecture in ("mixtral", "qwen2_moe"):
        assert {t.module for t in tensors if ".experts." in t.name} == {"experts"}
        assert "router" in modules.values()
    if architecture == "gpt2":
        assert modules["transformer.h.0.attn.c_proj.weight"] == "o"
        assert modules["transformer.h.0.mlp.c_proj.weight"] == "down"
        assert modules["transformer.wte.weight"] == "embed"
    if architecture == "gemma3_multimodal":
        assert all(t.layer is None and t.module == "tower" for t in tensors if "vision_tower" in t.name)
    if architecture == "llama":
        assert modules["model.layers.1.self_attn.q_proj.weight"] == "q"
        assert modules["lm_head.weight"] == "head"
        assert modules["model.layers.0.mlp.gate_proj.weight"] == "gate"


def test_a_lora_adapter_is_measured_as_the_model_it_makes(tmp_path):
    """POST a PEFT adapter: every tensor's drift equals that of the model PEFT itself merges (merge_and_unload)."""
    save_tiny_llama(0, tmp_path / "pre", max_shard_size=None)
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tmp_path / "pre"),
        LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]),
    )
    train_lora(peft_model, steps=3, seed=1).save_pretrained(tmp_path / "adapter")
    merged = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tmp_path / "pre"), tmp_path / "adapter"
    ).merge_and_unload()
    merged.save_pretrained(tmp_path / "merged")
    pre, post = stored(tmp_path / "pre"), stored(tmp_path / "merged")
    tensors = weight_drift(str(tmp_path / "pre"), str(tmp_path / "adapter"))
    check_against_reference(tensors, pre, post)
    moved = {t.name for t in tensors if t.relative_drift > 0}
    assert moved == {n for n in pre if n.endswith(("q_proj.weight", "v_proj.weight", "down_proj.weight"))}


def direct_cka(x: torch.Tensor, y: torch.Tensor) -> float:
    """CKA from its definition (Kornblith et al. 2019, eq. 2): HSIC of the Gram matrices centred by H."""
    n = x.shape[0]
    x, y = x.to(torch.float64), y.to(torch.float64)
    centring = torch.eye(n, dtype=torch.float64) - torch.full((n, n), 1 / n, dtype=torch.float64)

    def hsic(a, b):
        return torch.trace(a @ centring @ b @ centring) / (n - 1) ** 2

    kx, ky = x @ x.T, y @ y.T
    return float(hsic(kx, ky) / torch.sqrt(hsic(kx, kx) * hsic(ky, ky)))


def test_linear_cka_against_its_definition():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(50, 8, generator=generator)
    y = x @ torch.randn(8, 12, generator=generator) + 0.5 * torch.randn(50, 12, generator=generator)
    assert linear_cka(x, y) == pytest.approx(direct_cka(x, y), rel=1e-9)
    rotation, _ = torch.linalg.qr(torch.randn(8, 8, generator=generator))
    assert linear_cka(x, 3 * x @ rotation + 1) == pytest.approx(1.0, rel=1e-9)  # rotation, scale and shift
    assert linear_cka(x, torch.ones(50, 4)) is None


def token_states(folder: Path, tokenizer, texts: list[str]) -> list[torch.Tensor]:
    """Decoder layers' outputs at the texts' non-special tokens, taken with transformers directly."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    per_layer = None
    for text in texts:
        encoded = tokenizer(text, return_special_tokens_mask=True, return_tensors="pt")
        keep = encoded["special_tokens_mask"][0] == 0
        with torch.no_grad():
            hidden = model(input_ids=encoded["input_ids"], output_hidden_states=True).hidden_states[1:]
        per_layer = per_layer or [[] for _ in hidden]
        for rows, states in zip(per_layer, hidden, strict=True):
            rows.append(states[0, keep])
    return [torch.cat(rows) for rows in per_layer]


@pytest.mark.slow
def test_cli_drift_of_the_toy_pair_with_cka_and_heatmap(toy_pair, tmp_path):
    heatmap, texts_file = tmp_path / "drift.png", tmp_path / "texts.txt"
    texts_file.write_text("\n".join(read_texts(toy_pair.typical_texts)[:8]) + "\n")
    result = cli(
        "drift", toy_pair.pre_dir, toy_pair.post_dir, "--texts", texts_file, "--json", "--heatmap", heatmap, "-q"
    )
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    pre, post = stored(toy_pair.pre_dir), stored(toy_pair.post_dir)
    for name, value in payload["tensors"].items():
        diff_sq, pre_sq = reference_drift(pre, post, [name])
        assert value["relative_drift"] == pytest.approx(math.sqrt(diff_sq / pre_sq), rel=1e-6)
    texts = read_texts(texts_file)
    tokenizer = AutoTokenizer.from_pretrained(toy_pair.pre_dir)
    before, after = token_states(toy_pair.pre_dir, tokenizer, texts), token_states(toy_pair.post_dir, tokenizer, texts)
    assert [row["layer"] for row in payload["layers"]] == list(range(len(before)))
    for row, x, y in zip(payload["layers"], before, after, strict=True):
        assert row["cka"] == pytest.approx(direct_cka(x, y), rel=1e-5)
        assert set(row["modules"]) >= {"q", "k", "v", "o", "gate", "up", "down", "norm"}
    assert heatmap.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = cli("drift", toy_pair.pre_dir, toy_pair.post_dir)
    assert table.returncode == 0 and "| layer" in table.stdout and "outside layers" in table.stdout


@pytest.mark.slow
def test_cka_of_an_adapter_is_that_of_the_model_peft_merges(toy_pair, tmp_path):
    pre = save_tiny_llama(0, tmp_path / "pre", max_shard_size=None)
    tokenizer = AutoTokenizer.from_pretrained(toy_pair.pre_dir)  # the toy's words, ids within the tiny vocabulary
    tokenizer.save_pretrained(pre)
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(pre), LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "up_proj"])
    )
    train_lora(peft_model, steps=3, seed=1, batch=(2, 8)).save_pretrained(tmp_path / "adapter")
    PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(pre), tmp_path / "adapter"
    ).merge_and_unload().save_pretrained(tmp_path / "merged")
    texts = read_texts(toy_pair.typical_texts)[:6]
    of_adapter = model_drift(str(pre), str(tmp_path / "adapter"), texts)
    before, after = token_states(pre, tokenizer, texts), token_states(tmp_path / "merged", tokenizer, texts)
    assert all(row.cka is not None and row.cka < 1 for row in of_adapter.layers)
    for row, x, y in zip(of_adapter.layers, before, after, strict=True):
        assert row.cka == pytest.approx(direct_cka(x, y), rel=1e-5)


def test_bad_input_is_one_line_exit_2(tmp_path):
    save_tiny_llama(0, tmp_path / "pre", max_shard_size=None)
    save_tiny_llama(1, tmp_path / "wide", max_shard_size=None, hidden_size=48)
    one_error_line(cli("drift", tmp_path / "pre", tmp_path / "wide"), 2, "another shape")
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00binary\x80")
    one_error_line(cli("drift", tmp_path / "pre", tmp_path / "pre", "--texts", tmp_path / "binary.txt"), 2)
    one_error_line(cli("drift", tmp_path / "pre", tmp_path / "pre", "--heatmap", tmp_path / "drift.jpg"), 2, ".png")
    (tmp_path / "theirs.png").write_text("not ours")
    one_error_line(
        cli("drift", tmp_path / "pre", tmp_path / "pre", "--heatmap", tmp_path / "theirs.png"), 2, "already exists"
    )
    assert (tmp_path / "theirs.png").read_text() == "not ours"
    one_error_line(
        cli("drift", tmp_path / "pre", tmp_path / "pre", "--heatmap", tmp_path / "pre" / "h.png"), 2, "inside the input"
    )
