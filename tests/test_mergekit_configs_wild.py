"""Config shapes mergekit users write, beyond tests/test_mergekit_compat.py, that mergekit-lite got wrong: each run
as written through mergekit 0.1.5 and through our CLI, outputs compared tensor by tensor (or both refusing).

- A slice merge with `tokenizer_source`: mergekit builds the embeddings from the first slice's sources and the
  head from the last slice's, and fills a token a model lacks from that tensor's own inputs only (the only one
  that has it, the base if it is one of them, their mean, else zeros: tokenizer/embed.py). We filled it from
  every input of the merge, so a model of another slice leaked its rows into the tensor.
- A slice whose sources leave out the base (the slice's or the config's): mergekit refuses it ("Base input is not
  present in merge inputs"); we merged it with the slice's first source in the base's place.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from mergekit_reference import BATCH, _environment, mergekit_cli
from test_mergekit_compat import NEW_TOKENS, noisy, read_state, save_model
from test_safety import cli, one_error_line
from tiny_models import VOCAB, tiny_llama
from transformers import AutoTokenizer

pytestmark = pytest.mark.slow

# {name} placeholders are the fixture's model folders
VOCABULARY_SLICES = {
    # a frankenmerge whose embeddings come from models without the chat tokens: mergekit's rows for them are zeros
    "embeddings_from_models_without_the_tokens": """
slices:
  - sources:
      - model: {base}
        layer_range: [0, 2]
      - model: {a}
        layer_range: [0, 2]
  - sources:
      - model: {base}
        layer_range: [2, 3]
      - model: {chat}
        layer_range: [2, 3]
merge_method: slerp
base_model: {base}
parameters:
  t: 0.5
tokenizer_source: union
dtype: float32
""",
    # a's missing chat rows are chat's (the one input of the embeddings that has them), not chat's and chat2's mean
    "one_holder_among_the_tensors_inputs": """
slices:
  - sources:
      - model: {a}
        layer_range: [0, 2]
      - model: {chat}
        layer_range: [0, 2]
  - sources:
      - model: {b}
        layer_range: [2, 3]
      - model: {chat2}
        layer_range: [2, 3]
merge_method: linear
base_model: {base}
parameters:
  weight: 0.5
tokenizer_source: union
dtype: float32
""",
}
BASE_LEFT_OUT = """
slices:
  - sources:
      - model: {a}
        layer_range: [0, 3]
      - model: {b}
        layer_range: [0, 3]
merge_method: slerp
base_model: {base}
parameters:
  t: 0.5
dtype: float32
"""


def with_chat_rows(state: dict, seed: int) -> dict:
    """Two more embedding and head rows (the chat tokens), seeded."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: torch.cat([tensor, torch.randn(2, tensor.shape[1], generator=generator)])
        if name in ("model.embed_tokens.weight", "lm_head.weight")
        else tensor
        for name, tensor in state.items()
    }


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """A 3-layer base, two fine-tunes, two chat fine-tunes that add the same two tokens with rows of their own."""
    root = tmp_path_factory.mktemp("wild")
    base = tiny_llama(0, num_hidden_layers=3).state_dict()
    return {
        "base": save_model(base, root / "base"),
        "a": save_model(noisy(base, 1), root / "a"),
        "b": save_model(noisy(base, 2), root / "b"),
        "chat": save_model(with_chat_rows(noisy(base, 3), 4), root / "chat", VOCAB + 2, NEW_TOKENS),
        "chat2": save_model(with_chat_rows(noisy(base, 5), 6), root / "chat2", VOCAB + 2, NEW_TOKENS),
        "root": root,
    }


def write_config(models: dict[str, Path], name: str, text: str) -> Path:
    path = models["root"] / f"{name}.yml"
    path.write_text(text.format(**{key: str(folder) for key, folder in models.items()}))
    return path


@pytest.fixture(scope="module")
def mergekit_runs(models) -> tuple[dict[str, tuple[Path, Path]], subprocess.CompletedProcess]:
    """Every config of this file through mergekit's own entry point in one process (mergekit_reference.BATCH),
    the one it refuses last: name -> (config, mergekit's output), and the run, which ends in that refusal."""
    python = mergekit_cli().parent / "python"
    configs = {name: write_config(models, name, text) for name, text in VOCABULARY_SLICES.items()}
    outputs = {name: models["root"] / f"mk-{name}" for name in configs}
    jobs = [*configs.items(), ("base_left_out", write_config(models, "base_left_out", BASE_LEFT_OUT))]
    arguments = [str(part) for name, config in jobs for part in (config, models["root"] / f"mk-{name}")]
    run = subprocess.run(
        [str(python), "-c", BATCH, "0", *arguments], capture_output=True, text=True, env=_environment(), timeout=900
    )
    return {name: (configs[name], outputs[name]) for name in configs}, run


@pytest.mark.parametrize("name", list(VOCABULARY_SLICES))
def test_slice_merges_fill_missing_tokens_from_the_tensors_own_inputs(models, mergekit_runs, name):
    config, theirs = mergekit_runs[0][name]
    ours = models["root"] / f"lite-{name}"
    run = cli("merge", config, "--out", ours, "-q")
    assert run.returncode == 0, run.stderr
    expected, merged = read_state(theirs), read_state(ours)
    assert sorted(merged) == sorted(expected)
    for tensor_name, tensor in expected.items():
        torch.testing.assert_close(
            merged[tensor_name], tensor, rtol=1e-5, atol=1e-6, msg=lambda m: f"{tensor_name}: {m}"
        )
    assert AutoTokenizer.from_pretrained(ours).get_vocab() == AutoTokenizer.from_pretrained(theirs).get_vocab()


def test_a_slice_without_its_base_is_refused_as_mergekit_refuses_it(models, mergekit_runs):
    refusal = mergekit_runs[1]
    assert refusal.returncode != 0 and "Base input is not present in merge inputs" in refusal.stderr
    run = cli("merge", models["root"] / "base_left_out.yml", "--out", models["root"] / "lite-base_left_out")
    one_error_line(run, 2, r"slices\[0\]: the base model .*/base is not among this slice's sources")
    assert not (models["root"] / "lite-base_left_out").exists()
