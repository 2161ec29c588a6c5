"""mergekit's configs run as-is: the same YAML through mergekit 0.1.5 and mergekit-lite, outputs compared tensor
by tensor (deterministic methods within float32 tolerance, DARE by distribution), vocabularies merged by token,
and hub ids resolved from a cache laid out here. CONFIGS are ours, written for this test; REAL_CONFIGS and the
tests after them are real users' configs, each citing where it was found."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import yaml
from mergekit_reference import mergekit_cli, run_mergekit, run_mergekit_batch
from safetensors.torch import load_file
from test_safety import cli
from tiny_models import VOCAB, tiny_llama
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AddedToken,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerFast,
)

from mergekit_lite.audited import run_merge
from mergekit_lite.errors import InputError
from mergekit_lite.merge.schema import config_from_dict, load_config

CLI = Path(sys.executable).parent / "mergekit-lite"
NEW_TOKENS = ("<|im_start|>", "<|im_end|>")
TEMPLATE = "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"


def save_tokenizer(folder: Path, added: tuple[str, ...] = ()) -> None:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    if added:
        tokenizer.add_tokens([AddedToken(token, special=True) for token in added], special_tokens=True)
    tokenizer.save_pretrained(folder)


def save_model(state: dict, folder: Path, vocab_size: int = VOCAB, added: tuple[str, ...] = ()) -> Path:
    model = tiny_llama(0, num_hidden_layers=3, vocab_size=vocab_size)
    model.load_state_dict(state)
    model.save_pretrained(folder, max_shard_size="40KB")
    save_tokenizer(folder, added)
    return folder


def noisy(state: dict, seed: int, scale: float = 0.05) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {name: tensor + scale * torch.randn(tensor.shape, generator=generator) for name, tensor in state.items()}


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> dict[str, Path]:
    """A 3-layer base, two fine-tunes, an instruct model with two added chat tokens, and an exact
    +d / -d pair on a 2^-10 grid (their task vectors cancel exactly: the zero-sum sign vote)."""
    root = tmp_path_factory.mktemp("zoo")
    base = tiny_llama(0, num_hidden_layers=3).state_dict()
    instruct = noisy(base, 3)
    generator = torch.Generator().manual_seed(4)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        instruct[name] = torch.cat([instruct[name], torch.randn(2, instruct[name].shape[1], generator=generator)])
    grid = {name: torch.round(tensor * 1024) / 1024 for name, tensor in base.items()}
    step = {name: torch.randint(-8, 9, tensor.shape, generator=generator) / 1024 for name, tensor in base.items()}
    return {
        "base": save_model(base, root / "base"),
        "a": save_model(noisy(base, 1), root / "a"),
        "b": save_model(noisy(base, 2), root / "b"),
        "instruct": save_model(instruct, root / "instruct", VOCAB + 2, NEW_TOKENS),
        "grid": save_model(grid, root / "grid"),
        "up": save_model({n: grid[n] + step[n] for n in grid}, root / "up"),
        "down": save_model({n: grid[n] - step[n] for n in grid}, root / "down"),
        "root": root,
    }


# mergekit-format configs: together they use every key of its schema that mergekit-lite reads.
CONFIGS = {
    "linear": """
merge_method: linear
base_model: {base}
models:
  - model: {base}
    parameters:
      weight: 0.5
  - model: {a}
    parameters:
      weight: [0.2, 0.8]
  - model: {b}
    parameters:
      weight:
        - filter: mlp
          value: 0.7
        - value: 0.3
parameters:
  normalize: true
dtype: float32
out_dtype: float32
tokenizer_source: base
chat_template: @TEMPLATE@
""",
    "task_arithmetic": """
merge_method: task_arithmetic
base_model: {base}
models:
  - model: {base}
    parameters:
  - model: {a}
    parameters:
      weight: [0.3, 1.0]
  - model: {b}
    parameters:
      weight: 0.5
parameters:
  lambda: 0.8
  int8_mask: true
  normalize: false
dtype: float32
out_dtype: bfloat16
""",
    "ties": """
merge_method: ties
base_model: {base}
models:
  - model: {a}
    parameters:
      weight: 1.0
      density: 0.5
  - model: {b}
    parameters:
      weight: 0.6
      density: [0.3, 0.9]
parameters:
  int8_mask: true
dtype: float32
""",
    "ties_zero_sum": """
merge_method: ties
base_model: {grid}
models:
  - model: {up}
    parameters:
      weight: 1.0
  - model: {down}
    parameters:
      weight: 1.0
dtype: float32
""",
    "dare_ties_no_drop": """
merge_method: dare_ties
base_model: {base}
models:
  - model: {a}
    parameters:
      weight: 1.0
      density: 1.0
  - model: {b}
    parameters:
      weight: 0.5
      density: 1.0
dtype: float32
""",
    "dare_ties": """
merge_method: dare_ties
base_model: {base}
models:
  - model: {a}
    parameters:
      weight: 0.6
      density: 0.5
  - model: {b}
    parameters:
      weight: 0.4
      density: 0.5
dtype: float32
""",
    "dare_linear": """
merge_method: dare_linear
base_model: {base}
models:
  - model: {a}
    parameters:
      weight: 1.0
      density: 0.6
parameters:
  rescale: true
dtype: float32
""",
    "slerp": """
merge_method: slerp
base_model: {base}
models:
  - model: {base}
  - model: {a}
parameters:
  t:
    - filter: self_attn
      value: [0, 0.5, 1]
    - filter: mlp
      value: [1, 0.5, 0]
    - value: 0.5
dtype: float32
""",
    "union": """
merge_method: linear
models:
  - model: {base}
    parameters:
      weight: 0.5
  - model: {instruct}
    parameters:
      weight: 0.5
base_model: {base}
tokenizer:
  source: union
  pad_to_multiple_of: 8
dtype: float32
""",
    "base_vocab": """
merge_method: task_arithmetic
base_model: {base}
models:
  - model: {instruct}
    parameters:
      weight: 0.5
tokenizer_source: base
dtype: float32
""",
    "model_vocab": """
merge_method: task_arithmetic
base_model: {base}
models:
  - model: {a}
    parameters:
      weight: 0.5
  - model: {instruct}
    parameters:
      weight: 0.5
tokenizer_source: {instruct}
dtype: float32
""",
}
# The task_arithmetic config stored in float32: the bf16 one only shows agreement to bf16 rounding.
# filter lists without a default entry: a tensor none of them matches falls through to the next level (the global
# parameters, then the default), as mergekit resolves it
CONFIGS["filters_fall_through"] = """
merge_method: linear
models:
  - model: {a}
    parameters:
      weight:
        - filter: mlp
          value: 0.2
  - model: {b}
parameters:
  weight:
    - filter: self_attn
      value: [0.5, 1.5]
    - filter: input_layernorm
      value: 3.0
    - value: 1.0
dtype: float32
"""
CONFIGS["nearswap"] = """
merge_method: nearswap
base_model: {base}
models:
  - model: {base}
  - model: {a}
parameters:
  t: [0.01, 0.05]
dtype: float32
"""
CONFIGS["sce"] = """
merge_method: sce
base_model: {base}
models:
  - model: {a}
  - model: {b}
parameters:
  select_topk: 0.5
dtype: float32
"""
CONFIGS["task_arithmetic_fp32"] = CONFIGS["task_arithmetic"].replace("out_dtype: bfloat16", "out_dtype: float32")
SLICE_CONFIGS = {
    "slerp_slices": """
merge_method: slerp
base_model: {base}
slices:
  - sources:
      - model: {base}
        layer_range: [0, 2]
      - model: {a}
        layer_range: [1, 3]
  - sources:
      - model: {b}
        layer_range: [2, 3]
      - model: {base}
        layer_range: [2, 3]
    parameters:
      t: 0.3
parameters:
  t: [0, 0.5, 1]
dtype: float32
""",
}
SLICE_CONFIGS["slerp_slices_fall_through"] = SLICE_CONFIGS["slerp_slices"].replace(
    "      t: 0.3\n", "      t:\n        - filter: self_attn\n          value: 0.3\n"
)


def read_state(folder: Path) -> dict[str, torch.Tensor]:
    state = {}
    for shard in sorted(folder.glob("*.safetensors")):
        state.update(load_file(shard))
    return state


@pytest.fixture(scope="module")
def mergekit_outputs(zoo) -> dict[str, tuple[Path, Path]]:
    """Every config of this file (CONFIGS, SLICE_CONFIGS, REAL_CONFIGS) written out with the zoo's paths and run
    as-is by mergekit, two at a time (its CLI itself for one config, the rest in one batch that pays mergekit's
    imports once): name -> (config file, mergekit's output)."""
    mergekit_cli()
    root = zoo["root"]
    paths = {name: str(path) for name, path in zoo.items()}
    written = {}
    for name, text in {**CONFIGS, **SLICE_CONFIGS, **REAL_CONFIGS}.items():
        written[name] = root / f"{name}.yml"
        written[name].write_text(text.format(**paths).replace("@TEMPLATE@", json.dumps(TEMPLATE)))
    theirs = {name: root / f"mk-{name}" for name in written}
    with ThreadPoolExecutor(max_workers=2) as pool:
        alone = pool.submit(run_mergekit, written["union"], theirs["union"])
        run_mergekit_batch({written[name]: theirs[name] for name in written if name != "union"})
        alone.result()
    return {name: (written[name], theirs[name]) for name in written}


@pytest.fixture(scope="module")
def side_by_side(zoo, mergekit_outputs) -> dict[str, tuple[Path, Path, Path]]:
    """CONFIGS and SLICE_CONFIGS by mergekit and CONFIGS by mergekit-lite: name -> (theirs, ours, config)."""
    ours = {
        name: run_merge(load_config(mergekit_outputs[name][0]), zoo["root"] / f"lite-{name}").out for name in CONFIGS
    }
    return {
        name: (mergekit_outputs[name][1], ours.get(name), mergekit_outputs[name][0])
        for name in {**CONFIGS, **SLICE_CONFIGS}
    }


@pytest.mark.parametrize(
    "name",
    [
        "linear",
        "task_arithmetic_fp32",
        "ties",
        "ties_zero_sum",
        "dare_ties_no_drop",
        "slerp",
        "union",
        "base_vocab",
        "model_vocab",
        "filters_fall_through",
        "nearswap",
        "sce",
    ],
)
@pytest.mark.slow
def test_deterministic_methods_match_mergekit_tensor_by_tensor(side_by_side, name):
    theirs, ours, _ = side_by_side[name]
    expected, merged = read_state(theirs), read_state(ours)
    assert sorted(merged) == sorted(expected)
    for tensor_name, tensor in expected.items():
        assert merged[tensor_name].dtype == tensor.dtype, tensor_name
        torch.testing.assert_close(
            merged[tensor_name], tensor, rtol=1e-5, atol=1e-6, msg=lambda m: f"{tensor_name}: {m}"
        )
    their_config = json.loads((theirs / "config.json").read_text())
    our_config = json.loads((ours / "config.json").read_text())
    assert our_config["vocab_size"] == their_config["vocab_size"]


@pytest.mark.slow
def test_stored_dtype_is_out_dtype_and_values_agree_to_bf16(side_by_side):
    theirs, ours, _ = side_by_side["task_arithmetic"]
    expected, merged = read_state(theirs), read_state(ours)
    for tensor_name, tensor in expected.items():
        assert tensor.dtype == merged[tensor_name].dtype == torch.bfloat16
        torch.testing.assert_close(merged[tensor_name].float(), tensor.float(), rtol=1e-2, atol=1e-3)


@pytest.mark.slow
def test_zero_sum_sign_vote_keeps_the_positive_side_in_compat_mode_only(side_by_side, zoo):
    """mergekit elects + where the task vectors cancel exactly; our own rule elects nothing there."""
    _, ours, config_file = side_by_side["ties_zero_sum"]
    name = "model.layers.1.mlp.up_proj.weight"
    grid, up = read_state(zoo["grid"])[name], read_state(zoo["up"])[name]
    assert torch.equal(read_state(ours)[name], grid + (up - grid).abs())
    config = load_config(config_file)
    data = {**config.to_dict(), "mergekit_compat": False}
    ours_strict = run_merge(config_from_dict(data), zoo["root"] / "zero-sum-own").out
    assert torch.equal(read_state(ours_strict)[name], grid)


def projection_deltas(state: dict, base: dict) -> dict[str, torch.Tensor]:
    """state - base for each decoder layer's projection weight, flattened: the tensors DARE tests read."""
    return {n: (state[n] - base[n]).flatten() for n in base if "layers" in n and n.endswith("proj.weight")}


@pytest.mark.slow
def test_dare_matches_mergekit_in_distribution(side_by_side, zoo):
    """Random masks differ; the share dropped and the rescaling of survivors must agree (density 0.6)."""
    theirs, ours, _ = side_by_side["dare_linear"]
    base = read_state(zoo["base"])
    original = torch.cat(list(projection_deltas(read_state(zoo["a"]), base).values()))
    for state in (read_state(theirs), read_state(ours)):
        deltas = torch.cat(list(projection_deltas(state, base).values()))
        kept = deltas.abs() > 1e-7
        share = kept.float().mean().item()
        spread = 4 * (0.6 * 0.4 / deltas.numel()) ** 0.5
        assert abs(share - 0.6) < spread, share
        scale = (deltas[kept] / original[kept]).median().item()
        assert abs(scale - 1 / 0.6) < 0.05 * (1 / 0.6), scale


@pytest.mark.slow
def test_dare_ties_at_a_real_drop_matches_mergekit_in_distribution(side_by_side, zoo):
    """density 0.5 for two models: an entry stays at the base only where both were dropped (a lone survivor
    elects its own sign), so 1/4 of the entries, and the survivors' spread depends on rescale and normalize.

    Masks come from different RNGs, so each tensor is compared by statistics with their sampling error: the
    share equal to the base is binomial (standard deviation of the difference of two runs sqrt(2·p(1-p)/n));
    a sample standard deviation has relative error sqrt((kurtosis - 1) / 4n), the kurtosis read off
    mergekit's deltas (a point mass at 0 makes it far from Gaussian). Both are allowed 4.5 deviations:
    21 tensors of 512 to 2048 entries, where a missing rescale (x2) or our own normalize (x1.7 with these
    weights) is 12 deviations and more. Both runs are seeded, so the outcome is fixed; the tolerances are
    what another seed may move."""
    theirs, ours, _ = side_by_side["dare_ties"]
    base = read_state(zoo["base"])
    expected, merged = projection_deltas(read_state(theirs), base), projection_deltas(read_state(ours), base)
    for name, their_delta in expected.items():
        n, our_delta = their_delta.numel(), merged[name]
        their_share, our_share = ((d == 0).float().mean().item() for d in (their_delta, our_delta))
        assert abs(our_share - their_share) < 4.5 * (2 * 0.25 * 0.75 / n) ** 0.5, (name, our_share, their_share)
        kurtosis = (their_delta**4).mean() / (their_delta**2).mean() ** 2
        spread = 4.5 * (2 * (kurtosis.item() - 1) / (4 * n)) ** 0.5
        assert abs(our_delta.std() / their_delta.std() - 1) < spread, (name, our_delta.std(), their_delta.std())
    for deltas in (expected, merged):  # ~27k entries pooled: one deviation is 0.0026
        share = torch.cat(list(deltas.values())).eq(0).float().mean().item()
        assert abs(share - 0.25) < 0.02, share


@pytest.mark.slow
def test_gradient_ends_follow_mergekit(side_by_side, zoo):
    """weight [0.3, 1.0]: mergekit gives the final norm and the head the first value, as mergekit-lite does here."""
    theirs, ours, _ = side_by_side["task_arithmetic"]
    base, a, b = (read_state(zoo[key]) for key in ("base", "a", "b"))
    for merged in (read_state(theirs), read_state(ours)):
        for name in ("lm_head.weight", "model.norm.weight"):
            expected = base[name] + 0.8 * (0.3 * (a[name] - base[name]) + 0.5 * (b[name] - base[name]))
            torch.testing.assert_close(merged[name].float(), expected, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize(
    "name, size, rows",
    [
        ("union", VOCAB + 2, 104),  # union pads to a multiple of 8
        ("base_vocab", VOCAB, VOCAB),
        ("model_vocab", VOCAB + 2, VOCAB + 2),  # tokenizer_source: the instruct model, which the base lacks tokens of
    ],
)
@pytest.mark.slow
def test_vocabularies_merge_by_token(side_by_side, zoo, name, size, rows):
    theirs, ours, _ = side_by_side[name]
    instruct = read_state(zoo["instruct"])
    merged = read_state(ours)
    tokenizer = AutoTokenizer.from_pretrained(ours)
    assert tokenizer.get_vocab() == AutoTokenizer.from_pretrained(theirs).get_vocab()
    assert len(tokenizer) == size and json.loads((ours / "config.json").read_text())["vocab_size"] == rows
    model = AutoModelForCausalLM.from_pretrained(ours)
    assert model.get_input_embeddings().weight.shape[0] == rows
    if size > VOCAB:
        ids = tokenizer("<|im_start|> w5 w6 <|im_end|>").input_ids
        assert ids == [VOCAB, 5, 6, VOCAB + 1]
        assert tokenizer.decode(ids) == "<|im_start|> w5 w6 <|im_end|>"
        for tensor_name in ("model.embed_tokens.weight", "lm_head.weight"):  # rows only the fine-tune has
            torch.testing.assert_close(
                merged[tensor_name][VOCAB:size], instruct[tensor_name][VOCAB:], rtol=0, atol=1e-7
            )
    else:
        assert "<|im_start|>" not in tokenizer.get_vocab()


@pytest.mark.slow
def test_chat_template_is_written(side_by_side):
    theirs, ours, _ = side_by_side["linear"]
    assert AutoTokenizer.from_pretrained(ours).chat_template == TEMPLATE
    assert AutoTokenizer.from_pretrained(theirs).chat_template == TEMPLATE


def test_vocabulary_mismatch_without_a_tokenizer_setting_names_the_option(zoo):
    config = config_from_dict(
        {
            "merge_method": "linear",
            "models": [
                {"model": str(zoo["base"]), "parameters": {"weight": 0.5}},
                {"model": str(zoo["instruct"]), "parameters": {"weight": 0.5}},
            ],
        }
    )
    with pytest.raises(InputError, match=r"vocabularies differ \(100 tokens in .*, 102 in .*\): set tokenizer_source"):
        run_merge(config, zoo["root"] / "never")
    assert not (zoo["root"] / "never").exists()


# ----------------------------------------------------------------------------------- schema, strictly


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "method: linear\nmodels:\n  - model: {a}\n    parameters:\n      weight: 1\n      normalize: false\n",
            r"cannot be set per model",
        ),
        (
            "merge_method: linear\nmodels: [{{model: {a}}}]\nparameters:\n  normalize: 'false'\n",
            r"normalize must be true or false, got 'false'",
        ),
        ("method: linear\nmodels: [{a}]\nskip: lm_head\n", r"cfg\.yml: skip: expected a list, got 'lm_head'"),
        ("method: linear\nmodels: [{a}]\nallow_pickle: 'yes'\n", r"cfg\.yml: allow_pickle: expected true or false"),
        (
            "merge_method: linear\nmodels: [{{model: {a}}}]\nout_dtyp: float32\n",
            r"cfg\.yml: unknown key 'out_dtyp' \(did you mean 'out_dtype'\?\)",
        ),
        (
            "merge_method: ties\nbase_model: {base}\nmodels:\n  - model: {a}\n    paramters: {{}}\n",
            r"cfg\.yml: models\[0\]: unknown key 'paramters' \(did you mean 'parameters'\?\)",
        ),
        (
            "merge_method: tise\nbase_model: {base}\nmodels: [{{model: {a}}}]\n",
            r"unknown method 'tise' \(did you mean 'ties'\?\)",
        ),
        (
            "merge_method: linear\nbase_model: {base}\nmodels: [{{model: {a}, parameters: {{weight: 1}}}}]\n",
            r"give .*base.* a weight",
        ),
        (
            "merge_method: linear\nslices:\n  - sources:\n      - model: {a}\n        layer_range: [0, 'two']\n",
            r"slices\[0\]\.sources\[0\]\.layer_range\[1\]: expected an integer",
        ),
        (
            "merge_method: linear\nmodels: [{{model: {a}}}]\nslices: [{{sources: [{{model: {a}, layer_range: [0, 1]}}]}}]\n",
            r"exactly one of models: or slices:",
        ),
        (
            "merge_method: dare_ties\nbase_model: {base}\nmodels: [{{model: {a}, parameters: {{density: 0.5, drop: 0.5}}}}]\n",
            r"density .* or drop .*not both",
        ),
        (
            "merge_method: linear\nmodels: [{{model: {a}}}]\ntokenizer_source: union\ntokenizer: {{source: base}}\n",
            r"tokenizer_source or tokenizer, not both",
        ),
    ],
)
def test_schema_errors_name_file_key_and_expectation(zoo, tmp_path, text, message):
    path = tmp_path / "cfg.yml"
    path.write_text(text.format(**{k: str(v) for k, v in zoo.items()}))
    with pytest.raises(InputError, match=message):
        load_config(path)


def test_mergekit_meanings_of_keys(zoo):
    """Base listed under models: is the base; out_dtype is stored, dtype is mergekit's compute dtype;
    DARE's density is the keep share; an empty parameters: is nothing; mergekit's defaults apply."""
    base, a = str(zoo["base"]), str(zoo["a"])
    config = config_from_dict(
        {
            "merge_method": "dare_ties",
            "base_model": base,
            "dtype": "bfloat16",
            "out_dtype": "float16",
            "models": [{"model": base, "parameters": None}, {"model": a, "parameters": {"density": 0.7}}],
        }
    )
    assert config.inputs == [base, a] and config.dtype == "float16" and config.mergekit_compat
    assert config.parameter("drop", 0) == pytest.approx(0.3)
    assert config.parameter("normalize") is False  # mergekit's dare_ties default
    own = config_from_dict({"method": "dare_ties", "base": base, "models": [a]})
    assert own.parameter("normalize") is True and own.parameter("drop", 0) == 0.5 and not own.mergekit_compat
    assert (
        config_from_dict({"merge_method": "ties", "base_model": base, "models": [{"model": a}]}).parameter("density", 0)
        == 1.0
    )


def test_own_schema_round_trips_mergekit_settings(zoo):
    data = {
        "merge_method": "linear",
        "base_model": str(zoo["base"]),
        "tokenizer": {"source": "union", "pad_to_multiple_of": 8},
        "chat_template": "chatml",
        "models": [{"model": str(zoo["base"]), "parameters": {"weight": 0.4}}, {"model": str(zoo["a"])}],
    }
    config = config_from_dict(data)
    again = config_from_dict(config.to_dict())
    assert again == config


# ------------------------------------------------------------------------------------------- hub ids


def lay_out_hub_cache(cache: Path, repo: str, model_folder: Path, commit: str) -> Path:
    """huggingface_hub's cache layout: models--org--name/snapshots/<commit>/files and refs/main."""
    entry = cache / ("models--" + repo.replace("/", "--"))
    snapshot = entry / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in model_folder.iterdir():
        (snapshot / file.name).write_bytes(file.read_bytes())
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(commit)
    return snapshot


@pytest.mark.slow
def test_hub_ids_resolve_offline_from_the_cache(zoo, tmp_path):
    cache = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    lay_out_hub_cache(cache, "tiny-org/base", zoo["base"], commit)
    lay_out_hub_cache(cache, "tiny-org/fine", zoo["a"], commit)
    config = tmp_path / "hub.yml"
    config.write_text(
        "merge_method: task_arithmetic\nbase_model: tiny-org/base\nmodels:\n"
        f"  - model: tiny-org/fine@{commit}\n    parameters:\n      weight: 0.5\n"
    )
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [str(CLI), "merge", str(config), "--out", str(tmp_path / "out"), "-q"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    merged, base, fine = (read_state(p) for p in (tmp_path / "out", zoo["base"], zoo["a"]))
    name = "model.layers.0.mlp.up_proj.weight"
    torch.testing.assert_close(merged[name], base[name] + 0.5 * (fine[name] - base[name]))
    config.write_text("merge_method: linear\nmodels:\n  - model: tiny-org/missing\n")
    run = subprocess.run(
        [str(CLI), "merge", str(config), "--out", str(tmp_path / "out2"), "-q"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert "tiny-org/missing: not in the Hugging Face cache" in run.stderr and "HF_HUB_OFFLINE=1" in run.stderr


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLICE_CONFIGS))
def test_slices_match_mergekit(side_by_side, name):
    """Layer ranges from several models stacked (slices execution is plan.py's), per-slice parameters, gradients,
    a slice's filter list falling through to the global parameters."""
    theirs, _, config_file = side_by_side[name]
    ours = run_merge(load_config(config_file), config_file.parent / f"lite-{name}").out
    expected, merged = read_state(theirs), read_state(ours)
    assert sorted(merged) == sorted(expected)
    for tensor_name, tensor in expected.items():
        torch.testing.assert_close(
            merged[tensor_name], tensor, rtol=1e-5, atol=1e-6, msg=lambda m: f"{tensor_name}: {m}"
        )
    assert json.loads((ours / "config.json").read_text())["num_hidden_layers"] == 3


# ------------------------------------------------------------------------------- configs from the wild
# Real mergekit configs from model cards and repositories, as written, with the zoo's models for the hub ids,
# layer ranges cut to its 3 layers and dtype float32 (so deterministic methods agree bit for bit).

REAL_CONFIGS = {
    # adriansterr/fine-tuning-for-absa merging_configurations/german/karcher/karcher_default/mergekit_config.yml:
    # YAML reads `1e-5` (no dot) as a string, mergekit reads it as the number
    "karcher_tol_string": """
models:
  - model: "{a}"
  - model: "{b}"

merge_method: karcher
dtype: float32

parameters:
  max_iter: 10
  tol: 1e-5
""",
    # the breadcrumbs_ties example of a public mergekit config collection (code search, "Mergekit Example: Model
    # Breadcrumbs (breadcrumbs_ties)"): per-model gamma, which the CLI lost on its way to the plan
    "breadcrumbs_per_model_gamma": """
base_model: "{base}"
models:
  - model: "{a}"
    parameters:
      weight: 0.6                     # Contribution of this model (e.g., 60%)
      gamma: 0.02                     # Prune top 2% largest magnitude parameters from this model's task vector
      density: 0.9                    # Retain 90% of parameters in this model's task vector after pruning
  - model: "{b}"
    parameters:
      weight: 0.4
      gamma: 0.02
      density: 0.9
merge_method: breadcrumbs_ties
dtype: float32
""",
    # https://huggingface.co/YOYO-AI/Qwen2.5-7B-YOYO-super (its Qwen2.5-7B-della stage): mergekit-multi's `name:`,
    # a per-model lambda (mergekit ignores it), density 1 (so DELLA drops nothing: deterministic)
    "della_name_and_model_lambda": """
models:
  - model: {a}
    parameters:
      density: 1
      weight: 1
      lambda: 0.9
merge_method: della
base_model: {base}
parameters:
  density: 1
  weight: 1
  lambda: 0.9
  normalize: true
  int8_mask: true
dtype: float32
tokenizer_source: base
name: Qwen2.5-7B-della
""",
}


@pytest.fixture(scope="module")
def real_side_by_side(zoo, mergekit_outputs) -> dict[str, tuple[Path, Path, subprocess.CompletedProcess]]:
    """Each real config through mergekit and through our CLI (which reads the file and re-reads it in our own
    schema, so every key has to survive that trip): name -> (theirs, ours, our CLI run)."""
    outputs = {}
    for name in REAL_CONFIGS:
        config, theirs = mergekit_outputs[name]
        outputs[name] = theirs, zoo["root"] / f"lite-{name}", run_cli(config, zoo["root"] / f"lite-{name}")
    return outputs


def run_cli(config: Path, out: Path, *flags: str) -> subprocess.CompletedProcess:
    """`mergekit-lite merge CONFIG --out OUT` through the CLI's click group in this process."""
    return cli("merge", config, "--out", out, *flags)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(REAL_CONFIGS))
def test_real_configs_run_through_the_cli_as_mergekit_runs_them(real_side_by_side, name):
    theirs, ours, run = real_side_by_side[name]
    assert run.returncode == 0, run.stderr
    expected, merged = read_state(theirs), read_state(ours)
    assert sorted(merged) == sorted(expected)
    for tensor_name, tensor in expected.items():
        torch.testing.assert_close(
            merged[tensor_name], tensor, rtol=1e-5, atol=1e-6, msg=lambda m: f"{tensor_name}: {m}"
        )


@pytest.mark.slow
def test_settings_mergekit_ignores_are_accepted_and_named(real_side_by_side):
    _, _, run = real_side_by_side["della_name_and_model_lambda"]
    assert "lambda has no effect per model (mergekit reads it from parameters: only)" in run.stdout


@pytest.mark.slow
def test_della_per_model_epsilon_reaches_the_plan(zoo, tmp_path, calibrated_rates):
    """adriansterr/fine-tuning-for-absa merging_configurations/german/della/della_1_08_07_08_02_01: per-model
    epsilon was refused by the CLI ("models[0]: unknown key 'epsilon'")."""
    config = tmp_path / "della.yml"
    config.write_text(f"""
models:
  - model: "{zoo["a"]}"
    parameters:
      weight: 1.0
      density: 0.7
      epsilon: 0.2
  - model: "{zoo["b"]}"
    parameters:
      weight: 0.8
      density: 0.8
      epsilon: 0.1

base_model: "{zoo["base"]}"

merge_method: della
dtype: bfloat16

parameters:
  lambda: 1.0
""")
    run = run_cli(config, tmp_path / "out", "--dry-run")
    assert run.returncode == 0, run.stderr
    assert "epsilons=[0.2, 0.1]" in run.stdout and f"measured {calibrated_rates} at load " in run.stdout


def test_default_module_is_the_whole_model(zoo, tmp_path):
    """https://huggingface.co/Alelcv27/Llama3.1-8B-Base-DELLA-Math-Code: mergekit writes a merge's slices as
    `modules: default:` in the config it saves, and model cards show that form; `normalize: 1.0` is true."""
    text = """
base_model: {base}
dtype: float16
merge_method: della
modules:
  default:
    slices:
    - sources:
      - layer_range: [0, 3]
        model: {a}
        parameters:
          density: 0.8
          weight: 0.7
      - layer_range: [0, 3]
        model: {b}
        parameters:
          density: 0.7
          weight: 0.5
      - layer_range: [0, 3]
        model: {base}
parameters:
  epsilon: 0.1
  lambda: 0.9
  normalize: 1.0
""".format(**{k: str(v) for k, v in zoo.items()})
    modules, sliced = tmp_path / "modules.yml", tmp_path / "slices.yml"
    modules.write_text(text)
    sliced.write_text(text.replace("modules:\n  default:\n", "").replace("\n    ", "\n"))
    config = load_config(modules)
    assert config == load_config(sliced) and len(config.slices) == 1
    assert config.parameter("normalize") is True
    with pytest.raises(InputError, match=r"modules: \(multi-module architectures\) is not supported"):
        config_from_dict({**yaml.safe_load(text), "modules": {"text_decoder": {}, "vision_tower": {}}})


def test_a_base_alone_under_models_is_named(zoo, tmp_path):
    """https://huggingface.co/007ankit/della-linear-BioMistral-mistral-hindi: its only model is its base, so
    mergekit writes the base unchanged; we say so instead of writing a copy."""
    config = tmp_path / "base-only.yml"
    config.write_text(f"""
models:
  - model: {zoo["base"]}
    parameters:
      density: 1 # Fraction of weights in differences from the base model to retain
      epsilon: 0.1 # Maximum change in drop probability based on magnitude (range: density ± epsilon)
      weight: 1
      lambda: 0.9
merge_method: della_linear
base_model: {zoo["base"]}
parameters:
  density: 1
  epsilon: 0.1
  weight: 1
  lambda: 0.9
  normalize: true
  int8_mask: true
dtype: bfloat16
""")
    run = run_cli(config, tmp_path / "out")
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert run.stderr.startswith("error:") and "every entry under models: is the base" in run.stderr
