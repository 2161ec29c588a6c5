"""Merges, sweeps and adapters on tiny random-initialised models of the architectures people merge.

Every output is loaded with transformers' from_pretrained (no missing or unexpected keys) and, where a
method has a closed form, its logits are compared with those of a plain-torch merge of the on-disk state
dicts, written here from the papers' definitions; the rest (random masks, iterative means, RECALL's
profile) must move away from their inputs. Models are built once per module (hidden 16, 2 layers, vocab 100).
"""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from tiny_models import ARCHITECTURES, tiny_model, train_lora
from transformers import AutoTokenizer

from mergekit_lite.audited import run_merge
from mergekit_lite.audits.adapter import audit_adapter
from mergekit_lite.io.sources import open_inputs
from mergekit_lite.merge.methods import NAMES as METHODS
from mergekit_lite.merge.recall import RecallWeights
from mergekit_lite.merge.schema import config_from_dict
from mergekit_lite.sweep import SweepSettings, run_sweep
from mergekit_lite.sweep.models import ModelLoader, ResidentPair
from mergekit_lite.threads import torch_threads

ALL_METHODS_ON = ("gemma3_multimodal", "gpt2", "mixtral")
TOKENS = torch.tensor([[1, 5, 17, 42, 63, 8, 2, 30, 77, 11]])
TOWERS = ("vision_tower.", "multi_modal_projector.")  # Gemma3's vision tower and projector, on disk
LAYERS = 2  # every tiny architecture's decoder depth (tiny_models._text)
RECALL_ROWS = [[0.9, 0.1], [0.3, 0.7], [0.6, 0.4]]  # embeddings and towers, decoder layer 0, layer 1 (and head)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Per architecture: base, and two fine-tunes (the base plus seeded noise), saved with save_pretrained."""
    root = tmp_path_factory.mktemp("architectures")
    folders = {}
    for architecture in ARCHITECTURES:
        folders[architecture] = []
        for seed, shift in ((0, 0.0), (1, 0.02), (2, 0.02)):
            folder = root / architecture / f"model{seed}"
            tiny_model(architecture, seed, shift).save_pretrained(folder)
            folders[architecture].append(folder)
    return folders


def state(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in sorted(Path(folder).glob("*.safetensors")):
        tensors.update(load_file(shard))
    return {name: tensor.to(torch.float64) for name, tensor in tensors.items()}


def reference_slerp(a: torch.Tensor, b: torch.Tensor, t: float) -> torch.Tensor:
    """Shoemake's SLERP of two tensors seen as flat vectors; the angle from the normalised vectors
    (zero or colinear vectors: the linear interpolation, where the angle is undefined or imprecise)."""
    norms = float(a.norm() * b.norm())
    cosine = float(torch.dot(a.flatten(), b.flatten())) / norms if norms else 1.0
    if abs(cosine) > 0.9995:
        return (1 - t) * a + t * b
    theta = math.acos(cosine)
    return (math.sin((1 - t) * theta) * a + math.sin(t * theta) * b) / math.sin(theta)


def reference_ties(base: torch.Tensor, models: list[torch.Tensor], density: float, scale: float) -> torch.Tensor:
    """TIES-Merging (Yadav et al. 2023, sec. 3): trim each task vector to its top-density magnitudes,
    elect the sign of the summed trimmed vectors, average the entries that agree with it."""
    trimmed = []
    for model in models:
        delta = model - base
        keep = round(density * delta.numel())
        threshold = delta.abs().flatten().topk(keep).values[-1]
        trimmed.append(torch.where(delta.abs() >= threshold, delta, torch.zeros_like(delta)))
    stacked = torch.stack(trimmed)
    agree = stacked.sign() == stacked.sum(0).sign()
    count = agree.sum(0).clamp(min=1)
    return base + scale * (stacked * agree).sum(0) / count


def reference_model_stock(base: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """Model Stock (Jang et al. 2024, eq. 3) for two fine-tunes: t = 2cos / (1 + cos), cos the angle between
    their offsets from the base; t times their average plus (1 - t) times the base."""
    a, b = (first - base).flatten(), (second - base).flatten()
    cosine = float(torch.dot(a, b) / (a.norm() * b.norm()))
    t = 2 * cosine / (1 + cosine)
    return t * (first + second) / 2 + (1 - t) * base


def reference_sce(base: torch.Tensor, models: list[torch.Tensor]) -> torch.Tensor:
    """SCE (Wan et al. 2024, FuseChat-2.0, sec. 3.3) with every entry selected: weigh each task vector by its mean
    square as a share of their sum, elect the sign of their sum (+ on a zero sum, mergekit's rule), and take the
    weighted mean of the entries that agree with it."""
    deltas = torch.stack([model - base for model in models])
    weights = deltas.square().flatten(1).mean(1)
    weights = weights / weights.sum() if weights.sum() >= 1e-6 else torch.full_like(weights, 1 / len(models))
    elected = torch.where(deltas.sum(0) >= 0, 1.0, -1.0).to(deltas.dtype)
    kept = (deltas.sign() == elected) * weights.view(-1, *[1] * base.dim())
    return base + (deltas * kept).sum(0) / kept.sum(0).clamp(min=1e-6)


def decoder_layer(name: str) -> int | None:
    """The decoder layer of an on-disk name; None outside the decoder layers (towers included)."""
    decoder = name if not name.startswith(TOWERS) else ""
    for marker in (".layers.", ".h."):
        if marker in decoder:
            return int(decoder.split(marker)[1].split(".")[0])
    return None


def recall_row(name: str) -> list[float]:
    """RECALL weights by depth: a decoder layer its own row; embeddings and towers the first; the rest the last."""
    if decoder_layer(name) is not None:
        return RECALL_ROWS[decoder_layer(name) + 1]
    embedding = any(part in name for part in ("embed_tokens", "wte", "wpe"))
    return RECALL_ROWS[0] if embedding or name.startswith(TOWERS) else RECALL_ROWS[-1]


def reference(method: str, folders: list[Path]) -> dict[str, torch.Tensor]:
    """The plain-torch merge, in float64, of what MERGES below asks mergekit-lite for."""
    base, first, second = (state(folder) for folder in folders)
    merged = {}
    for name, b in base.items():
        m1, m2 = first[name], second[name]
        if method == "linear":
            merged[name] = 0.7 * b + 0.3 * m1
        elif method == "slerp":
            merged[name] = reference_slerp(b, m1, 0.4)
        elif method in ("task_arithmetic", "dare_linear"):  # DARE with drop 0 keeps every entry
            merged[name] = b + 0.8 * ((m1 - b) + (m2 - b))
        elif method == "ties":
            merged[name] = reference_ties(b, [m1, m2], 0.5, 1.0)
        elif method == "dare_ties":
            merged[name] = reference_ties(b, [m1, m2], 1.0, 1.0)
        elif method == "model_stock":
            merged[name] = reference_model_stock(b, m1, m2)
        elif method == "nuslerp":  # with a base: SLERP of the task vectors, t = 3 / (1 + 3)
            merged[name] = b + reference_slerp(m1 - b, m2 - b, 0.75)
        elif method == "passthrough":
            merged[name] = 0.5 * m2
        elif method == "nearswap":  # the model where within t of the base, else a step of t / |model - base|
            step = (0.01 / (m1 - b).abs().clamp(min=1e-6)).clamp(0, 1)
            merged[name] = step * m1 + (1 - step) * b
        elif method == "sce":
            merged[name] = reference_sce(b, [m1, m2])
        elif (
            method == "lines"
        ):  # LiNeS (arXiv 2410.17146, Sec. 3): alpha + beta * l / (L - 1), alpha outside the layers
            layer = decoder_layer(name)
            factor = 0.2 if layer is None else 0.2 + 0.6 * layer / (LAYERS - 1)
            merged[name] = b + factor * ((m1 - b) + (m2 - b))
        elif method == "ema":  # the recursion s_0 = c_0, s_i = decay s_(i-1) + (1 - decay) c_i
            average = b
            for checkpoint in (m1, m2):
                average = 0.6 * average + 0.4 * checkpoint
            merged[name] = average
        else:
            row = recall_row(name)
            merged[name] = row[0] * b + row[1] * m1
    return merged


MERGES = {
    "linear": lambda paths: {"base": paths[0], "models": [paths[1]], "parameters": {"alpha": 0.3}},
    "slerp": lambda paths: {"base": paths[0], "models": [paths[1]], "parameters": {"t": 0.4}},
    "task_arithmetic": lambda paths: {"base": paths[0], "models": paths[1:], "parameters": {"lambda": 0.8}},
    "ties": lambda paths: {"base": paths[0], "models": paths[1:], "parameters": {"density": 0.5}},
    "dare_linear": lambda paths: {"base": paths[0], "models": paths[1:], "parameters": {"lambda": 0.8, "drop": 0.0}},
    "dare_ties": lambda paths: {"base": paths[0], "models": paths[1:], "parameters": {"drop": 0.0}},
    "recall": lambda paths: {"models": paths[:2]},
    "model_stock": lambda paths: {"base": paths[0], "models": paths[1:]},
    "nuslerp": lambda paths: {
        "base": paths[0],
        "models": [{"model": paths[1], "weight": 1.0}, {"model": paths[2], "weight": 3.0}],
    },
    "passthrough": lambda paths: {"models": [{"model": paths[2], "parameters": {"scale": 0.5}}]},
    "nearswap": lambda paths: {"base": paths[0], "models": [paths[1]], "parameters": {"t": 0.01}},
    "sce": lambda paths: {"base": paths[0], "models": paths[1:]},
    "lines": lambda paths: {"base": paths[0], "models": paths[1:], "parameters": {"alpha": 0.2, "beta": 0.6}},
    "ema": lambda paths: {"models": paths, "parameters": {"decay": 0.6}},
}
CASES = [
    (architecture, method)
    for architecture in ARCHITECTURES
    for method in MERGES
    if architecture in ALL_METHODS_ON or method in ("linear", "ties")
]
# The methods with no closed form here: random masks (DARE past drop 0, DELLA), Breadcrumbs' outlier band
# (its own tests compare it with mergekit), iterative or multi-way spherical means, RECALL's similarity profile.
UNREFERENCED = {
    "dare_linear_dropping": lambda paths: {
        "method": "dare_linear",
        "base": paths[0],
        "models": paths[1:],
        "parameters": {"lambda": 0.8, "drop": 0.3},
    },
    "dare_ties_dropping": lambda paths: {
        "method": "dare_ties",
        "base": paths[0],
        "models": paths[1:],
        "parameters": {"drop": 0.3},
    },
    "della": lambda paths: {
        "method": "della",
        "base": paths[0],
        "models": paths[1:],
        "parameters": {"density": 0.6, "epsilon": 0.2},
    },
    "della_linear": lambda paths: {
        "method": "della_linear",
        "base": paths[0],
        "models": paths[1:],
        "parameters": {"density": 0.6, "epsilon": 0.2},
    },
    "breadcrumbs": lambda paths: {
        "method": "breadcrumbs",
        "base": paths[0],
        "models": paths[1:],
        "parameters": {"density": 0.8, "gamma": 0.05},
    },
    "breadcrumbs_ties": lambda paths: {
        "method": "breadcrumbs_ties",
        "base": paths[0],
        "models": paths[1:],
        "parameters": {"density": 0.8, "gamma": 0.05},
    },
    "multislerp": lambda paths: {
        "method": "multislerp",
        "base": paths[0],
        "models": [{"model": paths[1], "weight": 1.0}, {"model": paths[2], "weight": 2.0}],
    },
    "karcher": lambda paths: {"method": "karcher", "models": paths},
    "recall_lerp": lambda paths: {
        "method": "recall_lerp",
        "base": paths[0],
        "models": [paths[1]],
        "parameters": {"alpha": 0.5},
    },
}


def model_class(folder: Path):
    return getattr(transformers, json.loads((Path(folder) / "config.json").read_text())["architectures"][0])


def loaded(folder: Path):
    """from_pretrained, failing on any missing or unexpected key."""
    model, info = model_class(folder).from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def from_state(folder: Path, tensors: dict[str, torch.Tensor]):
    config = transformers.AutoConfig.from_pretrained(folder)
    return model_class(folder).from_pretrained(None, config=config, state_dict=tensors).eval()


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=TOKENS).logits


def recall_weights_file(folder: Path, models: list[Path]) -> Path:
    weights = RecallWeights([str(m) for m in models], 1, 1.0, RECALL_ROWS, RECALL_ROWS, [0])  # post: the reference
    path = folder / "recall.json"
    path.write_text(json.dumps(weights.to_json()))
    return path


def merge(data: dict, folders: list[Path], out: Path) -> Path:
    """run_merge on `data`; the RECALL methods read their weights from a file over the first two models."""
    if data["method"] in ("recall", "recall_lerp"):
        data = {**data, "recall": {"weights_file": str(recall_weights_file(out.parent, folders[:2]))}}
    run_merge(config_from_dict(data), out)
    return out


def test_the_matrix_covers_every_registered_method():
    """A method added to the registry without a case here would go untested on these architectures."""
    placeholders = ["base", "first", "second"]
    assert set(MERGES) | {case(placeholders)["method"] for case in UNREFERENCED.values()} == set(METHODS)


@pytest.mark.parametrize("architecture,method", CASES)
def test_every_method_merges_loads_and_matches_a_plain_torch_merge(checkpoints, architecture, method, tmp_path):
    paths = [str(folder) for folder in checkpoints[architecture]]
    merge({"method": method, **MERGES[method](paths)}, checkpoints[architecture], tmp_path / "out")

    merged = loaded(tmp_path / "out")
    expected = {name: tensor.to(torch.float32) for name, tensor in reference(method, checkpoints[architecture]).items()}
    torch.testing.assert_close(logits(merged), logits(from_state(tmp_path / "out", expected)), rtol=0, atol=2e-6)


@pytest.mark.parametrize("case", UNREFERENCED)
@pytest.mark.parametrize("architecture", ALL_METHODS_ON)
def test_methods_without_a_closed_form_merge_load_and_move_away_from_their_inputs(
    checkpoints, architecture, case, tmp_path
):
    """No reference to equal: the output must load and differ from the base and from the first fine-tune."""
    folders = checkpoints[architecture]
    loaded(merge(UNREFERENCED[case]([str(folder) for folder in folders]), folders, tmp_path / "out"))

    merged = state(tmp_path / "out")
    for folder in folders[:2]:
        assert max(float((merged[name] - tensor).abs().max()) for name, tensor in state(folder).items()) > 1e-4


def test_vision_tower_layers_are_not_decoder_layers(checkpoints, tmp_path):
    """A gradient over decoder depth gives the vision tower the decoder input's value, never a layer's."""
    paths = [str(folder) for folder in checkpoints["gemma3_multimodal"]]
    config = config_from_dict(
        {"method": "linear", "base": paths[0], "models": [paths[1]], "parameters": {"alpha": [0.0, 1.0]}}
    )
    from mergekit_lite.merge.plan import plan_merge

    alphas = {step.name: step.parameters.alpha for step in plan_merge(config).steps}
    assert alphas["vision_tower.encoder.layers.1.mlp.fc1.weight"] == 0.0
    assert alphas["multi_modal_projector.mm_input_projection_weight"] == 0.0
    assert alphas["language_model.model.layers.1.mlp.up_proj.weight"] == 1.0
    assert alphas["language_model.model.layers.0.mlp.up_proj.weight"] == 0.0
    assert plan_merge(config).n_layers == 2


@pytest.mark.parametrize("stored_first", [True, False], ids=["duplicate-head-first", "tied-first"])
def test_tied_head_stored_by_one_input_only(checkpoints, stored_first, tmp_path):
    """GPT2 ties lm_head to transformer.wte: a fine-tune that also stores the head merges with a base that
    does not, in either order, and the head follows the embeddings."""
    base, tuned = checkpoints["gpt2"][:2]
    duplicate = tmp_path / "with-head"
    shutil.copytree(tuned, duplicate)
    tensors = load_file(duplicate / "model.safetensors")
    save_file(
        {**tensors, "lm_head.weight": tensors["transformer.wte.weight"].clone()},
        duplicate / "model.safetensors",
        metadata={"format": "pt"},
    )
    first, second = (duplicate, base) if stored_first else (base, duplicate)
    run_merge(
        config_from_dict(
            {"method": "linear", "base": str(first), "models": [str(second)], "parameters": {"alpha": 0.5}}
        ),
        tmp_path / "out",
    )

    expected = {
        name: (0.5 * tensor + 0.5 * state(tuned)[name]).to(torch.float32) for name, tensor in state(base).items()
    }
    torch.testing.assert_close(
        logits(model_class(base).from_pretrained(tmp_path / "out").eval()),
        logits(from_state(base, expected)),
        rtol=0,
        atol=2e-6,
    )


ADAPTED = {
    "qwen2_tied": ["q_proj", "v_proj"],
    "mixtral": ["q_proj", "v_proj"],
    "gpt2": ["c_attn"],
    "gemma3_multimodal": ["q_proj", "v_proj"],
}


def trained_adapter(base: Path, folder: Path, target_modules: list[str]) -> Path:
    """A PEFT adapter on `base`, trained 3 steps. lora_alpha 32: a few steps on a tiny model must clear the
    audit's absolute no-op norm (the paper's 1.0)."""
    peft_model = get_peft_model(
        loaded(base), LoraConfig(r=4, lora_alpha=32, target_modules=target_modules, lora_dropout=0.0)
    )
    train_lora(peft_model, steps=3, seed=1, batch=(2, 8)).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("architecture", ADAPTED)
def test_adapter_merge_equals_peft_merge_and_unload(checkpoints, architecture, tmp_path):
    """PEFT names Gemma3's adapted modules as they are in memory (model.language_model...), not as on disk
    (language_model.model...): the merge and the adapter audit that gates it (no force) both map them."""
    base = checkpoints[architecture][0]
    trained_adapter(base, tmp_path / "adapter", ADAPTED[architecture])
    run_merge(
        config_from_dict(
            {"method": "linear", "base": str(base), "models": [str(tmp_path / "adapter")], "parameters": {"alpha": 1.0}}
        ),
        tmp_path / "out",
    )

    expected = PeftModel.from_pretrained(loaded(base), tmp_path / "adapter").merge_and_unload().eval()
    torch.testing.assert_close(logits(loaded(tmp_path / "out")), logits(expected), rtol=0, atol=2e-6)


def test_lora_on_gpt2s_tied_head_is_refused_with_the_reason(checkpoints, tmp_path):
    """GPT2 ties lm_head to transformer.wte (its own tied keys, not Llama's names): a LoRA on the head would
    change the input embeddings too, and the audit says so rather than "not in the base"."""
    base = checkpoints["gpt2"][0]
    report = audit_adapter(trained_adapter(base, tmp_path / "head-lora", ["lm_head", "c_attn"]), base)
    assert report.verdict == "REJECTED"
    assert "the base ties lm_head to transformer.wte.weight" in report.reasons[0]


@pytest.fixture(scope="module")
def sweep_pairs(checkpoints, toy_pair, tmp_path_factory):
    """pre and post of the MoE and the multimodal model, with the toy pair's tokenizer (its vocabulary fits)."""
    root = tmp_path_factory.mktemp("sweep_pairs")
    tokenizer = AutoTokenizer.from_pretrained(toy_pair.pre_dir)
    pairs = {}
    for architecture in ("mixtral", "gemma3_multimodal"):
        pairs[architecture] = []
        for source in checkpoints[architecture][:2]:
            folder = root / architecture / source.name
            shutil.copytree(source, folder)
            tokenizer.save_pretrained(folder)
            (folder / "chat_template.jinja").write_text(f"{{{{ messages }}}} from {source.name}")
            pairs[architecture].append(folder)
    return pairs


@pytest.mark.slow
@pytest.mark.parametrize("method", ["linear", "slerp", "ties", "dare_ties"])
@pytest.mark.parametrize("architecture", ["mixtral", "gemma3_multimodal"])
def test_sweep_point_written_in_place_equals_the_merge_loaded_from_disk(
    sweep_pairs, toy_pair, architecture, method, tmp_path
):
    """The resident model holds pre and post (or the sparsified task vector) once; one point's weights,
    written into its parameters, equal the streamed merge of the on-disk tensors loaded by from_pretrained."""
    pre, post = sweep_pairs[architecture]
    settings = SweepSettings(
        str(pre),
        str(post),
        method,
        [0.6],
        toy_pair.old_tasks,
        toy_pair.new_tasks,
        str(toy_pair.task_dir),
        str(tmp_path / "run"),
        **{"ties": {"density": 0.4}, "dare_ties": {"drop": 0.3}}.get(method, {}),
    )
    config = settings.merge_config(0.6)
    resident = ResidentPair(
        ModelLoader(str(pre), torch.float32, "cpu"),
        settings,
        open_inputs([str(pre), str(post)], str(pre), False),
        settings.merge_config(1.0),
    )
    if method == "slerp" and architecture == "mixtral":  # fused experts: SLERP's angle is per on-disk expert
        assert not resident.exact
        return
    assert resident.exact
    resident.write(config)
    run_merge(config, tmp_path / "merged")

    expected = loaded(tmp_path / "merged").state_dict()
    written = resident.model.state_dict()
    assert set(written) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(written[name], tensor, rtol=0, atol=1e-6, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("architecture,stream", [("mixtral", True), ("gemma3_multimodal", False)])
def test_two_point_sweep_runs_and_saves_the_best_with_the_chosen_side_files(
    sweep_pairs, toy_pair, architecture, stream, tmp_path
):
    pre, post = sweep_pairs[architecture]
    result = run_sweep(
        SweepSettings(
            str(pre),
            str(post),
            "ties",
            [0.5, 1.0],
            toy_pair.old_tasks,
            toy_pair.new_tasks,
            str(toy_pair.task_dir),
            str(tmp_path / "run"),
            limit=8,
            stream=stream,
            save_best=str(tmp_path / "best"),
            copy_files_from=str(post),
        )
    )
    assert [point.alpha for point in result.points] == [0.5, 1.0]
    assert (tmp_path / "run" / "report.md").is_file()
    assert all(len(run.outcomes.correct) == 8 for point in result.points for run in point.tasks)
    assert (tmp_path / "best" / "chat_template.jinja").read_text() == (post / "chat_template.jinja").read_text()
    loaded(tmp_path / "best")


@pytest.mark.slow
def test_eval_dtype_defaults_and_a_bf16_resident_model(sweep_pairs, toy_pair, tmp_path):
    pre, post = sweep_pairs["mixtral"]
    common = (str(pre), str(post), "linear", [0.5], toy_pair.old_tasks, toy_pair.new_tasks, None, str(tmp_path))
    assert SweepSettings(*common).eval_dtype == "float32"
    assert SweepSettings(*common, device="cuda").eval_dtype == "bfloat16"
    settings = SweepSettings(*common, eval_dtype="bf16")
    resident = ResidentPair(
        ModelLoader(str(pre), torch.bfloat16, "cpu"),
        settings,
        open_inputs([str(pre), str(post)], str(pre), False),
        settings.merge_config(0.5),
    )
    resident.write(settings.merge_config(0.5))
    expected = from_state(
        pre, {name: (0.5 * tensor + 0.5 * state(post)[name]).to(torch.float32) for name, tensor in state(pre).items()}
    ).state_dict()
    for name, tensor in resident.model.state_dict().items():
        assert tensor.dtype == torch.bfloat16
        torch.testing.assert_close(tensor.float(), expected[name], rtol=1e-2, atol=1e-2, msg=name)


def test_post_trained_chat_template_and_generation_config_are_kept_when_the_base_has_none(
    checkpoints, toy_pair, tmp_path
):
    """A base merged with its instruct model keeps the instruct chat template (here inside
    tokenizer_config.json, as transformers 4 saves it) and generation config, with a note;
    --copy-files-from base keeps the base's files only."""
    base, post = tmp_path / "base", tmp_path / "instruct"
    for source, folder in ((checkpoints["llama"][0], base), (checkpoints["llama"][1], post)):
        shutil.copytree(source, folder)
        AutoTokenizer.from_pretrained(toy_pair.pre_dir).save_pretrained(folder)
    (base / "generation_config.json").unlink()
    generation = json.loads((post / "generation_config.json").read_text())
    (post / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": [2, 3]}))
    tokenizer_config = json.loads((post / "tokenizer_config.json").read_text())
    template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
    (post / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "chat_template": template}))
    data = {"method": "linear", "base": str(base), "models": [str(post)], "parameters": {"alpha": 0.5}}

    result = run_merge(config_from_dict(data), tmp_path / "out")
    assert AutoTokenizer.from_pretrained(tmp_path / "out").chat_template == template
    assert transformers.GenerationConfig.from_pretrained(tmp_path / "out").eos_token_id == [2, 3]
    assert any("chat template taken from" in note for note in result.plan.notes)

    run_merge(config_from_dict({**data, "copy_files_from": str(base)}), tmp_path / "as-base")
    assert AutoTokenizer.from_pretrained(tmp_path / "as-base").chat_template is None
    assert not (tmp_path / "as-base" / "generation_config.json").exists()


@pytest.mark.slow
def test_recall_on_the_multimodal_model_weighs_decoder_layers_only(sweep_pairs, toy_pair, tmp_path):
    """RECALL runs both models on typical texts: one row per decoder depth (embeddings + 2 layers), none for
    the vision tower's layers, and the merge loads."""
    pre, post = sweep_pairs["gemma3_multimodal"]
    run_merge(
        config_from_dict(
            {
                "method": "recall",
                "models": [str(pre), str(post)],
                "recall": {"texts": str(toy_pair.typical_texts), "samples": 3},
            }
        ),
        tmp_path / "out",
    )
    weights = json.loads((tmp_path / "out" / "recall_weights.json").read_text())
    assert len(weights["weights"]) == 3
    loaded(tmp_path / "out")
