"""The method registry: every method's merge gives the bytes recorded in tests/data/method_hashes.json (tiny
real models, float32 and bf16 outputs, a slice merge, a tokenizer_source merge), and the registry describes
every method the configs accept."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from mergekit_lite.merge.engine import run_merge
from mergekit_lite.merge.methods import NAMES, REGISTRY, method
from mergekit_lite.merge.recall import RecallWeights
from mergekit_lite.merge.schema import config_from_dict
from tests.tiny_models import VOCAB, save_tiny_llama

HASHES = Path(__file__).resolve().parent / "data" / "method_hashes.json"


def merges(paths: dict[str, str]) -> dict[str, dict]:
    """One config per case: every method with non-default options, so each parameter reaches the math."""
    base, first, second = paths["base"], paths["first"], paths["second"]
    three = {"base": base, "models": [first, second]}
    recall = {"recall": {"weights_file": paths["recall_weights"]}}
    return {
        "linear_alpha": {"method": "linear", "base": base, "models": [first], "parameters": {"alpha": 0.3}},
        "linear_weights": {
            "method": "linear",
            "base": base,
            "models": [{"model": first, "parameters": {"weight": 2.0}}, second],
            "parameters": {"normalize": True},
        },
        "slerp": {"method": "slerp", "base": base, "models": [first], "parameters": {"t": [0.2, 0.7]}},
        "nearswap": {"method": "nearswap", "base": base, "models": [first], "parameters": {"t": 0.01}},
        "task_arithmetic": {**three, "method": "task_arithmetic", "parameters": {"lambda": 0.8}},
        "ties": {**three, "method": "ties", "parameters": {"density": 0.5}},
        "dare_linear": {**three, "method": "dare_linear", "parameters": {"lambda": 0.8, "drop": 0.4}, "seed": 3},
        "dare_ties": {**three, "method": "dare_ties", "parameters": {"density": 0.6}, "seed": 5},
        "della": {**three, "method": "della", "parameters": {"density": 0.6, "epsilon": 0.2}, "seed": 1},
        "della_linear": {**three, "method": "della_linear", "parameters": {"density": 0.6, "epsilon": 0.1}},
        "breadcrumbs": {**three, "method": "breadcrumbs", "parameters": {"density": 0.8, "gamma": 0.05}},
        "breadcrumbs_ties": {**three, "method": "breadcrumbs_ties", "parameters": {"density": 0.7, "gamma": 0.1}},
        "sce": {**three, "method": "sce", "parameters": {"select_topk": 0.5}},
        "model_stock": {**three, "method": "model_stock"},
        "model_stock_filter_wise": {**three, "method": "model_stock", "parameters": {"filter_wise": True}},
        "nuslerp": {
            "method": "nuslerp",
            "base": base,
            "models": [
                {"model": first, "parameters": {"weight": 1.0}},
                {"model": second, "parameters": {"weight": 3.0}},
            ],
        },
        "nuslerp_rows": {
            "method": "nuslerp",
            "models": [
                {"model": first, "parameters": {"weight": 1.0}},
                {"model": second, "parameters": {"weight": 2.0}},
            ],
            "parameters": {"nuslerp_flatten": False, "nuslerp_row_wise": True},
        },
        "multislerp": {
            **three,
            "method": "multislerp",
            "models": [
                {"model": first, "parameters": {"weight": 1.0}},
                {"model": second, "parameters": {"weight": 2.0}},
            ],
        },
        "karcher": {"method": "karcher", "models": [base, first, second], "parameters": {"max_iter": 5}},
        "passthrough": {"method": "passthrough", "models": [{"model": second, "parameters": {"scale": 0.5}}]},
        "recall": {"method": "recall", "base": base, "models": [first], **recall},
        "recall_lerp": {
            "method": "recall_lerp",
            "base": base,
            "models": [first],
            "parameters": {"alpha": 0.4},
            **recall,
        },
        "lines": {**three, "method": "lines", "parameters": {"alpha": 0.2, "beta": 0.6}},
        "ema": {"method": "ema", "models": [base, first, second], "parameters": {"decay": 0.6}},
        "slices": {
            "method": "linear",
            "slices": [
                {
                    "sources": [{"model": base, "layer_range": [0, 2]}, {"model": first, "layer_range": [0, 2]}],
                    "parameters": {"weight": [0.2, 0.8]},
                },
                {"sources": [{"model": second, "layer_range": [1, 2]}, {"model": first, "layer_range": [1, 2]}]},
            ],
        },
        "slices_passthrough": {
            "method": "passthrough",
            "slices": [
                {"sources": [{"model": base, "layer_range": [0, 2]}]},
                {"sources": [{"model": second, "layer_range": [1, 2]}]},
            ],
        },
        "tokenizer_source": {
            "method": "ties",
            "base": base,
            "models": [first, paths["wide"]],
            "parameters": {"density": 0.5},
            "tokenizer_source": "union",
        },
    }


CASES = sorted(merges(dict.fromkeys(("base", "first", "second", "wide", "recall_weights"), "")))
DTYPES = ("float32", "bfloat16")


def save_tokenizer(folder: Path, extra: str | None = None) -> None:
    """A word-level tokenizer of VOCAB words (plus `extra`, a word only this model knows)."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    if extra:
        tokenizer.add_tokens([extra])
    tokenizer.save_pretrained(folder)


def build_models(root: Path) -> dict[str, str]:
    """Three tiny Llamas of one vocabulary, a fourth with one word more, and RECALL weights over two of them."""
    paths = {}
    for seed, name in enumerate(("base", "first", "second", "wide")):
        folder = save_tiny_llama(seed, root / name, vocab_size=VOCAB + (name == "wide"))
        save_tokenizer(folder, "extra" if name == "wide" else None)
        paths[name] = str(folder)
    rows = [[0.5, 0.5], [0.7, 0.3], [0.2, 0.8]]  # embeddings, layer 0, layer 1
    weights = RecallWeights([paths["base"], paths["first"]], 1, 1.0, rows, rows, [0])
    (root / "recall.json").write_text(json.dumps(weights.to_json()))
    paths["recall_weights"] = str(root / "recall.json")
    return paths


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    return build_models(tmp_path_factory.mktemp("registry"))


def output_hash(folder: Path) -> str:
    """sha256 over the output's weight shards and tokenizer, in name order (the card names no bytes)."""
    digest = hashlib.sha256()
    for path in sorted(folder.iterdir()):
        if path.suffix == ".safetensors" or path.name in ("tokenizer.json", "model.safetensors.index.json"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def merged_hash(case: str, dtype: str, paths: dict[str, str], out: Path) -> str:
    data = merges(paths)[case]
    run_merge(config_from_dict({**data, "dtype": dtype}), out)
    return output_hash(out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_every_method_gives_the_recorded_bytes(case, dtype, tiny_models, tmp_path):
    recorded = json.loads(HASHES.read_text())
    assert merged_hash(case, dtype, tiny_models, tmp_path / "out") == recorded[f"{case}/{dtype}"]


if __name__ == "__main__":  # records HASHES from this code: `python -m tests.test_method_registry`
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        built = build_models(Path(scratch))
        hashes = {
            f"{case}/{dtype}": merged_hash(case, dtype, built, Path(scratch) / f"{case}-{dtype}")
            for case in CASES
            for dtype in DTYPES
        }
    HASHES.parent.mkdir(exist_ok=True)
    HASHES.write_text(json.dumps(hashes, indent=1, sort_keys=True) + "\n")


def test_every_declaration_is_consistent():
    """What the CLI, the sweep and the dry run take from a declaration holds for every method: a sweep's coefficient
    is a parameter with an explanation, defaults lie within their bounds and have their type, and the dry run's
    calibration merge is a valid config of the method."""
    for name, declared in REGISTRY.items():
        assert declared.name == name and declared.summary, name
        if declared.main_coefficient:
            assert declared.main_coefficient in declared.parameter_names and declared.alpha_meaning, name
        for parameter in declared.parameters:
            assert parameter.help, (name, parameter.name)
            if parameter.default is not None:
                assert isinstance(parameter.default, parameter.kind), (name, parameter.name)
                assert parameter.kind is bool or not parameter.out_of_bounds(parameter.default), (name, parameter.name)
        if declared.same_math_as:
            assert REGISTRY[declared.same_math_as].same_math_as is None, name


@pytest.mark.parametrize("name", NAMES)
def test_calibration_merges_are_valid_configs(name, tiny_models):
    calibration = method(name).calibration
    inputs = [tiny_models[key] for key in ("base", "first", "second")]
    models = inputs[1 : calibration.models + 1] if calibration.with_base else inputs[: calibration.models]
    config = config_from_dict(
        {
            "method": name,
            "base": inputs[0] if calibration.with_base else None,
            "models": models,
            "parameters": calibration.parameters,
        }
    )
    assert config.merge_method is method(name)


def test_every_registered_method_has_recorded_bytes():
    """A method added to the registry without a case in `merges` would have no bytes pinned."""
    cases = merges(dict.fromkeys(("base", "first", "second", "wide", "recall_weights"), ""))
    assert {data["method"] for data in cases.values()} == set(NAMES)
    assert set(json.loads(HASHES.read_text())) == {f"{case}/{dtype}" for case in CASES for dtype in DTYPES}


def test_the_documented_example_method_merges(tiny_models, tmp_path, monkeypatch):
    """docs/adding-a-method.md's `median` module, registered as its steps say, merges through config, plan and
    engine: the entrywise median of three models, and the one-line error for two."""
    from safetensors.torch import load_file

    from mergekit_lite.errors import InputError
    from mergekit_lite.merge import methods

    page = (Path(__file__).resolve().parent.parent / "docs" / "adding-a-method.md").read_text()
    module_source = page.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(compile(module_source, "median.py", "exec"), namespace)
    [median] = namespace["METHODS"]
    monkeypatch.setitem(methods.REGISTRY, median.name, median)
    inputs = [tiny_models[name] for name in ("base", "first", "second")]
    run_merge(config_from_dict({"method": "median", "models": inputs}), tmp_path / "out")
    merged = load_file(tmp_path / "out" / "model.safetensors")
    read = [
        {name: tensor for part in sorted(Path(path).glob("*.safetensors")) for name, tensor in load_file(part).items()}
        for path in inputs
    ]
    for name, tensor in merged.items():
        assert torch.equal(tensor, torch.stack([model[name] for model in read]).median(dim=0).values), name
    with pytest.raises(InputError, match="median needs at least three models, got 2"):
        config_from_dict({"method": "median", "models": inputs[:2]})
