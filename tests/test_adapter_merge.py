"""merge-adapters against the dense truth: base + sum_i w_i * (each adapter's own merge_and_unload - base), read back
through PEFT (the written adapter loaded as it is, then merge_and_unload). PEFT's own add_weighted_adapter is the
second reference where it is right; where it is not (rsLoRA cat, DoRA), the test records it."""

import json
import shutil

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.utils import merge_utils
from test_safety import cli
from tiny_models import save_tiny_llama, train_lora
from transformers import LlamaForCausalLM

from mergekit_lite.audited import merge_adapters
from mergekit_lite.errors import InputError
from mergekit_lite.merge import adapter_merge
from mergekit_lite.merge.adapters import AdapterMergeSettings
from mergekit_lite.threads import torch_threads

WEIGHTS = (0.7, 0.3)
KINDS = {  # each pair: two adapters on one base, made by PEFT with random B (DoRA: trained, so m moved)
    "plain": [
        dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        dict(r=4, lora_alpha=16, target_modules=["q_proj", "down_proj"]),
    ],
    "rslora": [
        dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"]),
        dict(r=8, lora_alpha=4, use_rslora=True, target_modules=["q_proj", "down_proj"]),
    ],
    "dora": [
        dict(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "v_proj"]),
        dict(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "down_proj"]),
    ],
}  # fmt: skip


def base_model(root):
    return LlamaForCausalLM.from_pretrained(root / "base")


def state(model) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapter-merge")
    with torch_threads(1):
        save_tiny_llama(0, root / "base")
        base = state(base_model(root))
        truths = {}
        for kind, configs in KINDS.items():
            deltas = []
            for index, config in enumerate(configs):
                torch.manual_seed(10 + index)
                model = get_peft_model(base_model(root), LoraConfig(init_lora_weights=False, **config))
                if config.get("use_dora"):
                    train_lora(model, 2, seed=index)
                model.save_pretrained(root / f"{kind}{index}")
                merged = state(model.merge_and_unload())
                deltas.append({name: merged[name] - base[name] for name in base})
            truths[kind] = {name: sum(w * d[name] for w, d in zip(WEIGHTS, deltas, strict=True)) for name in base}
    return root, base, truths


def adapters(root, kind):
    return [root / f"{kind}0", root / f"{kind}1"]


def loaded_delta(root, folder, base) -> dict[str, torch.Tensor]:
    """What PEFT makes of the written adapter: merge_and_unload of it on the base, minus the base."""
    merged = state(PeftModel.from_pretrained(base_model(root), folder).merge_and_unload())
    assert set(merged) == set(base)
    return {name: merged[name] - base[name] for name in base}


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm().clamp_min(1e-12))


def best_rank_error(truth: torch.Tensor, rank: int) -> float:
    """Eckart-Young: the error of the best rank-`rank` approximation, from torch's SVD of the truth itself."""
    return float(torch.linalg.svd(truth, full_matrices=False).S[rank:].square().sum().sqrt())


def run(root, kind, tmp_path, combination, **options):
    out = tmp_path / f"{kind}-{combination}"
    settings = AdapterMergeSettings(combination=combination, weights=WEIGHTS, **options)
    with torch_threads(1):
        result = merge_adapters(adapters(root, kind), out, settings)
    return out, result


def changed(truth: dict) -> list[str]:
    return [name for name, delta in truth.items() if bool(delta.abs().max() > 0)]


@pytest.mark.parametrize("kind", ["plain", "rslora"])
def test_cat_is_exact(setup, tmp_path, kind):
    root, base, truths = setup
    out, result = run(root, kind, tmp_path, "cat")
    got = loaded_delta(root, out, base)
    assert result.exact and result.error < 1e-5
    for name in truths[kind]:
        assert relative(got[name], truths[kind][name]) < 1e-5 if name in changed(truths[kind]) else not got[name].any()
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["use_rslora"] is False and config["lora_alpha"] == config["r"] == 12 - 4 * (kind == "plain")


@pytest.mark.parametrize("kind", ["plain", "rslora", "dora"])
@pytest.mark.parametrize("rank", [2, None])
def test_svd_reaches_the_best_rank_k_error(setup, tmp_path, kind, rank):
    root, base, truths = setup
    out, result = run(root, kind, tmp_path, "svd", rank=rank)
    got = loaded_delta(root, out, base)
    k = rank or (8 if kind == "rslora" else 4)
    for name in changed(truths[kind]):
        truth = truths[kind][name]
        k_here = min(k, *truth.shape)
        assert float((got[name] - truth).norm()) <= 1.01 * best_rank_error(truth, k_here) + 1e-6 * truth.norm(), name
    assert result.best_error is not None and result.error <= 1.01 * result.best_error + 1e-6


def peft_weighted(root, kind, combination, **options) -> dict[str, torch.Tensor]:
    """PEFT's own add_weighted_adapter on the same adapters, merged as it would be."""
    model = PeftModel.from_pretrained(base_model(root), adapters(root, kind)[0], adapter_name="a")
    model.load_adapter(adapters(root, kind)[1], adapter_name="b")
    model.add_weighted_adapter(["a", "b"], list(WEIGHTS), "mix", combination_type=combination, **options)
    return state(model.merge_and_unload(adapter_names=["mix"]))


@pytest.mark.parametrize(
    "combination, options",
    [
        ("linear", {}),
        ("ties", {"density": 0.5}),
        ("magnitude_prune", {"density": 0.5}),
        ("dare_linear", {"density": 1.0}),
        ("cat", {}),
        ("ties_svd", {"density": 0.5}),
        ("magnitude_prune_svd", {"density": 0.5}),
    ],
)
def test_plain_lora_agrees_with_peft_where_peft_is_right(setup, tmp_path, combination, options):
    """Plain LoRA on one rank: PEFT's scaling is right, so its add_weighted_adapter is a second reference."""
    root, base, _ = setup
    out, _ = run(root, "plain", tmp_path, combination, **options)
    got = loaded_delta(root, out, base)
    with torch_threads(1):
        reference = peft_weighted(root, "plain", combination, **options)
    for name in base:
        torch.testing.assert_close(base[name] + got[name], reference[name], rtol=1e-4, atol=1e-5)


def test_peft_cat_of_rslora_is_wrong_and_ours_is_not(setup, tmp_path):
    """PEFT keeps use_rslora with lora_alpha = r on the merged adapter: scaling sqrt(r), not 1."""
    root, base, truths = setup
    model = PeftModel.from_pretrained(base_model(root), adapters(root, "rslora")[0], adapter_name="a")
    model.load_adapter(adapters(root, "rslora")[1], adapter_name="b")
    model.add_weighted_adapter(["a", "b"], list(WEIGHTS), "mix", combination_type="cat")
    peft = state(model.merge_and_unload(adapter_names=["mix"]))
    out, _ = run(root, "rslora", tmp_path, "cat")
    ours = loaded_delta(root, out, base)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert relative(peft[name] - base[name], truths["rslora"][name]) > 1.0
    assert relative(ours[name], truths["rslora"][name]) < 1e-5


def test_peft_weighted_dora_is_wrong_and_ours_is_refused_or_right(setup, tmp_path):
    root, base, truths = setup
    with torch_threads(1):
        peft = peft_weighted(root, "dora", "cat")
    name = "model.layers.0.self_attn.q_proj.weight"
    assert relative(peft[name] - base[name], truths["dora"][name]) > 0.05
    with pytest.raises(InputError, match="is a DoRA adapter.*use an svd type"):
        run(root, "dora", tmp_path, "cat")
    assert not (tmp_path / "dora-cat").exists()


def test_factor_rules_are_peft_merge_utils():
    """The sparsifiers and sign election, against PEFT's merge_utils on the same tensors (DARE: its draw replayed)."""
    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randn(6, 5, generator=generator) for _ in range(3)]
    weights = [0.5, -1.0, 2.0]
    for rule, reference in (
        ("linear", lambda: merge_utils.task_arithmetic(tensors, torch.tensor(weights))),
        ("ties", lambda: merge_utils.ties(tensors, torch.tensor(weights), 0.4)),
        ("magnitude_prune", lambda: merge_utils.magnitude_prune(tensors, torch.tensor(weights), 0.4)),
    ):
        torch.testing.assert_close(adapter_merge.combine(rule, tensors, weights, 0.4), reference())
    seeds = [adapter_merge.generator_for(0, "m", index, "A") for index in range(3)]
    ours = adapter_merge.combine("dare_ties", tensors, weights, 0.4, seeds)
    replayed = [adapter_merge.generator_for(0, "m", index, "A") for index in range(3)]
    masks = [torch.bernoulli(torch.full_like(t, 0.4), generator=g) for t, g in zip(tensors, replayed, strict=True)]
    stacked = torch.stack([t * m / 0.4 for t, m in zip(tensors, masks, strict=True)])
    agree = merge_utils.calculate_majority_sign_mask(stacked)
    weighted = stacked * torch.tensor(weights).view(-1, 1, 1)
    torch.testing.assert_close(ours, merge_utils.disjoint_merge(weighted, agree))


def test_dare_is_the_same_run_to_run(setup, tmp_path):
    root, *_ = setup
    first, _ = run(root, "plain", tmp_path / "one", "dare_ties", density=0.5)
    second, _ = run(root, "plain", tmp_path / "two", "dare_ties", density=0.5)
    name = "adapter_model.safetensors"
    assert (first / name).read_bytes() == (second / name).read_bytes()


def test_cli_prints_the_error_and_refuses_in_one_line(setup, tmp_path):
    root, _, _ = setup
    first, second = adapters(root, "rslora")
    done = cli("merge-adapters", first, second, "--weights", "0.7,0.3", "--combination", "svd", "--rank", "2",
               "--out", tmp_path / "out", "--quiet")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "svd (approximate); relative error" in done.stdout and "best rank-2 error" in done.stdout
    card = (tmp_path / "out" / "README.md").read_text()
    assert "merge-adapters (svd)" in card and str(root / "base") in card
    for args, message in (
        (["--combination", "linear"], "needs one rank"),
        (["--combination", "ties"], "needs --density"),
        (["--weights", "1"], "1 weights for 2 adapters"),
    ):
        options = {"--weights": "0.7,0.3", **dict(zip(args[::2], args[1::2], strict=True))}
        flat = [part for pair in options.items() for part in pair]
        done = cli("merge-adapters", first, second, *flat, "--out", tmp_path / "refused", "--quiet")
        errors = [line for line in done.stderr.splitlines() if not line.startswith("audit: ")]
        assert done.returncode == 2 and len(errors) == 1 and message in errors[0], done.stderr
        assert not (tmp_path / "refused").exists()


def test_adapters_on_different_bases_are_refused(setup, tmp_path):
    root, _, _ = setup
    other = tmp_path / "other"
    shutil.copytree(adapters(root, "plain")[1], other)
    config = json.loads((other / "adapter_config.json").read_text())
    (other / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "Qwen/Qwen2.5-7B"}))
    settings = AdapterMergeSettings(combination="cat", weights=WEIGHTS)
    with pytest.raises(InputError, match="different bases: .* declares .*, .*other declares Qwen/Qwen2.5-7B"):
        merge_adapters([adapters(root, "plain")[0], other], tmp_path / "out", settings)
